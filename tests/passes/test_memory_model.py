"""passes/memory_model/: predicted activations, memory and step time against what the runtime measures.

Measured figures come from ``pipe.memory`` (compile(..., track_memory=True)): the bytes autograd saves per
stage, counted by storage. torch.split hands stage 0 its micro-batch as a view of the whole batch's storage,
so the runtime's counter charges every micro-batch the whole input's storage where a stage saves its input
(the MLP's first Linear, the GPT's embedding indices): the measuring tests give each micro-batch its own
storage (``own_storage``), which is what a device that received the micro-batch would hold.
"""
from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

import autopipe
from autopipe.ir.plan import human_bytes
from autopipe.ir.schedule import NAMES as SCHEDULES, Schedule
from autopipe.passes import memory_model as mm
from autopipe.passes.cost import cost
from autopipe.passes.partition import NoFeasiblePlan, partition
from autopipe.passes.trace import trace
from autopipe.runtime import microbatch
from autopipe.runtime.memory import SavedBytes
from zoo import GPT, MLP, ResNet, random_inputs

TOLERANCE = 0.15


def _costed(model, args):
    return cost(trace(model, args, {}))


def _activation_bytes(costed, plan, saved=None) -> list[int]:
    """Per stage, what one whole-batch forward keeps (checkpoint="never", one micro-batch)."""
    return [p.kept_all for p in mm.predict_memory(costed, plan, "gpipe", "never", 1, saved=saved)]


def _autograd_saves(model, args) -> int:
    """Bytes autograd saves in one forward of the plain model, parameters and buffers excluded."""
    resident = {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    with SavedBytes(resident) as saved, torch.enable_grad():
        out = model(*args)
    del out
    return saved.total


def _models():
    torch.manual_seed(0)
    return {
        "mlp": (MLP(d_in=64, hidden=256, depth=6), (torch.randn(16, 64),)),
        "gpt": (GPT(), random_inputs("gpt", batch=16)[0]),
        "resnet": (ResNet(), random_inputs("resnet", batch=16)[0]),
    }


@pytest.fixture
def own_storage(monkeypatch):
    original = microbatch.split

    def split(*args, **kwargs):
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, original(*args, **kwargs))

    monkeypatch.setattr(microbatch, "split", split)


# ---- activations from the graph vs autograd's own saves ------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet"])
def test_activation_bytes_match_autograd(name):
    """Calibration: one stage, the whole model. The fake-tensor run is what autograd saves (measured: 0.0%
    on all three)."""
    model, args = _models()[name]
    costed = _costed(model, args)
    real = _autograd_saves(model, args)
    fake = _activation_bytes(costed, partition(costed, 1))[0]
    assert abs(fake - real) <= 0.01 * real, (fake, real)


def test_stages_split_the_activations():
    """Cut into stages, each value counts where it is saved: the stages add up to the whole model
    (a value saved on both sides of a cut would count twice; the GPT's cuts carry the residual stream,
    which LayerNorm saves on the receiving side only)."""
    model, args = _models()["gpt"]
    costed = _costed(model, args)
    saved = mm.saved_tensors(costed)
    whole = _activation_bytes(costed, partition(costed, 1), saved)[0]
    parts = _activation_bytes(costed, partition(costed, 3), saved)
    assert len(parts) == 3 and all(p > 0 for p in parts)
    assert abs(sum(parts) - whole) <= 0.02 * whole


def test_meta_model_predicts_as_the_real_one():
    torch.manual_seed(0)
    real = GPT()
    with torch.device("meta"):
        meta = GPT()
    idx = random_inputs("gpt", batch=8)[0]
    a = _activation_bytes(_costed(real, idx), partition(_costed(real, idx), 2))
    costed = _costed(meta, idx)
    assert _activation_bytes(costed, partition(costed, 2)) == a


# ---- predicted vs measured through the runtime -------------------------------------------------------------------


def _measured(model, x, devices, chunks, checkpoint, schedule="gpipe"):
    pipe = autopipe.compile(model, devices=devices, chunks=chunks, checkpoint=checkpoint, schedule=schedule,
                            track_memory=True, example_inputs=(x,))
    try:
        if schedule == "gpipe":
            pipe(x).sum().backward()
        else:
            pipe.step(x, target=torch.zeros(()), loss_fn=lambda out, _: out.sum())
        return pipe.plan, pipe.memory
    finally:
        model.zero_grad(set_to_none=True)
        if hasattr(pipe, "close"):
            pipe.close()


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_predicted_kept_and_recompute_match_measured(name, checkpoint, own_storage):
    """float32, GPipe, M=4: predicted kept (all micro-batches, what pipe.memory adds up) and recompute peak
    per stage within 15% of the measured figures (measured here: MLP exact; GPT within 0.1%, the position
    ids being the same for every micro-batch where the model scales everything by rows)."""
    torch.manual_seed(0)
    if name == "mlp":
        model, x, devices = MLP(), torch.randn(32, 8), 3
    else:
        model, x, devices = GPT(), random_inputs("gpt", batch=8)[0][0], 2
    plan, memory = _measured(model, x, devices, 4, checkpoint)
    predicted = mm.predict_memory(_costed(model, (x,)), plan, "gpipe", checkpoint, 4)
    report = f"{predicted}\n{memory}"
    for p, m in zip(predicted, memory.stages):
        assert p.kept_activations == p.kept_all  # GPipe: every micro-batch is in flight at once
        assert m.kept > 0 and abs(m.kept - p.kept_all) <= TOLERANCE * m.kept, report
        if checkpoint == "never":
            assert p.recompute_peak == m.recompute_peak == 0
        else:
            assert abs(m.recompute_peak - p.recompute_peak) <= TOLERANCE * m.recompute_peak, report
        assert abs(m.peak - p.activations_peak) <= TOLERANCE * m.peak, report


def test_1f1b_measured_and_predicted(own_storage):
    """Under 1F1B pipe.memory still adds up every micro-batch (kept_all); what a stage holds at once is
    predicted from the schedule: K - s micro-batches in flight instead of M."""
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(32, 8)
    plan, memory = _measured(model, x, 3, 4, "never", schedule="1f1b")
    costed = _costed(model, (x,))
    one_f = mm.predict_memory(costed, plan, "1f1b", "never", 4)
    gpipe = mm.predict_memory(costed, plan, "gpipe", "never", 4)
    for s, (p, g, m) in enumerate(zip(one_f, gpipe, memory.stages)):
        assert abs(m.kept - p.kept_all) <= TOLERANCE * m.kept
        assert p.in_flight == 3 - s and g.in_flight == 4
        assert p.kept_activations == pytest.approx(g.kept_activations * (3 - s) / 4, abs=1)
        assert p.kept_activations < g.kept_activations


# ---- the formulas ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_plan():
    torch.manual_seed(0)
    model = GPT(layers=4)
    x = random_inputs("gpt", batch=16)[0]
    costed = _costed(model, x)
    return costed, partition(costed, 4, chunks=8)


def test_in_flight_and_checkpoint_formulas(gpt_plan):
    costed, plan = gpt_plan
    M = 8
    configurations = [("gpipe", "never"), ("gpipe", "always"), ("gpipe", "except_last"), ("1f1b", "always")]
    never, always, last, one_f = (mm.predict_memory(costed, plan, *c, M) for c in configurations)
    for stage, n, a, e, o in zip(plan.stages, never, always, last, one_f):
        received = [plan.tensors[t] for t in stage.inputs if t in plan.tensors]
        inputs = sum(t.nbytes for t in received if t.batched)
        fixed = sum(t.nbytes for t in received if not t.batched)
        acts = n.kept_activations  # GPipe without recompute: every micro-batch's activations at once
        assert acts == n.kept_all > 0 and n.recompute_peak == 0
        assert a.kept_activations == inputs + M * fixed
        assert a.recompute_peak == pytest.approx(acts / M, abs=1)
        assert e.kept_activations == pytest.approx(inputs * (M - 1) / M + acts / M, abs=1)
        assert o.in_flight == plan.n_stages - stage.index
        assert o.kept_activations == pytest.approx(a.kept_activations * o.in_flight / M, abs=1)
        assert n.total == n.params + n.grads + n.optimizer_state + n.kept_activations + n.recompute_peak
    text = str(never)
    assert "in_flight x (inputs/M if recomputed else activations/M)" in text and "adam" in text


def test_optimizer_state_and_tied_weights(gpt_plan):
    costed, plan = gpt_plan
    adam = mm.predict_memory(costed, plan, "gpipe", "never", 8, optimizer="adam")
    sgd = mm.predict_memory(costed, plan, "gpipe", "never", 8, optimizer="sgd")
    for a, s, stage in zip(adam, sgd, plan.stages):
        assert a.params == stage.param_bytes and a.grads == s.grads <= a.params
        assert a.optimizer_state == 2 * a.grads and s.optimizer_state == 0
    tied = plan.shared_params["wte.weight"]  # the embedding and the LM head: one tensor, held by both stages
    wte = costed.tensor_bytes["wte.weight"]
    assert all(adam[s].grads >= wte for s in tied)
    with pytest.raises(ValueError, match="optimizer"):
        mm.predict_memory(costed, plan, optimizer="lion")


def test_step_time(gpt_plan):
    _, plan = gpt_plan
    K, M = plan.n_stages, 8

    def time(schedule, checkpoint, chunks, **overhead):
        return mm.predicted_step_time(plan, schedule, checkpoint, chunks, **({"task_overhead": 0} | overhead))

    gpipe = time("gpipe", "never", M)
    assert gpipe == pytest.approx(3 * plan.bottleneck * (M + K - 1) / M)
    assert time("1f1b", "never", M) == pytest.approx(gpipe)  # same bubble
    assert time("gpipe", "always", M) == pytest.approx(gpipe * 4 / 3)
    assert time("gpipe", "except_last", M) == pytest.approx(gpipe * (3 + (M - 1) / M) / 3)
    assert time("gpipe", "never", 2 * M) < gpipe
    # a fixed cost per (stage, micro-batch) task: forward and backward, and the recompute where there is one
    assert time("gpipe", "never", M, task_overhead=1.0) == pytest.approx(gpipe + 2 * M * (M + K - 1) / M)
    assert time("gpipe", "always", M, task_overhead=1.0) == pytest.approx(time("gpipe", "always", M)
                                                                          + 3 * M * (M + K - 1) / M)
    # by default each task costs DEVICE_FLOPS x (TASK_SECONDS + OP_SECONDS per op of its stage), here in FLOPs
    per_task = [mm.DEVICE_FLOPS * (mm.TASK_SECONDS + mm.OP_SECONDS * (len(s.nodes) + len(s.replicated)))
                for s in plan.stages]
    busiest = max(3 * s.cost + 2 * M * t for s, t in zip(plan.stages, per_task))
    assert mm.predicted_step_time(plan, "gpipe", "never", M) == pytest.approx(busiest * (M + K - 1) / M)


def test_chunks_trade_the_bubble_against_a_cost_per_task():
    """More micro-batches shrink the bubble and add tasks. Without a cost per task the chooser always took the
    most chunks offered; with it a tiny model (all overhead) runs few, and a large one a count in between."""
    def choose(d, **kwargs):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(d=d, heads=8, layers=8)
        costed = _costed(model, random_inputs("gpt", batch=32)[0])
        return mm.choose_configuration(lambda n: (partition(costed, n), costed), batch_size=32, n_devices=4,
                                       memory_cap=2**50, schedules=("gpipe",), checkpoint_modes=("never",), **kwargs)

    assert choose(32, task_overhead=0).chunks == 32  # the bubble alone: the most chunks always wins
    tiny = choose(32)
    assert tiny.chunks < 32 and tiny.time == min(c.time for c in tiny.candidates)
    large = choose(512)
    assert 1 < large.chunks < 32, large.table(full=True)
    times = {c.chunks: c.time for c in large.candidates}
    assert times[1] > times[large.chunks] < times[32]  # a real minimum, not an end of the range


def test_interleaved_sums_a_devices_stages():
    torch.manual_seed(0)
    model = GPT(layers=4)
    x = random_inputs("gpt", batch=16)[0]
    costed = _costed(model, x)
    plan = partition(costed, 4)  # 2 devices x 2 virtual stages
    predicted = mm.predict_memory(costed, plan, "interleaved", "never", 4, virtual_stages=2)
    assert [p.device for p in predicted] == [0, 1, 0, 1]
    assert predicted.per_device() == [predicted[0].total + predicted[2].total, predicted[1].total + predicted[3].total]
    table = Schedule.build("interleaved", 2, 4, 2)
    assert [p.in_flight for p in predicted] == [table.max_in_flight(s) for s in range(4)]
    two = partition(costed, 2)
    interleaved, one_f = (mm.predicted_step_time(plan, "interleaved", "never", 4, virtual_stages=2, task_overhead=0),
                          mm.predicted_step_time(two, "1f1b", "never", 4, task_overhead=0))
    assert interleaved < one_f * 1.05  # smaller bubble, same work
    # but twice the tasks per device: on a model this small their fixed cost outweighs the bubble
    assert (mm.predicted_step_time(plan, "interleaved", "never", 4, virtual_stages=2)
            > mm.predicted_step_time(two, "1f1b", "never", 4))


def test_zero_bubble_memory_holds_each_graph_until_its_w(gpt_plan):
    """ZB-H1 keeps K micro-batches in flight on every stage (1F1B: K - s), each held until its W with the gradients B
    kept for W; a stage reading only the model's inputs (the embedding) does all in B and holds as under 1F1B. With
    re-materialisation the activations B recomputes live until W, so no recompute term is added on top."""
    costed, plan = gpt_plan
    M, K = 8, plan.n_stages
    for checkpoint in ("never", "always"):
        one_f = mm.predict_memory(costed, plan, "1f1b", checkpoint, M)
        zb = mm.predict_memory(costed, plan, "zb-h1", checkpoint, M)
        assert [p.in_flight for p in zb] == [K] * K
        assert zb[0].kept_activations == one_f[0].kept_activations  # stage 0: B+W in one task
        acts = mm.predict_memory(costed, plan, "gpipe", "never", M)
        for s in range(1, K):
            assert zb[s].recompute_peak == 0 and zb[s].kept_activations > one_f[s].kept_activations
            assert zb[s].kept_activations >= K * acts[s].kept_activations / M * (0.5 if checkpoint == "always" else 1)
        assert "kept gradients" in zb[K - 1].formula
    assert "K for zb-h1" in str(zb)


def test_zbv_lays_2k_stages_in_a_v_and_weighs_its_smaller_bubble():
    """And dualpipev, zbv's V, bubble and in-flight counts: its full backwards free a micro-batch at B, keep no
    gradients for a W and are one task, not two, so no stage holds more than under zbv and a step with a cost per
    task is shorter."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(d=128, layers=8)
    costed = _costed(model, random_inputs("gpt", batch=16)[0])
    v_plan = partition(costed, 8, chunks=8)
    zbv = mm.predict_memory(costed, v_plan, "zbv", "never", 8, virtual_stages=2)
    assert [p.device for p in zbv] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert zbv.per_device()[0] == zbv[0].total + zbv[7].total
    assert [p.in_flight for p in zbv] == [Schedule.zbv(4, 8).max_in_flight(s) for s in range(8)]
    assert zbv.bubble == pytest.approx(Schedule.zbv(4, 8).bubble_fraction) and zbv.bubble < 0.07
    four = partition(costed, 4, chunks=8)
    time = lambda plan, name, v=1: mm.predicted_step_time(plan, name, "never", 8, v, task_overhead=0)
    assert time(v_plan, "zbv", 2) < time(four, "zb-h1") < time(four, "1f1b")  # the bubbles, same work
    # a W per micro-batch is one more task: a fixed cost per task weighs against it on a model this small
    assert mm.predicted_step_time(four, "zb-h1", "never", 8) > mm.predicted_step_time(four, "1f1b", "never", 8)
    dual = mm.predict_memory(costed, v_plan, "dualpipev", "never", 8, virtual_stages=2)
    assert [p.device for p in dual] == [p.device for p in zbv]
    assert [p.in_flight for p in dual] == [Schedule.dualpipev(4, 8).max_in_flight(s) for s in range(8)]
    assert dual.bubble == pytest.approx(zbv.bubble)
    assert all(d.kept_activations <= z.kept_activations for d, z in zip(dual, zbv))
    assert dual[1].kept_activations < zbv[1].kept_activations and "kept gradients" not in dual[1].formula
    assert time(v_plan, "dualpipev", 2) == pytest.approx(time(v_plan, "zbv", 2))  # same work, same bubble
    assert mm.predicted_step_time(v_plan, "dualpipev", "never", 8, 2) < mm.predicted_step_time(v_plan, "zbv", "never",
                                                                                                8, 2)


# ---- choosing a configuration --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gpt_choice():
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(layers=8)
    x = random_inputs("gpt", batch=32)[0]
    costed = _costed(model, x)
    calls: list[int] = []

    def plan_for(n_stages):
        calls.append(n_stages)
        return partition(costed, n_stages), costed

    return plan_for, calls


def test_choose_picks_the_fastest_that_fits(gpt_choice):
    plan_for, calls = gpt_choice
    cap = 1.5 * 2**20
    choice = mm.choose_configuration(plan_for, batch_size=32, n_devices=4, memory_cap=cap)
    assert sorted(calls) == [4, 8]  # one plan per stage count, whatever chunks, checkpoint and schedule
    assert choice.chosen.fits and choice.memory.peak <= cap
    fitting = [c for c in choice.candidates if c.fits]
    assert choice.time == min(c.time for c in fitting)
    assert any(not c.fits for c in choice.candidates)  # the cap excluded something
    assert {c.schedule for c in choice.candidates} == set(SCHEDULES)
    assert {c.checkpoint for c in choice.candidates} == {"never", "except_last", "always"}
    assert choice.plan.n_stages == 4 * choice.virtual_stages
    text = str(choice)
    assert "Chosen:" in text and "bubble" in text and "fits" in text and "over by" in text
    # a roomy cap: nothing to trade, so no re-materialisation
    roomy = mm.choose_configuration(plan_for, batch_size=32, n_devices=4, memory_cap=2**40)
    assert roomy.checkpoint == "never" and roomy.time <= choice.time


def test_choose_refuses_naming_the_smallest_peak(gpt_choice):
    plan_for, _ = gpt_choice
    cap = 64 * 2**10
    with pytest.raises(NoFeasiblePlan) as info:
        mm.choose_configuration(plan_for, batch_size=32, n_devices=4, memory_cap=cap, chunks=[4, 8])
    message = str(info.value)
    assert "no configuration fits memory_cap=64.0 KiB" in message
    assert "smallest predicted peak is" in message and "Raise memory_cap to at least" in message
    # the smallest peak it names is the smallest of the candidates
    choice = mm.choose_configuration(plan_for, batch_size=32, n_devices=4, memory_cap=2**40, chunks=[4, 8])
    least = min(c.peak for c in choice.candidates)
    assert f"smallest predicted peak is {human_bytes(least)}" in message


def test_choose_restricted_candidates(gpt_choice):
    plan_for, _ = gpt_choice
    choice = mm.choose_configuration(plan_for, batch_size=32, n_devices=4, memory_cap=2**40,
                                     schedules=("gpipe", "1f1b"), checkpoint_modes=("always",), chunks=8)
    assert {(c.schedule, c.checkpoint, c.chunks) for c in choice.candidates} == {("gpipe", "always", 8),
                                                                                  ("1f1b", "always", 8)}
    gpipe, one_f = sorted(choice.candidates, key=lambda c: c.schedule != "gpipe")
    assert choice.schedule == "1f1b" and choice.time == one_f.time
    assert one_f.time == pytest.approx(gpipe.time) and one_f.peak < gpipe.peak  # same time, less memory


def test_auto_weighs_the_zero_bubble_schedules_and_plans_zbvs_v():
    """plan(schedule="auto") weighs zb-h1 and zbv beside the others; zbv's plan has 2K stages, laid in the V."""
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(d=256, layers=8)
    x = random_inputs("gpt", batch=32)[0]
    auto = autopipe.plan(model, x, devices=4, chunks=8, schedule="auto", checkpoint="never", memory_cap=2**40)
    assert {c.schedule for c in auto.choice.candidates} == set(SCHEDULES)
    zbv = autopipe.plan(model, x, devices=2, chunks="auto", schedule="zbv", checkpoint="never", memory_cap=2**40)
    assert zbv.choice.schedule == "zbv" and zbv.n_stages == 4 and zbv.memory.virtual_stages == 2
    assert [p.device for p in zbv.memory] == [0, 1, 1, 0]
    assert "->" in zbv.choice.table()  # the chosen row is marked after the V re-plan too


# -- cuda_graphs=True: each captured stage's graph slots ---------------------------------------------------------

def _graphs_plan(schedule="gpipe", checkpoint="never", **options):
    torch.manual_seed(0)
    return autopipe.plan(MLP(), torch.randn(16, 8), devices=2, chunks=4, schedule=schedule, checkpoint=checkpoint,
                         cuda_graphs=True, **options)


@pytest.mark.parametrize("schedule, checkpoint, slots", [("gpipe", "never", [4, 4]), ("1f1b", "never", [2, 1]),
                                                         ("gpipe", "except_last", [1, 1]),
                                                         ("1f1b", "always", [1, 1])])
def test_graph_slots_follow_the_schedule(schedule, checkpoint, slots):
    """A kept micro-batch holds a slot from F to B; a recomputed one only while it is recomputed and backwarded."""
    memory = _graphs_plan(schedule, checkpoint).memory
    assert [p.graph_slots for p in memory] == slots


def test_a_graph_slot_holds_a_micro_batch_and_the_parameter_gradients():
    plan = _graphs_plan()
    eager = autopipe.plan(MLP(), torch.randn(16, 8), devices=2, chunks=4, checkpoint="never").memory
    for p, e, s in zip(plan.memory, eager, plan.stages):
        outputs = [plan.tensors[n] for n in s.outputs]
        received = [plan.tensors[n] for n in s.inputs if plan.tensors[n].producer >= 0]
        slot = (e.kept_all + sum(2 * t.nbytes for t in outputs) + sum(t.nbytes for t in received)) / 4 + p.grads
        assert p.graph_bytes == pytest.approx(p.graph_slots * slot, abs=4)
        assert p.kept_activations == 0 and p.recompute_peak == 0  # all inside the slots
        assert p.total == p.params + p.grads + p.optimizer_state + p.graph_bytes
    assert "graphs = slots x" in str(plan.memory) and "4 x " in str(plan.memory)


def test_recomputed_inputs_stay_outside_the_graphs():
    """GPipe, except_last: micro-batches 0-2 wait for their backward as their inputs, the last inside its slot."""
    plan = _graphs_plan("gpipe", "except_last")
    inputs = [sum(plan.tensors[n].nbytes for n in s.inputs) / 4 for s in plan.stages]
    assert [p.kept_activations for p in plan.memory] == [3 * b for b in inputs]


def test_memory_cap_holds_with_graphs_on():
    eager_peak = autopipe.plan(MLP(), torch.randn(16, 8), devices=2, chunks=4, checkpoint="never").memory.peak
    graphs_peak = _graphs_plan().memory.peak
    assert graphs_peak > eager_peak
    cap = (eager_peak + graphs_peak) / 2
    with pytest.raises(ValueError, match="cuda_graphs=True: device .* over memory_cap"):
        _graphs_plan(memory_cap=cap)
    chosen = autopipe.plan(MLP(), torch.randn(16, 8), devices=2, chunks="auto", checkpoint="auto", memory_cap=cap,
                           cuda_graphs=True)
    assert chosen.memory.peak <= cap and any(p.graph_slots for p in chosen.memory)
