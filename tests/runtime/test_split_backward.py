"""A stage's backward as B (input gradients) then W (parameter gradients): bit for bit the fused backward's, each
parameter's gradient computed once, and the graph freed once W ran."""
import gc
import weakref

import pytest
import torch
from torch import nn

from autopipe.runtime.split_backward import backward_input, engine_grad
from zoo import GPT


class TiedTwice(nn.Module):
    """A weight used at two depths of one stage: W from both sources would re-run the input path between them."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(torch.relu(self.b(self.a(x))))


class WeightOut(nn.Module):
    """An output whose graph never reaches the input: only W can give its weight a gradient."""

    def __init__(self):
        super().__init__()
        self.a, self.w = nn.Linear(8, 8), nn.Parameter(torch.randn(4, 8))

    def forward(self, x):
        return self.a(x), self.w * 3


def blocks():
    return nn.Sequential(*GPT(vocab=64, d=32, heads=4, layers=2, block=16).blocks)


CASES = {"gpt_blocks": (blocks, (4, 16, 32)), "tied_twice": (TiedTwice, (4, 8)), "weight_out": (WeightOut, (4, 8))}


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("input_grad", [True, False])
def test_b_then_w_is_the_fused_backward_bit_for_bit(name, input_grad):
    torch.manual_seed(0)
    build, shape = CASES[name]
    model = build().double()
    params = list(model.parameters())
    x = torch.randn(shape, dtype=torch.float64).requires_grad_(input_grad)
    inputs = [x] if input_grad else []
    outs = model(x)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    grads = [torch.randn_like(o) for o in outs]
    fused = engine_grad(outs, grads, inputs + params, keep_graph=True)
    got_inputs, work = backward_input(outs, grads, inputs, params)
    got = list(got_inputs) + work.run()
    assert len(got) == len(fused)
    for k, (a, b) in enumerate(zip(fused, got)):
        assert a is not None and torch.equal(a, b), k


def test_w_waits_for_b_and_frees_the_graph():
    """B leaves every parameter gradient to W (here: none is computed early), and the activations autograd saved
    live until W has run, then go."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    hidden = model[1](model[0](x))
    out = model[2](hidden)
    alive = weakref.ref(hidden)
    _, work = backward_input([out], [torch.ones_like(out)], [x], list(model.parameters()))
    assert work.done == [None] * 4 and len(work.groups) == 2
    del hidden, out
    gc.collect()
    assert alive() is not None  # the second Linear's W needs it
    grads = work.run()
    assert all(g is not None for g in grads)
    del work
    gc.collect()
    assert alive() is None


def test_a_weight_used_at_two_depths_is_differentiated_in_b():
    """Its W would run the input path between its two uses again: B computes it, in its one engine call."""
    model = TiedTwice().double()
    x = torch.randn(4, 8, dtype=torch.float64, requires_grad=True)
    out = model(x)
    _, work = backward_input([out], [torch.ones_like(out)], [x], list(model.parameters()))
    names = [n for n, _ in model.named_parameters()]
    assert [names[k] for k, g in enumerate(work.done) if g is not None] == ["a.weight", "a.bias"]
    assert [[names[k] for k in g.params] for g in work.groups] == [["b.weight", "b.bias"]]
