"""passes/microbatch_analysis/scalar_merges.py: how each 0-dim output merges over micro-batches (Note [scalar merges]),
read from the graph, and what that gives through autopipe.compile in float64 on uneven micro-batches (5 rows: 3 and 2)
with ignored targets spread unevenly: the plain model's values and gradients, or, for an "unknown", the size-weighted
mean the plan's note announces."""
from __future__ import annotations

import copy
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils._pytree as pytree

import autopipe
from autopipe.ir.plan import TargetCount
from autopipe.passes.microbatch_analysis import analyse_micro_batches
from autopipe.passes.trace import trace

IGNORED = -100
# one output each: (its node's name, how it merges)
MERGES = [("mean", "mean"),                 # a mean over samples: the size-weighted mean
          ("sum_1", "sum"),                 # a sum over samples
          ("truediv", "mean"),              # a sum over the batch size: a mean
          ("truediv_1", "sum"),             # a sum over a number the batch does not set (num_items_in_batch)
          ("cross_entropy", "count"),       # a mean over the targets not ignored: by each micro-batch's count
          ("mean_1", "count"),              # a mean over the rows a mask of the inputs selects
          ("mul", "unknown"),               # a product of two batch means
          ("mul_1", "mean"),                # no batch in it
          ("mse_loss", "sum")]              # a loss summed


class Losses(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin, self.scale = nn.Linear(4, 3), nn.Parameter(torch.tensor(2.0))

    def forward(self, x, target):
        logits = self.lin(x)
        return (logits.mean(), logits.sum(), logits.sum() / x.size(0), logits.sum() / 7.0,
                F.cross_entropy(logits, target), logits[target != IGNORED].mean(), logits.mean() * logits.mean(),
                self.scale * 3, F.mse_loss(logits, torch.ones_like(logits), reduction="sum"))


def inputs():
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    return x, torch.tensor([0, IGNORED, 2, IGNORED, 1])  # 2 targets in the first micro-batch, 1 in the second


def test_each_scalar_output_is_read_as_the_graph_reduces_it():
    analysis = analyse_micro_batches(trace(Losses().double(), inputs()))
    assert analysis.scalar_merges == dict(MERGES)
    assert analysis.counts == {"cross_entropy": TargetCount(target="target", ignore_index=IGNORED, weight=None),
                               "mean_1": TargetCount(target="ne", per_row=3)}  # the mask's rows, 3 logits each


def test_scalar_outputs_merge_to_the_plain_models_values_and_gradients():
    torch.manual_seed(0)
    model = Losses().double()
    reference = copy.deepcopy(model)
    x, target = inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = autopipe.compile(model, devices=2, chunks=2, example_inputs=(x, target))
    got, want = pipe(x, target), reference(x, target)
    exact = [k for k, (_, how) in enumerate(MERGES) if how != "unknown"]
    for k in exact:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=1e-12, msg=MERGES[k][0])
    sum(got[k] for k in exact).backward()
    sum(want[k] for k in exact).backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=name)


def test_an_unknown_merge_is_the_size_weighted_mean_and_the_plan_says_so():
    model = Losses().double()
    x, target = inputs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = autopipe.compile(model, devices=2, chunks=2, example_inputs=(x, target))
    unknown = next(k for k, (_, how) in enumerate(MERGES) if how == "unknown")
    with torch.no_grad():
        parts = [model(x[rows], target[rows])[unknown] for rows in (slice(0, 3), slice(3, 5))]
        got = pipe(x, target)[unknown]
    torch.testing.assert_close(got, (3 * parts[0] + 2 * parts[1]) / 5, rtol=0, atol=1e-12)
    assert not torch.allclose(got, model(x, target)[unknown].detach())  # a product of means is not merged exactly
    notes = [note for note in pipe.plan.notes if note.startswith("output ")]
    assert [note.split(":")[0] for note in notes] == ["output mul", "output cross_entropy", "output mean_1"]
    assert "size-weighted mean" in notes[0] and "merged exactly" in notes[1] and "merged exactly" in notes[2]


def test_the_outputs_a_graph_returns_are_the_ones_read():
    """Only 0-dim floating outputs merge as scalars: a vector and an integer count are not read."""
    class Mixed(nn.Module):
        def forward(self, x):
            return x.sum(), x.sum(0), (x > 0).sum()

    traced = trace(Mixed(), (torch.randn(4, 3),))
    output = next(n for n in traced.graph_module.graph.nodes if n.op == "output")
    scalar, vector, count = (n.name for n in pytree.tree_leaves(output.args))
    assert analyse_micro_batches(traced).scalar_merges == {scalar: "sum"}
