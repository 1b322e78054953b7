"""What ran when in the last step: a text Gantt chart per device (rows as in ``print(pipe.schedule)``), the
measured bubble beside the schedule's, busy time per device, and a Chrome trace."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from autopipe.ir.schedule import Schedule

_MARK = {"forward": "F", "recompute": "R", "backward": "B", "weight": "W", "loss": "L"}


class Event(NamedTuple):
    stage: int
    micro_batch: int
    kind: str          # "forward", "recompute", "backward", "weight" (W: parameter gradients, split schedules) or
    # "loss" (pipe.step's loss function on the last stage's outputs, forward and backward)
    start: float       # seconds, time.perf_counter()
    end: float


@dataclass
class Timeline:
    schedule: Schedule
    _events: list[Event] = field(default_factory=list)  # appended by every worker: list.append is atomic
    _cuda: list[tuple] = field(default_factory=list)    # CUDA spans: events read when the timeline is

    def begin(self, device: torch.device) -> tuple:
        """A task's start: the host clock; on a GPU also a CUDA event on the current stream (the host only enqueues)."""
        if device.type != "cuda":
            return time.perf_counter(), None
        mark = torch.cuda.Event(enable_timing=True)
        mark.record()
        return time.perf_counter(), mark

    def end(self, begun: tuple, stage: int, micro_batch: int, kind: str, device: torch.device) -> None:
        start, mark = begun
        if mark is None:
            self._events.append(Event(stage, micro_batch, kind, start, time.perf_counter()))
        else:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._cuda.append((device, start, stage, micro_batch, kind, mark, end))

    @property
    def events(self) -> list[Event]:
        """The tasks' spans. A GPU's are its CUDA events, placed on the host clock at its first task's enqueue
        time: exact between the tasks of one GPU, approximate across devices."""
        if self._cuda:
            pending, self._cuda = self._cuda, []
            anchors: dict = {}
            for device, host, *_, begin, _ in sorted(pending, key=lambda p: p[1]):
                anchors.setdefault(device, (host, begin))
            for device, _, stage, micro_batch, kind, begin, end in pending:
                end.synchronize()
                host, first = anchors[device]
                self._events.append(Event(stage, micro_batch, kind, host + first.elapsed_time(begin) / 1e3,
                                          host + first.elapsed_time(end) / 1e3))
        return self._events

    @property
    def start(self) -> float:
        return min((e.start for e in self.events), default=0.0)

    @property
    def makespan(self) -> float:
        return max((e.end for e in self.events), default=0.0) - self.start

    def device_events(self, device: int) -> list[Event]:
        return sorted((e for e in self.events if self.schedule.device_of(e.stage) == device), key=lambda e: e.start)

    def busy(self, device: int) -> float:
        return sum(e.end - e.start for e in self.device_events(device))

    def ran(self, device: int) -> list[str]:
        """The device's tasks as they ran, in the schedule's notation (F<i>, B<i>, W<i>; R<i> a recompute; the loss,
        no task of the schedule's, left out)."""
        suffix = self.schedule.virtual_stages > 1
        return [f"{_MARK[e.kind]}{e.micro_batch}" + (f".{e.stage}" if suffix else "")
                for e in self.device_events(device) if e.kind != "loss"]

    def held(self, stage: int) -> int:
        """Most micro-batches whose forward ran on ``stage`` and whose graph was not yet freed, as it ran: freed by
        the backward, or by W where the stage's backward is split (Schedule.max_in_flight's count, measured)."""
        events = sorted((e for e in self.events if e.stage == stage), key=lambda e: e.start)
        split = {e.micro_batch for e in events if e.kind == "weight"}  # the others' backward did it all (dualpipev)
        live = peak = 0
        for e in events:
            live += 1 if e.kind == "forward" else -1 if e.kind == ("weight" if e.micro_batch in split else "backward") \
                else 0
            peak = max(peak, live)
        return peak

    @property
    def measured_bubble(self) -> float:
        """Idle share of device time between the first task's start and the last task's end."""
        k = self.schedule.n_devices
        return 1.0 - sum(self.busy(d) for d in range(k)) / (k * self.makespan) if self.makespan else 0.0

    @property
    def predicted_bubble(self) -> float:
        return self.schedule.bubble_fraction

    @property
    def measured_imbalance(self) -> float:
        busy = [self.busy(d) for d in range(self.schedule.n_devices)]
        mean = sum(busy) / len(busy)
        return max(busy) / mean if mean else 1.0

    def __str__(self, width: int = 96) -> str:
        s = self.schedule
        if not self.events:
            return f"Timeline: no step has run yet ({s.name}, K={s.n_devices}, M={s.chunks})"
        t0, span = self.start, self.makespan or 1e-9
        rows = [f"Timeline of the last step: {s.name} schedule, {s.n_devices} devices x {s.chunks} "
                f"micro-batches{f', {s.virtual_stages} stages per device' if s.virtual_stages > 1 else ''}, "
                f"{1e3 * self.makespan:.1f} ms",
                f"  a task is drawn as F (forward), R (recompute), B "
                f"(backward){', W (parameter gradients)' if s.splits_backward else ''}"
                f"{', L (the loss)' if any(e.kind == 'loss' for e in self.events) else ''} then its micro-batch "
                f"(mod 10) repeated over its time; '.' idle"]
        for d in range(s.n_devices):
            cells = ["."] * width
            for e in self.device_events(d):
                a = min(int((e.start - t0) / span * width), width - 1)
                b = min(max(a + 1, int((e.end - t0) / span * width)), width)
                cells[a:b] = [_MARK[e.kind]] + [str(e.micro_batch % 10)] * (b - a - 1)
            rows.append(f"device {d:<2} |{''.join(cells)}| busy {1e3 * self.busy(d):8.1f} ms")
        for d in range(s.n_devices):
            ran = self.ran(d)
            rows.append(f"device {d:<2} ran: {' '.join(ran[:48])}{' ...' if len(ran) > 48 else ''}")
        rows.append(f"bubble: measured {self.measured_bubble:.3f}, the schedule's {self.predicted_bubble:.3f}; busy "
                    f"max/mean {self.measured_imbalance:.3f}")
        return "\n".join(rows)

    __repr__ = __str__

    def save_chrome_trace(self, path: str | os.PathLike[str]) -> str:
        """Write a trace that Perfetto (ui.perfetto.dev) and chrome://tracing open."""
        t0, device_of = self.start, self.schedule.device_of
        events = [{"name": f"{e.kind} {e.micro_batch}", "cat": e.kind, "ph": "X", "ts": (e.start - t0) * 1e6,
                   "dur": (e.end - e.start) * 1e6, "pid": device_of(e.stage), "tid": e.stage,
                   "args": {"stage": e.stage, "micro_batch": e.micro_batch}} for e in self.events]
        names = [{"name": "thread_name", "ph": "M", "pid": device_of(s), "tid": s, "args": {"name": f"stage {s}"}}
                 for s in range(self.schedule.n_stages)]
        names += [{"name": "process_name", "ph": "M", "pid": d, "args": {"name": f"device {d}"}}
                  for d in range(self.schedule.n_devices)]
        with open(path, "w") as f:
            json.dump({"traceEvents": names + events, "displayTimeUnit": "ms"}, f)
        return os.fspath(path)
