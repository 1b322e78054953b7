"""The user's loss in ``pipe.step``: run per micro-batch on the last stage, right after its forward, and weighted so
that the micro-batches' losses add up to the plain model's loss (docs/architecture.md, "A step in process").

A mean over samples weighs each micro-batch by its share of the rows. A mean-reduced cross-entropy or NLL loss
divides by the targets it does not ignore (``ignore_index=-100``, class weights): each such call inside ``loss_fn``
is counted before the step, so that 1F1B's first backward already has its weight, and at the step it becomes its
sum over the whole batch's count (Note [means at the step], runtime/loss_counts.py). A 0-dim output the model
merges other than by rows (its own loss: a sum, a mean over counted targets) is weighed as pipe(x) merges it, also
inside an expression of ``loss_fn`` (Note [model losses in loss_fn]). A loss that returns ``(sum, count)`` is
backpropagated as the sum, and the step's gradients are divided by the whole count at the end, as Megatron-LM's
``calculate_per_token_loss`` does (``finalize_model_grads``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence

import torch
import torch.utils._pytree as pytree

from . import microbatch
from .loss_counts import CallCounts, MeansAtStep, check_counts, count_ahead

if TYPE_CHECKING:
    from autopipe.ir.plan import Plan


# Note [model losses in loss_fn]: loss_fn may read a loss the model computes (``out.loss``) inside an expression
# (``2 * out.loss``, ``out.loss + aux``), where the loss loss_fn returns is weighed by the micro-batch's share of the
# rows. A loss the model sums (merged by 1) or means over counted targets (by its share of the counts) enters loss_fn
# times its merge weight over that share, so a sum of it and other terms with constant coefficients is the plain
# model's; returned as it is, it is weighed by its merge weight directly. Other 0-dim outputs enter as they are: one
# no batch input reaches (a temperature, CLIP's logit scale) is the same in every micro-batch, and a per-sample loss
# using it is weighed by rows.


class _Finals(Protocol):
    """The part of executor.py's Transport the loss uses: a micro-batch's flat outputs, and where their gradients go."""

    def finals(self, micro_batch: int) -> list: ...
    def send_final_grads(self, micro_batch: int, grads: list) -> None: ...


@dataclass
class Loss:
    """The user's loss, run per micro-batch right after the last stage's forward (``pipe.step``);
    it must be known per micro-batch for 1F1B-style schedules to start backward early.

    Contract: ``fn(output, target)`` runs once per micro-batch at the step and, unless it is torch's loss itself or
    there is one micro-batch, once per micro-batch before the step on meta stand-ins of that micro-batch's outputs
    (with its real target), to count the targets of each mean-reduced cross-entropy / NLL call it makes (Note [means
    at the step]). It must be a pure function of its arguments: its side effects happen twice, and the step checks the
    counts it meets against those, refusing where they differ."""

    fn: Callable[[Any, Any], Any]
    rebuild: Callable[[list], Any]      # flat outputs -> the model's output structure
    targets: Sequence[Any]              # per micro-batch
    sizes: Sequence[int]                # rows per micro-batch
    plan: Plan                          # the last stage's: each flat output's merge facts
    output_counts: Sequence[dict[str, float]]  # per micro-batch: an output merged by count -> its count of targets
    values: dict[int, torch.Tensor] = field(default_factory=dict, init=False)  # micro-batch -> its weighted loss
    counts: dict[int, float] = field(default_factory=dict, init=False)  # micro-batch -> its count, for (sum, count)
    call_counts: CallCounts = field(init=False)  # the mean calls' counts of targets, taken before the step
    seen: dict[int, list] = field(default_factory=dict, init=False)  # micro-batch weighed by rows -> its calls

    def __post_init__(self):
        self.call_counts = count_ahead(self.fn, self.rebuild, self.plan, self.targets, self.sizes)

    def run(self, i: int, transport: _Finals) -> None:
        leaves = [_leaf(v) for v in transport.finals(i)]  # the loss's graph starts at the model's outputs
        device = next((v.device for v in leaves if isinstance(v, torch.Tensor)), None)
        target = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) and device else t,
                                 self.targets[i])  # on the last stage's device, which the caller need not know
        means = MeansAtStep(self.call_counts, i, self.sizes[i] / sum(self.sizes))
        with torch.enable_grad():
            outputs = leaves if self.call_counts.returns_pair else self._merge_weighted(i, leaves, means.rows_share)
            with means:
                loss = self.fn(self.rebuild(outputs), target)
        means.check_calls()
        with torch.enable_grad():
            loss, weight = self._weighted(i, loss, leaves, outputs, means)
            wrt = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.requires_grad]
            if not weight:  # a mean over no targets (nan in the plain model's terms, weighted 0 there too)
                loss, got = torch.zeros_like(loss.detach()), [torch.zeros_like(leaves[k]) for k in wrt]
            else:
                loss = loss * weight
                wrt_leaves = [leaves[k] for k in wrt]
                got = torch.autograd.grad(loss, wrt_leaves, allow_unused=True) if loss.requires_grad else ()
        self.values[i] = loss.detach()
        if len(self.values) == len(self.sizes):  # the last loss of the step: before its backward, and before .grad
            check_counts(self.call_counts, self.seen, self.sizes)
        grads = dict(zip(wrt, got))
        transport.send_final_grads(i, [grads.get(k) for k in range(len(leaves))])

    def _merge_weights(self, name: str) -> list[float] | None:
        """Each micro-batch's weight in pipe(x)'s merge of 0-dim output ``name``; None for other outputs."""
        info = self.plan.tensors.get(name)
        if info is None or info.shape != ():
            return None
        counts = [c[name] for c in self.output_counts] if info.scalar_merge == "count" else None
        return microbatch.scalar_weights(list(self.sizes), info, counts)

    def _merge_weighted(self, i: int, leaves: list, rows_share: float) -> list:
        """The outputs loss_fn reads (Note [model losses in loss_fn]): a loss the model sums or means over counted
        targets, times its merge weight over ``rows_share``; zero where that weight is 0 (a mean over no targets)."""
        outputs = list(leaves)
        for k, (name, leaf) in enumerate(zip(self.plan.graph_outputs, leaves)):
            info = self.plan.tensors.get(name)
            if info is None or info.scalar_merge not in ("sum", "count") or info.batch_free:
                continue
            weights = self._merge_weights(name)
            if weights is not None and not math.isclose(weights[i], rows_share):
                outputs[k] = leaf * (weights[i] / rows_share) if weights[i] else torch.zeros_like(leaf.detach())
        return outputs

    def _weighted(self, i: int, loss: Any, leaves: list, outputs: list,
                  means: MeansAtStep) -> tuple[torch.Tensor, float]:
        """The micro-batch's loss and the weight that makes the weighted losses add up to the plain model's."""
        if isinstance(loss, (tuple, list)) and len(loss) == 2:
            loss, count = loss
            if isinstance(count, torch.Tensor) and count.requires_grad:
                raise TypeError("pipe.step: loss_fn returned (sum, count) with a count that requires grad; return the "
                                "number of targets the sum is over (e.g. (target != -100).sum())")
            if self.values and not self.counts:
                raise TypeError(_MIXED_RETURNS)
            if any(o is not v for o, v in zip(outputs, leaves)):  # the run before the step did not see the pair
                raise TypeError(f"pipe.step: loss_fn returned (sum, count) at the step, not when run before it on meta "
                                f"stand-ins, and reads a 0-dim output the model merges by count or sum: make it run on "
                                f"meta tensors ({_SEE})")
            self.counts[i] = float(count)
            _check_scalar(loss)
            return loss, 1.0  # the step divides every gradient by the whole count
        _check_scalar(loss)
        if self.counts:
            raise TypeError(_MIXED_RETURNS)
        k = next((k for k, v in enumerate(outputs) if v is loss), None)  # the model's own loss, as model_loss gives it
        weights = self._merge_weights(self.plan.graph_outputs[k]) if k is not None else None
        if weights is not None:  # weighted as pipe(x) merges that output
            return leaves[k], weights[i]
        self.seen[i] = means.calls  # checked with the step's last loss
        return loss, means.rows_share

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


_SEE = "docs/faithfulness.md#a-loss-given-to-pipestep"
_MIXED_RETURNS = "pipe.step: loss_fn returned (sum, count) for some micro-batches and a single loss for others"


def _leaf(value: Any) -> Any:
    floating = isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())
    return value.detach().requires_grad_(True) if floating else value


def _check_scalar(loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError(f"pipe.step needs loss_fn to return a scalar tensor, or (sum, count) (got "
                        f"{type(loss).__name__} {getattr(loss, 'shape', '')})")
