"""The targets each mean-reduced cross-entropy / NLL call of a ``pipe.step`` loss divides by (torch's
``total_weight``: the targets not ignored, class-weighted), per micro-batch: counted before the step, so that 1F1B's
first backward already has its weight, by a run of the loss on meta stand-ins of the model's outputs with the real
targets; and checked at the step (Note [means at the step]). runtime/loss.py weighs the losses with them."""
from __future__ import annotations

import functools
import inspect
import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

if TYPE_CHECKING:
    from autopipe.ir.plan import Plan


# Note [means at the step]: a mean-reduced F.cross_entropy / F.nll_loss divides by its targets not ignored (torch's
# total_weight), which differ between micro-batches. Every such call loss_fn makes is counted before the step (a dry
# run of loss_fn on meta stand-ins of the outputs, the targets real: count_ahead), and at the step call k of micro-batch
# i returns its sum / (the whole batch's count of call k x i's share of the rows), the loss being weighed by that share:
# so any sum of such means, and of means over samples (weighed by rows as they are), with constant coefficients is the
# plain model's. A call whose target the dry run could not count (computed from the outputs) runs as it is, weighed by
# rows; with the step's last loss, its count per row must be the same in every micro-batch, or the step is refused.


@dataclass
class CallCounts:
    """What a run of loss_fn before the step found: each mean-reduced cross-entropy / NLL call's count of targets,
    ``per_micro_batch[i][k]`` (None: a call whose target is not known before the step), and why a call is not
    counted. ``verify``: the step checks its counts against these (not for torch's loss passed as it is).
    ``returns_pair``: loss_fn returned (sum, count) there."""

    per_micro_batch: list[list[float | None]] | None = None  # None: the calls were not found before the step
    why: str = ""
    verify: bool = True
    returns_pair: bool = False

    @property
    def known(self) -> bool:
        return self.per_micro_batch is not None and all(c is not None for r in self.per_micro_batch for c in r)

    def whole(self, k: int) -> float | None:
        """Call ``k``'s count over the whole batch; None where a micro-batch's is unknown."""
        column = [row[k] for row in self.per_micro_batch or ()]
        return None if not column or None in column else sum(column)


def count_ahead(fn: Callable, rebuild: Callable[[list], Any], plan: Plan, targets: Sequence[Any],
                sizes: Sequence[int]) -> CallCounts:
    """The counts of targets of ``fn``'s mean calls in each micro-batch (Note [means at the step]): from the targets
    for torch's loss itself, else from a run of ``fn`` per micro-batch on meta stand-ins of the outputs (with warnings
    silenced and the CPU random state restored); no counts where that run fails or ``fn`` returns (sum, count), nor
    for one micro-batch, whose mean is the plain model's as it is; no run for torch's own losses."""
    if len(sizes) == 1:
        return CallCounts()
    if (how := _target_mean(fn)) is not None:  # torch's loss: its target is the micro-batch's
        if all(isinstance(t, torch.Tensor) and not t.is_floating_point() for t in targets):
            return CallCounts(_as_floats([[_target_total(t, *how)] for t in targets]), verify=False)
        return CallCounts()
    module = type(fn).__module__ if isinstance(fn, torch.nn.Module) else getattr(fn, "__module__", None)
    if module in ("torch.nn.functional", "torch.nn.modules.loss"):  # torch's other losses: no mean over targets
        return CallCounts([[] for _ in targets], verify=False)
    rows = []
    with torch.no_grad(), torch.random.fork_rng(devices=[]), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for target, size in zip(targets, sizes):
            outputs = _stand_ins(plan, size)
            if outputs is None:
                return CallCounts(why="an output's micro-batch shape is unknown")
            dry = _DryRun()
            try:
                with dry:
                    result = fn(rebuild(outputs), target)
            except Exception as e:  # noqa: BLE001 -- the step runs loss_fn for real, and raises there if it must
                return CallCounts(why=f"on meta stand-ins: {(str(e).splitlines() or [type(e).__name__])[0][:48]}")
            if isinstance(result, (tuple, list)):  # (sum, count): the step divides by the whole count
                return CallCounts(returns_pair=True)
            rows.append(dry.counts)
    if len({len(r) for r in rows}) > 1:
        return CallCounts(why="its calls differ between micro-batches")
    known = [all(c is not None for c in column) for column in zip(*rows)]
    rows = [[c if known[k] else None for k, c in enumerate(r)] for r in rows]
    return CallCounts(_as_floats(rows), "" if all(known) else "its target comes from the model's output")


def _stand_ins(plan: Plan, rows: int) -> list[torch.Tensor] | None:
    """Meta tensors of the shapes of a micro-batch's flat outputs at ``rows`` samples; None where an output has no
    such shape known before the step (a Python value, rows a mask selects)."""
    outputs = []
    for name in plan.graph_outputs:
        info = plan.tensors.get(name)
        if info is None or info.kind != "tensor" or info.selected_rows:
            return None
        shape = (info.rows_per_sample * rows, *info.shape[1:]) if info.batched and not info.batch_free else info.shape
        outputs.append(torch.empty(shape, dtype=info.dtype, device="meta"))
    return outputs


def _as_floats(rows: list[list[torch.Tensor | None]]) -> list[list[float | None]]:
    """The counts as numbers, with one host sync a device."""
    tensors = [c for r in rows for c in r if c is not None]
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for c in tensors:
        by_device.setdefault(c.device, []).append(c)
    value = {id(c): v for group in by_device.values()
             for c, v in zip(group, torch.stack([c.double() for c in group]).tolist())}
    return [[None if c is None else value[id(c)] for c in r] for r in rows]


_SIGNATURES = {f: inspect.signature(f) for f in (F.cross_entropy, F.nll_loss)}


def _mean_call(func: Any, args: tuple, kwargs: dict) -> tuple[inspect.BoundArguments, tuple] | None:
    """A call of F.cross_entropy / F.nll_loss reducing by the mean over class-index targets: its bound arguments and
    (ignore_index, class weights); None for any other call."""
    if func not in _SIGNATURES:
        return None
    try:
        bound = _SIGNATURES[func].bind(*args, **kwargs)
    except TypeError:
        return None  # the call raises its own error
    how, target = _mean_over_targets(bound.arguments), bound.arguments.get("target")
    if how is None or not isinstance(target, torch.Tensor) or target.is_floating_point():
        return None  # a sum, or class probabilities (a mean over rows)
    return bound, how


def _is_meta(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta


def _names_meta(value: Any) -> bool:
    return isinstance(value, (str, torch.device)) and torch.device(value).type == "meta"


def _to_meta(value: Any) -> Any:
    return value.to("meta") if isinstance(value, torch.Tensor) and not value.is_meta else value


class _DryRun(TorchFunctionMode):
    """loss_fn before the step, on meta stand-ins of the outputs: a mean call is counted from its real target
    argument (None where the target is meta, computed from the outputs) and returns a meta stand-in of its result; a
    real tensor moved to a stand-in's device stays real; an op on a stand-in and a real tensor runs on meta."""

    def __init__(self):
        super().__init__()
        self.counts: list[torch.Tensor | None] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (call := _mean_call(func, args, kwargs)) is not None:
            bound, (ignore_index, weight) = call
            target = bound.arguments["target"]
            real = not _is_meta(target) and not _is_meta(weight)
            self.counts.append(_target_total(target, ignore_index, weight) if real else None)
            return torch.empty((), dtype=bound.arguments["input"].dtype, device="meta")
        if func is torch.Tensor.to and not _is_meta(args[0]):  # labels.to(logits.device): counted as they are
            args, kwargs = [args[0].device if _names_meta(a) else a for a in args], \
                {key: args[0].device if _names_meta(a) else a for key, a in kwargs.items()}
        try:
            return func(*args, **kwargs)
        except (RuntimeError, NotImplementedError):
            if not any(map(_is_meta, pytree.tree_leaves((args, kwargs)))):
                raise
            return func(*pytree.tree_map(_to_meta, args), **pytree.tree_map(_to_meta, kwargs))


class MeansAtStep(TorchFunctionMode):
    """loss_fn at the step for micro-batch ``i``: each mean call is kept with its count of targets (a device tensor,
    checked with the step's last loss) and, where counted before the step, returns its sum over the whole batch's
    count, over ``rows_share`` (Note [means at the step])."""

    def __init__(self, call_counts: CallCounts, i: int, rows_share: float):
        super().__init__()
        self.call_counts, self.i, self.rows_share = call_counts, i, rows_share
        counts = call_counts.per_micro_batch
        self.expected = counts[i] if counts is not None else None
        self.calls: list[tuple[str, torch.Tensor | None]] = []  # (function, its count of targets), in call order

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if (call := _mean_call(func, args, kwargs)) is None:
            return func(*args, **kwargs)
        bound, how = call
        k = len(self.calls)
        if self.expected is not None and k >= len(self.expected):
            raise ValueError(_changed_message(f"made more than {k} mean {func.__name__} calls", self.i, str(k)))
        checked = self.call_counts.verify or self.expected is None or self.expected[k] is None
        with torch.no_grad():  # torch's loss passed as it is has its counts from its own target
            self.calls.append((func.__name__, _target_total(bound.arguments["target"], *how) if checked else None))
        if self.expected is None:
            return func(*args, **kwargs)
        whole = self.call_counts.whole(k)
        if not whole:  # not counted ahead, or no target in the whole batch (nan, as in the plain model)
            return func(*args, **kwargs)
        bound.arguments["reduction"] = "sum"
        return func(*bound.args, **bound.kwargs) / (whole * self.rows_share)

    def check_calls(self) -> None:
        if self.expected is not None and len(self.calls) != len(self.expected):
            raise ValueError(_changed_message(f"made {len(self.calls)} mean cross_entropy/nll_loss calls", self.i,
                                              str(len(self.expected))))


def check_counts(call_counts: CallCounts, seen: dict[int, list[tuple[str, torch.Tensor | None]]],
                 sizes: Sequence[int]) -> None:
    """After a step's last loss (one host sync): each mean call of the micro-batches weighed by rows (``seen``: their
    calls, as MeansAtStep kept them) counted before the step met that count at the step, and each other one has the
    same count of targets per row in every micro-batch, without which no weight by rows makes its mean the plain
    model's. Raises ValueError otherwise."""
    if not call_counts.verify and call_counts.known:
        return
    order = sorted(seen)
    tensors = [c for i in order for _, c in seen[i]]
    if not tensors:
        return
    found = iter(torch.stack([c.to(tensors[0].device, torch.float64) for c in tensors]).tolist())
    unknown: dict[int, list[tuple[str, float]]] = {}
    for i in order:
        counts = call_counts.per_micro_batch
        expected = counts[i] if counts is not None else [None] * len(seen[i])
        for (name, _), want in zip(seen[i], expected):
            got = next(found)
            if want is None:
                unknown.setdefault(i, []).append((name, got))
            elif call_counts.verify and not math.isclose(got, want, rel_tol=1e-9):
                raise ValueError(_changed_message(f"gave {name} {got:g} targets", i, f"{want:g}"))
    per_row = [[c / sizes[i] for _, c in unknown.get(i, [])] for i in order]
    if any(len(r) != len(per_row[0]) or not all(map(math.isclose, r, per_row[0])) for r in per_row):
        name = next(iter(unknown.values()))[0][0]
        why = call_counts.why or "not found before the step"
        raise ValueError(_uneven_message(name, [r[0] if r else 0.0 for r in per_row], why))


def _target_mean(fn: Any) -> tuple[int, torch.Tensor | None] | None:
    """(ignore_index, class weights) where ``fn`` is torch's cross-entropy or NLL loss reducing by the mean over its
    targets (the function, a module, or a functools.partial of the function); None otherwise."""
    if isinstance(fn, (torch.nn.CrossEntropyLoss, torch.nn.NLLLoss)):
        return (fn.ignore_index, fn.weight) if fn.reduction == "mean" else None
    if isinstance(fn, functools.partial) and not fn.args and fn.func in (F.cross_entropy, F.nll_loss):
        return _mean_over_targets(fn.keywords)
    return _mean_over_targets({}) if fn in (F.cross_entropy, F.nll_loss) else None


def _mean_over_targets(arguments: dict[str, Any]) -> tuple[int, torch.Tensor | None] | None:
    """(ignore_index, weight) of a call of F.cross_entropy / F.nll_loss with these keyword arguments, if it reduces
    by the mean."""
    if arguments.get("reduction", "mean") != "mean" or arguments.get("size_average") is not None \
            or arguments.get("reduce") is not None:
        return None
    return arguments.get("ignore_index", -100), arguments.get("weight")


def _target_total(target: torch.Tensor, ignore_index: int, weight: torch.Tensor | None) -> torch.Tensor:
    """What torch's mean-reduced NLL loss divides by (its ``total_weight``), on the target's device: the targets not
    ignored, each weighed by its class's weight."""
    valid = target != ignore_index
    if weight is not None:
        return (weight.to(target.device)[torch.where(valid, target, 0)] * valid).sum()
    return valid.sum()


_SEE = "docs/faithfulness.md#a-loss-given-to-pipestep"


def _changed_message(what: str, i: int, before: str) -> str:
    return (f"pipe.step: loss_fn {what} in micro-batch {i} at the step, {before} when autopipe ran it before the step "
            f"to count targets: make loss_fn a pure function of (output, target) ({_SEE})")


def _uneven_message(name: str, per_row: list[float], why: str) -> str:
    return (f"pipe.step: loss_fn's {name} means over {min(per_row):g} to {max(per_row):g} targets a row across "
            f"micro-batches, uncounted before the step ({why}); by rows it is not the plain loss. Return (sum, count): "
            f"{_SEE}")
