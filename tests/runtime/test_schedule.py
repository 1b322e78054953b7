"""Schedules as plain data, checked without a device.

The rules are checked here independently of Schedule.validate(): `violations`
re-derives them and `run_in_order` executes every device's order the way the
runtime does (one worker per device, strictly in order, a task waiting only for
its inputs), so a schedule that would deadlock the runtime fails here.
"""
import itertools
import types
from dataclasses import replace

import pytest
from hypothesis import given, settings, strategies as st

from autopipe.ir.schedule import Schedule, Task


# -- an independent executor and rule checker ---------------------------------------

def inputs(t, n_stages):
    if t.kind == "W":
        return {Task(t.stage, t.micro_batch, "B")}
    if t.kind == "F":
        return {Task(t.stage - 1, t.micro_batch, "F")} if t.stage else set()
    return {Task(t.stage, t.micro_batch, "F")} | (
        {Task(t.stage + 1, t.micro_batch, "B")} if t.stage + 1 < n_stages else set())


def device(s, stage):
    """Round robin, or the V of zbv and dualpipev: device d holds stages d and 2K-1-d."""
    K = s.n_devices
    return 2 * K - 1 - stage if s.name in ("zbv", "dualpipev") and stage >= K else stage % K


def run_in_order(s, tf=1, tb=2, tw=1):
    """Simulate K workers running device_order(d) strictly in order, a task starting once
    its inputs finished and its worker is free. Returns the makespan; raises on deadlock."""
    orders = [s.device_order(d) for d in range(s.n_devices)]
    finish, free, head = {}, [0] * s.n_devices, [0] * s.n_devices
    progress = True
    while progress:
        progress = False
        for d, order in enumerate(orders):
            while head[d] < len(order) and inputs(order[head[d]], s.n_stages) <= finish.keys():
                t = order[head[d]]
                start = max([free[d]] + [finish[p] for p in inputs(t, s.n_stages)])
                finish[t] = free[d] = start + {"F": tf, "B": tb, "W": tw}[t.kind]
                head[d] += 1
                progress = True
    stuck = [order[h] for h, order in zip(head, orders) if h < len(order)]
    if stuck:
        raise AssertionError(f"deadlock: workers wait on {stuck}")
    return max(free)


def violations(s):
    """The rules, re-derived: counts, inputs in earlier cycles, one task per device per cycle,
    device orders consistent with the cycles, and executable without deadlock."""
    tasks = [t for c in s.cycles for t in c]
    kinds = "FBW" if any(t.kind == "W" for t in tasks) else "FB" if any(t.kind == "B" for t in tasks) else "F"
    want = {Task(j, i, k) for j in range(s.n_stages) for i in range(s.chunks) for k in kinds}
    bad = []
    if len(tasks) != len(set(tasks)) or set(tasks) != want:
        bad.append("not exactly one F (and B) per (stage, micro-batch)")
    when = {t: c for c, cycle in enumerate(s.cycles) for t in cycle}
    if any(p not in when or when[p] >= when[t] for t in when for p in inputs(t, s.n_stages)):
        bad.append("an input not done in an earlier cycle")
    for cycle in s.cycles:
        devices = [device(s, t.stage) for t in cycle]
        if len(devices) != len(set(devices)):
            bad.append("a device runs two tasks in one cycle")
    for d in range(s.n_devices):
        order = s.device_order(d)
        if [when[t] for t in order] != sorted(when[t] for t in order) or \
                sorted(order) != sorted(t for t in tasks if device(s, t.stage) == d):
            bad.append(f"device {d}'s order disagrees with the cycles")
    if not bad:
        try:
            run_in_order(s)
        except AssertionError as e:
            bad.append(str(e))
    return bad


def interleavable(K, M):
    return M % max(1, M // K) == 0


@st.composite
def schedules(draw):
    name = draw(st.sampled_from(["gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev"]))
    K, M = draw(st.integers(1, 6)), draw(st.integers(1, 16))
    if name != "interleaved":
        return Schedule.build(name, K, M)
    M = draw(st.integers(1, 16).filter(lambda m: interleavable(K, m)))
    return Schedule.build(name, K, M, virtual_stages=draw(st.integers(2, 3)))


# -- every builder satisfies the rules ---------------------------------------------

@settings(max_examples=150, deadline=None)
@given(schedules())
def test_every_schedule_keeps_the_rules_and_runs_without_deadlock(s):
    assert violations(s) == []
    s.validate()
    fwd = s.forward_only()
    assert violations(fwd) == [] and all(t.kind == "F" for c in fwd.cycles for t in c)
    fwd.validate()
    v_layout = s.name in ("zbv", "dualpipev")
    assert s.stages_on(0) == ([0, s.n_stages - 1] if v_layout else list(range(0, s.n_stages, s.n_devices)))
    for d in range(s.n_devices):
        assert all(device(s, j) == d for j in s.stages_on(d))
        assert [s.device_of(j) for j in s.stages_on(d)] == [d] * (s.n_stages // s.n_devices)
        assert [t for t in fwd.device_order(d)] == [t for t in s.device_order(d) if t.kind == "F"]


@settings(max_examples=150, deadline=None)
@given(schedules(), st.data())
def test_validate_agrees_with_the_rules_on_damaged_tables(s, data):
    cycles = [list(c) for c in s.cycles] + [[]]
    src = data.draw(st.sampled_from([c for c, cycle in enumerate(cycles) if cycle]))
    task = data.draw(st.sampled_from(cycles[src]))
    action = data.draw(st.sampled_from(["move", "drop", "copy"]))
    if action != "copy":
        cycles[src].remove(task)
    if action != "drop":
        cycles[data.draw(st.integers(0, len(cycles) - 1))].append(task)
    damaged = replace(s, cycles=tuple(tuple(c) for c in cycles if c))
    broken = violations(damaged)
    if broken:
        with pytest.raises(ValueError):
            damaged.validate()
    else:
        damaged.validate()


@pytest.mark.parametrize("cycles,message", [
    (((Task(0, 0, "F"),), (Task(1, 0, "F"),), (Task(1, 0, "B"),)), "missing B of micro-batch 0 on stage 0"),
    (((Task(0, 0, "F"), Task(1, 0, "F")), (Task(1, 0, "B"),), (Task(0, 0, "B"),)), "dependency broken"),
    (((Task(0, 0, "F"),), (Task(1, 0, "F"),), (Task(1, 0, "B"),), (Task(0, 0, "B"), Task(0, 0, "B"))),
     "runs twice"),
    (((Task(0, 0, "F"),), (Task(2, 0, "F"),)), "out of range"),
])
def test_validate_names_the_broken_rule(cycles, message):
    with pytest.raises(ValueError, match=message):
        Schedule("gpipe", 2, 2, 1, cycles).validate()


def test_validate_refuses_two_tasks_of_one_device_in_a_cycle():
    with pytest.raises(ValueError, match="two tasks at cycle 0"):
        Schedule("interleaved", 4, 2, 1, ((Task(0, 0, "F"), Task(2, 0, "F")),)).validate()


# -- GPipe: the layout of Huang et al. fig. 2c --------------------------------------

@pytest.mark.parametrize("K,M", [(1, 1), (2, 4), (4, 8), (3, 1), (8, 32)])
def test_gpipe_clock_cycles_and_bubble(K, M):
    s = Schedule.gpipe(K, M)
    assert (s.name, s.n_stages, s.n_devices) == ("gpipe", K, K)
    assert len(s.cycles) == 2 * (M + K - 1)
    assert s.bubble_fraction == pytest.approx((K - 1) / (M + K - 1))
    for j in range(K):
        order = s.stage_order(j)
        assert order == s.device_order(j)
        assert order[:M] == [Task(j, i, "F") for i in range(M)]
        assert order[M:] == [Task(j, i, "B") for i in reversed(range(M))]
    assert s.forward_only() == Schedule.gpipe(K, M, backward=False)


def test_prints_a_grid():
    lines = str(Schedule.gpipe(2, 3)).splitlines()
    assert lines[0] == ("gpipe schedule: K=2 devices, v=1 stages per device, M=3 micro-batches, "
                        "8 clock cycles, bubble 0.250")
    assert "F<i> / B<i> = forward / backward of micro-batch i" in lines[1]
    assert lines[3].split() == ["device", "0", "F0", "F1", "F2", ".", ".", "B2", "B1", "B0"]
    assert lines[4].split() == ["device", "1", ".", "F0", "F1", "F2", "B2", "B1", "B0", "."]


def test_prints_the_stage_when_interleaved():
    lines = str(Schedule.interleaved(2, 2, 4)).splitlines()
    assert lines[0].startswith("interleaved schedule: K=2 devices, v=2 stages per device, M=4")
    assert "F<i>.<s>" in lines[1] and "through stage s" in lines[1]
    assert lines[3].split()[2:8] == ["F0.0", "F1.0", "F0.2", "F1.2", "F2.0", "B0.2"]


def test_rejects_empty_schedule():
    with pytest.raises(ValueError, match="at least one"):
        Schedule.gpipe(0, 4)


# -- 1F1B: same time as GPipe, K instead of M micro-batches in flight ---------------

def test_1f1b_order_is_pipedream_flush():
    s = Schedule.one_f_one_b(4, 8)
    f = lambda *i: [Task(0, j, "F") for j in i]
    b = lambda i: Task(0, i, "B")
    assert s.device_order(0) == f(0, 1, 2, 3) + [b(0), *f(4), b(1), *f(5), b(2), *f(6), b(3), *f(7),
                                                b(4), b(5), b(6), b(7)]
    assert s.device_order(3)[:5] == [Task(3, 0, "F"), Task(3, 0, "B"), Task(3, 1, "F"),
                                     Task(3, 1, "B"), Task(3, 2, "F")]


def test_in_flight_micro_batches():
    assert Schedule.one_f_one_b(4, 16).max_in_flight(0) == 4
    assert Schedule.gpipe(4, 16).max_in_flight(0) == 16
    for K, M in itertools.product(range(1, 7), range(1, 17)):
        s = Schedule.one_f_one_b(K, M)
        assert [s.max_in_flight(j) for j in range(K)] == [min(M, K - j) for j in range(K)]
        assert s.forward_only().max_in_flight(0) == M


def test_interleaved_in_flight_per_device_is_megatrons_warmup_plus_one():
    """Megatron's interleaved warm-up on device d is (v-1)*K + 2*(K-d-1) forwards (torch:
    _get_warmup_ops); then F,B pairs keep one more in flight, never more than all v*M."""
    for K, v, M in itertools.product(range(1, 7), (2, 3), range(1, 17)):
        if not interleavable(K, M):
            continue
        s, per_round = Schedule.interleaved(K, v, M), M // max(1, M // K)
        for d in range(K):
            live = peak = 0
            for t in s.device_order(d):
                live += 1 if t.kind == "F" else -1
                peak = max(peak, live)
            assert peak == min(v * M, (v - 1) * per_round + 2 * (K - d - 1) + 1)


# -- makespans: what is actually true, with unit tasks F=1, B=2 ---------------------

def test_makespan_and_bubble_formulas():
    """GPipe and 1F1B take (M+K-1)(tf+tb); 1F1B saves memory, not time. Interleaving v
    stages per device (each F=1, B=2 for 1/v of the layers) takes v*M + K - 1 steps when
    M >= K, so the bubble relative to the work is (K-1)/(v*M) instead of (K-1)/M
    (Megatron-LM sec. 2.2.1); with M < K it is latency bound: v*K + M - 1 steps."""
    for K, M in itertools.product(range(1, 7), range(1, 17)):
        g, f = Schedule.gpipe(K, M), Schedule.one_f_one_b(K, M)
        assert run_in_order(g) == run_in_order(f) == 3 * (M + K - 1)
        assert len(g.cycles) == len(f.cycles) == 2 * (M + K - 1)
        assert g.bubble_fraction == pytest.approx(f.bubble_fraction) == pytest.approx((K - 1) / (M + K - 1))
        for v in (2, 3):
            if not interleavable(K, M):
                continue
            s = Schedule.interleaved(K, v, M)
            steps = v * max(M, K) + min(M, K) - 1
            assert run_in_order(s) == 3 * steps
            assert len(s.cycles) == 2 * steps
            assert s.bubble_fraction == pytest.approx(1 - v * M / steps)
            # the same model on 1F1B: each of the K stages is v chunks' work
            one_f_one_b = run_in_order(f, tf=v, tb=2 * v)
            assert run_in_order(s) <= one_f_one_b
            assert (run_in_order(s) < one_f_one_b) == (K > 1 and M > 1)
            if M >= K:
                assert (run_in_order(s) - 3 * v * M) / (3 * v * M) == pytest.approx((K - 1) / (v * M))


# -- interleaved: torch's table, build() and its errors ----------------------------

def test_interleaved_orders_match_torch():
    """Our device orders are torch's ScheduleInterleaved1F1B rank orders, no-ops dropped."""
    schedules_mod = pytest.importorskip("torch.distributed.pipelining.schedules")
    calc = getattr(schedules_mod.ScheduleInterleaved1F1B, "_calculate_single_rank_operations", None)
    if calc is None:
        pytest.skip("torch's private schedule table moved")
    for K, v, M in [(2, 2, 4), (4, 2, 8), (4, 3, 16), (3, 2, 2), (4, 2, 10), (1, 3, 5)]:
        ours = Schedule.interleaved(K, v, M)
        fake = types.SimpleNamespace(n_local_stages=v, pp_group_size=K, _n_microbatches=M,
                                     microbatches_per_round=M // max(1, M // K))
        for d in range(K):
            theirs = [(a.stage_index, a.microbatch_index, "F" if a.computation_type.name == "FORWARD" else "B")
                      for a in calc(fake, d) if a is not None]
            assert [(t.stage, t.micro_batch, t.kind) for t in ours.device_order(d)] == theirs


def test_build_by_name_and_errors():
    assert Schedule.build("gpipe", 3, 5) == Schedule.gpipe(3, 5)
    assert Schedule.build("1f1b", 3, 5) == Schedule.one_f_one_b(3, 5)
    s = Schedule.build("interleaved", 4, 8, virtual_stages=2)
    assert (s.name, s.n_stages, s.n_devices, s.chunks) == ("interleaved", 8, 4, 8)
    assert s.stages_on(1) == [1, 5] and s.device_of(6) == 2
    with pytest.raises(ValueError, match="unknown schedule 'pipedream'.*gpipe, 1f1b, interleaved, zb-h1, zbv, dualpipev"):
        Schedule.build("pipedream", 4, 8)
    with pytest.raises(ValueError, match="virtual_stages >= 2"):
        Schedule.build("interleaved", 4, 8)
    with pytest.raises(ValueError, match="one stage per device"):
        Schedule.build("1f1b", 4, 8, virtual_stages=2)
    with pytest.raises(ValueError, match="chunks=16, n_devices=3.*multiple of n_devices.*15 and 18"):
        Schedule.build("interleaved", 3, 16, virtual_stages=2)
    with pytest.raises(ValueError, match="at least one"):
        Schedule.build("interleaved", 0, 4, virtual_stages=2)


# -- zero bubble: B (input gradients) and W (parameter gradients) as tasks of their own ---------

def test_zero_bubble_tables_beat_1f1b():
    """Qi et al. (ICLR 2024) with F = B = W = 1 and 1F1B's fused backward 2, at K=4, M=8: ZB-H1's bubble is (K-1)
    of 3M + K - 1 (1F1B's 3(K-1) of 3(M+K-1)), at most 0.45 of 1F1B's; ZB-V's (2K stages of half the layers) at most
    0.25 of it. Simulated here by the test's own executor, and by Schedule.simulate alike."""
    K, M = 4, 8
    one_f = Schedule.one_f_one_b(K, M)
    zb, v = Schedule.zb_h1(K, M), Schedule.zbv(K, M)
    bubble = lambda s, span, work: 1 - work / (span * s.n_devices)
    base = bubble(one_f, run_in_order(one_f, tf=1, tb=2), 3 * M * K)
    zb_bubble = bubble(zb, run_in_order(zb, tf=1, tb=1, tw=1), 3 * M * K)
    v_bubble = bubble(v, run_in_order(v, tf=0.5, tb=0.5, tw=0.5), 3 * M * K)  # each of 2K stages: half the layers
    assert run_in_order(zb, tf=1, tb=1, tw=1) == 3 * M + K - 1
    assert zb_bubble <= 0.45 * base and v_bubble <= 0.25 * base, (base, zb_bubble, v_bubble)
    assert zb_bubble / base == pytest.approx(0.407, abs=1e-3) and v_bubble / base == pytest.approx(0.216, abs=1e-3)
    unit = {"F": 1, "B": 1, "W": 1}
    assert one_f.simulate(lambda t: {"F": 1, "B": 2}[t.kind])[1] == pytest.approx(base)
    assert zb.simulate(lambda t: unit[t.kind])[1] == pytest.approx(zb_bubble) == pytest.approx(zb.bubble_fraction)
    assert v.simulate(lambda t: unit[t.kind])[1] == pytest.approx(v_bubble) == pytest.approx(v.bubble_fraction)


def test_zero_bubble_in_flight_stays_at_1f1bs_memory():
    """Counted until W frees a micro-batch's graph: ZB-H1 holds K on every device, ZB-V 2K half-stages on the
    first (2K-d-... down the V); never more than 1F1B's activations, at K=4, M=16 and everywhere else."""
    assert Schedule.zb_h1(4, 16).max_in_flight(0) == 4
    assert Schedule.zbv(4, 16).max_in_flight(0) == 8
    for K, M in itertools.product(range(1, 7), range(1, 17)):
        zb, v = Schedule.zb_h1(K, M), Schedule.zbv(K, M)
        assert [zb.max_in_flight(j) for j in range(K)] == [min(M, K)] * K
        for d in range(K):  # device d: its two stages' half-size micro-batches, at most 2K of them
            live = peak = 0
            for t in v.device_order(d):
                live += {"F": 1, "B": 0, "W": -1}[t.kind]
                peak = max(peak, live)
            assert peak <= 2 * K and v.max_in_flight(0) <= 2 * K


def test_zero_bubble_orders_match_torch():
    """Our ZB-H1 device orders are torch's ScheduleInterleavedZeroBubble with one stage per rank, ZB-V's its
    ScheduleZBVZeroBubble's (no-ops dropped)."""
    schedules_mod = pytest.importorskip("torch.distributed.pipelining.schedules")
    kind = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}
    zb_calc = getattr(schedules_mod.ScheduleInterleavedZeroBubble, "_calculate_single_rank_operations", None)
    v_calc = getattr(schedules_mod.ScheduleZBVZeroBubble, "_calculate_single_rank_operations", None)
    if zb_calc is None or v_calc is None:
        pytest.skip("torch's private schedule tables moved")
    for K, M in [(2, 4), (4, 8), (4, 16), (3, 5), (4, 3), (1, 4), (5, 7)]:
        zb, v = Schedule.zb_h1(K, M), Schedule.zbv(K, M)
        zb_fake = types.SimpleNamespace(n_local_stages=1, pp_group_size=K, _n_microbatches=M,
                                        microbatches_per_round=M // max(1, M // K))
        v_fake = types.SimpleNamespace(pp_group_size=K, _n_microbatches=M, num_stages=2 * K)
        for d in range(K):
            for ours, calc, fake in ((zb, zb_calc, zb_fake), (v, v_calc, v_fake)):
                theirs = [(a.stage_index, a.microbatch_index, kind[a.computation_type.name])
                          for a in calc(fake, d) if a is not None]
                assert [(t.stage, t.micro_batch, t.kind) for t in ours.device_order(d)] == theirs, (ours.name, K, M, d)


def test_zero_bubble_prints_builds_and_names_errors():
    v = Schedule.build("zbv", 2, 4)
    assert (v.name, v.n_stages, v.n_devices, v.virtual_stages, v.splits_backward) == ("zbv", 4, 2, 2, True)
    assert v.stages_on(0) == [0, 3] and v.stages_on(1) == [1, 2] and v.device_of(2) == 1
    assert Schedule.build("zbv", 2, 4, virtual_stages=2) == v
    lines = str(v).splitlines()
    assert lines[0].startswith("zbv schedule: K=2 devices, v=2 stages per device, M=4")
    assert "W<i>.<s>" in lines[1] and "parameter gradients" in lines[1]
    assert lines[3].split()[2:6] == ["F0.0", "F1.0", "F2.0", "F0.3"]
    zb = Schedule.build("zb-h1", 2, 3)
    assert str(zb).splitlines()[3].split() == ["device", "0", "F0", "F1", ".", "B0", "W0", "F2", "B1", "W1", "B2", "W2"]
    assert not Schedule.build("1f1b", 2, 3).splits_backward
    assert [t for c in zb.forward_only().cycles for t in c] == [t for c in Schedule.gpipe(2, 3, backward=False).cycles
                                                                for t in c]
    with pytest.raises(ValueError, match="'zbv' runs two stages per device"):
        Schedule.build("zbv", 2, 4, virtual_stages=3)
    with pytest.raises(ValueError, match="'zb-h1' runs one stage per device"):
        Schedule.build("zb-h1", 2, 4, virtual_stages=2)
    one = Schedule.zb_h1(2, 1)
    with pytest.raises(ValueError, match="missing W of micro-batch 0 on stage 1"):
        replace(one, cycles=tuple(tuple(t for t in c if t != Task(1, 0, "W")) for c in one.cycles)).validate()
    with pytest.raises(ValueError, match="dependency broken"):  # a W before its B
        replace(one, cycles=tuple((Task(*t),) for t in [(0, 0, "F"), (1, 0, "F"), (1, 0, "W"), (1, 0, "B"),
                                                         (0, 0, "B"), (0, 0, "W")])).validate()


# -- DualPipeV: ZB-V's V, a forward and a full backward of two micro-batches in turn -------------------------------

def _pipelining_dualpipev(K, M, d):
    """torch's ScheduleDualPipeV rank order in our terms: an OVERLAP_F_B as its two sub-actions in turn (as its
    runtime runs them), a FULL_BACKWARD as B then W; each B and W marked whether it is a full backward's."""
    calc = getattr(pytest.importorskip("torch.distributed.pipelining.schedules").ScheduleDualPipeV,
                   "_calculate_single_rank_operations", None)
    if calc is None:
        pytest.skip("torch's private schedule table moved")
    kind = {"FORWARD": "F", "BACKWARD_INPUT": "B", "BACKWARD_WEIGHT": "W"}

    def flat(a):
        name = a.computation_type.name
        if name == "OVERLAP_F_B":
            return [t for sub in a.sub_actions for t in flat(sub)]
        if name == "FULL_BACKWARD":
            return [(a.stage_index, a.microbatch_index, k, True) for k in "BW"]
        return [(a.stage_index, a.microbatch_index, kind[name], False)]
    return [t for a in calc(types.SimpleNamespace(pp_group_size=K, _n_microbatches=M), d) if a is not None
            for t in flat(a)]


def test_dualpipev_orders_match_torch():
    """Our device orders, and which backwards are full, are torch's ScheduleDualPipeV's (M >= 2K, as it asks)."""
    for K, M in [(1, 2), (2, 4), (2, 7), (3, 6), (4, 8), (4, 13), (5, 10)]:
        s = Schedule.dualpipev(K, M)
        for d in range(K):
            ours = [(t.stage, t.micro_batch, t.kind, t.kind != "F" and (t.stage, t.micro_batch) in s.full_backwards)
                    for t in s.device_order(d)]
            assert ours == _pipelining_dualpipev(K, M, d), (K, M, d)


def test_dualpipev_bubble_and_in_flight_beside_zbvs():
    """With unit tasks (a full backward is B then W) its bubble is zbv's, 0.059 at K=4, M=8; stage s holds
    min(M, 2K - s) micro-batches as zbv's, and device d 2K + 1 half-stage ones at M >= 2K, DeepSeek's PP + 1 for
    2K = PP stages (zbv: 2K); a full backward frees its graph at B. Fewer than 2K micro-batches run torch's order of
    2K with the rest dropped."""
    v, zbv = Schedule.dualpipev(4, 8), Schedule.zbv(4, 8)
    unit = lambda t: 1.0
    assert v.bubble_fraction == pytest.approx(zbv.bubble_fraction) == pytest.approx(0.0588, abs=1e-4)
    assert v.simulate(unit) == pytest.approx(zbv.simulate(unit))
    assert 0.6 < len(v.full_backwards) / (8 * 8) < 0.7  # the others split, to fill the cool-down
    for K, M in itertools.product(range(1, 6), range(1, 13)):
        s = Schedule.dualpipev(K, M)
        assert violations(s) == []
        assert [s.max_in_flight(j) for j in range(2 * K)] == [min(M, 2 * K - j) for j in range(2 * K)]
        for d in range(K):
            live = peak = 0
            for t in s.device_order(d):
                frees = "B" if (t.stage, t.micro_batch) in s.full_backwards else "W"
                live += 1 if t.kind == "F" else -1 if t.kind == frees else 0
                peak = max(peak, live)
            assert peak <= 2 * K + 1 and (peak == 2 * K + 1 or M < 2 * K), (K, M, d)
        if M < 2 * K:
            full = Schedule.dualpipev(K, 2 * K)
            for d in range(K):
                assert s.device_order(d) == [t for t in full.device_order(d) if t.micro_batch < M]


def test_dualpipev_builds_by_name_and_checks_its_full_backwards():
    s = Schedule.build("dualpipev", 2, 4)
    assert (s.name, s.n_stages, s.virtual_stages, s.splits_backward, s.stages_on(1)) == ("dualpipev", 4, 2, True,
                                                                                         [1, 2])
    assert Schedule.build("dualpipev", 2, 4, virtual_stages=2) == s
    assert s.forward_only().full_backwards == frozenset()
    with pytest.raises(ValueError, match="'dualpipev' runs two stages per device"):
        Schedule.build("dualpipev", 2, 4, virtual_stages=3)
    with pytest.raises(ValueError, match="full backwards"):
        replace(s, full_backwards=s.full_backwards | {(4, 0)}).validate()
    with pytest.raises(ValueError, match="does not split its backward"):
        replace(Schedule.one_f_one_b(2, 2), full_backwards=frozenset({(0, 0)})).validate()
