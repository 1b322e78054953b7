"""The GPipe schedule as plain data: no device needed."""
import pytest

from autopipe.runtime.schedule import Schedule, Task


@pytest.mark.parametrize("K,M", [(1, 1), (2, 4), (4, 8), (3, 1), (8, 32)])
def test_gpipe_clock_cycles_and_bubble(K, M):
    s = Schedule.gpipe(K, M)
    assert len(s.cycles) == 2 * (M + K - 1)
    assert s.bubble_fraction == pytest.approx((K - 1) / (M + K - 1))
    for j in range(K):
        order = s.stage_order(j)
        assert order[:M] == [Task(j, i, "F") for i in range(M)]
        assert order[M:] == [Task(j, i, "B") for i in reversed(range(M))]


def test_dependencies_hold_at_every_cycle():
    s = Schedule.gpipe(4, 6)
    when = {t: c for c, cycle in enumerate(s.cycles) for t in cycle}
    for (j, i, kind), c in ((tuple((t.stage, t.micro_batch, t.kind)), c) for t, c in when.items()):
        if kind == "F" and j > 0:
            assert when[Task(j - 1, i, "F")] < c
        if kind == "B":
            assert when[Task(j, i, "F")] < c
            if j < 3:
                assert when[Task(j + 1, i, "B")] < c


def test_prints_a_grid():
    text = str(Schedule.gpipe(2, 3))
    assert text.splitlines()[2].split() == ["stage", "0", "F0", "F1", "F2", ".", ".", "B2", "B1", "B0"]
    assert text.splitlines()[3].split() == ["stage", "1", ".", "F0", "F1", "F2", "B2", "B1", "B0", "."]


def test_rejects_empty_schedule():
    with pytest.raises(ValueError, match="at least one"):
        Schedule.gpipe(0, 4)
