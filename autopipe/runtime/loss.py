"""The user's loss in ``pipe.step``: run per micro-batch on the last stage, right after its forward, and
weighted so that the micro-batches' losses add up to the plain model's loss (docs/architecture.md, "Losses")."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

if TYPE_CHECKING:
    from .executor import Transport


@dataclass
class Loss:
    """The user's loss, run per micro-batch right after the last stage's forward (``pipe.step``);
    it must be known per micro-batch for 1F1B-style schedules to start backward early."""

    fn: Callable[[Any, Any], torch.Tensor]
    rebuild: Callable[[list], Any]      # flat outputs -> the model's output structure
    targets: Sequence[Any]              # per micro-batch
    weights: Sequence[float]            # micro-batch size / batch size
    last_stage: int
    values: dict[int, torch.Tensor] = field(default_factory=dict, init=False)  # micro-batch -> its weighted loss, once run

    def run(self, i: int, transport: Transport) -> None:
        leaves = [v.detach().requires_grad_(True) if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
                  else v for v in transport.finals(i)]
        device = next((v.device for v in leaves if isinstance(v, torch.Tensor)), None)
        target = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) and device else t,
                                 self.targets[i])  # on the last stage's device, which the caller need not know
        with torch.enable_grad():
            loss = self.fn(self.rebuild(leaves), target)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError(f"pipe.step needs loss_fn to return a scalar tensor (got {type(loss).__name__} {getattr(loss, 'shape', '')})")
            loss = loss * self.weights[i]
            wrt = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.requires_grad]
            got = torch.autograd.grad(loss, [leaves[k] for k in wrt], allow_unused=True) if loss.requires_grad else ()
        self.values[i] = loss.detach()
        grads = dict(zip(wrt, got))
        transport.send_final_grads(i, [grads.get(k) for k in range(len(leaves))])

    @property
    def total(self) -> torch.Tensor:
        return sum(v for _, v in sorted(self.values.items()))
