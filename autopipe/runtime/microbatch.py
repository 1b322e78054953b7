"""Split flat inputs into micro-batches on dim 0 and merge outputs back.

The trace pass already flattened the call's (nested) args and kwargs into
tensor leaves; non-tensor arguments were baked into the graph, so they reach
every micro-batch. Micro-batch sizes differ by at most one,
so a batch that does not divide by ``chunks`` works (``micro_batch_sizes``:
the first ``batch % chunks`` micro-batches are one row larger).
"""
from __future__ import annotations

import warnings
from typing import Sequence

import torch
import torch.utils._pytree as pytree


class BatchMismatch(ValueError):
    """Tensor arguments that should share a batch dimension do not."""


_warned_small_batch = False


def micro_batch_sizes(batch: int, chunks: int) -> list[int]:
    """Sizes of the micro-batches; fewer than ``chunks`` (with one warning) for a small batch."""
    global _warned_small_batch
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    if batch < chunks:
        if not _warned_small_batch:
            warnings.warn(
                f"batch of {batch} is smaller than chunks={chunks}: running {batch} micro-batches of one row",
                stacklevel=4,
            )
            _warned_small_batch = True
        chunks = max(batch, 1)
    base, extra = divmod(batch, chunks)
    return [base + (1 if i < extra else 0) for i in range(chunks)]


def split(inputs: Sequence[torch.Tensor], names: Sequence[str], sizes: list[int]) -> list[list[torch.Tensor]]:
    """``[micro_batch][input]``: batch tensors cut on dim 0, 0-dim tensors given to every micro-batch."""
    batch = sum(sizes)
    columns = []
    for name, t in zip(names, inputs):
        if t.dim() == 0:
            columns.append([t] * len(sizes))
            continue
        if t.shape[0] != batch:
            raise BatchMismatch(
                f"argument {name!r} has {t.shape[0]} rows in dim 0 but the batch is {batch} "
                f"(from {names[0]!r}); every tensor argument must carry the same batch in dim 0"
            )
        columns.append(list(torch.split(t, sizes)))
    return [list(row) for row in zip(*columns)] if columns else [[] for _ in sizes]


def merge(parts: Sequence[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """One output from its micro-batch pieces: concatenated, or for a 0-dim value
    (a loss computed inside the model) the micro-batch-size-weighted mean."""
    if parts[0].dim() == 0:
        total = sum(sizes)
        if not parts[0].is_floating_point():
            return parts[0]
        return sum(p * (s / total) for p, s in zip(parts, sizes))
    return parts[0] if len(parts) == 1 else torch.cat(list(parts))


def split_grad(grad: torch.Tensor | None, like: torch.Tensor, sizes: list[int]) -> list[torch.Tensor | None]:
    """The gradient of :func:`merge`'s output, back on each micro-batch."""
    if grad is None:
        return [None] * len(sizes)
    if like.dim() == 0:
        total = sum(sizes)
        return [grad * (s / total) for s in sizes]
    return list(torch.split(grad, sizes))


def split_target(target, sizes: list[int]) -> list:
    """A loss target per micro-batch: tensors (also inside tuples, lists, dicts) cut on dim 0
    like the inputs; anything else goes to every micro-batch."""
    batch = sum(sizes)
    leaves, spec = pytree.tree_flatten(target)
    columns = [list(torch.split(t, sizes)) if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch
               else [t] * len(sizes) for t in leaves]
    return [pytree.tree_unflatten([c[i] for c in columns], spec) for i in range(len(sizes))]
