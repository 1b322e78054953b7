"""passes/inplace_writes.py: which nodes write in place to what, and which later reads a cut could hide from a write."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from autopipe.passes.inplace_writes import find_inplace_writes
from autopipe.passes.trace import trace

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def analysed(model, *args, route="fx"):
    return find_inplace_writes(trace(model, args, route=route).graph_module)


def ways(read) -> list[set[str]]:
    return [{n.name for n in way} for way in read.ways]


class ZeroedThroughAView(nn.Module):
    """``h`` is written through a view of it, then read through ``h`` itself."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        h.narrow(1, 0, 2).zero_()
        return self.b(h)


def test_a_read_through_another_alias_is_listed_with_both_ways_to_see_the_write():
    (read,) = analysed(ZeroedThroughAView(), torch.randn(3, 4)).reads
    assert (read.write.name, read.written.name, read.reader.name, read.through.name) == ("zero_", "narrow", "b", "a")
    # the writing stage makes h and sends it on, written; or the reader runs in the writing stage
    assert ways(read) == [{"a", "narrow", "zero_"}, {"narrow", "zero_", "b"}]


class ReadsTheWritesResult(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.relu = nn.Linear(4, 4), nn.Linear(4, 4), nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.relu(self.a(x))
        y = h.mul_(2)
        return self.b(y.view(-1, 4))


def test_reads_of_a_writes_result_or_a_view_of_it_are_not_listed():
    writes = analysed(ReadsTheWritesResult(), torch.randn(3, 4))
    assert sorted(n.name for n, written in writes.writes.items() if written) == ["mul_", "relu"]
    assert writes.reads == ()  # every later read goes through what the writing stage returns, the write included


class CountsCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return self.a(x) * self.calls


def test_a_buffer_every_stage_holds_is_not_listed():
    writes = analysed(CountsCalls(), torch.randn(3, 4), route="export")
    assert [a.op for written in writes.writes.values() for a in written] == ["get_attr"]
    assert writes.reads == ()


class ReturnsItsInputWritten(nn.Module):
    def forward(self, x):
        x.mul_(2)
        return x


def test_a_written_input_the_model_returns_has_no_way_to_be_seen():
    (read,) = analysed(ReturnsItsInputWritten(), torch.randn(3, 4)).reads
    assert read.reader.op == "output" and read.through.op == "placeholder"
    assert read.ways == ()


class ShiftRight(nn.Module):
    """transformers' shift_tokens_right, then an embedding of what it made."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 4)

    def forward(self, labels):
        shifted = labels.new_zeros(labels.shape)
        shifted[:, 1:] = labels[:, :-1].clone()
        shifted[:, 0] = 2
        shifted.masked_fill_(shifted == -100, 1)
        return self.embed(shifted)


def test_shift_tokens_right_on_the_export_route():
    writes = analysed(ShiftRight(), torch.randint(0, 16, (3, 5)), route="export")
    written = {n.name: [a.name for a in args] for n, args in writes.writes.items() if args}
    assert set(written) == {"copy_", "fill_", "masked_fill_"}
    # the embedding reads masked_fill_'s result, a view of the new tensor: it sees masked_fill_'s write wherever it
    # runs, but the two earlier writes only where one stage makes masked_fill_ (or runs the embedding) with them
    readers = {(r.write.name, r.reader.name) for r in writes.reads}
    assert {("copy_", "embed_embedding"), ("fill_", "embed_embedding"), ("copy_", "eq"), ("fill_", "eq")} <= readers
    assert not any(w == "masked_fill_" for w, _ in readers)
    (read,) = [r for r in writes.reads if (r.write.name, r.reader.name) == ("copy_", "embed_embedding")]
    # the writing stage makes masked_fill_ or new_zeros (with the views written), or runs the embedding
    assert ways(read) == [{"copy_", "slice_8", "slice_9", "masked_fill_"}, {"copy_", "slice_8", "slice_9", "new_zeros"},
                          {"copy_", "slice_8", "slice_9", "masked_fill_", "embed_embedding"}]
