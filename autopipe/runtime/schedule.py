"""Schedule: which (stage, micro-batch, forward/backward) task runs at each clock cycle.

GPipe (Huang et al., 2019, fig. 2c): all forwards on a diagonal, stage j
running micro-batch i at clock i + j; then all backwards in reverse, the last
stage first, micro-batches in reverse order. A Schedule is plain data: it
prints and is tested without a device, and both transports (threads and
torch.distributed) execute each stage's tasks in its order.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True, order=True)
class Task:
    stage: int
    micro_batch: int
    kind: Literal["F", "B"]

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


@dataclass(frozen=True)
class Schedule:
    n_stages: int
    chunks: int
    cycles: tuple[tuple[Task, ...], ...]   # tasks that may run at the same clock cycle

    @classmethod
    def gpipe(cls, n_stages: int, chunks: int, backward: bool = True) -> "Schedule":
        if n_stages < 1 or chunks < 1:
            raise ValueError(f"a schedule needs at least one stage and one micro-batch (got K={n_stages}, M={chunks})")
        span = chunks + n_stages - 1
        cycles: list[list[Task]] = [[] for _ in range(span * (2 if backward else 1))]
        for i in range(chunks):
            for j in range(n_stages):
                cycles[i + j].append(Task(j, i, "F"))
                if backward:
                    cycles[span + (chunks - 1 - i) + (n_stages - 1 - j)].append(Task(j, i, "B"))
        return cls(n_stages, chunks, tuple(tuple(sorted(c)) for c in cycles))

    def stage_order(self, stage: int) -> list[Task]:
        """The tasks of one stage in the order its worker runs them."""
        return [t for cycle in self.cycles for t in cycle if t.stage == stage]

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the stage-cycles: (K-1)/(M+K-1) for GPipe."""
        busy = sum(len(c) for c in self.cycles)
        return 1 - busy / (len(self.cycles) * self.n_stages)

    def __str__(self) -> str:
        width = max(2, len(str(self.chunks - 1)) + 1)
        header = "cycle   " + " ".join(f"{c:>{width}}" for c in range(len(self.cycles)))
        rows = [f"GPipe schedule: {self.n_stages} stages x {self.chunks} micro-batches, "
                f"{len(self.cycles)} clock cycles, bubble {self.bubble_fraction:.3f}", header]
        for j in range(self.n_stages):
            cells = []
            for cycle in self.cycles:
                task = next((t for t in cycle if t.stage == j), None)
                cells.append(f"{str(task) if task else '.':>{width}}")
            rows.append(f"stage {j:<2}" + " ".join(cells))
        return "\n".join(rows)

    __repr__ = __str__
