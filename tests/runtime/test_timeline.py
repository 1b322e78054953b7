import json

import pytest
import torch

import autopipe
from zoo import build


def test_timeline_records_every_task_and_prints(tmp_path):
    model = build("mlp")
    pipe = autopipe.compile(model, devices=3, chunks=4, checkpoint="always")
    pipe(torch.randn(16, 8)).sum().backward()
    tl = pipe.timeline
    kinds = {(e.stage, e.micro_batch, e.kind) for e in tl.events}
    for s in range(3):
        for i in range(4):
            assert {(s, i, "forward"), (s, i, "recompute"), (s, i, "backward")} <= kinds
    for s in range(3):  # a stage's own tasks never overlap in time
        spans = sorted((e.start, e.end) for e in tl.events if e.stage == s and e.kind in ("forward", "backward"))
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    text = str(tl)
    assert text.count("device ") == 6 and "measured" in text and "the schedule's 0.333" in text
    with open(tl.save_chrome_trace(tmp_path / "trace.json")) as f:
        trace = json.load(f)
    assert sum(1 for e in trace["traceEvents"] if e["ph"] == "X") == len(tl.events)
    assert 0.0 < tl.measured_bubble < 1.0  # 3 devices: the later ones wait for the first forward


@pytest.mark.parametrize("schedule, virtual_stages", [("1f1b", 1), ("interleaved", 2)])
def test_timeline_shows_each_device_running_its_schedule_order(schedule, virtual_stages):
    """The order each device ran its tasks in is the schedule's, and the text shows it as print(pipe.schedule) does."""
    model = build("mlp")
    pipe = autopipe.compile(model, devices=2, chunks=4, checkpoint="never", schedule=schedule,
                            virtual_stages=virtual_stages)
    pipe.step(torch.randn(16, 8), target=torch.randn(16, 4), loss_fn=torch.nn.functional.mse_loss)
    sched, tl = pipe.schedule, pipe.timeline
    suffix = (lambda t: f".{t.stage}") if virtual_stages > 1 else (lambda t: "")
    for d in range(2):
        expected = [f"{t}{suffix(t)}" for t in sched.device_order(d)]
        assert tl.ran(d) == expected
        assert f"device {d}  ran: " + " ".join(expected) in str(tl)
    assert f"{schedule} schedule" in str(tl) and f"the schedule's {sched.bubble_fraction:.3f}" in str(tl)
