"""Gradients between tasks and into ``.grad``: sums in a fixed order (``sum_grads``), a task's parameter gradients
added to the step's, in place where reference counts show nothing else holds them (``add_param_grads``; on a CPU as
the engine makes each, ``summed_as_made``), and a step's gradients handed to the autograd engine as ``loss.backward()``
would (``accumulate_grads``)."""
from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections import OrderedDict
from typing import Any, Iterator, Sequence

import torch


def sum_grads(parts: Sequence[torch.Tensor | None]) -> torch.Tensor | None:
    """The sum of the parts that are not None, in the order given (bitwise reproducible), on the first one's
    device; None if none. Every gradient a value or parameter gets from several places is summed by this."""
    present = [g for g in parts if g is not None]
    return functools.reduce(lambda a, b: a + b.to(a.device), present) if present else None


def differentiable(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and (x.is_floating_point() or x.is_complex())


# Note [gradients through the engine]: a stage never adds into .grad itself. Doing so where the caller's backward
# is a plain backward() saved a little of the step, but a hook on a parameter's AccumulateGrad node (DDP's reducer,
# DeepSpeed's and Megatron's gradient hooks) then ran once per micro-batch plus once with no gradient, and Python
# cannot see such hooks to avoid them. pipe.step hands its sums to AccumulateGrad through the engine too.
class _Deliver(torch.autograd.Function):
    """A step's gradients handed to the autograd engine, as pipe(x)'s Function hands them: each parameter's hooks
    run once, on its whole gradient, then AccumulateGrad and the post-accumulate hooks, as in the plain model (Note
    [gradients through the engine])."""

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
    the engine, so each hook runs once on the whole gradient, those on a parameter's AccumulateGrad node too (Note
    [gradients through the engine]). A CUDA parameter without a hook Python sees is added to directly, the path that
    has run on a GPU. ``pairs`` is emptied: AccumulateGrad copies a gradient anything else still holds
    (accumulate_grad.h): a copy of each gradient a step (benchmarks/distributed.py times the step)."""
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


# Note [gradient sums in place]: a micro-batch's parameter gradient is added in place into the running sum only
# where nothing else holds it or its memory (CPU, contiguous, Python and storage reference counts: AccumulateGrad's
# own rule, accumulate_grad.h); one the engine passed through (the loss's own) is summed into a new tensor. The
# sums reach AccumulateGrad with no other reference, so .grad is the sum itself, not a copy. On a CPU the sums are
# made as the engine makes each gradient (Note [gradients summed as the engine makes them]).
def add_param_grads(mine: Any, grads: tuple) -> None:
    """A task's parameter gradients added to the step's sums (``mine``: its StageStep), in task order (Note [gradient
    sums in place])."""
    if not mine.param_grads:  # the step's first backward: its gradients as they are
        mine.param_grads, mine.owned = list(grads), [False] * len(grads)
        return
    for k, g in enumerate(grads):
        if g is not None and not g._is_zerotensor():  # a zero tensor: summed as the engine made it
            _add(mine, k, g)


def _add(mine: Any, k: int, g: torch.Tensor) -> None:
    if mine.param_grads[k] is None:
        mine.param_grads[k] = g
    elif mine.owned[k] or _held_only_by(mine.param_grads, k):
        mine.param_grads[k].add_(g)
        mine.owned[k] = True
    else:
        mine.param_grads[k], mine.owned[k] = mine.param_grads[k] + g, True


def _taken(mine: Any, k: int, thread: int, copy_first: bool, g: torch.Tensor) -> torch.Tensor | None:
    """A tensor hook's body: ``g`` added to the step's sum now, and the engine handed a zero tensor (no storage) in
    its place; left to the engine (None) in another thread's call. The step's first gradient, where more will be
    added, is copied into the parameter's layout (Note [gradients summed as the engine makes them])."""
    if threading.get_ident() != thread:
        return None
    p = mine.wrt_params[k]
    if mine.param_grads[k] is None and (copy_first or g.stride() != p.stride()):
        mine.param_grads[k], mine.owned[k] = torch.empty_like(p, memory_format=torch.preserve_format).copy_(g), True
    else:
        _add(mine, k, g)
    key = (g.shape, g.dtype)
    zero = _ZEROS.get(key)
    if zero is None:  # made once per shape: a step adds no op of its own per parameter
        zero = _ZEROS[key] = torch._efficientzerotensor(g.shape, dtype=g.dtype)
    return zero


_ZEROS: dict[tuple, torch.Tensor] = {}  # the zero tensors hooks hand the engine (CPU), by shape and dtype


# Note [no hook on a tensor two threads differentiate]: a weight tied between two stages run by two CPU worker threads
# is one tensor in both. Setting its hooks in one thread while the other's engine call reads them races in C++ (the
# engine walks the tensor's hook list without the GIL): a segfault, or "vector::_M_range_check" inside the backward.
# So only a torchrun rank's runners (one thread drives a rank's stages) sum as made: the page faults this removes were
# measured there (benchmarks/schedules.py); the in-process step, its stages worker threads, is as it was.
# Note [gradients summed as the engine makes them]: an engine call towards a stage's parameters returns all their
# gradients at once, so on a CPU a micro-batch's weight gradients were all alive together and freed together at
# the top of glibc's heap, which trimmed them back to the OS; the next micro-batch's matrix products then wrote
# fresh pages (a page fault per 4 KiB). AccumulateGrad (torch.distributed.pipelining's path) adds each gradient as
# it is made, and the next product reuses the memory just freed. A tensor hook on each CPU parameter the engine
# differentiates does the same here for the length of the call: it adds the gradient to the step's sum (Note
# [gradient sums in place]) and hands the engine a zero tensor, which ``add_param_grads`` skips. The first
# micro-batch's gradient is copied to make the sum (as AccumulateGrad copies one it may not keep): kept, it would
# pin the spot among that backward's temporaries where the next micro-batch's products would go, and they would
# land at the heap's top again, to be trimmed after each backward. The hooks are the parameters' own
# ``_backward_hooks``, set and restored around the call, so nothing outlives it, and AccumulateGrad (which a
# captured input never runs) and its hooks are untouched. CPU workers are threads, and a
# weight tied between two stages of one device type is one tensor in both: a hook takes only gradients of the
# engine call of the thread that set it (the engine runs a CPU graph on the calling thread), and leaves any other
# to that call, which sums it as before (add_param_grads: the same additions in the same order).
@contextlib.contextmanager
def summed_as_made(mine: Any, more: bool) -> Iterator[None]:
    """Around an engine call towards ``mine.wrt_params`` (``mine``: a StageStep): each CPU parameter's gradient added
    to the step's sum as the engine makes it; ``more``: other micro-batches' will be added to it (Note [gradients
    summed as the engine makes them]); on a torchrun rank only (Note [no hook on a tensor two threads
    differentiate])."""
    params, thread = mine.wrt_params, threading.get_ident()
    hooked = [(k, p, p._backward_hooks) for k, p in enumerate(params) if p.device.type == "cpu"
              and not p._backward_hooks and type(p) in (torch.nn.Parameter, torch.Tensor)]
    if hooked and not mine.param_grads:  # only then: an empty list still tells a CUDA graph its first backward
        mine.param_grads, mine.owned = [None] * len(params), [False] * len(params)
    for k, p, _ in hooked:
        p._backward_hooks = OrderedDict({0: functools.partial(_taken, mine, k, thread, more)})
    try:
        yield
    finally:
        for _, p, before in hooked:
            p._backward_hooks = before


def _held_only_by(grads: list, k: int) -> bool:
    """Whether nothing but ``grads`` holds ``grads[k]`` or its memory: a gradient the engine made for this step alone,
    which the sums may then add to in place (Note [gradient sums in place]). A gradient the engine passed through (an
    output's own gradient, an input's, a tensor a custom Function returned) is held elsewhere too and is never
    written. On the CPU only, where a fresh sum costs a page fault per 4 KiB (benchmarks/distributed.py times the
    step); on a GPU a copy stream may still read a tensor Python let go of (record_stream), and allocation is cached."""
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
