"""Gradients between tasks and into ``.grad``: sums in a fixed order (``sum_grads``), a task's parameter gradients
added to the step's, in place where reference counts show nothing else holds them (``add_param_grads``), and a step's
gradients handed to the autograd engine as ``loss.backward()`` would (``accumulate_grads``)."""
from __future__ import annotations

import functools
import sys
from typing import Any, Sequence

import torch


def sum_grads(parts: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The sum of the parts that are not None, in the order given (bitwise reproducible), on the first one's
    device; None if none. Every gradient a value or parameter gets from several places is summed by this."""
    present = [g for g in parts if g is not None]
    return functools.reduce(lambda a, b: a + b.to(a.device), present) if present else None


def differentiable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


class _Deliver(torch.autograd.Function):
    """A step's gradients handed to the autograd engine, as pipe(x)'s Function hands them: each parameter's hooks
    run once, on its whole gradient, then AccumulateGrad and the post-accumulate hooks, as in the plain model."""

    @staticmethod
    def forward(ctx, grads: list, *params: torch.Tensor):
        ctx.grads = grads
        return torch.zeros(())

    @staticmethod
    def backward(ctx, _):
        given, ctx.grads = ctx.grads, None
        handed = (None, *given)
        given.clear()  # the engine's references alone: AccumulateGrad makes each .grad without a copy
        return handed


def accumulate_grads(pairs: list[tuple[torch.nn.Parameter, torch.Tensor | None]]) -> None:
    """``pipe.step``: a step's (parameter, gradient) pairs added into ``.grad`` as ``loss.backward()`` would: through
    the engine, so each hook runs once on the whole gradient, those on a parameter's AccumulateGrad node too (DDP's
    reducer registers there; Python cannot see them). A CUDA parameter without a hook Python sees is added to directly,
    the path that has run on a GPU. ``pairs`` is emptied: AccumulateGrad copies a gradient anything else still holds
    (accumulate_grad.h), ~20 ms a step for transformer_like's 12M parameters a rank on the CPU."""
    taken = [(p, g) for p, g in pairs if g is not None]
    pairs.clear()
    if any(p.device.type == "cpu" or p._backward_hooks or p._post_accumulate_grad_hooks for p, _ in taken):
        params, grads = [p for p, _ in taken], [g for _, g in taken]
        taken.clear()
        with torch.enable_grad():
            _Deliver.apply(grads, *params).backward()
        return
    with torch.no_grad():
        for p, g in taken:
            p.grad = g if p.grad is None else p.grad.add_(g)


def add_param_grads(mine: Any, grads: tuple) -> None:
    if not mine.param_grads:  # the step's first backward: its gradients as they are
        mine.param_grads, mine.owned = list(grads), [False] * len(grads)
        return
    for k, g in enumerate(grads):
        if g is None:
            continue
        if mine.param_grads[k] is None:
            mine.param_grads[k] = g
        elif mine.owned[k] or _held_only_by(mine.param_grads, k):
            mine.param_grads[k].add_(g)
            mine.owned[k] = True
        else:
            mine.param_grads[k], mine.owned[k] = mine.param_grads[k] + g, True


def _held_only_by(grads: list, k: int) -> bool:
    """Whether nothing but ``grads`` holds ``grads[k]`` or its memory: a gradient the engine made for this step alone,
    which the sums may then add to in place, as AccumulateGrad steals a gradient no one else holds
    (torch/csrc/autograd/functions/accumulate_grad.h). A gradient the engine passed through (an output's own gradient,
    an input's, a tensor a custom Function returned) is held elsewhere too and is never written. Measured on the CPU:
    the sum's fresh allocation costs a page fault per 4 KiB, ~4% of a transformer's step over 2 ranks. Not on a GPU,
    where a copy stream may still read a tensor Python let go of (record_stream), and allocation is cached."""
    g = grads[k]
    if g.device.type != "cpu" or sys.getrefcount(g) != 3 or g._use_count() != 1:  # 3: grads, g, the argument
        return False
    if not g.is_contiguous():  # an expanded gradient (stride 0) has elements an in-place sum would write twice
        return False
    holders = torch._C._storage_Use_Count(g.untyped_storage()._cdata) - 1  # less the storage object just made
    base = g._base  # a Linear's weight gradient is a transposed view of the product the engine made
    if base is None:
        return holders == 1
    return holders == 2 and base._base is None and base._use_count() == 2 and sys.getrefcount(base) == 3
