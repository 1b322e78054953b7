"""The micro-batch analysis pass: which values hold the batch, and whether computing them per micro-batch gives the
plain model's values. ``analyse_micro_batches(traced) -> MicroBatchAnalysis``, read by partition (into each crossing
value's and output's ``TensorInfo``, which codegen and the runtime read) and by compile (its warnings). The rules, one
file each, its reasons in the notes beside it:

- ``facts.py``: trace's facts on each node, as the rules read them (rows a sample, the nodes from the batch, views)
- ``scalar_merges.py``: how a 0-dim output (a loss) merges: mean, sum, count of targets, or unknown
- ``samples.py``: an output's rows of each sample kept together, or samples mixed (``u @ v.T``, a flatten after a
  transpose)
- ``selections.py``: rows selected by value (``x[mask]``, nonzero), used as the plain model uses them or misread
- ``across_micro_batches.py``: batch rows that depend on other samples (``h - h.mean(0)``, flip, cumsum): warnings"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

from autopipe.ir.plan import TargetCount

from ..traced_model import TracedModel
from .across_micro_batches import across_micro_batches
from .facts import from_batch
from .samples import interleaved_rows, samples_mixed, samples_together
from .scalar_merges import scalar_merges
from .selections import selections_misread

__all__ = ["MicroBatchAnalysis", "analyse_micro_batches"]


@dataclass
class MicroBatchAnalysis:
    """What the rules found, by node name."""

    # a 0-dim float output -> "mean", "sum", "count" or "unknown" (scalar_merges.py)
    scalar_merges: dict[str, str] = field(default_factory=dict)
    # a "count" value -> how a micro-batch counts its targets (scalar_merges.py)
    counts: dict[str, TargetCount] = field(default_factory=dict)
    # k > 1 rows a sample, each sample's rows together: parts concatenate (samples.py)
    together: set[str] = field(default_factory=set)
    # rows selected from the batch's rows in their order, x[mask]: parts concatenate (selections.py)
    selected: set[str] = field(default_factory=set)
    # a value computed from one that mixes samples -> (that node, how): refused as an output (samples.py)
    mixed: dict[str, tuple[str, str]] = field(default_factory=dict)
    # batch rows that depend on other samples: warned at compile (across_micro_batches.py)
    across_micro_batches: list[str] = field(default_factory=list)
    # an output no batch input reaches (a parameter returned as it is, a norm of the weights): each micro-batch
    # computes the plain model's value (facts.from_batch)
    batch_free: set[str] = field(default_factory=set)

    def merge_notes(self, outputs: Iterable[str]) -> list[str]:
        """The plan's notes on how these outputs merge: each merged as a weighted mean it cannot show is exact, then
        each merged by its count of targets."""
        outputs = list(outputs)
        return [_unknown_merge(name) for name in outputs if self.scalar_merges.get(name, "mean") == "unknown"] + \
            [_count_merge(name, count) for name in outputs
             if self.scalar_merges.get(name) == "count" and (count := self.counts.get(name))]


def _unknown_merge(name: str) -> str:
    return (f"output {name}: a number from the whole micro-batch that autopipe cannot read as a mean or a sum over its "
            f"samples (a mean over the targets a loss does not ignore, a load-balancing loss): merged as the "
            f"size-weighted mean of the micro-batches' values, as gradient accumulation by hand does: the plain "
            f"model's value only for a mean over samples that weigh the same in every micro-batch (no ignored "
            f"targets), not for a product of batch means (a load-balancing loss); a loss summed and divided by the "
            f"whole batch's count (Hugging Face's num_items_in_batch) merges exactly")


def _count_merge(name: str, count: TargetCount) -> str:
    over = f"the rows the mask {count.target} selects" if count.ignore_index is None else \
        f"the targets {count.target} not equal to {count.ignore_index}"
    weighed = f" weighed by {count.weight}" if count.weight else ""
    return (f"output {name}: a mean over {over}{weighed}: merged exactly, each micro-batch's mean weighted by its "
            f"count of them over the batch's (counted from the inputs before the step)")


def analyse_micro_batches(traced: TracedModel) -> MicroBatchAnalysis:
    """Every rule over ``traced``'s graph, whose nodes carry trace's batch facts."""
    gm = traced.graph_module
    batch = from_batch(gm)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    merges, counted = scalar_merges(gm, batch)
    interleaved = interleaved_rows(gm)
    misread, selected = selections_misread(gm, batch, interleaved, set(counted))
    return MicroBatchAnalysis(
        scalar_merges={n.name: how for n, how in merges.items()}, counts={n.name: c for n, c in counted.items()},
        together={n.name for n in samples_together(gm, batch)}, selected={n.name for n in selected},
        mixed={n.name: why for n, why in samples_mixed(gm, batch, interleaved, misread).items()},
        across_micro_batches=across_micro_batches(gm),
        batch_free={n.name for n in output.all_input_nodes if n not in batch})
