"""``cuda_graphs=True``'s facts between the passes and the runtime: which stages replay as CUDA graphs and why not
(passes/graph_capture.py makes the report, runtime/cuda_graphs.py follows it), and the slots a stage's task order needs
(the memory model prices them, the runtime captures them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from .schedule import Task


@dataclass(frozen=True)
class CaptureBlocker:
    """Why a stage's graph cannot be captured as a CUDA graph: the node, its op, where it is in the user's code."""

    node: str
    op: str
    where: str
    why: str

    def __str__(self) -> str:
        return f"{self.op} ({self.node}) at {self.where}: {self.why}"


@dataclass(frozen=True)
class StageCapture:
    """One stage's verdict: captured (forward, backward and recompute replayed as CUDA graphs) or run eagerly."""

    stage: int
    blockers: tuple[CaptureBlocker, ...] = ()

    @property
    def captured(self) -> bool:
        return not self.blockers


@dataclass
class CaptureReport:
    """``cuda_graphs=True``: which stages replay as CUDA graphs and, for each one that runs eagerly, why
    (passes/graph_capture.py; assumptions in its docstring)."""

    stages: list[StageCapture]
    assumptions: tuple[str, ...] = ()

    def captured(self, stage: int) -> bool:
        return self.stages[stage].captured

    def __str__(self) -> str:
        lines = [f"CUDA graphs: {sum(s.captured for s in self.stages)} of {len(self.stages)} stages captured"]
        for s in self.stages:
            if s.captured:
                lines.append(f"  stage {s.stage}: captured (forward, backward and recompute replayed)")
                continue
            lines.append(f"  stage {s.stage}: runs eagerly: {s.blockers[0]}")
            lines += [f"    also {b}" for b in s.blockers[1:4]]
            if len(s.blockers) > 4:
                lines.append(f"    and {len(s.blockers) - 4} more")
        lines += [f"  assumed: {a}" for a in self.assumptions]
        return "\n".join(lines)

    __repr__ = __str__


def graph_slots(order: Sequence[Task], recomputed: Sequence[bool]) -> int:
    """The slots a stage replays into at once under its task ``order``: a kept micro-batch holds one from F to B; a
    recomputed one uses one for its forward, handed back at once, and holds one from its recompute (at the start of B,
    executor.run_tasks) to B."""
    live = peak = 0
    for t in order:
        if t.kind == "F":
            peak = max(peak, live + 1)
            live += not recomputed[t.micro_batch]
        elif t.kind == "B":
            peak = max(peak, live + recomputed[t.micro_batch])
            live -= not recomputed[t.micro_batch]
    return peak
