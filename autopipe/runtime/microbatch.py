"""Split the trace's flat tensor inputs into micro-batches on dim 0 (sizes differ by at most one) and merge outputs. A
tensor argument whose dim 0 is not the batch (a (seq, seq) attention mask, Flux's position ids) goes whole to every
micro-batch, as the plain model sees it."""
from __future__ import annotations

import warnings
from typing import Sequence

import torch
import torch.utils._pytree as pytree

from autopipe.ir.batch import carries_batch
from autopipe.ir.plan import TensorInfo


def micro_batch_sizes(batch: int, chunks: int) -> list[int]:
    """The first ``batch % chunks`` micro-batches are one row larger; a batch under ``chunks`` runs
    one-row micro-batches (with a warning, which Python's default filter shows once per call site)."""
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    if batch < chunks:
        warnings.warn(f"batch of {batch} is smaller than chunks={chunks}: running {batch} micro-batches of one row",
                      stacklevel=4)
        chunks = max(batch, 1)
    base, extra = divmod(batch, chunks)
    return [base + (1 if i < extra else 0) for i in range(chunks)]


def shape_key(t: torch.Tensor, batch: int) -> tuple:
    """What a graph traced for ``t`` fixes of its shape: all but the batch, or all of a tensor given whole to every
    micro-batch."""
    return tuple(t.shape[1:]) if carries_batch(t, batch) else ("whole", *t.shape)


def split(inputs: Sequence[torch.Tensor], sizes: list[int]) -> list[list[torch.Tensor]]:
    """``[micro_batch][input]``: batch tensors cut on dim 0, others given whole to every micro-batch."""
    columns = [list(torch.split(t, sizes)) if carries_batch(t, sum(sizes)) and len(sizes) > 1 else [t] * len(sizes)
               for t in inputs]
    return [list(row) for row in zip(*columns)] if columns else [[] for _ in sizes]


def merge(parts: Sequence[torch.Tensor], sizes: list[int], traced: TensorInfo | None = None,
          name: str = "output", counts: Sequence[float] | None = None) -> torch.Tensor:
    """Concatenated, each part holding the same number of rows a sample (a (batch * seq, ...) tensor flattened
    batch-major; ``traced``: as the trace saw it, its other dims too); a 0-dim float (a loss computed inside the model):
    the micro-batch-size-weighted mean, the sum where ``traced`` says it sums over samples, or the mean weighted by
    ``counts`` where it is a mean over targets a micro-batch counts (a part over no targets is nan and weighs 0). Parts
    no concatenation turns into the plain model's value (a statistic over the batch, CLIP's batch x batch logits) are
    refused."""
    if len(parts) == 1 or (parts[0].dim() == 0 and not parts[0].is_floating_point()) or \
            (traced is not None and traced.batch_free):
        return parts[0]
    if parts[0].dim() == 0:
        if traced is not None and traced.scalar_merge == "count" and counts is not None and not sum(counts):
            return sum(parts)  # no targets in the whole batch: nan, as the plain model's mean
        return sum(p * w for p, w in zip(parts, scalar_weights(sizes, traced, counts)) if w)
    rows = [p.shape[0] for p in parts]
    k = (traced.rows_per_sample if traced.merges else 0) if traced is not None else rows[0] // sizes[0]
    other_dims = traced.shape[1:] if traced is not None else parts[0].shape[1:]
    if traced is not None and traced.selected_rows and traced.merges:
        k, sizes = 1, rows  # as many rows as each micro-batch's mask selected
    if k == 0 or rows != [k * s for s in sizes] or any(p.shape[1:] != other_dims for p in parts):
        shapes = [tuple(p.shape) for p in parts]
        raise ValueError(f"{name}: micro-batches of {sizes} rows gave parts of shapes {shapes}"
                         + (f" (traced at a batch of {traced.shape[0] // max(k, 1)}: {traced.shape})" if traced else "")
                         + ": it does not carry the batch in dim 0 alone, so no concatenation of the parts is the "
                           "plain model's value; return it per sample or run with chunks=1 (docs/faithfulness.md)")
    return torch.cat(list(parts))


def scalar_weights(sizes: list[int], traced: TensorInfo | None = None,
                   counts: Sequence[float] | None = None) -> list[float]:
    """What each micro-batch's 0-dim output weighs in :func:`merge`: 1 for a sum, its share of the targets for a mean
    over counted targets, its share of the rows otherwise."""
    how = traced.scalar_merge if traced is not None else "mean"
    if traced is not None and traced.batch_free:
        return [1.0] + [0.0] * (len(sizes) - 1)
    if how == "sum":
        return [1.0] * len(sizes)
    return count_shares(counts, sizes) if how == "count" and counts is not None else [s / sum(sizes) for s in sizes]


def count_shares(counts: Sequence[float], sizes: Sequence[int]) -> list[float]:
    """Each micro-batch's share of the targets a mean is over; its share of the rows where there is no target at all
    (every part is nan then, as the plain model's mean)."""
    total = sum(counts)
    return [c / total for c in counts] if total else [s / sum(sizes) for s in sizes]


def split_grad(grad: torch.Tensor | None, parts: Sequence[torch.Tensor], sizes: list[int],
               traced: TensorInfo | None = None, counts: Sequence[float] | None = None) -> list[torch.Tensor | None]:
    """The gradient of :func:`merge`'s output, back on each of its ``parts``."""
    if grad is None or len(parts) == 1:
        return [grad] * len(sizes)
    if traced is not None and traced.batch_free:
        return [grad] + [None] * (len(parts) - 1)
    if parts[0].dim() == 0:
        return [grad * w for w in scalar_weights(sizes, traced, counts)]
    return list(torch.split(grad, [p.shape[0] for p in parts]))


def split_target(target, sizes: list[int]) -> list:
    """A loss target per micro-batch: tensors (also in tuples, lists, dicts) with the batch in dim 0 are cut
    like the inputs; anything else goes to every micro-batch."""
    leaves, spec = pytree.tree_flatten(target)
    columns = [list(torch.split(t, sizes)) if isinstance(t, torch.Tensor)
               and carries_batch(t, sum(sizes)) else [t] * len(sizes) for t in leaves]
    return [pytree.tree_unflatten([c[i] for c in columns], spec) for i in range(len(sizes))]
