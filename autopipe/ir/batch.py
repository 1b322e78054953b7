"""The batch as every layer takes it: dim 0 of the first tensor argument (``batch_rows``); a tensor whose dim 0 is
the batch is cut into micro-batches, any other goes whole to each (``carries_batch``); a call that does not fit what
was compiled raises ``InputMismatch``."""
from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree


class InputMismatch(ValueError):
    """A call does not match the arguments the pipeline was compiled for."""


def batch_rows(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> int | None:
    """The batch as trace takes it: dim 0 of the first tensor argument in the order of the forward's parameters (None:
    0-dim, or none)."""
    try:
        arguments: Any = dict(inspect.signature(model.forward).bind(*args, **kwargs).arguments)
    except TypeError:  # named where the call is traced or checked
        arguments = (tuple(args), dict(kwargs))
    first = next((t for t in pytree.tree_leaves(arguments) if isinstance(t, torch.Tensor)), None)
    return first.shape[0] if first is not None and first.dim() else None


def carries_batch(t: torch.Tensor, batch: int | None) -> bool:
    """Is ``t`` a batch tensor (dim 0 = the batch), which micro-batches cut, rather than one each gets whole?"""
    return t.dim() > 0 and t.shape[0] == batch
