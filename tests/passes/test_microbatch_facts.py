"""passes/microbatch_analysis/facts.py: the batch facts trace records on each node from the graph run again one row
larger (Note [the batch found by one more row]), and what the rules read of them: the nodes computed from the batch,
the values sharing a storage, the rows a concatenation keeps in order. Each fact on a tiny graph of ours, exactly."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopipe.passes.microbatch_analysis.facts import (concatenated_rows, from_batch, record_batch_facts,
                                                       rows_per_sample, views)
from autopipe.passes.trace import BatchSpecialised, trace

FACTS = ("rows_per_sample", "batch_dim", "pairs_samples", "batch_free", "batch_number", "data_dependent",
         "selected_rows", "literals_unknown")


def traced(model: nn.Module, *inputs: torch.Tensor):
    """The fx graph trace records, and each node's facts by name."""
    graph_module = trace(model, inputs).graph_module
    return graph_module, {n.name: {k: n.meta[k] for k in FACTS if k in n.meta} for n in graph_module.graph.nodes}


class Shapes(nn.Module):
    """Values whose dim 0 is the batch, k rows of it, or not the batch although as large."""

    def forward(self, x, seq_first):
        rows = x.reshape(-1, 2)                  # (batch * 3, 2): three rows a sample
        stacked = torch.stack([x[:, 0], x[:, 1]])   # (2, batch, 2): at a batch of two, dim 0 is as large as the batch
        return x * 2, rows + 1, stacked - 1, seq_first.transpose(0, 1) * 3


def test_the_batch_dim_is_the_one_that_grows_by_one_row_not_a_dim_as_large_as_the_batch():
    """At a batch of two, a stack of two and a sequence of two look like the batch to a comparison of sizes; the
    graph run one row larger tells them apart: only the batch dim grows."""
    x, seq_first = torch.randn(2, 3, 2), torch.randn(2, 2, 5)  # seq_first: (batch, seq = 2, d), transposed inside
    _, facts = traced(Shapes(), x, seq_first)
    assert facts["x"] == {"rows_per_sample": 1, "batch_dim": 0}
    assert facts["mul"] == {"rows_per_sample": 1, "batch_dim": 0}
    assert facts["add"] == {"rows_per_sample": 3, "batch_dim": 0}       # reshape(-1, 2): 3 rows a sample
    assert facts["sub"] == {"rows_per_sample": 0, "batch_dim": 1}       # stack: (2, batch, 2)
    assert facts["mul_1"] == {"rows_per_sample": 0, "batch_dim": 1}     # (seq, batch, d)


class Statistics(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return x @ x.T, x.mean(0), x * x.shape[0], self.weight.square().sum()


def test_pairs_of_samples_statistics_over_the_batch_batch_numbers_and_values_of_no_input():
    graph_module, facts = traced(Statistics(), torch.randn(5, 4))
    assert facts["matmul"] == {"rows_per_sample": 0, "pairs_samples": True}   # (batch, batch): both dims grow
    assert facts["mean"] == {"rows_per_sample": 0, "batch_free": True}        # the same shape at every batch size
    assert facts["getitem"] == {"batch_number": True}                         # x.shape[0]
    assert facts["mul"] == {"rows_per_sample": 1, "batch_dim": 0}
    batch = {n.name for n in from_batch(graph_module)}
    assert {"x", "matmul", "mean", "mul"} <= batch
    assert not {"weight", "square", "sum_1"} & batch                          # from the parameter alone
    assert facts["sum_1"] == {"rows_per_sample": 0, "batch_free": True}


class Selects(nn.Module):
    def forward(self, x):
        return x[x[:, 0] > 0] * 2, torch.nonzero(x[:, 1] > 0)


def test_rows_selected_by_value_have_a_size_set_by_values_in_their_first_dim():
    _, facts = traced(Selects(), torch.randn(6, 3))
    for name in ("getitem_1", "mul", "nonzero"):  # x[mask], a row-wise op on it, nonzero's positions
        assert facts[name]["data_dependent"] and not facts[name]["batch_number"]
        assert facts[name]["selected_rows"][0] == 0 and facts[name]["selected_rows"][1].startswith("u")
        assert "rows_per_sample" not in facts[name]
    assert facts["getitem_1"]["selected_rows"] == facts["mul"]["selected_rows"] != facts["nonzero"]["selected_rows"]


class Concatenations(nn.Module):
    def forward(self, h):
        return torch.cat(h.unbind(0)) * 1, torch.cat([h[1:], h[:1]]) * 2, torch.cat([h, h]) * 3


def test_a_cat_of_a_tensors_rows_in_order_keeps_each_samples_rows_together():
    """Note [rows concatenated in order] the batch's rows each once and in order are the tensor reshaped (k = seq
    rows a sample); rotated they cover every row in another order (k = 0); two whole copies are no such cat."""
    graph_module, facts = traced(Concatenations(), torch.randn(4, 3, 2))
    nodes = {n.name: n for n in graph_module.graph.nodes}
    assert concatenated_rows(nodes["cat"]) == (nodes["h"], 3)
    assert concatenated_rows(nodes["cat_1"]) == (nodes["h"], 0)
    assert concatenated_rows(nodes["cat_2"]) is None
    assert concatenated_rows(nodes["mul"]) is None  # not a cat
    assert rows_per_sample(nodes["mul"]) == facts["mul"]["rows_per_sample"] == 3
    assert rows_per_sample(nodes["cat_2"]) == 2       # two rows a sample, one from each copy: not in sample order


class Views(nn.Module):
    def forward(self, x):
        y = x.view(-1, 2, 2).transpose(1, 2)
        return y + 1, x.clone() + 2


def test_views_of_a_tensor_share_its_representative_and_a_new_value_is_its_own():
    graph_module, _ = traced(Views(), torch.randn(3, 4))
    nodes = {n.name: n for n in graph_module.graph.nodes}
    root = views(graph_module)
    assert root[nodes["view"]] is root[nodes["transpose"]] is nodes["x"]
    assert root[nodes["add"]] is nodes["add"]
    assert root[nodes["clone"]] is nodes["x"]  # a clone counts with its source (RESHAPES): the safe side


def test_a_graph_known_at_one_size_alone_knows_only_the_batch_tensors():
    """Without a run one row larger (a static export that runs at one size), what looks like k rows a sample may hold
    more samples' elements than k rows do: k is 0, and every node with a literal may hold the batch size."""
    graph_module, _ = traced(Shapes(), torch.randn(2, 3, 2), torch.randn(2, 2, 5))
    for n in graph_module.graph.nodes:  # the facts of the run one row larger, forgotten
        for fact in FACTS:
            n.meta.pop(fact, None)
    record_batch_facts(graph_module, 2, None)
    nodes = {n.name: n for n in graph_module.graph.nodes}
    assert rows_per_sample(nodes["x"]) == rows_per_sample(nodes["mul"]) == 1
    assert rows_per_sample(nodes["add"]) == 0          # reshape(-1, 2): 3 rows a sample at batch 2 alone is no fact
    assert nodes["mul"].meta["literals_unknown"] and nodes["reshape"].meta["literals_unknown"]
    assert "literals_unknown" not in nodes["x"].meta and "batch_dim" not in nodes["mul"].meta


class FixedBatch(nn.Module):
    def forward(self, x):
        return x.view(4, -1) * 2  # the batch size written in: runs at 4 rows only


def test_a_graph_that_does_not_run_one_row_larger_specialises_on_the_batch():
    with pytest.raises(BatchSpecialised):
        trace(FixedBatch(), (torch.randn(4, 3),))
