"""The wire spec: what travels between ranks, read from the Plan once, identical on every rank.

Every rank traces and plans the same model with the same inputs, so every rank
derives the same edges; a hash of them is compared once when the transport
starts (a mismatch would otherwise surface as a size error mid-step). Shapes
come from the plan, so a step exchanges payload only: no shape handshakes.
Python values computed in the graph (sizes from ``x.shape``) travel as int64
tensors.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch

from autopipe.plan import Plan, TensorInfo


@dataclass(frozen=True)
class Edge:
    """One value from stage ``src`` to each stage in ``dsts``, once per micro-batch."""

    name: str
    src: int
    dsts: tuple[int, ...]
    info: TensorInfo

    @property
    def grad(self) -> bool:
        """Gradients flow back along the edge; a reader whose input got none sends zeros,
        so the message pattern never depends on data."""
        return self.info.kind == "tensor" and (self.info.dtype.is_floating_point or self.info.dtype.is_complex)

    def empty(self, rows: int) -> torch.Tensor:
        return torch.empty(self.info.micro_batch_shape(rows), dtype=self.info.dtype)

    def to_wire(self, value: Any) -> torch.Tensor:
        if self.info.kind == "tensor":
            return value.detach().contiguous()
        if self.info.kind in ("int", "size"):
            return torch.tensor(value if self.info.kind == "int" else list(value), dtype=torch.int64)
        raise TypeError(f"{self.name!r} crosses a cut between ranks but is a {type(value).__name__}; only tensors, "
                        f"ints and sizes can travel between ranks")

    def from_wire(self, tensor: torch.Tensor) -> Any:
        if self.info.kind == "int":
            return int(tensor.item())
        if self.info.kind == "size":
            return torch.Size(tensor.tolist())
        return tensor


@dataclass(frozen=True)
class WireSpec:
    edges: tuple[Edge, ...]
    n_stages: int
    graph_outputs: tuple[str, ...]

    @classmethod
    def from_plan(cls, plan: Plan) -> "WireSpec":
        """Each value to the stages that read it; a model output made before the last stage
        also goes to the last stage, where the loss runs."""
        last = plan.n_stages - 1
        edges = []
        for name, info in plan.tensors.items():
            if info.producer < 0:
                continue  # graph inputs: every rank gets the call's arguments
            dsts = set(info.consumers) - {info.producer}
            if info.is_output and info.producer != last:
                dsts.add(last)
            if dsts:
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
        """A short hash, compared across ranks once at start-up."""
        described = [(e.name, e.src, e.dsts, e.info.shape, str(e.info.dtype), e.info.kind) for e in self.edges]
        return hashlib.sha1(repr((described, self.n_stages, self.graph_outputs)).encode()).hexdigest()[:16]
