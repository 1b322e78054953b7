"""Timeline: what ran when in the last step, per stage; a text Gantt chart and a Chrome trace.

The measured bubble (idle share of stage time between the first task's start
and the last task's end) prints next to GPipe's prediction (K-1)/(M+K-1), and
per-stage busy time shows the measured imbalance.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Iterator

KINDS = ("forward", "recompute", "backward", "copy")


@dataclass(frozen=True)
class Event:
    stage: int
    micro_batch: int
    kind: str          # one of KINDS
    start: float       # seconds, time.perf_counter()
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    n_stages: int
    chunks: int
    events: list[Event] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def record(self, stage: int, micro_batch: int, kind: str, start: float, end: float) -> None:
        with self._lock:
            self.events.append(Event(stage, micro_batch, kind, start, end))

    @contextlib.contextmanager
    def span(self, stage: int, micro_batch: int, kind: str) -> Iterator[None]:
        """Times one task: ``with timeline.span(stage, mb, "forward"): ...``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record(stage, micro_batch, kind, start, time.perf_counter())

    # -- numbers ---------------------------------------------------------------
    @property
    def start(self) -> float:
        return min((e.start for e in self.events), default=0.0)

    @property
    def makespan(self) -> float:
        return max((e.end for e in self.events), default=0.0) - self.start

    def busy(self, stage: int) -> float:
        """Seconds the stage's worker spent computing (forward, recompute, backward; copies overlap them)."""
        return sum(e.seconds for e in self.events if e.stage == stage and e.kind != "copy")

    @property
    def measured_bubble(self) -> float:
        if not self.makespan:
            return 0.0
        return 1.0 - sum(self.busy(s) for s in range(self.n_stages)) / (self.n_stages * self.makespan)

    @property
    def predicted_bubble(self) -> float:
        return (self.n_stages - 1) / (self.chunks + self.n_stages - 1)

    @property
    def measured_imbalance(self) -> float:
        busy = [self.busy(s) for s in range(self.n_stages)]
        mean = sum(busy) / len(busy) if busy else 0.0
        return max(busy) / mean if mean else 1.0

    # -- views -----------------------------------------------------------------
    def __str__(self, width: int = 96) -> str:
        if not self.events:
            return "Timeline: no step has run yet"
        t0, span = self.start, self.makespan or 1e-9
        rows = [f"Timeline of the last step: {self.n_stages} stages x {self.chunks} micro-batches, "
                f"{1e3 * self.makespan:.1f} ms",
                "  cells: micro-batch number (mod 10) in forward, the same in backward after the forward phase, "
                "'^' recompute, '.' idle"]
        for s in range(self.n_stages):
            cells = ["."] * width
            for e in sorted(self.events, key=lambda e: KINDS.index(e.kind)):
                if e.stage != s or e.kind == "copy":
                    continue
                a = int((e.start - t0) / span * width)
                b = max(a + 1, int((e.end - t0) / span * width))
                mark = "^" if e.kind == "recompute" else str(e.micro_batch % 10)
                for c in range(a, min(b, width)):
                    if e.kind != "backward" or cells[c] != "^":
                        cells[c] = mark
            rows.append(f"stage {s:<2} |{''.join(cells)}| busy {1e3 * self.busy(s):8.1f} ms")
        rows.append(f"bubble: measured {self.measured_bubble:.3f}, GPipe's (K-1)/(M+K-1) = {self.predicted_bubble:.3f};"
                    f" busy max/mean {self.measured_imbalance:.3f}")
        return "\n".join(rows)

    __repr__ = __str__

    def chrome_trace(self) -> dict:
        t0 = self.start
        events = [{
            "name": f"{e.kind} {e.micro_batch}", "cat": e.kind, "ph": "X",
            "ts": (e.start - t0) * 1e6, "dur": e.seconds * 1e6, "pid": 0, "tid": e.stage,
            "args": {"stage": e.stage, "micro_batch": e.micro_batch},
        } for e in self.events]
        names = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": s, "args": {"name": f"stage {s}"}}
                 for s in range(self.n_stages)]
        return {"traceEvents": names + events, "displayTimeUnit": "ms"}

    def save_chrome_trace(self, path: str | os.PathLike[str]) -> str:
        """Write a trace that Perfetto (ui.perfetto.dev) and chrome://tracing open."""
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)
        return os.fspath(path)
