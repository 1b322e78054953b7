"""passes/microbatch_analysis/selections.py: rows selected by value (Note [rows selected by value]). Used as the note
allows (computed row by row, put back where they were taken, positions indexing the rows they came from, a
cross-entropy merged by count), they give the plain model's values and gradients through autopipe.compile in float64,
with each micro-batch selecting another number of rows; any other use is refused, naming the node and why."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopipe
from autopipe.passes.microbatch_analysis import analyse_micro_batches
from autopipe.passes.trace import trace


class Selecting(nn.Module):
    """``use(self, x)``, with a Linear and a parameter table to use."""

    def __init__(self, use):
        super().__init__()
        self.use, self.lin, self.table = use, nn.Linear(3, 3), nn.Parameter(torch.randn(6, 3))

    def forward(self, x, target):
        return self.use(self, x, target)


def put_back(m, x, target):
    mask = x[:, 0] > 0
    return x.index_put((mask,), m.lin(x[mask]).tanh())


def added_back_by_position(m, x, target):
    where = torch.nonzero(x[:, 0] > 0).squeeze(1)
    return torch.zeros_like(x).index_add(0, where, m.lin(x.index_select(0, where))), m.lin(x[where]) * 2


def kept_in_order(m, x, target):
    return m.lin(x[x[:, 0] > 0]).relu()


def cross_entropy_over_them(m, x, target):
    mask = x[:, 0] > 0
    return F.cross_entropy(m.lin(x[mask]), target[mask])


AS_THE_PLAIN_MODEL = {"put back": put_back, "added back by position": added_back_by_position,
                      "kept in order": kept_in_order, "a cross-entropy over them": cross_entropy_over_them}
# a use -> (the node it is misread at, why)
MISREAD = {
    "a scan over them": (lambda m, x, t: m.lin(x[x[:, 0] > 0]).cumsum(0),
                         "cumsum", "computes from rows selected by value (lin) other than row by row"),
    "a mean over them": (lambda m, x, t: m.lin(x[x[:, 0] > 0]).mean(0),
                         "mean", "reads rows selected by value (lin) other than row by row or put back where they "
                                 "were taken"),
    "a slice of them": (lambda m, x, t: m.lin(x[x[:, 0] > 0])[:2],
                        "getitem_2", "has a size set by values (getitem) that autopipe cannot follow from rows lin"),
    "arithmetic on positions": (lambda m, x, t: x[torch.nonzero(x[:, 0] > 0).squeeze(1) + 1],
                                "add", "computes with the positions squeeze (row numbers each micro-batch counts "
                                       "from 0) other than as indices of the rows they came from"),
    "a parameter indexed by them": (lambda m, x, t: m.table[torch.nonzero(x[:, 0] > 0).squeeze(1)],
                                    "getitem_1", "indexes dim 0 of table with positions in a mask's dim of 6 (not the "
                                                 "same rows: a micro-batch numbers its own from 0)"),
    "their count in arithmetic": (lambda m, x, t: x * x[x[:, 0] > 0].shape[0],
                                  "mul", "computes with getitem_2, a count of rows selected by value (each "
                                         "micro-batch counts its own)"),
}


def inputs():
    """6 rows in micro-batches of 3: the first selects 2 rows, the second 1."""
    x = torch.tensor([[1.0, 2, 3], [-1, 0, 1], [2, -1, 0], [-2, 1, 1], [-1, -1, 2], [0.5, 1, -1]], dtype=torch.float64)
    return x, torch.tensor([0, 1, 2, 0, 1, 2])


@pytest.mark.parametrize("use", AS_THE_PLAIN_MODEL)
def test_rows_selected_by_value_used_as_the_plain_model_uses_them(use):
    torch.manual_seed(0)
    model = Selecting(AS_THE_PLAIN_MODEL[use]).double()
    reference = copy.deepcopy(model)
    x, target = inputs()
    assert analyse_micro_batches(trace(model, (x, target))).mixed == {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = autopipe.compile(model, devices=2, chunks=2, example_inputs=(x, target))
    got, want = pipe(x, target), reference(x, target)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
    sum(g.square().sum() for g in got).backward()
    sum(w.square().sum() for w in want).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        if q.grad is None:
            assert p.grad is None, name
        else:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=name)


@pytest.mark.parametrize("use", MISREAD)
def test_any_other_use_of_rows_selected_by_value_is_refused_naming_the_node(use):
    function, node, why = MISREAD[use]
    model = Selecting(function).double()
    x, target = inputs()
    assert analyse_micro_batches(trace(model, (x, target))).mixed["output"] == (node, why)
    with warnings.catch_warnings(), pytest.raises(ValueError, match=rf"\b{node}\b"):
        warnings.simplefilter("ignore")
        autopipe.compile(model, devices=2, chunks=2)(x, target)


def test_a_single_micro_batch_computes_any_use_as_the_plain_model():
    """chunks=1: nothing is split, so the same uses run whole (a cumsum over the selected rows)."""
    model = Selecting(MISREAD["a scan over them"][0]).double()
    x, target = inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = autopipe.compile(model, devices=2, chunks=1)(x, target)
    torch.testing.assert_close(got, model(x, target), rtol=0, atol=1e-12)
