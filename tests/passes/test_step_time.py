"""passes/step_time.py and passes/node_times.py: a stage's predicted step time is built from its named terms (forward,
recompute, B, W, loss, link), and ``plan.validate(timeline)`` names the term that misses. No wall-clock figure is
asserted: the timelines compared against here are built, or only checked for their shape."""
from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import autopipe
from autopipe.ir.step_time import Link
from autopipe.passes.cost import cost
from autopipe.passes.node_times import NodeTimes, loss_gradients, measure_loss, measure_node_times
from autopipe.passes.partition import partition
from autopipe.passes.step_time import crossing_price, measure_link, predict_step_time
from autopipe.passes.trace import trace
from autopipe.runtime.timeline import Event, Timeline
from autopipe.ir.schedule import Schedule
import zoo
from zoo.models import MLP

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def planned(n_stages=2, chunks=4, batch=8):
    torch.manual_seed(0)
    model = MLP()
    x = torch.randn(batch, 8)
    costed = cost(trace(model, (x,), {}, route="fx"))
    return model, x, costed, partition(costed, n_stages, chunks=chunks)


def stated_times(costed, rows: int) -> NodeTimes:
    """Given node times: forward 1 ms a node, backward 3 ms of which 1 ms is B."""
    names = list(costed.costs)
    return NodeTimes(forward={n: 1e-3 for n in names}, backward={n: 3e-3 for n in names},
                     input_grad={n: 1e-3 for n in names}, rows=rows, repeats=1)


def test_prediction_is_the_sum_of_its_named_terms():
    _, _, costed, plan = planned(n_stages=2, chunks=4)
    times = stated_times(costed, rows=2)  # one micro-batch of 8 rows / 4
    link = Link(bandwidth=1e9, latency=1e-5)
    fused = predict_step_time(costed, plan, times, "1f1b", "except_last", link=link, loss_seconds=5e-3)
    split = predict_step_time(costed, plan, times, "zb-h1", "never", link=link)
    assert plan.step_time is split  # what plan.validate reads
    for s, f, z in zip(plan.stages, fused, split):
        nodes = len(s.nodes) + len(s.replicated)
        assert f.forward == pytest.approx(4 * nodes * 1e-3)
        assert f.recompute == pytest.approx(3 * nodes * 1e-3)  # except_last: 3 of 4 micro-batches
        assert z.recompute == 0
        assert f.backward == pytest.approx(4 * len(s.nodes) * 3e-3) and f.weight == 0  # fused
        assert f.loss == (pytest.approx(4 * 5e-3) if s.index == 1 else 0)
        assert f.total == pytest.approx(f.forward + f.recompute + f.backward + f.weight + f.loss + f.send + f.receive)
    # zb-h1 runs W apart on the stage that receives a float tensor: B is the input gradients alone; stage 0 fuses
    assert split[0].weight == 0 and split[0].backward == pytest.approx(4 * len(plan.stages[0].nodes) * 3e-3)
    assert split[1].backward == pytest.approx(4 * len(plan.stages[1].nodes) * 1e-3)
    assert split[1].weight == pytest.approx(4 * len(plan.stages[1].nodes) * 2e-3)
    crossing = [plan.tensors[n] for n in plan.stages[1].inputs if plan.tensors[n].producer == 0]
    nbytes = 2 * sum(t.nbytes for t in crossing)  # the values, and their gradients back
    assert fused[1].receive == pytest.approx(link.seconds(nbytes, 2 * 4 * len(crossing)))
    assert fused[0].send == pytest.approx(fused[1].receive) and fused[0].receive == 0


def test_zbv_adds_up_the_two_stages_a_device_holds():
    _, _, costed, plan = planned(n_stages=4, chunks=4)
    prediction = predict_step_time(costed, plan, stated_times(costed, rows=2), "zbv", "never")
    assert [s.device for s in prediction] == [0, 1, 1, 0]
    assert prediction.per_device()[0] == pytest.approx(prediction[0].total + prediction[3].total)
    assert prediction.step == pytest.approx(max(prediction.per_device()) / (1 - prediction.bubble))
    report = plan.validate(timeline_of(prediction, plan, {}))
    pair = 1e3 * (prediction[0].timed + prediction[3].timed)
    assert report.ok and f"0: {pair:.2f} / {pair:.2f}" in str(report)


def timeline_of(prediction, plan, scale: dict) -> Timeline:
    """A timeline whose tasks take the predicted time, times ``scale[(stage, kind)]`` where given."""
    timeline, clock = Timeline(Schedule.build("1f1b", plan.n_stages, prediction.chunks)), 0.0
    for s in prediction:
        for kind in ("forward", "recompute", "backward", "weight", "loss")[:5 if s.loss else 4]:
            seconds = s.term(kind) * scale.get((s.stage, kind), 1.0) / prediction.chunks
            for i in range(prediction.chunks):
                timeline._events.append(Event(s.stage, i, kind, clock, clock + seconds))
                clock += seconds
    return timeline


def test_validate_names_the_term_that_misses():
    _, _, costed, plan = planned(n_stages=2, chunks=4)
    prediction = predict_step_time(costed, plan, stated_times(costed, rows=2), "1f1b", "except_last")
    agreed = plan.validate(timeline_of(prediction, plan, {}))
    assert agreed.ok and all(abs(c.error) < 1e-9 for c in agreed.checks)
    report = plan.validate(timeline_of(prediction, plan, {(1, "backward"): 2.0}))
    assert not report.ok and [c.stage for c in report.misses] == [1] and report.misses[0].worst == "backward"
    assert "miss: backward" in str(report) and "1 stage(s) not within 10%" in str(report)
    # several steps: the median step per (stage, kind)
    steps = [timeline_of(prediction, plan, {(1, "backward"): f}) for f in (1.0, 1.01, 3.0)]
    assert plan.validate(steps).ok


def test_validate_needs_a_prediction_and_a_step():
    _, _, costed, plan = planned()
    with pytest.raises(ValueError, match="no predicted step time"):
        plan.validate(Timeline(Schedule.build("1f1b", 2, 4)))
    predict_step_time(costed, plan, stated_times(costed, rows=2), "1f1b")
    with pytest.raises(ValueError, match="no tasks"):
        plan.validate(Timeline(Schedule.build("1f1b", 2, 4)))


def test_measured_times_leave_the_model_as_it_was_and_validate_a_real_step():
    model, x, costed, _ = planned(n_stages=2, chunks=4)
    flags = [p.requires_grad for p in model.parameters()]
    times = measure_node_times(costed.traced.graph_module, [x[:2]], repeats=1, threads=1)
    loaded = measure_node_times(costed.traced.graph_module, [x[:2]], repeats=1, threads=1, peers=1)
    assert loaded.peers == 1 and set(loaded.forward) == set(times.forward)
    assert [p.requires_grad for p in model.parameters()] == flags and all(p.grad is None for p in model.parameters())
    linears = [n for n in costed.costs if "layers" in n or n.startswith("out")]
    assert set(times.forward) == set(costed.costs) and all(times.weight(n) >= 0 for n in linears)
    assert measure_loss(lambda out, t: out.pow(2).mean(), model(x[:2]).detach(), repeats=1) > 0
    pipe = autopipe.compile(model, 2, 4, example_inputs=(x,), schedule="1f1b")
    pipe.step(x, target=None, loss_fn=lambda out, t: out.pow(2).mean())
    predict_step_time(costed, pipe.plan, times, "1f1b", "except_last", loss_seconds=1e-3)
    report = pipe.plan.validate(pipe.timeline)
    assert [c.stage for c in report.checks] == [0, 1] and all(c.measured["forward"] > 0 for c in report.checks)
    # pipe.step's loss is a task of the last stage's, once per micro-batch, compared with its prediction
    assert [e.micro_batch for e in pipe.timeline.events if e.kind == "loss"] == [0, 1, 2, 3]
    assert all(e.stage == 1 for e in pipe.timeline.events if e.kind == "loss")
    assert report.checks[1].measured["loss"] > 0 == report.checks[0].measured["loss"]
    assert report.checks[1].predicted["loss"] == pytest.approx(4e-3) and "loss (ms)" in str(report)
    # with no loss task (GPipe's pipe(x), the caller's own loss and backward) the loss is named, not compared
    tasks = dataclasses.replace(pipe.timeline, _events=[e for e in pipe.timeline.events if e.kind != "loss"])
    report = pipe.plan.validate(tasks)
    assert "loss" not in report.checks[1].measured and "stage 1 loss 4.00 ms" in str(report)


def test_link_by_ping_pong():
    threads = measure_link("threads", repeats=2)
    assert math.isinf(threads.bandwidth) and threads.latency > 0 and crossing_price(threads, 1.0) == 0
    gloo = measure_link("gloo", sizes=(1 << 10, 1 << 20), repeats=2)
    assert 0 < gloo.bandwidth < math.inf and crossing_price(gloo, 1.0) == pytest.approx(2 / gloo.bandwidth)


def test_a_backward_is_timed_from_the_losss_own_gradient_where_a_loss_is_given():
    """Note [a backward's speed depends on its values]. ``loss_gradients`` is the gradient the loss gives the graph's
    outputs, exactly (float64), and measure_node_times starts its backwards there, once per backward timed."""
    model, x, costed, _ = planned()
    model, x = model.double(), x.double()
    costed = cost(trace(model, (x,), {}, route="fx"))
    target = torch.randn(2, *model(x[:2]).shape[1:], dtype=torch.float64)
    loss_fn = lambda out, t: torch.nn.functional.mse_loss(out, t)
    gradients = loss_gradients(loss_fn, target, costed.traced.rebuild_output)
    out = model(x[:2])
    (want,) = torch.autograd.grad(loss_fn(out, target), [out])
    (got,) = gradients([model(x[:2])])
    torch.testing.assert_close(got, want, rtol=0, atol=1e-15)
    calls = []
    times = measure_node_times(costed.traced.graph_module, [x[:2]], repeats=2, threads=1,
                               output_grads=lambda flat: calls.append(len(flat)) or gradients(flat))
    assert calls == [1] * 4 and set(times.backward) == set(costed.costs)  # B-and-W and B alone, each repeat
    assert all(p.grad is None for p in model.parameters())


def test_each_later_micro_batchs_gradients_are_summed_in_the_task_that_makes_them_on_a_rank():
    """Each micro-batch after the first adds every parameter of its stage once (Note [a micro-batch's gradients added
    to the step's]); on a torchrun rank inside the task that makes the gradients (the fused backward, else W), and
    the first copied too, at its own price (Note [a step's first gradient copied to fresh pages]); in process after
    the task (untimed, printed)."""
    _, _, costed, plan = planned(n_stages=2, chunks=4)
    names = [name for name, _ in costed.traced.graph_module.named_parameters()]
    times = dataclasses.replace(stated_times(costed, rows=2), accumulate={name: 1e-4 for name in names},
                                first_sum={name: 5e-4 for name in names})
    after = predict_step_time(costed, plan, times, "zb-h1", "never")
    inside = predict_step_time(costed, plan, times, "zb-h1", "never", sums_in_tasks=True)
    for s, a, i in zip(plan.stages, after, inside):
        assert a.accumulate == pytest.approx(3 * len(s.params) * 1e-4)  # micro-batches 1, 2 and 3
        assert i.accumulate == pytest.approx(3 * len(s.params) * 1e-4 + len(s.params) * 5e-4)  # and the first, copied
        assert a.term("backward") == a.backward and a.timed == pytest.approx(a.forward + a.backward + a.weight)
        assert a.total == pytest.approx(a.timed + a.send + a.receive + a.accumulate)
        assert i.timed == pytest.approx(i.forward + i.backward + i.weight + i.accumulate)
        assert i.total == pytest.approx(a.total + len(s.params) * 5e-4)
    # stage 0 fuses B and W (no float input): its sums land in its backward; stage 1's in its W
    assert inside[0].term("backward") == pytest.approx(inside[0].backward + inside[0].accumulate)
    assert inside[1].term("backward") == inside[1].backward
    assert inside[1].term("weight") == pytest.approx(inside[1].weight + inside[1].accumulate)
    report = plan.validate(timeline_of(inside, plan, {}))  # plan.step_time: the last prediction
    assert report.ok and all(abs(c.error) < 1e-9 for c in report.checks)
    assert "accumulate" not in str(report)  # compared inside the tasks' terms, not listed apart
    predict_step_time(costed, plan, times, "zb-h1", "never")
    report = plan.validate(timeline_of(after, plan, {}))
    added = 1e3 * 3 * len(plan.stages[1].params) * 1e-4
    assert report.ok and f"stage 1 accumulate {added:.2f} ms" in str(report)  # after the tasks: named, not compared


def test_measured_sums_cover_every_name_of_a_trainable_parameter_and_leave_grads_as_they_were():
    """A tied weight has two names, each priced (a stage holding either adds its gradient); a ``.grad`` already set
    is the same tensor, unchanged, after the measurement (Note [gradients dropped as made])."""
    torch.manual_seed(0)
    model = zoo.GPT(vocab=32, d=16, heads=2, layers=1, block=8, dropout=None)
    ids = torch.randint(0, 32, (2, 8))
    gm = trace(model, (ids,), {}, route="fx").graph_module
    held = {name: torch.full_like(p, 3.0) for name, p in gm.named_parameters()}
    for name, p in gm.named_parameters():
        p.grad = held[name]
    times = measure_node_times(gm, [ids], repeats=1, threads=1)
    names = [name for name, _ in gm.named_parameters(remove_duplicate=False)]
    assert len(names) > len(held) and set(times.accumulate) == set(names) == set(times.first_sum)
    assert all(seconds > 0 for seconds in [*times.accumulate.values(), *times.first_sum.values()])
    for name, p in gm.named_parameters():
        assert p.grad is held[name] and bool((p.grad == 3.0).all())


def test_b_and_w_timed_as_a_split_schedule_runs_them_price_the_split_stages():
    """With ``split_backward=True`` every node past the first floating value computed from the inputs gets a B, and
    each node reading parameters there a W, timed as zero bubble runs them (Note [B and W timed apart]); a stage
    whose W runs apart is priced with them, a fused one is not."""
    model, x, costed, plan = planned(n_stages=2, chunks=4)
    gm = costed.traced.graph_module
    times = measure_node_times(gm, [x[:2]], repeats=1, threads=1, split_backward=True)
    reading = {n.name for n in gm.graph.nodes
               if n.op == "call_module" and next(gm.get_submodule(n.target).parameters(), None) is not None}
    first = next(n.name for n in gm.graph.nodes if n.op == "call_module")  # reads the input: before the leaves
    assert set(times.weight_apart) == reading - {first} and first not in times.input_grad_apart
    assert set(times.input_grad_apart) >= reading - {first}
    assert all(p.requires_grad and p.grad is None for p in model.parameters())
    stated = dataclasses.replace(stated_times(costed, rows=2), input_grad_apart={n: 5e-3 for n in costed.costs},
                                 weight_apart={n: 7e-3 for n in costed.costs})
    before_the_leaves = dataclasses.replace(stated, input_grad_apart={n: 5e-3 for n in costed.costs if n != first},
                                            weight_apart={n: 7e-3 for n in costed.costs if n != first})
    assert before_the_leaves.weight_split(first) == pytest.approx(2e-3)  # not timed apart: its fused share
    assert dataclasses.replace(stated, weight_apart={}).weight_split(first) == 0  # timed apart, no W: none runs
    split = predict_step_time(costed, plan, stated, "zb-h1", "never")
    fused = predict_step_time(costed, plan, stated_times(costed, rows=2), "zb-h1", "never")
    nodes = len(plan.stages[1].nodes)
    assert split[1].backward == pytest.approx(4 * nodes * 5e-3) and split[1].weight == pytest.approx(4 * nodes * 7e-3)
    assert split[0].backward == fused[0].backward and split[0].weight == 0  # stage 0 fuses B and W


def test_measuring_runs_none_of_the_users_parameter_hooks():
    """An optimizer in the backward (a post-accumulate hook on a parameter) must not step while compile or the cost
    model times the nodes: AccumulateGrad runs only where no parameter has hooks of its own (Note [gradients dropped
    as made])."""
    model, x, costed, _ = planned()
    stepped = []
    handle = next(model.parameters()).register_post_accumulate_grad_hook(lambda p: stepped.append(p))
    try:
        times = measure_node_times(costed.traced.graph_module, [x[:2]], repeats=1, threads=1, split_backward=True)
    finally:
        handle.remove()
    assert stepped == [] and all(p.grad is None for p in model.parameters()) and times.weight_apart
