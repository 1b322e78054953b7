"""compile(..., cuda_graphs=True) (runtime/cuda_graphs.py). The CPU checks run everywhere: how many graph slots a
schedule needs, and the option's refusals. The CUDA checks (skipped without CUDA; ``make gpu`` runs them) are what the
option promises: graphed gradients against eager ones, two graphed steps with one seed bit for bit, the recompute
inside a graph bit for bit, GPipe / 1F1B / interleaved with dropout and checkpoint="always", a stage with .item()
eager with the reason in its plan, memory flat over 100 graphed steps. None of them has run on a GPU yet.

Each CUDA test runs three steps at least: the first is eager (the warm-up whose inputs the captures copy), the second
captures at its start and replays, the third replays only.
"""
import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopipe
from autopipe.ir.capture import graph_slots
from autopipe.ir.checkpoint import checkpoints
from autopipe.ir.schedule import Schedule
from autopipe.runtime.cuda_graphs import GraphedStageRunner
from test_cuda import CUDA, cuda, no_tf32  # noqa: F401 (no_tf32: an autouse fixture, TF32 off in every test here)
from zoo import GPT, ScaledByItem


# -- on the CPU ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, v", [("gpipe", 1), ("1f1b", 1), ("interleaved", 2)])
def test_kept_micro_batches_need_a_slot_each_while_in_flight(name, v):
    schedule = Schedule.build(name, 2, 4, v)
    for s in range(schedule.n_stages):
        order = schedule.stage_order(s)
        assert graph_slots(order, [False] * 4) == schedule.max_in_flight(s)
        assert graph_slots(order, [True] * 4) == 1  # checkpoint="always": one, recomputed just before its backward
        except_last = [checkpoints("except_last", i, 4) for i in range(4)]
        assert 1 <= graph_slots(order, except_last) <= 2


def test_graphs_need_cuda_devices():
    with pytest.raises(ValueError, match="cuda_graphs=True needs every stage on a CUDA device, but devices gives 'cpu'"):
        autopipe.compile(nn.Linear(4, 4), devices=["cpu", "cpu"], cuda_graphs=True)


@pytest.mark.parametrize("options, match", [(dict(schedule="zb-h1"), "schedule='zb-h1' is not supported yet"),
                                            (dict(deferred_batch_norm=True), "deferred_batch_norm=True is not"),
                                            (dict(track_memory=True), "track_memory=True is not supported yet"),
                                            (dict(chunks=0), "chunks must be a positive int")])
def test_unsupported_combinations_are_refused_by_name(options, match):
    with pytest.raises(ValueError, match=match):
        autopipe.compile(nn.Linear(4, 4), devices=["cpu"], cuda_graphs=True, **options)


# -- on a GPU -----------------------------------------------------------------------------------------------------

def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def batch(seed=0, size=8, seq=16):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 64, (size, seq), generator=g).to(CUDA),
            torch.randint(0, 64, (size, seq), generator=g).to(CUDA))


def twins(dropout=0.1, **options):
    """The same GPT compiled twice on one GPU, eager and graphed, two stages."""
    torch.manual_seed(0)
    model = GPT(dropout=dropout).train().to(CUDA)
    other = copy.deepcopy(model)
    options = dict(devices=[CUDA] * 2, chunks=4) | options
    return (model, autopipe.compile(model, **options)), (other, autopipe.compile(other, cuda_graphs=True, **options))


def step(model, pipe, ids, target, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the step's seed is one draw from the global generator: the same dropout masks
    loss = pipe.step(ids, target=target, loss_fn=lm_loss)
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def relative(got, want):
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def replays(pipe) -> bool:
    return any(isinstance(r, GraphedStageRunner) and any(r.slots.values()) for r in pipe.compiled.main.runners)


@cuda
@pytest.mark.parametrize("schedule, v, checkpoint", [("gpipe", 1, "never"), ("gpipe", 1, "always"),
                                                     ("1f1b", 1, "except_last"), ("1f1b", 1, "always"),
                                                     ("interleaved", 2, "never"), ("interleaved", 2, "always")])
def test_graphed_gradients_equal_eager_ones(schedule, v, checkpoint):
    (model, eager), (twin, graphed) = twins(schedule=schedule, virtual_stages=v, checkpoint=checkpoint)
    ids, target = batch()
    for k in range(3):
        want_loss, want = step(model, eager, ids, target, seed=10 + k)
        got_loss, got = step(twin, graphed, ids, target, seed=10 + k)
        assert got.keys() == want.keys()
        assert got_loss.item() == pytest.approx(want_loss.item(), rel=1e-5)
        worst = max((relative(got[n], want[n]), n) for n in want)
        assert worst[0] < 1e-5, f"step {k}: {worst}"
    assert replays(graphed), str(graphed.plan.cuda_graphs)


@cuda
def test_graphed_gradients_under_bf16_autocast():
    (model, eager), (twin, graphed) = twins(checkpoint="except_last")
    ids, target = batch()
    for k in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, want = step(model, eager, ids, target, seed=20 + k)
            _, got = step(twin, graphed, ids, target, seed=20 + k)
        worst = max((relative(got[n], want[n]), n) for n in want)
        assert worst[0] < 2e-2, f"step {k}: {worst}"  # bf16 rounding: a few ulps of 2**-8 through the stages
    assert replays(graphed)


@cuda
def test_two_graphed_steps_with_one_seed_are_bit_for_bit_equal():
    _, (twin, graphed) = twins(checkpoint="except_last")
    ids, target = batch()
    for k in range(2):  # warm-up, then the captures
        step(twin, graphed, ids, target, seed=k)
    first_loss, first = step(twin, graphed, ids, target, seed=7)
    second_loss, second = step(twin, graphed, ids, target, seed=7)
    assert torch.equal(first_loss, second_loss)
    assert all(torch.equal(first[n], second[n]) for n in first)
    _, third = step(twin, graphed, ids, target, seed=8)  # another seed: dropout draws afresh at each replay
    assert any(not torch.equal(first[n], third[n]) for n in first)


@cuda
def test_a_recompute_inside_a_graph_replays_its_forward_bit_for_bit():
    """checkpoint="always" recomputes every micro-batch by replaying its forward graph; "never" keeps the first
    replay's activations: with the same seed their gradients are the same bits."""
    _, (kept_model, kept) = twins(checkpoint="never")
    _, (recomputed_model, recomputed) = twins(checkpoint="always")
    ids, target = batch()
    for k in range(3):
        _, want = step(kept_model, kept, ids, target, seed=30 + k)
        _, got = step(recomputed_model, recomputed, ids, target, seed=30 + k)
        assert all(torch.equal(got[n], want[n]) for n in want), f"step {k}"
    assert replays(kept) and replays(recomputed)


@cuda
def test_a_stage_with_item_runs_eagerly_and_its_plan_says_why():
    torch.manual_seed(0)
    model = ScaledByItem(width=32).to(CUDA)
    reference = copy.deepcopy(model)
    x = torch.randn(8, 32, device=CUDA)
    pipe = autopipe.compile(model, devices=[CUDA] * 4, chunks=4, cuda_graphs=True, example_inputs=(x,))
    eager_stage = next(s.index for s in pipe.plan.stages if "item" in s.nodes)
    assert f"stage {eager_stage}: runs eagerly: Tensor.item" in str(pipe.plan)
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        pipe(x).square().mean().backward()
        reference(x).square().mean().backward()
        for p, q in zip(model.parameters(), reference.parameters()):
            assert relative(p.grad, q.grad) < 1e-5
    runners = pipe.compiled.main.runners
    assert not isinstance(runners[eager_stage], GraphedStageRunner)
    assert all(any(r.slots.values()) for k, r in enumerate(runners) if k != eager_stage)


@cuda
def test_memory_stays_flat_over_100_graphed_steps():
    _, (twin, graphed) = twins(checkpoint="except_last", schedule="1f1b")
    ids, target = batch()
    for k in range(3):
        step(twin, graphed, ids, target, seed=k)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(CUDA)
    for k in range(100):
        step(twin, graphed, ids, target, seed=k)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(CUDA) <= before + (1 << 20), (before, torch.cuda.memory_allocated(CUDA))
    assert replays(graphed)
