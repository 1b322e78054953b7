"""Split the trace's flat tensor inputs into micro-batches on dim 0 (sizes differ by at most one) and merge outputs."""
from __future__ import annotations

import warnings
from typing import Sequence

import torch
import torch.utils._pytree as pytree


class BatchMismatch(ValueError):
    """Tensor arguments that should share a batch dimension do not."""


def micro_batch_sizes(batch: int, chunks: int) -> list[int]:
    """The first ``batch % chunks`` micro-batches are one row larger; a batch under ``chunks`` runs
    one-row micro-batches (with a warning, which Python's default filter shows once per call site)."""
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, got {chunks}")
    if batch < chunks:
        warnings.warn(f"batch of {batch} is smaller than chunks={chunks}: running {batch} micro-batches of one row", stacklevel=4)
        chunks = max(batch, 1)
    base, extra = divmod(batch, chunks)
    return [base + (1 if i < extra else 0) for i in range(chunks)]


def split(inputs: Sequence[torch.Tensor], names: Sequence[str], sizes: list[int]) -> list[list[torch.Tensor]]:
    """``[micro_batch][input]``: batch tensors cut on dim 0, 0-dim tensors given to every micro-batch."""
    batch = sum(sizes)
    columns = []
    for name, t in zip(names, inputs):
        if t.dim() > 0 and t.shape[0] != batch:
            raise BatchMismatch(f"argument {name!r} has {t.shape[0]} rows in dim 0 but the batch is {batch} "
                                f"(from {names[0]!r}); every tensor argument must carry the same batch in dim 0")
        columns.append(list(torch.split(t, sizes)) if t.dim() > 0 and len(sizes) > 1 else [t] * len(sizes))
    return [list(row) for row in zip(*columns)] if columns else [[] for _ in sizes]


def merge(parts: Sequence[torch.Tensor], sizes: list[int]) -> torch.Tensor:
    """Concatenated; a 0-dim float (a loss computed inside the model): the micro-batch-size-weighted mean."""
    if parts[0].dim() > 0:
        return parts[0] if len(parts) == 1 else torch.cat(list(parts))
    return sum(p * (s / sum(sizes)) for p, s in zip(parts, sizes)) if parts[0].is_floating_point() else parts[0]


def split_grad(grad: torch.Tensor | None, like: torch.Tensor, sizes: list[int]) -> list[torch.Tensor | None]:
    """The gradient of :func:`merge`'s output, back on each micro-batch."""
    if grad is None:
        return [None] * len(sizes)
    if like.dim() == 0:
        return [grad * (s / sum(sizes)) for s in sizes]
    return list(torch.split(grad, sizes))


def split_target(target, sizes: list[int]) -> list:
    """A loss target per micro-batch: tensors (also in tuples, lists, dicts) with the batch in dim 0 are cut
    like the inputs; anything else goes to every micro-batch."""
    leaves, spec = pytree.tree_flatten(target)
    columns = [list(torch.split(t, sizes)) if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == sum(sizes) else [t] * len(sizes) for t in leaves]
    return [pytree.tree_unflatten([c[i] for c in columns], spec) for i in range(len(sizes))]
