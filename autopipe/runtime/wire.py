"""What travels between ranks, read from the Plan, so identical on every rank (docs/architecture.md, "Under torchrun"):
a step exchanges payload only, and a hash of the spec compared once at start-up catches a mismatch that would otherwise
surface as a size error mid-step."""
from __future__ import annotations

import hashlib
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
        shape, k = self.info.shape, self.info.rows_per_sample  # a micro-batch of ``rows`` samples
        return torch.empty((rows * k, *shape[1:]) if k and shape else shape, dtype=self.info.dtype, device=device,
                           pin_memory=pin_memory)

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
