"""The in-process runtime under every schedule: the plain model's gradients, memory held as the schedule says."""
import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autopipe
from zoo import GPT, MLP

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 1)]
STAGES_PER_DEVICE = {"interleaved": 2, "zbv": 2}


def plain_grads(model, x, y):
    model = copy.deepcopy(model)
    F.mse_loss(model(x), y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("schedule,v", SCHEDULES)
@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
@pytest.mark.parametrize("devices", [2, 4])
def test_every_schedule_gives_the_plain_models_gradients_in_float64(schedule, v, checkpoint, devices):
    torch.manual_seed(0)
    model = MLP(depth=8).double()
    x, y = torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 4, dtype=torch.float64)
    expected = plain_grads(model, x, y)
    pipe = autopipe.compile(model, devices=devices, chunks=4, checkpoint=checkpoint, schedule=schedule,
                            virtual_stages=v)
    loss = pipe.step(x, target=y, loss_fn=F.mse_loss)
    torch.testing.assert_close(loss, F.mse_loss(model(x), y), rtol=0, atol=1e-12)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=0, atol=1e-12, msg=n)
    assert pipe.plan.n_stages == devices * STAGES_PER_DEVICE.get(schedule, 1)


@pytest.mark.parametrize("schedule,v", SCHEDULES)
def test_schedules_with_dropout_are_reproducible_and_replay(schedule, v):
    grads = []
    for checkpoint in ("never", "always"):
        torch.manual_seed(0)
        model = GPT(vocab=64, d=32, heads=4, layers=4, block=16, dropout=0.1).double().train()
        pipe = autopipe.compile(model, devices=2, chunks=4, checkpoint=checkpoint, schedule=schedule,
                                virtual_stages=v)
        ids = torch.randint(0, 64, (8, 16))
        torch.manual_seed(5)
        pipe.step(ids, target=ids, loss_fn=lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n in grads[0]:
        assert torch.equal(grads[0][n], grads[1][n]), n


def test_1f1b_holds_at_most_k_micro_batches_on_the_first_stage():
    """Counted from the forward and backward tasks as they ran (the timeline), K=4, M=16."""
    held = {}
    for schedule in ("gpipe", "1f1b"):
        torch.manual_seed(0)
        model = MLP(depth=8)
        pipe = autopipe.compile(model, devices=4, chunks=16, checkpoint="never", schedule=schedule)
        pipe.step(torch.randn(32, 8), target=torch.randn(32, 4), loss_fn=F.mse_loss)
        events = sorted((e for e in pipe.timeline.events if e.stage == 0 and e.kind in ("forward", "backward")),
                        key=lambda e: e.start)
        live = peak = 0
        for e in events:
            live += 1 if e.kind == "forward" else -1
            peak = max(peak, live)
        held[schedule] = peak
    assert held == {"gpipe": 16, "1f1b": 4}


@pytest.mark.parametrize("schedule,bound", [("zb-h1", 4), ("zbv", 8)])
def test_zero_bubble_holds_at_most_k_or_2k_micro_batches_on_the_first_stage(schedule, bound):
    """ZB-H1 keeps 1F1B's K; ZB-V's first stage holds half the layers, 2K micro-batches of them (K=4, M=16). A
    stage 1 whose input needs a gradient runs B and W apart and holds each graph until its W."""
    torch.manual_seed(0)
    pipe = autopipe.compile(MLP(depth=8), devices=4, chunks=16, checkpoint="never", schedule=schedule)
    pipe.step(torch.randn(32, 8), target=torch.randn(32, 4), loss_fn=F.mse_loss)
    assert pipe.timeline.held(0) == bound
    assert any(e.kind == "weight" and e.stage == 1 for e in pipe.timeline.events)
    assert pipe.timeline.held(1) <= bound


@pytest.mark.parametrize("split,fused,v", [("zb-h1", "1f1b", 1), ("zbv", "interleaved", 2)])
def test_zero_bubble_gradients_equal_1f1bs_bit_for_bit(split, fused, v):
    """B then W computes every gradient from the same values as a fused backward, and W adds a stage's micro-batches
    in 1F1B's order; the V is given interleaved's cut of 2K stages (``balance=plan``: its own balances each device's
    two stages), float32, dropout, tied embedding, recompute."""
    grads, cut = {}, "flops"
    for schedule, stages, checkpoint in ((fused, v, "never"), (split, 1, "always")):
        torch.manual_seed(0)
        model = GPT(vocab=64, d=32, heads=4, layers=4, block=16, dropout=0.1).train()
        pipe = autopipe.compile(model, devices=2, chunks=4, checkpoint=checkpoint, schedule=schedule,
                                virtual_stages=stages, balance=cut)
        ids = torch.randint(0, 64, (8, 16))
        torch.manual_seed(5)
        pipe.step(ids, target=ids, loss_fn=lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten()))
        grads[schedule] = {n: p.grad.clone() for n, p in model.named_parameters()}
        cut = pipe.plan
    assert all(torch.equal(grads[fused][n], grads[split][n]) for n in grads[fused])


def test_pipe_call_under_1f1b_asks_for_step_and_works_without_grad():
    pipe = autopipe.compile(MLP(), devices=2, chunks=2, schedule="1f1b")
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="pipe.step"):
        pipe(x)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), pipe.model(x))


def test_schedule_prints_and_bad_options_are_named():
    pipe = autopipe.compile(MLP(), devices=2, chunks=4, schedule="interleaved", virtual_stages=2,
                            example_inputs=(torch.randn(8, 8),))
    text = str(pipe.schedule)
    assert text.startswith("interleaved") and "device 1" in text
    with pytest.raises(ValueError, match="virtual_stages"):
        autopipe.compile(MLP(), devices=2, schedule="interleaved")
    with pytest.raises(ValueError, match="schedule"):
        autopipe.compile(MLP(), devices=2, schedule="zigzag")


def test_pipeline_refuses_to_be_moved_as_a_whole():
    pipe = autopipe.compile(MLP(), devices=2, chunks=2)
    with pytest.raises(RuntimeError, match="placement"):
        pipe.to(torch.float64)


class ReturnsOneTensorTwice(torch.nn.Module):
    """As Hugging Face models do: last_hidden_state and hidden_states[-1] are one tensor."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(8, 8) for _ in range(4)))

    def forward(self, x):
        h = self.layers(x)
        return {"last": h, "all": (x, h)}


def test_a_tensor_returned_twice_gets_both_gradients():
    model, x = ReturnsOneTensorTwice().double(), torch.randn(8, 8, dtype=torch.float64)
    plain = copy.deepcopy(model)
    out = plain(x)
    (out["last"].sum() + 2 * out["all"][1].sum()).backward()
    pipe = autopipe.compile(model, devices=2, chunks=4)
    out = pipe(x)
    (out["last"].sum() + 2 * out["all"][1].sum()).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=name)


class ReturnsItsScale(nn.Module):
    """Returns a parameter as it is: its gradient is the loss's own tensor, which the engine passes through (before
    the trace put such an output through an op, no stage sent it and the step waited forever)."""

    def __init__(self):
        super().__init__()
        self.first, self.last = nn.Linear(8, 8), nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.last(torch.tanh(self.first(x))), self.scale


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb-h1"])
def test_gradients_the_engine_passes_through_or_makes_sum_to_the_plain_models(schedule):
    """The step sums micro-batches' parameter gradients in place where nothing else holds them (the engine made them)
    and into a fresh tensor where something does (a gradient the engine passed through, here the loss's own)."""
    torch.manual_seed(0)
    model, x, y = ReturnsItsScale().double(), torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    loss_fn = lambda out, target: ((out[0] - target) ** 2).sum() * out[1] + out[1] ** 2
    plain = copy.deepcopy(model)
    plain_loss = sum(loss_fn(plain(x[k:k + 2]), y[k:k + 2]) for k in range(0, 8, 2)) / 4  # step: the rows' mean
    plain_loss.backward()
    pipe = autopipe.compile(model, devices=2, chunks=4, schedule=schedule)
    for _ in range(2):  # the second step sums into the first's .grad
        loss = pipe.step(x, target=y, loss_fn=loss_fn)
    assert loss.item() == pytest.approx(plain_loss.item(), rel=1e-12)
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, 2 * q.grad, rtol=0, atol=1e-12, msg=name)


class _Looped(torch.nn.Module):
    """One block applied ``n`` times: more ops with ``n``, the same parameters."""

    def __init__(self, n: int):
        super().__init__()
        self.n, self.linear, self.drop = n, torch.nn.Linear(16, 16), torch.nn.Dropout(0.1)

    def forward(self, x):
        for _ in range(self.n):
            x = self.drop(torch.tanh(self.linear(x)))
        return x


def _step_counts(model: torch.nn.Module, x: torch.Tensor) -> tuple[int, int, int]:
    """(aten ops of the plain step, aten ops of the pipeline's step, Python calls into autopipe/ and passes/
    during the pipeline's step; random_ops.py's stand-ins for torch's dropout are the model's own calls)."""
    import sys
    from pathlib import Path

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += 1
            return func(*args, **(kwargs or {}))

    pipe = autopipe.compile(model, devices=1, chunks=1, checkpoint="never", example_inputs=(x,))

    def step(fn):
        model.zero_grad(set_to_none=True)
        fn(x).sum().backward()

    counts = []
    for fn in (model, pipe):
        step(fn)
        with Ops() as ops:
            ops.count = 0
            step(fn)
        counts.append(ops.count)
    root = Path(autopipe.__file__).parent.parent
    ours = (str(root / "autopipe"), str(root / "passes"))
    calls = [0]

    def profile(frame, event, arg):
        name = frame.f_code.co_filename
        if event == "call" and name.startswith(ours) and not name.endswith("random_ops.py"):
            calls[0] += 1

    step(pipe)
    sys.setprofile(profile)
    try:
        step(pipe)
    finally:
        sys.setprofile(None)
    return counts[0], counts[1], calls[0]


def test_a_step_pays_no_per_op_tax():
    """The stage is plain generated code: the pipeline's step runs the plain step's aten ops plus a fixed few,
    and the runtime's Python work per step does not grow with the model's ops (random ops are routed at codegen,
    no TorchFunctionMode wraps the stage). Counted, not timed: benchmarks/overhead.py has the seconds."""
    extra = []
    for layers in (2, 8):
        torch.manual_seed(0)
        model = GPT(vocab=64, d=32, heads=4, layers=layers, block=16, dropout=0.1).train()
        plain, pipe, _ = _step_counts(model, torch.randint(0, 64, (4, 16)))
        extra.append(pipe - plain)
    assert extra[0] == extra[1] <= 8, extra
    torch.manual_seed(0)
    short, long = (_step_counts(_Looped(n), torch.randn(4, 16)) for n in (4, 16))
    assert long[0] > 3 * short[0]  # the longer loop does run more ops
    assert long[1] - long[0] == short[1] - short[0] <= 8
    assert long[2] == short[2], (short[2], long[2])


def test_a_worker_that_cannot_start_fails_the_step_instead_of_hanging():
    """A worker's start-up (``torch.cuda.set_device`` on a GPU, the thread count here) raising is the step's
    error, raised promptly; the pipeline's other worker is not left waiting."""
    import time

    torch.manual_seed(0)
    model = MLP(depth=4)
    x = torch.randn(8, 8)
    pipe = autopipe.compile(model, devices=2, chunks=2, intra_op_threads=-1)  # torch.set_num_threads(-1) raises
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="could not start") as failure:
        pipe(x).sum().backward()
    assert "set_num_threads" in str(failure.value.__cause__)
    assert time.monotonic() - start < 30
    threads = [w._thread for w in pipe.workers]
    pipe.close()
    assert all(t is not None for t in threads) and not any(t.is_alive() for t in threads)  # started, and none left


def test_a_backward_that_creates_a_graph_is_refused_and_the_next_step_runs():
    """create_graph=True (a gradient penalty) got a second-order gradient of nothing: torch's "does not require grad", or the
    pipeline's "once per forward", neither naming the cause."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1)).double()
    pipe = autopipe.compile(model, devices=2, chunks=2)
    x = torch.randn(6, 8, dtype=torch.float64, requires_grad=True)
    with pytest.raises(RuntimeError, match="create_graph=True through the pipeline"):
        torch.autograd.grad(pipe(x).sum(), x, create_graph=True)
    with pytest.raises(RuntimeError, match="create_graph=True through the pipeline"):
        torch.autograd.grad(pipe(x).sum(), list(model.parameters()), create_graph=True)
    (grad,) = torch.autograd.grad(pipe(x).sum(), x)
    (want,) = torch.autograd.grad(model(x).sum(), x)
    torch.testing.assert_close(grad, want, rtol=1e-12, atol=1e-12)
