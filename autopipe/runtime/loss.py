"""The user's loss in ``pipe.step``: run per micro-batch on the last stage, right after its forward, and weighted so
that the micro-batches' losses add up to the plain model's loss (docs/architecture.md, "Losses").

A mean over samples weighs each micro-batch by its share of the rows. A mean over the targets a loss does not ignore
(cross-entropy's default ``ignore_index=-100``) weighs each by its share of those targets: counted before the step for
torch's own cross-entropy and NLL losses and for a model output merged by count, so that 1F1B's first backward already
has its weight. A loss that returns ``(sum, count)`` is backpropagated as the sum, and the step's gradients are divided
by the whole count at the end, as Megatron-LM's ``calculate_per_token_loss`` does (``finalize_model_grads``)."""
from __future__ import annotations

import contextlib
import functools
import inspect
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

from . import microbatch

if TYPE_CHECKING:
    from autopipe.plan import Plan


class _Finals(Protocol):
    """The part of executor.py's Transport the loss uses: a micro-batch's flat outputs, and where their gradients go."""

    def finals(self, micro_batch: int) -> list: ...
    def send_final_grads(self, micro_batch: int, grads: list) -> None: ...


@dataclass
class Loss:
    """The user's loss, run per micro-batch right after the last stage's forward (``pipe.step``);
    it must be known per micro-batch for 1F1B-style schedules to start backward early."""

    fn: Callable[[Any, Any], Any]
    rebuild: Callable[[list], Any]      # flat outputs -> the model's output structure
    targets: Sequence[Any]              # per micro-batch
    sizes: Sequence[int]                # rows per micro-batch
    plan: Plan                          # the last stage's: each flat output's merge facts
    output_counts: Sequence[dict[str, float]]  # per micro-batch: an output merged by count -> its count of targets
    values: dict[int, torch.Tensor] = field(default_factory=dict, init=False)  # micro-batch -> its weighted loss
    counts: dict[int, float] = field(default_factory=dict, init=False)  # micro-batch -> its count, for (sum, count)
    target_shares: list[float] | None = field(default=None, init=False)  # torch's cross-entropy: counts over the total

    def __post_init__(self):
        if (how := _target_mean(self.fn)) is not None:
            counts = [_count_targets(t, *how) if isinstance(t, torch.Tensor) and not t.is_floating_point() else None
                      for t in self.targets]
            if None not in counts:
                self.target_shares = microbatch.count_shares(counts, self.sizes)

    def run(self, i: int, transport: _Finals) -> None:
        leaves = [_leaf(v) for v in transport.finals(i)]  # the loss's graph starts at the model's outputs
        device = next((v.device for v in leaves if isinstance(v, torch.Tensor)), None)
        target = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) and device else t,
                                 self.targets[i])  # on the last stage's device, which the caller need not know
        with torch.enable_grad(), _TargetMeans() if self.target_shares is None else contextlib.nullcontext() as seen:
            loss = self.fn(self.rebuild(leaves), target)
        with torch.enable_grad():
            loss, weight = self._weighted(i, loss, leaves, seen)
            wrt = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.requires_grad]
            if not weight:  # a mean over no targets (nan in the plain model's terms, weighted 0 there too)
                loss, got = torch.zeros_like(loss.detach()), [torch.zeros_like(leaves[k]) for k in wrt]
            else:
                loss = loss * weight
                wrt_leaves = [leaves[k] for k in wrt]
                got = torch.autograd.grad(loss, wrt_leaves, allow_unused=True) if loss.requires_grad else ()
        self.values[i] = loss.detach()
        grads = dict(zip(wrt, got))
        transport.send_final_grads(i, [grads.get(k) for k in range(len(leaves))])

    def _weighted(self, i: int, loss: Any, leaves: list, seen: _TargetMeans) -> tuple[torch.Tensor, float]:
        """The micro-batch's loss and the weight that makes the weighted losses add up to the plain model's."""
        if isinstance(loss, (tuple, list)) and len(loss) == 2:
            loss, count = loss
            if isinstance(count, torch.Tensor) and count.requires_grad:
                raise TypeError("pipe.step: loss_fn returned (sum, count) with a count that requires grad; return the "
                                "number of targets the sum is over (e.g. (target != -100).sum())")
            if self.values and not self.counts:
                raise TypeError(_MIXED_RETURNS)
            self.counts[i] = float(count)
            _check_scalar(loss)
            return loss, 1.0  # the step divides every gradient by the whole count
        _check_scalar(loss)
        if self.counts:
            raise TypeError(_MIXED_RETURNS)
        if self.target_shares is not None:
            return loss, self.target_shares[i]
        k = next((k for k, v in enumerate(leaves) if v is loss), None)  # the model's own loss, as model_loss returns it
        name = self.plan.graph_outputs[k] if k is not None else None
        info = self.plan.tensors.get(name) if name is not None else None
        if info is not None:  # weighted as pipe(x) merges that output
            counts = [c[name] for c in self.output_counts] if info.scalar_merge == "count" else None
            return loss, microbatch.scalar_weights(list(self.sizes), info, counts)[i]
        if seen.uneven:
            raise ValueError(_uneven_message(seen.uneven))
        return loss, self.sizes[i] / sum(self.sizes)

    @property
    def last_stage(self) -> int:
        return self.plan.n_stages - 1

    @property
    def grad_scale(self) -> float | None:
        """What the step's gradients are multiplied by at the end: 1 / the whole count, for a loss returning
        (sum, count)."""
        if not self.counts:
            return None
        total = sum(self.counts.values())
        return 1.0 / total if total else math.nan  # no target in the whole batch: nan, as the plain model's sum / 0

    @property
    def total(self) -> torch.Tensor:
        total = sum(v for _, v in sorted(self.values.items()))
        return total * self.grad_scale if self.counts else total


def scaled(pairs: list[tuple[torch.nn.Parameter, torch.Tensor | None]],
           scale: float | None) -> list[tuple[torch.nn.Parameter, torch.Tensor | None]]:
    """A step's (parameter, gradient) pairs multiplied by ``scale`` (Loss.grad_scale), where there is one."""
    return pairs if scale is None else [(p, g if g is None else g * scale) for p, g in pairs]


_MIXED_RETURNS = "pipe.step: loss_fn returned (sum, count) for some micro-batches and a single loss for others"


def _leaf(value: Any) -> Any:
    floating = isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())
    return value.detach().requires_grad_(True) if floating else value


def _check_scalar(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(f"pipe.step needs loss_fn to return a scalar tensor, or (sum, count) (got "
                        f"{type(loss).__name__} {getattr(loss, 'shape', '')})")


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


def _count_targets(target: torch.Tensor, ignore_index: int, weight: torch.Tensor | None) -> float:
    """What torch's mean-reduced NLL loss divides by (its ``total_weight``): the targets not ignored, each weighed by
    its class's weight."""
    valid = target != ignore_index
    if weight is not None:
        return float((weight.to(target.device)[torch.where(valid, target, 0)] * valid).sum())
    return float(valid.sum())


class _TargetMeans(TorchFunctionMode):
    """Notes a mean-reduced cross-entropy or NLL loss inside ``loss_fn`` whose divisor is not its number of targets
    (ignored targets, class weights): weighed by rows, such micro-batch means do not add up to the plain model's."""

    def __init__(self):
        super().__init__()
        self.uneven: tuple[str, float, int] | None = None  # (function, count, targets)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.uneven is None and func in (F.cross_entropy, F.nll_loss):
            arguments = inspect.signature(func).bind(*args, **kwargs).arguments
            how, target = _mean_over_targets(arguments), arguments.get("target")
            if how is not None and isinstance(target, torch.Tensor) and not target.is_floating_point():
                with torch.no_grad():
                    count = _count_targets(target, *how)
                if count != target.numel():
                    self.uneven = (func.__name__, count, target.numel())
        return func(*args, **kwargs)


def _uneven_message(uneven: tuple[str, float, int]) -> str:
    name, count, n = uneven
    return (f"pipe.step: loss_fn calls {name} with reduction='mean', which divides by the targets it does not ignore "
            f"({count:g} of {n} in this micro-batch; ignore_index or class weights), so per micro-batch means weighted "
            f"by rows are not the plain model's loss. Pass loss_fn=F.{name} (or its nn module) itself, flattening in "
            f"the model, or return (sum, count): e.g. lambda out, y: (F.{name}(out, y, reduction='sum'), "
            f"(y != -100).sum())")
