"""passes/microbatch_analysis/across_micro_batches.py: batch rows that depend on other samples give each micro-batch
its own statistic (Note [warned, not refused]). Each op on a tiny graph of ours: warned where it works along the batch,
silent along other dims and for integer counts; compiled, it warns and computes GPipe's per-micro-batch values in
float64, exactly."""
from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn as nn

import autopipe
from autopipe.passes.microbatch_analysis.across_micro_batches import across_micro_batches
from autopipe.passes.trace import trace


class Rows(nn.Module):
    def __init__(self, use):
        super().__init__()
        self.use, self.lin = use, nn.Linear(3, 3)

    def forward(self, x):
        return self.use(self.lin(x), x)


# an op on batch rows -> the node warned at and what the warning says it does; None: silent
USES = {
    "centred by the batch mean": (lambda h, x: h - h.mean(0), "sub", "combined with a value over the whole batch"),
    "flipped along the batch": (lambda h, x: h.flip(0), "flip", "moves rows along the batch dim"),
    "rolled flat": (lambda h, x: h.roll(1), "roll", "moves rows along the batch dim"),
    "softmax along the batch": (lambda h, x: h.softmax(0), "softmax", "normalises or sorts along the batch dim"),
    "cumsum along the batch": (lambda h, x: h.cumsum(0), "cumsum", "scans along the batch dim"),
    "times the batch size": (lambda h, x: h * x.shape[0], "mul", "computes batch rows with getitem, a number set "
                                                                 "by the batch size"),
    "flipped along the features": (lambda h, x: h.flip(1), None, None),
    "softmax along the features": (lambda h, x: h.softmax(-1), None, None),
    "cumsum along the features": (lambda h, x: h.cumsum(1), None, None),
    "times an integer count over the batch": (lambda h, x: h * (x > 0).sum(0), None, None),
}


@pytest.mark.parametrize("use", USES)
def test_batch_rows_that_depend_on_other_samples_are_warned_at_the_op(use):
    function, node, says = USES[use]
    notes = across_micro_batches(trace(Rows(function), (torch.randn(4, 3),)).graph_module)
    if node is None:
        assert notes == []
    else:
        assert len(notes) == 1 and re.match(rf"(batch rows \()?node {node}, ", notes[0]) and says in notes[0]
        assert notes[0].endswith("run with chunks=1")


def test_a_statistic_is_warned_once_at_the_first_batch_rows_combined_with_it():
    def use(h, x):
        mean = h.mean(0)
        return (h - mean) * 2 + mean, (h * 3) / mean
    notes = across_micro_batches(trace(Rows(use), (torch.randn(4, 3),)).graph_module)
    assert [re.findall(r"node (\w+),", note) for note in notes] == [["sub", "mean"]]


def test_compiled_it_warns_and_each_micro_batch_computes_over_its_own_samples():
    """GPipe's semantics, as BatchNorm's per-micro-batch statistics: the pipeline's value is the concatenation of the
    plain model's values on each micro-batch, which is not the whole batch's."""
    model = Rows(USES["centred by the batch mean"][0]).double()
    x = torch.randn(5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match=r"autopipe: batch rows \(node sub, .*combined with a value over the whole "
                                         r"batch \(node mean, "):
        pipe = autopipe.compile(model, devices=2, chunks=2, example_inputs=(x,))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = pipe(x)
    with torch.no_grad():
        per_micro_batch = torch.cat([model(x[:3]), model(x[3:])])
        torch.testing.assert_close(got, per_micro_batch, rtol=0, atol=1e-12)
        assert not torch.allclose(got, model(x))
