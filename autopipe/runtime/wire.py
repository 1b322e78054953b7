"""What travels between ranks, read from the Plan, so identical on every rank (docs/architecture.md, "Under torchrun"):
a step exchanges payload only, and a hash of the spec compared once at start-up catches a mismatch that would otherwise
surface as a size error mid-step."""
from __future__ import annotations

import hashlib
import sys
from dataclasses import dataclass
from typing import Any

import torch

from autopipe.ir.plan import Plan, TensorInfo


@dataclass(frozen=True)
class Edge:
    """One value from stage ``src`` to each stage in ``dsts``, once per micro-batch."""

    name: str
    src: int
    dsts: tuple[int, ...]
    info: TensorInfo

    @property
    def grad(self) -> bool:
        """Gradients flow back; a reader whose input got none sends zeros, so messages never depend on data."""
        return self.info.kind == "tensor" and (self.info.dtype.is_floating_point or self.info.dtype.is_complex)

    def empty(self, rows: int, device: torch.device | None = None, pin_memory: bool = False) -> torch.Tensor:
        shape, dtype = self.key(rows)  # a micro-batch of ``rows`` samples
        return torch.empty(shape, dtype=dtype, device=device, pin_memory=pin_memory)

    def key(self, rows: int) -> tuple:
        """What a buffer for a micro-batch of ``rows`` samples must match: its shape and dtype."""
        shape, k = self.info.shape, self.info.rows_per_sample
        return ((rows * k, *shape[1:]) if k and shape else tuple(shape)), self.info.dtype

    def to_wire(self, value: Any) -> torch.Tensor:
        if self.info.kind == "tensor":
            return value.detach().contiguous()
        return torch.tensor(value if self.info.kind == "int" else list(value), dtype=torch.int64)  # "int" or "size"

    def from_wire(self, tensor: torch.Tensor) -> Any:
        if self.info.kind == "int":
            return int(tensor.item())
        return torch.Size(tensor.tolist()) if self.info.kind == "size" else tensor


@dataclass(frozen=True)
class WireSpec:
    edges: tuple[Edge, ...]
    n_stages: int
    graph_outputs: tuple[str, ...]

    @classmethod
    def from_plan(cls, plan: Plan) -> "WireSpec":
        """Each value to the stages that read it; a model output made before the last stage also goes to the last stage,
        where the loss runs. Graph inputs do not travel: every rank gets the call's arguments."""
        last = plan.n_stages - 1
        edges = []
        for name, info in plan.tensors.items():
            dsts = (set(info.consumers) | ({last} if info.is_output else set())) - {info.producer}
            if info.producer < 0 or not dsts:
                continue
            if info.kind == "other":
                raise TypeError(f"{name!r} crosses a cut between ranks but is not a tensor, int or size; "
                                f"plan with other devices or leaf_modules so that it stays inside one stage")
            edges.append(Edge(name, info.producer, tuple(sorted(dsts)), info))
        return cls(tuple(edges), plan.n_stages, tuple(plan.graph_outputs))

    def into(self, stage: int) -> list[Edge]:
        return [e for e in self.edges if stage in e.dsts]

    def out_of(self, stage: int) -> list[Edge]:
        return [e for e in self.edges if e.src == stage]

    def digest(self) -> str:
        described = [(e.name, e.src, e.dsts, e.info.shape, str(e.info.dtype), e.info.kind) for e in self.edges]
        return hashlib.sha1(repr((described, self.n_stages, self.graph_outputs)).encode()).hexdigest()[:16]


# Note [receive buffers reused]: a CPU rank receives each message into a buffer kept from step to step, as
# torch.distributed.pipelining's stages keep theirs: glibc's malloc hands memory freed at the top of its heap back
# to the OS, so fresh buffers a step, held across the step, broke the heap into pieces the next micro-batch's
# gradients could not reuse, and the matrix products that wrote them took a page fault per fresh 4 KiB. A buffer
# is written again only when nothing but this pool holds it: no Python reference, no other tensor on its memory
# (the stage input made from it, which the stage's saved tensors keep until its backward; a view; a gradient sum
# that passed it through), no pending send or receive (a Work holds its tensor). So a buffer a stage's autograd
# graph still references is never overwritten, under any schedule: the pool just grows to the most buffers held
# at once, the micro-batches in flight. GPU and pinned buffers are not pooled: a queued copy may still read one
# no reference holds, and CUDA's caching allocators already reuse memory.
class ReceiveBuffers:
    """Buffers for received messages, by shape and dtype, each reused once nothing else holds it (Note [receive
    buffers reused])."""

    def __init__(self) -> None:
        self._kept: dict[tuple, list[torch.Tensor]] = {}

    def take(self, edge: Edge, rows: int, device: torch.device, pinned: bool) -> torch.Tensor:
        """A buffer for ``edge``'s message of a micro-batch of ``rows`` samples, which the caller may write."""
        if device.type != "cpu" or pinned:
            return edge.empty(rows, device, pinned)
        kept = self._kept.setdefault(edge.key(rows), [])
        for buffer in kept:
            if _references(buffer) == _POOLED:
                return buffer
        kept.append(edge.empty(rows, device))
        return kept[-1]

    def forget_held(self) -> None:
        """Drop the buffers something else still holds (at a step's start: a caller kept a received value), so the
        pool holds only buffers it may write, and what a user keeps is never written again."""
        for key, kept in self._kept.items():
            free = []
            for buffer in kept:
                if _references(buffer) == _POOLED:
                    free.append(buffer)
            self._kept[key] = free


def _references(buffer: torch.Tensor) -> tuple[int, int, int]:
    """Python references to ``buffer``, references to its TensorImpl, and tensors on its memory (plus the storage
    object made here)."""
    return (sys.getrefcount(buffer), buffer._use_count(),
            torch._C._storage_Use_Count(buffer.untyped_storage()._cdata))


def _pooled() -> tuple[int, int, int]:
    """What ``_references`` reads for a buffer only a pool's list holds, from the same loop (calibrated, not assumed:
    how locals count differs between Python versions)."""
    kept = [torch.empty(1)]
    for buffer in kept:
        return _references(buffer)
    raise AssertionError


_POOLED = _pooled()
