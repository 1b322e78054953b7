"""The zero-bubble schedules (zb-h1, zbv, and dualpipev, whose backwards are full or split) in process: the plain
model's gradients in float64 on the test zoo under every checkpoint mode, one replay per re-materialised forward, and
the features 1F1B has: tied weights, parameter hooks, deferred BatchNorm, and pipe(x) refused for training as under
1F1B."""
import copy
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopipe
from dist_worker import double_inputs, per_sample_loss
from zoo import GPT, MLP, build

NAMES = ["mlp", "resnet", "unet", "gpt", "kwargs", "dataclass", "two_inputs", "masked", "moe"]
MODES = ["never", "except_last", "always"]
# dualpipev runs zbv's tasks in another order, a full backward being B and W in one: one mode a model, spread over them
DUALPIPEV_MODES = dict(zip(NAMES[:-1], itertools.cycle(MODES)))


@pytest.mark.parametrize("schedule, name", [(s, n) for s in ("zb-h1", "zbv") for n in NAMES] +
                         [("dualpipev", n) for n in DUALPIPEV_MODES])
def test_the_zoo_trains_as_the_plain_model_in_float64(name, schedule):
    model = build(name).double().eval()  # BatchNorm's batch statistics and dropout's masks are per micro-batch in
    # train mode, as under every schedule: test_pipeline.py compares those with 1F1B's bit for bit
    args, kwargs = double_inputs(name)
    rows = torch.zeros(8)
    plain = copy.deepcopy(model)
    per_sample_loss(plain(*args, **kwargs), rows).backward()
    # the MoE traces through export, ~4 s a compile: one mode a schedule (test_distributed.py runs the others over ranks)
    modes = {"zb-h1": ["always"], "zbv": ["except_last"]}[schedule] if name == "moe" else \
        [DUALPIPEV_MODES[name]] if schedule == "dualpipev" else MODES
    for checkpoint in modes:
        model.zero_grad(set_to_none=True)
        pipe = autopipe.compile(model, devices=2, chunks=4, checkpoint=checkpoint, schedule=schedule)
        pipe.step(*args, **kwargs, target=rows, loss_fn=per_sample_loss)
        for (n, p), q in zip(model.named_parameters(), plain.parameters()):
            assert (p.grad is None) == (q.grad is None), n
            if q.grad is not None:
                torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10, msg=f"{checkpoint}: {n}")
        recomputed = [(e.stage, e.micro_batch) for e in pipe.timeline.events if e.kind == "recompute"]
        assert len(recomputed) == len(set(recomputed))  # each re-materialised forward replays once
        assert len(recomputed) == {"never": 0, "except_last": 3, "always": 4}[checkpoint] * pipe.plan.n_stages


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "dualpipev"])
def test_parameter_hooks_run_once_on_the_whole_gradient(schedule):
    """As under 1F1B: a tensor hook on a parameter sees the step's whole gradient once (a normalising hook would
    differ on per-micro-batch parts), then its post-accumulate hook runs once."""
    torch.manual_seed(0)
    model, x = nn.Sequential(*(nn.Linear(4, 4) for _ in range(8))).double(), torch.randn(8, 4, dtype=torch.float64)
    plain = copy.deepcopy(model)
    calls = {"model": 0, "plain": 0}
    for key, m in (("model", model), ("plain", plain)):
        m[3].weight.register_hook(lambda g: g / g.norm())
        m[7].bias.register_post_accumulate_grad_hook(lambda p, key=key: calls.__setitem__(key, calls[key] + 1))
    plain(x).mean().backward()
    pipe = autopipe.compile(model, devices=2, chunks=4, schedule=schedule)
    pipe.step(x, target=None, loss_fn=lambda out, _: out.mean())
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=n)
    assert calls == {"model": 1, "plain": 1}


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv"])
def test_deferred_batch_norm_statistics_and_gradients_equal_1f1bs(schedule):
    results = {}
    for name in ("1f1b", schedule):
        model = build("resnet").double()
        x = torch.randn(8, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        pipe = autopipe.compile(model, devices=2, chunks=4, schedule=name, deferred_batch_norm=True)
        for _ in range(2):
            pipe.step(x, target=None, loss_fn=lambda out, _: out.square().mean())
        results[name] = {**dict(model.named_buffers()), **{n: p.grad for n, p in model.named_parameters()}}
    for n, value in results["1f1b"].items():
        torch.testing.assert_close(results[schedule][n], value, rtol=0, atol=1e-12, msg=n)


@pytest.mark.parametrize("schedule", ["zb-h1", "zbv", "dualpipev"])
def test_tied_weights_across_the_v_and_pipe_call_refused_for_training(schedule):
    """GPT's embedding and LM head are one tensor; under zbv both ends of the V are device 0's. Training through
    pipe(x) (so autograd.grad or backward(inputs=...)) is refused naming pipe.step, as under 1F1B; without grad it
    runs."""
    torch.manual_seed(0)
    model = GPT(vocab=64, d=32, heads=4, layers=4, block=16, dropout=0.0).double()
    ids = torch.randint(0, 64, (8, 16))
    lm_loss = lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten())
    plain = copy.deepcopy(model)
    lm_loss(plain(ids), ids).backward()
    pipe = autopipe.compile(model, devices=2, chunks=4, schedule=schedule)
    pipe.step(ids, target=ids, loss_fn=lm_loss)
    assert model.wte.weight is model.lm_head.weight
    torch.testing.assert_close(model.wte.weight.grad, plain.wte.weight.grad, rtol=0, atol=1e-12)
    if schedule != "zb-h1":
        assert pipe.schedule.device_of(0) == pipe.schedule.device_of(pipe.plan.n_stages - 1) == 0
    with pytest.raises(RuntimeError, match="pipe.step"):
        torch.autograd.grad(lm_loss(pipe(ids), ids), [model.wte.weight])
    with torch.no_grad():
        torch.testing.assert_close(pipe(ids), model(ids))


def test_dualpipev_holds_what_its_table_says_freeing_a_full_backward_at_b():
    """K=4, M=16, as it ran (the timeline): stage s holds min(M, 2K - s) micro-batches at once, zbv's; a full
    backward computes the parameter gradients in its B, the others' W runs apart (but on stage 0, whose inputs need
    no gradient: its B does everything)."""
    torch.manual_seed(0)
    pipe = autopipe.compile(MLP(depth=8), devices=4, chunks=16, checkpoint="never", schedule="dualpipev")
    pipe.step(torch.randn(32, 8), target=torch.randn(32, 4), loss_fn=F.mse_loss)
    s = pipe.schedule
    held = [pipe.timeline.held(j) for j in range(8)]
    assert held == [s.max_in_flight(j) for j in range(8)] == [8, 7, 6, 5, 4, 3, 2, 1]
    apart = {(e.stage, e.micro_batch) for e in pipe.timeline.events if e.kind == "weight"}
    assert apart == {(j, i) for j in range(1, 8) for i in range(16)} - s.full_backwards
