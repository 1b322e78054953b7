"""FSDP2 over a rank's stages: ``fully_shard`` over the mesh's ``dp_shard`` (and ``dp_replicate``) dims, the
parameters gathered once a step and the gradients reduce-scattered once, after the step's last backward; the tied
weights' gradients summed over the ranks that hold them. docs/architecture.md, "Under torchrun".

Note [FSDP2 driven by the step]: a stage runs M micro-batches a step, each forward and backward of its own. FSDP2's
hooks would gather the parameters before each forward and reduce the gradients after each backward; instead, as
torch.distributed.pipelining's stage drives it (torch/distributed/pipelining/stage.py: UNSHARD,
``backward_maybe_with_nosync``, ``perform_reduce_grad``), the step unshards once at its start, runs every task with
``set_requires_gradient_sync(False)`` / ``set_reshard_after_backward(False)`` and ``reshard_after_forward=False``, and
at its end hands the summed gradients to the unsharded parameters and runs each parameter group's ``post_backward``
(the reduce-scatter, and the all-reduce over ``dp_replicate``) and the root's ``_root_post_backward_final_callback``
(which waits for them): the private hooks pipelining calls, for the reason its comment gives (it does not call
``.backward()`` the way FSDP2 expects). The stages' tasks differentiate the unsharded parameters themselves
(runtime/task.py, ``take_parameters``) and sum the micro-batches' gradients as without FSDP2. All of a rank's stages
are one FSDP2 group: a weight two of them share (interleaved, zbv) stays one parameter.

Note [one FSDP2 root over a rank's stages]: ``fully_shard`` is applied to a container of the rank's stages that no
one calls, not to the stages: FSDP2 refuses a group of several modules as a root the first time one of them runs
("FSDP requires a single root module"), and its forward hooks on a stage would gather and reduce per micro-batch,
which the step does itself once (Note [FSDP2 driven by the step]). The container is not part of the pipeline's
module tree: the stages' parameters keep the model's names (runtime/checkpoint.py). Its lazy initialisation, which
FSDP2 runs in the root's first forward, is called at once.

Note [programs after the first under FSDP2]: FSDP2 manages the parameters of the first program's stage modules: it
registers the gathered parameters on them for a step and the shards between steps. A later input signature's stages
(their own modules, holding the shards as the model does) follow those swaps by identity, at the gather and at the
reshard, so their tasks differentiate the gathered parameters and the reduction sees their gradients.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from .materialize import rebind, tables

__all__ = ["ShardedStages", "sharded_by_the_user", "refuse_fsdp_on_top", "grads_before", "sum_tied"]


def sharded_by_the_user(module: torch.nn.Module, what: str) -> str | None:
    """A description of FSDP2 (or a DTensor parameter) the user applied to ``module``, which autopipe's own
    sharding would wrap again; None where there is none."""
    for name, m in module.named_modules():
        if isinstance(m, FSDPModule):
            return f"{what}{'.' + name if name else ''} is already an FSDP2 module (fully_shard)"
    for name, p in module.named_parameters():
        if is_dtensor(p):
            return f"{what}'s parameter {name} is already a DTensor"
    return None


def is_dtensor(t: torch.Tensor) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "to_local")


def refuse_fsdp_on_top(pipe: torch.nn.Module, stages: list[torch.nn.Module]) -> None:
    """FSDP2 the user applied to the pipeline or a stage after compile, over autopipe's own: refused, naming it.
    autopipe's own shards the stages' root, never a stage (Note [one FSDP2 root over a rank's stages])."""
    wrapped = "the pipeline" if isinstance(pipe, FSDPModule) else next(
        (f"stage {s.index}" for s in stages if isinstance(s, FSDPModule)), None)
    if wrapped is not None:
        raise ValueError(f"{wrapped} is wrapped in FSDP2 (fully_shard) by the caller: autopipe shards each stage "
                         f"itself over the mesh's 'dp_shard' dim; drop your fully_shard (docs/torchrun.md)")


class _StagesRoot(torch.nn.Module):
    """The one module FSDP2 shards over a rank's stages (Note [one FSDP2 root over a rank's stages]); never called."""

    def __init__(self, stages: list[torch.nn.Module]):
        super().__init__()
        self.stages = torch.nn.ModuleList(stages)

    def forward(self, *args, **kwargs):
        raise RuntimeError("the stages run one by one, never through their FSDP2 root")


class ShardedStages:
    """This rank's stages under FSDP2 over ``mesh``: one group, gathered and reduced once a step (Note [FSDP2 driven
    by the step]). The model's own slots, and those of ``elsewhere`` (the traced graph), hold the sharded parameters
    afterwards: the export route's stages hold the parameters in containers of their own."""

    def __init__(self, stages: list[torch.nn.Module], mesh: DeviceMesh, holders: Iterable[torch.nn.Module]):
        self.stages = stages
        before = [(table, name, p) for table, name, p in tables(m for s in stages for m in s.modules())
                  if isinstance(p, torch.nn.Parameter)]
        self.root = _StagesRoot(stages)  # Note [one FSDP2 root over a rank's stages]
        fully_shard(self.root, mesh=mesh, reshard_after_forward=False)
        self.state = fully_shard.state(self.root)
        self.state._lazy_init()  # what the root's first forward would do: it is never called
        moved = {id(p): (p, table[name]) for table, name, p in before if table.get(name) is not p}
        rebind(holders, moved)

    def unshard(self, also: Iterable[torch.nn.Module] = ()) -> None:
        """At a step's start: the parameters gathered, and no task reduces or reshards; ``also``: a later program's
        stages, which then hold the gathered parameters too (Note [programs after the first under FSDP2])."""
        self._reduce_after_backward(False)
        held = self._held()
        self.root.unshard()
        self._follow(held, also)

    def _reduce_after_backward(self, on: bool) -> None:
        """FSDP2's three switches: whether its post-backward reduces the gradients and reshards (the step's end)."""
        self.root.set_is_last_backward(on)
        self.root.set_reshard_after_backward(on)
        self.root.set_requires_gradient_sync(on)

    def _held(self) -> list[tuple[dict, str, torch.Tensor]]:
        return list(tables(m for s in self.stages for m in s.modules()))

    @staticmethod
    def _follow(held: list[tuple[dict, str, torch.Tensor]], also: Iterable[torch.nn.Module]) -> None:
        """``also``'s slots that held a tensor the first program's stages held in ``held`` now hold what those hold."""
        swapped = {id(t): (t, table[name]) for table, name, t in held if table.get(name) is not t}
        if swapped:
            rebind([m for stage in also for m in stage.modules()], swapped)

    def reduce(self, pairs: list[tuple[torch.nn.Parameter, torch.Tensor | None]],
               also: Iterable[torch.nn.Module] = ()) -> None:
        """At a step's end: the step's (unsharded parameter, gradient) pairs handed over, reduce-scattered (and
        all-reduced over dp_replicate) into each sharded parameter's ``.grad``, the parameters resharded (``also``:
        a later program's stages, which follow, Note [programs after the first under FSDP2])."""
        also = list(also)
        with torch.no_grad():
            for p, g in pairs:
                if g is not None:
                    p.grad = g if p.grad is None else p.grad + g
        pairs.clear()
        self._reduce_after_backward(True)
        held = self._held()
        for state in self.state._state_ctx.all_states or [self.state]:
            for group in state._fsdp_param_groups:
                group.post_backward()
        self.state._root_post_backward_final_callback()
        self._follow(held, also)


def grads_before(tied: list[tuple[str, dist.ProcessGroup, list[int]]], lookup) -> list:
    """Each tied weight's ``.grad`` before a step adds to it (a clone; None where there is none), for sum_tied."""
    grads = [lookup(name).grad for name, _, _ in tied]
    return [None if g is None else g.detach().clone() for g in grads]


# Note [a tie sums the step's gradient alone]: the ranks holding a tied weight each add their stage's gradient to
# its .grad; summing the whole .grad over them would add every other rank's earlier steps again where a loop
# accumulates over several steps without zeroing. The step's part alone (.grad less what it held before) is summed.
def sum_tied(tied: list[tuple[str, dist.ProcessGroup, list[int]]], lookup, before: list) -> None:
    """Each tied weight's gradient of this step summed over the ranks that hold it (``lookup(name)``: this rank's
    parameter of that canonical name; ``before``: grads_before, taken before the step; Note [a tie sums the step's
    gradient alone]); a DTensor's local shard, which holds the same rows on every holder."""
    with torch.no_grad():
        for k, (name, group, _) in enumerate(tied):
            p = lookup(name)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            held = before[k]
            if held is None:
                dist.all_reduce(local, group=group)
                continue
            held = held.to_local() if hasattr(held, "to_local") else held
            mine = local - held
            dist.all_reduce(mine, group=group)
            local.copy_(held + mine)
