"""Gradient-norm clipping over a whole pipeline: ``pipe.clip_grad_norm_(max_norm)`` is the plain model's
``torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)`` wherever the stages run.

Note [clipping over ranks]: under torchrun a rank holds only its own stages' parameters, so the per-rank
``torch.nn.utils.clip_grad_norm_(pipe.parameters(), ...)`` clips each stage by its own norm: every parameter is then
scaled by another factor than in the plain model, silently. The plain model's norm is a reduction over every stage:
each rank reduces its gradients to one number (the sum of ``|g|^p``, or the largest ``|g|`` for the inf norm), the
ranks of a pipeline add (or take the max of) those numbers, and every rank scales by the same factor. A tied weight
held by several ranks has the same summed gradient on each of them after the step: it is counted on one of them only.
Gradients that are DTensors (FSDP2 shards) reduce over their mesh first, as torchtitan's ``clip_grad_norm_`` does.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch
import torch.distributed as dist

__all__ = ["clip_grad_norm_"]


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, *,
                    counted: Iterable[torch.Tensor] | None = None, group: dist.ProcessGroup | None = None,
                    device: torch.device | None = None, error_if_nonfinite: bool = False,
                    foreach: bool | None = None) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so that the norm over every rank of ``group`` is at most ``max_norm``;
    return that total norm (the plain model's, a float64-reduced scalar in the gradients' dtype).

    ``counted``: the parameters whose gradients make up this rank's share of the norm (default: ``parameters``); a
    tied weight another rank also counts is left out of it here, but still scaled. ``group``: the ranks whose shares
    add up to the whole model (None: this process holds all of it). ``device``: where this rank's share is reduced
    (its stages' device: NCCL reduces GPU tensors)."""
    parameters = [p for p in parameters if p.grad is not None]
    counted_grads = [p.grad for p in (parameters if counted is None else counted) if p.grad is not None]
    norm_type = float(norm_type)
    local = _local_norm(counted_grads, norm_type, foreach, device)
    if group is not None and dist.get_world_size(group) > 1:
        share = local.to(torch.float64)
        if math.isinf(norm_type):
            dist.all_reduce(share, op=dist.ReduceOp.MAX, group=group)
            total = share
        else:
            share = share ** norm_type
            dist.all_reduce(share, op=dist.ReduceOp.SUM, group=group)
            total = share ** (1.0 / norm_type)
        total = total.to(local.dtype)
    else:
        total = local
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(f"the total norm of order {norm_type:g} of the pipeline's gradients is non-finite "
                           f"({total.item()}), so it cannot be clipped; set error_if_nonfinite=False to clip anyway")
    if parameters:
        torch.nn.utils.clip_grads_with_norm_(parameters, max_norm, total.to(parameters[0].grad.device), foreach)
    return total


def _local_norm(grads: list[torch.Tensor], norm_type: float, foreach: bool | None,
                device: torch.device | None) -> torch.Tensor:
    """This rank's norm of ``grads`` as torch computes it (per-tensor norms, then the norm of those), a plain tensor on
    the CPU or the gradients' first device; a DTensor's norm is reduced over its mesh first."""
    if not grads:
        return torch.zeros((), dtype=torch.float64, device=device)
    local = torch.nn.utils.get_total_norm(grads, norm_type, False, foreach)
    full_tensor = getattr(local, "full_tensor", None)  # a DTensor norm (Partial over the shard dim): reduce it
    local = full_tensor() if full_tensor is not None else local
    return local if device is None else local.to(device)
