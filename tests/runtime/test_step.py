"""autopipe/runtime/step.py: one mini-batch's Run through the compiled Programs, on two stages of tiny float64 models
against the plain model run micro-batch by micro-batch, over uneven micro-batches (7 rows as 3, 2, 2). ``pipe(x)``'s
backward hands each parameter its gradient summed over micro-batches and stages, a tied weight's too, once, through
the engine (Note [anchors], Note [gradients through the engine], Note [parameter hooks on an alias]); a frozen
parameter and one the loss does not reach get None; ``autograd.grad`` leaves ``.grad`` alone; ``pipe.step``'s loss is
the plain loss, a model's own mean over labels not ignored weighed by ``count_targets``; a model traced per micro-batch
size runs each micro-batch on its size's Program (``Compiled.program``, ``covers``); ``Compiled.parameters`` and
``uses_rng``."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopipe
from autopipe.runtime.step import Run

ROWS = [slice(0, 3), slice(3, 5), slice(5, 7)]  # 7 rows, chunks=3: micro-batches of 3, 2 and 2
TOLERANCE = 1e-13


class TiedHeads(nn.Module):
    """``a`` reads the input and the last hidden state (one weight on both stages); ``aux`` is a second head; ``scale``
    is an input given whole to every micro-batch."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(4, 4), nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.aux = nn.Linear(8, 2)

    def forward(self, x, scale):
        h = self.c(self.b(self.a(x * scale).tanh()).tanh()).tanh()
        return self.a(self.d(h).tanh()), self.aux(h)


def compiled(model: nn.Module, *example, chunks: int = 3) -> autopipe.Pipeline:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return autopipe.compile(model, devices=2, chunks=chunks, example_inputs=example, checkpoint="never")


def tied_heads() -> tuple[nn.Module, nn.Module, autopipe.Pipeline, torch.Tensor, torch.Tensor]:
    """The model, its plain copy, its pipeline over 7 rows, and the rows and the scale."""
    torch.manual_seed(0)
    model = TiedHeads().double()
    x, scale = torch.randn(7, 4, dtype=torch.float64), torch.rand(4, dtype=torch.float64) + 0.5
    return model, copy.deepcopy(model), compiled(model, x, scale), x, scale


def grads(model: nn.Module) -> dict[str, torch.Tensor | None]:
    return {n: p.grad for n, p in model.named_parameters()}


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        assert (got[name] is None) == (want[name] is None), name
        if want[name] is not None:
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=TOLERANCE, msg=name)


def count_arrivals(model: nn.Module) -> dict[str, list]:
    """Per parameter, each gradient its tensor hook saw and each accumulation into ``.grad``."""
    seen = {n: [] for n, _ in model.named_parameters()}
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        p.register_hook(lambda g, n=n: seen[n].append(None if g is None else g.clone()))
        p.register_post_accumulate_grad_hook(lambda p, n=n: seen[n].append("accumulated"))
    return seen


def test_pipe_call_hands_each_parameter_its_sum_over_micro_batches_and_stages_once():
    """The tied ``a`` sits on both stages and gets one sum; ``c.weight`` frozen after compiling (the flags as the step
    starts) and ``aux``, which the loss does not read, get None, not zeros; a ``.grad`` already there is added to; a
    whole input's gradient is the sum over micro-batches, a cut input's the parts in order."""
    model, plain, pipe, x, scale = tied_heads()
    a_on = [any(p is model.a.weight for p in r.params) for r in pipe.compiled.main.runners]
    assert a_on == [True, True]
    ids = [id(p) for p in pipe.compiled.parameters]
    assert sorted(ids) == sorted(map(id, model.parameters()))  # each once, the frozen one too
    weight = torch.randn(7, 4, dtype=torch.float64)
    for m in (model, plain):
        m.c.weight.requires_grad_(False)
        m.b.bias.grad = torch.ones_like(m.b.bias)
    arrivals = count_arrivals(model)
    x_pipe, scale_pipe = x.clone().requires_grad_(), scale.clone().requires_grad_()
    out, aux = pipe(x_pipe, scale_pipe)
    x_plain, scale_plain = x.clone().requires_grad_(), scale.clone().requires_grad_()
    parts = []
    for rows in ROWS:
        parts.append(plain(x_plain[rows], scale_plain)[0])
        (parts[-1] * weight[rows]).sum().backward()
    torch.testing.assert_close(out, torch.cat(parts), rtol=0, atol=1e-15)
    assert aux.requires_grad and out.grad_fn is aux.grad_fn  # one autograd node for the whole pipeline
    (out * weight).sum().backward()
    assert_same(grads(model), grads(plain))
    assert model.c.weight.grad is None and model.aux.weight.grad is None and model.aux.bias.grad is None
    torch.testing.assert_close(x_pipe.grad, x_plain.grad, rtol=0, atol=TOLERANCE)
    torch.testing.assert_close(scale_pipe.grad, scale_plain.grad, rtol=0, atol=TOLERANCE)
    for name, seen in arrivals.items():
        if grads(model)[name] is None:
            continue  # test_a_parameter_the_loss_does_not_reach_runs_no_hook
        assert len(seen) == 2 and seen[1] == "accumulated", name  # the hook once, on the whole sum, then .grad
        expected = grads(plain)[name] - (1 if name == "b.bias" else 0)
        torch.testing.assert_close(seen[0], expected, rtol=0, atol=TOLERANCE, msg=name)


@pytest.mark.xfail(strict=True, reason="the anchor's inputs are every trainable parameter, so the engine runs the "
                   "hooks of one the loss does not reach: its tensor hook with None, its post-accumulate hook")
def test_a_parameter_the_loss_does_not_reach_runs_no_hook():
    """The plain model runs no hook of ``aux`` for a loss over the first output alone: ``aux`` is not in its graph. A
    hook that uses its gradient (``g.clamp(-1, 1)``) would meet None."""
    model, plain, pipe, x, scale = tied_heads()
    arrivals, plain_arrivals = count_arrivals(model), count_arrivals(plain)
    pipe(x, scale)[0].sum().backward()
    plain(x, scale)[0].sum().backward()
    assert plain_arrivals["aux.weight"] == [] and model.aux.weight.grad is None
    assert arrivals["aux.weight"] == [] and arrivals["aux.bias"] == []


def test_the_anchors_give_gradients_only_to_a_backward_that_runs_them_and_sum_two_calls_in_one():
    """``autograd.grad`` for the inputs or for the parameters leaves ``.grad`` as it was; two pipeline calls in one
    loss (two views of a batch) give each parameter the sum of both, once; a second backward of one call is refused."""
    model, plain, pipe, x, scale = tied_heads()
    x_pipe, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    (got,) = torch.autograd.grad(pipe(x_pipe, scale)[0].sum(), [x_pipe])
    (want,) = torch.autograd.grad(plain(x_plain, scale)[0].sum(), [x_plain])
    torch.testing.assert_close(got, want, rtol=0, atol=TOLERANCE)
    params, plain_params = list(model.parameters()), list(plain.parameters())
    got = torch.autograd.grad(pipe(x, scale)[0].square().sum(), params, allow_unused=True)
    want = torch.autograd.grad(plain(x, scale)[0].square().sum(), plain_params, allow_unused=True)
    assert_same(dict(enumerate(got)), dict(enumerate(want)))
    assert all(p.grad is None for p in params)
    arrivals = count_arrivals(model)
    y = torch.randn(7, 4, dtype=torch.float64)
    (pipe(x, scale)[0].sum() + pipe(y, scale)[1].square().sum()).backward()
    (plain(x, scale)[0].sum() + plain(y, scale)[1].square().sum()).backward()
    assert_same(grads(model), grads(plain))
    assert all(len(seen) == 2 for seen in arrivals.values()), {n: len(s) for n, s in arrivals.items()}
    loss = pipe(x, scale)[0].sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="once per forward"):
        loss.backward()


def test_pipe_step_returns_the_plain_loss_over_uneven_micro_batches_and_hands_gradients_on_once():
    """Each micro-batch's loss weighs its share of the rows (3/7, 2/7, 2/7): the loss and the gradients of the whole
    batch; the hooks run once on the step's whole gradient; the frozen parameter gets none."""
    model, plain, pipe, x, scale = tied_heads()
    assert pipe.compiled.main.counts is None and pipe.compiled.main.count_targets([x, scale]) == {}  # nothing to count
    y = torch.randn(7, 4, dtype=torch.float64)
    for m in (model, plain):
        m.d.bias.requires_grad_(False)
    arrivals = count_arrivals(model)
    loss_fn = lambda out, target: F.mse_loss(out[0], target) + out[1].square().mean()
    loss = pipe.step(x, scale, target=y, loss_fn=loss_fn)
    want = loss_fn(plain(x, scale), y)
    want.backward()
    assert not loss.requires_grad
    assert abs(loss.item() - want.item()) <= TOLERANCE * want.item()
    assert_same(grads(model), grads(plain))
    assert model.d.bias.grad is None
    assert all(len(seen) == 2 for n, seen in arrivals.items() if n != "d.bias")
    with pytest.raises(TypeError, match="scalar loss"):  # no loss_fn, and the model returns no loss
        pipe.step(x, scale)


class TokenLoss(nn.Module):
    """Hugging Face's shape of a model's own loss: a mean cross-entropy over the labels not -100, in a dict."""

    def __init__(self, vocab: int = 5, d: int = 6):
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(vocab, d), nn.Linear(d, d), nn.Linear(d, vocab)

    def forward(self, ids, labels):
        logits = self.head(self.mid(self.emb(ids)).tanh())
        return {"loss": F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100), "logits": logits}


def test_a_models_own_mean_over_labels_not_ignored_weighs_each_micro_batch_by_its_count():
    """``count_targets`` counts each micro-batch's labels not ignored (3, 7 and 1 here, where their rows are 3, 2 and
    2); ``pipe(x)``'s loss, ``pipe.step`` with the model's own loss and with a loss_fn's (sum, count) are the plain
    model's."""
    torch.manual_seed(0)
    ids = torch.randint(0, 5, (7, 4))
    labels = ids.clone()
    labels[:3, 1:] = -100
    labels[3, 0] = -100
    labels[5:] = -100
    labels[6, 2] = 3
    model = TokenLoss().double()
    plain = copy.deepcopy(model)
    pipe = compiled(model, ids, labels)
    program = pipe.compiled.main
    counts = [program.count_targets(program.traced.flat_inputs((ids[rows], labels[rows]), {})) for rows in ROWS]
    assert [list(c.values()) for c in counts] == [[3.0], [7.0], [1.0]]
    want = plain(ids, labels)["loss"]
    want.backward()
    out = pipe(ids, labels)
    assert abs(out["loss"].item() - want.item()) <= TOLERANCE * want.item()
    out["loss"].backward()
    assert_same(grads(model), grads(plain))
    model.zero_grad(set_to_none=True)
    loss = pipe.step(ids, labels)  # no loss_fn: the output's "loss"
    assert abs(loss.item() - want.item()) <= TOLERANCE * want.item()
    assert_same(grads(model), grads(plain))
    model.zero_grad(set_to_none=True)
    summed = lambda out, y: (F.cross_entropy(out["logits"].flatten(0, 1), y.flatten(), reduction="sum"),
                             (y != -100).sum())
    loss = pipe.step(ids, labels, target=labels, loss_fn=summed)  # the step divides by the whole count, 11
    assert abs(loss.item() - want.item()) <= TOLERANCE * want.item()
    assert_same(grads(model), grads(plain))


class FlattensByLen(nn.Module):
    """``len(x)`` bakes the batch size into the graph: traced once per micro-batch size."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(6, 5), nn.Linear(5, 2)

    def forward(self, x):
        return self.b(self.a(x.reshape(len(x), 6)).tanh())


def test_a_model_traced_per_micro_batch_size_runs_each_micro_batch_on_its_sizes_program():
    """4 rows as 2 and 2: one Program; 5 rows as 3 and 2 add one, and each micro-batch runs on its size's. A dynamic
    model's one Program covers every size. The parameters are the model's, once, whatever the number of Programs."""
    torch.manual_seed(0)
    model = FlattensByLen().double()
    plain = copy.deepcopy(model)
    x, weight = torch.randn(5, 2, 3, dtype=torch.float64), torch.randn(5, 2, dtype=torch.float64)
    pipe = compiled(model, x[:4], chunks=2)
    programs = pipe.compiled.programs
    assert list(programs) == [2] and pipe.compiled.covers([2, 2]) and not pipe.compiled.covers([3, 2])
    out = pipe(x)  # micro-batches of 3 and 2: traced at 3 now
    assert sorted(programs) == [2, 3] and pipe.compiled.covers([3, 2]) and pipe.compiled.program(3) is programs[3]
    assert [programs[n].traced.batch_size for n in (2, 3)] == [2, 3]
    (out * weight).sum().backward()
    for rows in (slice(0, 3), slice(3, 5)):
        (plain(x[rows]) * weight[rows]).sum().backward()
    assert_same(grads(model), grads(plain))
    assert [id(p) for p in pipe.compiled.parameters] == [id(p) for p in model.parameters()]
    run = Run(pipe, pipe.compiled, [x], [3, 2], training=False)
    assert [p is programs[n] for p, n in zip(run.programs, (3, 2))] == [True, True]
    with torch.no_grad():
        torch.testing.assert_close(run.forward()[0], plain(x), rtol=0, atol=1e-15)
    dynamic = compiled(nn.Sequential(nn.Linear(6, 3), nn.Tanh(), nn.Linear(3, 2)).double(),
                       torch.randn(4, 6, dtype=torch.float64))
    assert list(dynamic.compiled.programs) == [None] and dynamic.compiled.covers([3, 99])
    assert dynamic.compiled.program(3) is dynamic.compiled.programs[None]


def test_uses_rng_says_whether_a_step_draws_its_seed_from_the_global_generator():
    """A model without random ops leaves the caller's generator as it was; one with dropout in train mode draws the
    step's seed from it, once a step."""
    model, _, pipe, x, scale = tied_heads()
    assert not pipe.compiled.uses_rng
    state = torch.get_rng_state()
    pipe.step(x, scale, loss_fn=lambda out, _: out[0].sum())
    assert torch.equal(torch.get_rng_state(), state)
    torch.manual_seed(0)
    dropping = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5), nn.Linear(4, 2)).double().train()
    pipe = compiled(dropping, x)
    assert pipe.compiled.uses_rng
    torch.manual_seed(3)
    pipe.step(x, loss_fn=lambda out, _: out.sum())
    after_step = torch.get_rng_state()
    torch.manual_seed(3)
    torch.randint(0, 2**62, ())  # one draw: the step's seed
    assert torch.equal(after_step, torch.get_rng_state())
