"""Batch rows that depend on other samples, which a micro-batch does not hold: rows moved along the batch (flip, roll),
normalised, sorted or scanned along it (softmax(x, dim=0), cumsum), computed with the batch size, or combined with a
statistic over the batch (``h - h.mean(0)``, a batch norm by hand). Each micro-batch computes these over its own
samples, as BatchNorm does (GPipe sec. 2.2): warned at compile (``Plan.across_micro_batches``), not refused.

Note [warned, not refused]: batch rows combined with a value over the whole batch (h - h.mean(0), z @ (z.T @ z)),
flip, roll, cumsum, softmax or sort along the batch, and the batch size in arithmetic give each micro-batch its
own statistic. That is a warning, not a refusal, as BatchNorm's per-micro-batch statistics are GPipe's own.
Integer values stop the rule: a grouped expert dispatch orders its work by histc counts and mixes nothing."""
from __future__ import annotations

import torch
import torch.fx as fx

from autopipe.random_ops import bind, op_name

from ..custom_gradients import FunctionCall
from ..diagnostics import node_where
from .facts import rows_per_sample, shape_only

_ARITHMETIC = frozenset({"add", "sub", "mul", "truediv", "div", "floordiv", "pow", "rsub", "iadd", "isub", "imul",
                         "itruediv", "add_", "sub_", "mul_", "div_", "addcmul", "addcdiv", "lerp", "clamp", "where"})
_NORMALISES = ("softmax", "log_softmax", "_softmax", "_log_softmax", "softmin", "sort", "argsort")
_SCANS = ("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp")


def _moves_rows(n: fx.Node) -> str:
    return (f"{node_where(n)} moves rows along the batch dim: each micro-batch moves only its own rows, so values "
            f"and gradients are not the plain model's; compute it outside the model, or run with chunks=1")


def _normalises(n: fx.Node) -> str:
    return (f"{node_where(n)} normalises or sorts along the batch dim (softmax(x, dim=0)): each micro-batch does it "
            f"over only its own rows, so values and gradients are not the plain model's; compute it outside the model, "
            f"or run with chunks=1")


def _scans(n: fx.Node) -> str:
    return (f"{node_where(n)} scans along the batch dim (a running count over several samples' rows, as "
            f"capacity-limited routing keeps the first rows an expert gets): each micro-batch scans only its own rows, "
            f"so values and gradients are not the plain model's; compute it outside the model, or run with chunks=1")


def _with_batch_size(n: fx.Node, size: str) -> str:
    return (f"{node_where(n)} computes batch rows with {size}, a number set by the batch size (x.shape[0]): each "
            f"micro-batch uses its own, so values and gradients are not the plain model's; pass it in, or run with "
            f"chunks=1")


def _with_statistic(statistic: fx.Node, user: fx.Node) -> str:
    return (f"batch rows ({node_where(user)}) combined with a value over the whole batch ({node_where(statistic)}): "
            f"each micro-batch computes it over its own samples, as BatchNorm in training mode does (GPipe sec. 2.2), "
            f"so values and gradients are not the plain model's; compute it outside the model, or run with chunks=1")


def across_micro_batches(gm: fx.GraphModule) -> list[str]:
    """A note per op whose batch rows depend on other samples: along the batch (``_along_batch_notes``), then each
    statistic over the batch and the first batch rows combined with it (a floating value from batch rows whose shape is
    the same at every batch size: trace's ``batch_free``; or one computed from it without the batch, also through a
    module fx keeps whole)."""
    statistic: dict[fx.Node, fx.Node] = {}  # a value without the batch -> the statistic it is computed from
    readers: dict[fx.Node, fx.Node] = {}    # a statistic -> the first batch rows combined with it
    notes = []
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method", "call_module"):
            continue
        function = n.op != "call_module"  # fx's leaf modules (Linear): a module's name is not an op's
        if function:
            notes += _along_batch_notes(n)
        inputs = _value_inputs(n) if function else n.all_input_nodes
        source = next((statistic[a] for a in inputs if a in statistic), None)
        if rows_per_sample(n) and source is not None:
            readers.setdefault(source, n)
        elif not _floating(n):  # counts and offsets (a grouped expert dispatch's histc, cumsum) only order the work
            continue
        elif not rows_per_sample(n) and source is not None:
            statistic[n] = source
        elif n.meta.get("batch_free") and any(rows_per_sample(a) for a in inputs) and not (function and shape_only(n)):
            statistic[n] = n
    return notes + [_with_statistic(s, user) for s, user in readers.items()]


def _along_batch_notes(n: fx.Node) -> list[str]:
    """An op's notes for rows it moves, normalises, sorts or scans along the batch, or computes with the batch size."""
    notes = []
    if _reorders_batch(n):
        notes.append(_moves_rows(n))
    if _along_batch(n, _NORMALISES):
        notes.append(_normalises(n))
    if _along_batch(n, _SCANS):
        notes.append(_scans(n))
    size = next((a.name for a in n.args if isinstance(a, fx.Node) and a.meta.get("batch_number")),
                "a literal" if n.meta.get("batch_literal") else None)  # trace's facts
    arithmetic = op_name(n.target) in _ARITHMETIC or isinstance(n.target, FunctionCall)
    if rows_per_sample(n) and arithmetic and size is not None:
        notes.append(_with_batch_size(n, size))
    return notes


def _reorders_batch(n: fx.Node) -> bool:
    """``torch.flip`` or ``torch.roll`` of batch rows along dim 0 (a roll without dims rolls the flattened tensor)."""
    name, source = op_name(n.target), n.args[0] if n.args else None
    if name not in ("flip", "roll") or not rows_per_sample(source):
        return False
    if name == "flip":  # torch.flip(x, (0,)), x.flip(0, 1), aten.flip(x, [0])
        rest = n.kwargs.get("dims", n.args[1:])
        dims = rest[0] if isinstance(rest, tuple) and len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
    else:
        dims = n.kwargs.get("dims", n.args[2] if len(n.args) > 2 else None)
        if dims is None or dims == []:
            return True
    ndim = source.meta["val"].dim()
    return any(isinstance(d, int) and d % ndim == 0 for d in ([dims] if isinstance(dims, int) else dims))


def _along_batch(n: fx.Node, ops: tuple[str, ...]) -> bool:
    """One of ``ops`` (cumsum, softmax, ...) along dim 0 of batch rows."""
    source = n.args[0] if n.args else None
    if op_name(n.target) not in ops or not rows_per_sample(source):
        return False
    dim = (bind(n.target, n.args, n.kwargs) or {}).get("dim")
    return isinstance(dim, int) and dim % max(source.meta["val"].dim(), 1) == 0


def _floating(n: fx.Node) -> bool:
    return isinstance(v := n.meta.get("val"), torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _value_inputs(n: fx.Node) -> list[fx.Node]:
    """The inputs whose values an op reads: ``x.type_as(y)`` and ``x.to(y)`` read only y's dtype and device."""
    first = n.args[0] if n.args else None
    return [first] if op_name(n.target) in ("type_as", "to") and isinstance(first, fx.Node) else n.all_input_nodes
