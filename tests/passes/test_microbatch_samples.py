"""passes/microbatch_analysis/samples.py and the facts it reads (facts.py): an output whose rows of each sample stay
together merges as the micro-batches' concatenation, one whose samples' rows come out of their order is refused by
name. Each rule on a tiny model of ours, through autopipe.compile in float64 against the plain model: values and the
gradients through them."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import autopipe

# torch.cat along dim 0 of the rows of h (batch, seq, d), each once and in order: h reshaped
IN_ORDER = {
    "unbind": lambda h: torch.cat([p for p in h.unbind(0)]),      # exported once per micro-batch size: a node a sample
    "index": lambda h: torch.cat([h[i] for i in range(h.shape[0])]),
    "split": lambda h: torch.cat([s.flatten(0, 1) for s in h.split(1)]),
    "per-sample list": lambda h: torch.cat(list(h)),              # LLaVA's torch.cat(image_features)
    "fx unbind": lambda h: torch.cat(h.unbind(0)),                # fx: one node, any batch size
    "fx chunk": lambda h: torch.cat(h.chunk(2), 0),               # fx: a tuple read whole by the cat
}
# the rows of h, each sample's rows together, but not in the batch's order
OUT_OF_ORDER = {
    "reversed": lambda h: torch.cat(list(h.unbind(0))[::-1]),
    "pairs swapped": lambda h: torch.cat([h[i ^ 1] for i in range(h.shape[0])]),
    "fx rotated": lambda h: torch.cat([h[1:], h[:1]]),
    "fx reversed": lambda h: torch.cat(h.unbind(0)[::-1]),
}


class PerSampleCat(nn.Module):
    """h = Linear(x), c = ``form(h)``; returns (tanh(Linear(c)), c): the concatenation, and a value computed from it
    row by row."""

    def __init__(self, form, d: int = 6):
        super().__init__()
        self.form, self.inner, self.outer = form, nn.Linear(d, d), nn.Linear(d, 5)

    def forward(self, x):
        c = self.form(self.inner(x))
        return self.outer(c).tanh(), c


def compiled_against_plain(model, x, chunks):
    """pipe(x) and the plain model's outputs, and the gradients of one loss through every output (input's, then each
    parameter's): pipe's and the plain model's."""
    reference = copy.deepcopy(model)
    x_pipe, x_plain = x.clone().requires_grad_(), x.clone().requires_grad_()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # trace's notes on the routes it tried
        pipe = autopipe.compile(model, devices=2, chunks=chunks)
        out = pipe(x_pipe)
    want = reference(x_plain)
    weights = [torch.randn_like(w) for w in want]
    sum((o * w).sum() for o, w in zip(out, weights)).backward()
    sum((o * w).sum() for o, w in zip(want, weights)).backward()
    grads = lambda m, t: [t.grad] + [p.grad for p in m.parameters()]  # noqa: E731
    return pipe, out, want, grads(model, x_pipe), grads(reference, x_plain)


@pytest.mark.parametrize("form", IN_ORDER)
def test_a_cat_of_each_samples_rows_in_batch_order_merges_as_the_plain_value(form):
    """Refused before at chunks > 1 ("dim 0 does not hold the batch as whole samples"), or, for fx's chunk whose tuple
    crossed the cut as a Python value, the first stage got no gradient. Batch 5 in 2 micro-batches (3 and 2 rows)."""
    torch.manual_seed(0)
    pipe, out, want, got_grads, want_grads = compiled_against_plain(PerSampleCat(IN_ORDER[form]).double(),
                                                                    torch.randn(5, 3, 6, dtype=torch.double), chunks=2)
    assert pipe.plan.route == ("fx" if form.startswith("fx") else "export-static")
    for got, expected in zip(out, want):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    for got, expected in zip(got_grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


def test_a_cat_of_the_rows_of_one_sample_alone_merges_as_the_plain_value():
    """Micro-batches of one row (batch 4, chunks 4): the graph exported at one row concatenates one sample's rows."""
    torch.manual_seed(0)
    _, out, want, got_grads, want_grads = compiled_against_plain(PerSampleCat(IN_ORDER["unbind"]).double(),
                                                                 torch.randn(4, 3, 6, dtype=torch.double), chunks=4)
    for got, expected in zip(out, want):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    for got, expected in zip(got_grads, want_grads):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-10)


@pytest.mark.parametrize("form", OUT_OF_ORDER)
def test_a_cat_of_the_samples_rows_out_of_batch_order_is_refused_by_name(form):
    """Each micro-batch would reorder its own rows alone: no concatenation of the parts is the plain value. Refused
    before with the generic message, or (fx's h[1:], h[:1]) merged silently wrong."""
    model = PerSampleCat(OUT_OF_ORDER[form]).double()
    with warnings.catch_warnings(), pytest.raises(ValueError, match=r"computed from node cat\b.*concatenates the rows "
                                                                    r"of \w+ along dim 0 in another order than theirs"):
        warnings.simplefilter("ignore")
        autopipe.compile(model, devices=2, chunks=2)(torch.randn(4, 3, 6, dtype=torch.double))


def test_a_cat_of_pieces_each_holding_every_sample_stays_refused():
    """torch.cat(h.transpose(0, 1).unbind(0)): each piece holds one position of every sample; read back as rows of
    samples it mixes them (refused before too)."""
    model = PerSampleCat(lambda h: torch.cat(h.transpose(0, 1).unbind(0)).view_as(h)).double()
    with warnings.catch_warnings(), pytest.raises(ValueError, match="each row holds parts of several samples"):
        warnings.simplefilter("ignore")
        autopipe.compile(model, devices=2, chunks=2)(torch.randn(4, 3, 6, dtype=torch.double))


class PerSampleList(nn.Module):
    """Returns list(h): one tensor a sample (LLaVA's image features)."""

    def __init__(self, d: int = 8):
        super().__init__()
        self.inner, self.outer = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return list(self.outer(self.inner(x).tanh()))


def test_a_per_sample_list_from_micro_batches_of_one_row_is_as_long_as_the_batch():
    """At a micro-batch of one row the list of one tensor was not read as a list of one tensor a sample: refused
    before ("dim 0 does not hold the batch as whole samples")."""
    torch.manual_seed(0)
    model = PerSampleList().double()
    reference = copy.deepcopy(model)
    x = torch.randn(3, 4, 8, dtype=torch.double)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = autopipe.compile(model, devices=2, chunks=3)(x)
    want = reference(x)
    assert isinstance(out, list) and len(out) == len(want) == 3
    for got, expected in zip(out, want):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    torch.stack(out).square().sum().backward()
    torch.stack(want).square().sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-10)
