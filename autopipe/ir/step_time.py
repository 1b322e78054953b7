"""A step's predicted time per stage, term by term (passes/step_time.py predicts it), and its comparison with what a
Timeline measured (``plan.validate(timeline)``). Both sides read this module; it reads a timeline by its ``events``
(stage, micro_batch, kind, start, end) and its ``schedule``, so nothing here imports the runtime."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, fields
from typing import Any, Iterable, Protocol, Sequence

from tabulate import tabulate

# the Timeline's kinds, in the order a task runs them, and the prediction's term for each (the loss: pipe.step's)
TIMED = {"forward": "forward", "recompute": "recompute", "backward": "backward", "weight": "weight", "loss": "loss"}
MISS = 0.10  # a stage whose measured time differs from the prediction by more than this share is a miss


@dataclass(frozen=True)
class Link:
    """A transport's cost of moving bytes between two stages: ``latency`` seconds per message plus bytes over
    ``bandwidth`` (bytes/s). ``how`` says where the figures come from (a ping-pong, or a stated link)."""

    bandwidth: float            # bytes per second; inf: nothing is copied (in-process, one device)
    latency: float = 0.0        # seconds per message
    how: str = "stated"

    def seconds(self, nbytes: float, messages: int = 1) -> float:
        if messages == 0:
            return 0.0
        return messages * self.latency + (nbytes / self.bandwidth if math.isfinite(self.bandwidth) else 0.0)

    def __str__(self) -> str:
        bw = "no copy" if not math.isfinite(self.bandwidth) else f"{self.bandwidth / 1e9:.2f} GB/s"
        return f"link {bw}, {1e6 * self.latency:.1f} us a message ({self.how})"


SAME_DEVICE = Link(bandwidth=math.inf, latency=0.0, how="one device in process: tensors pass by reference")


@dataclass(frozen=True)
class StageTime:
    """One stage's predicted seconds in one step, summed over its micro-batches, by term. ``backward`` is B (input
    gradients) where the schedule runs W apart, else the whole fused backward; ``weight`` is W then, else 0. ``loss``:
    the loss function on the last stage's outputs, forward and backward (a Timeline task of ``pipe.step``'s). ``send``
    and ``receive`` (its crossing bytes over the link, forward values and backward gradients) are not in a Timeline's
    tasks: predicted, shown, not compared."""

    stage: int
    device: int
    forward: float
    recompute: float
    backward: float
    weight: float
    loss: float = 0.0
    send: float = 0.0
    receive: float = 0.0
    # the parameter gradients summed over micro-batches (Note [a micro-batch's gradients added to the step's]); of it,
    # ``accumulate_in_weight`` is added by W tasks; ``sums_in_tasks``: inside the backward tasks (a torchrun rank adds
    # each gradient as the engine makes it), else after them, untimed
    accumulate: float = 0.0
    accumulate_in_weight: float = 0.0
    sums_in_tasks: bool = False

    @property
    def timed(self) -> float:
        """What the Timeline's tasks of this stage add up to."""
        return self.forward + self.recompute + self.backward + self.weight + self.loss + (
            self.accumulate if self.sums_in_tasks else 0.0)

    def term(self, kind: str) -> float:
        """The predicted seconds of a Timeline kind's tasks: its term, with the gradient sums the task adds."""
        inside = self.accumulate if self.sums_in_tasks else 0.0
        weight_share = self.accumulate_in_weight if self.sums_in_tasks else 0.0
        extra = {"backward": inside - weight_share, "weight": weight_share}.get(kind, 0.0)
        return getattr(self, kind) + extra

    @property
    def total(self) -> float:
        return self.timed + self.send + self.receive + (0.0 if self.sums_in_tasks else self.accumulate)


class Timed(Protocol):  # what validate reads of a runtime Timeline
    events: Sequence[Any]
    schedule: Any


class PredictedStepTime(list):
    """``list[StageTime]``, one per stage, with each device's sum (zbv and dualpipev: the two stages of its V) and the
    step's bound: the busiest device over the schedule's busy share."""

    def __init__(self, stages: Iterable[StageTime], *, schedule: str, chunks: int, checkpoint: str, n_devices: int,
                 bubble: float, link: Link, source: str, stretch: float = 1.0):
        super().__init__(stages)
        self.schedule, self.chunks, self.checkpoint, self.n_devices = schedule, chunks, checkpoint, n_devices
        self.bubble, self.link, self.source, self.stretch = bubble, link, source, stretch

    def per_device(self) -> list[float]:
        return [sum(s.total for s in self if s.device == d) for d in range(self.n_devices)]

    @property
    def step(self) -> float:
        """The busiest device's work over the share of the step it is not idle in the bubble."""
        busy = 1.0 - self.bubble
        return max(self.per_device(), default=0.0) / busy if busy > 0 else math.inf

    def __str__(self) -> str:
        columns = [f.name for f in fields(StageTime)[2:] if f.type in (float, "float")
                   and f.name != "accumulate_in_weight"]
        rows = [[s.stage, s.device, *(_ms(getattr(s, name)) for name in columns), _ms(s.total)] for s in self]
        head = (f"Predicted step time: {self.schedule}, checkpoint={self.checkpoint!r}, M={self.chunks}, "
                f"{self.n_devices} device(s); node times {self.source}"
                f"{f', tasks x{self.stretch:.2f} (more busy workers than cores)' if self.stretch > 1 else ''}; "
                f"{self.link}")
        table = tabulate(rows, headers=["stage", "device", *columns, "total"])
        devices = ", ".join(f"{d}: {_ms(t)}" for d, t in enumerate(self.per_device()))
        return "\n".join([head, table, f"per device (ms): {devices}; step (busiest / (1 - bubble "
                                       f"{self.bubble:.3f})): {_ms(self.step)} ms"])

    __repr__ = __str__


@dataclass(frozen=True)
class StageCheck:
    """One stage's predicted and measured seconds per timed term, and the term that misses most."""

    stage: int
    device: int
    predicted: dict[str, float]
    measured: dict[str, float]

    @property
    def error(self) -> float:
        """(predicted - measured) / measured over the timed terms."""
        measured = sum(self.measured.values())
        return (sum(self.predicted.values()) - measured) / measured if measured else 0.0

    @property
    def missed(self) -> bool:
        return abs(self.error) > MISS

    @property
    def worst(self) -> str:
        """The timed term whose prediction is furthest from its measurement, in seconds."""
        return max(self.predicted, key=lambda t: abs(self.predicted[t] - self.measured[t]))


@dataclass(frozen=True)
class Validation:
    """``plan.validate(timeline)``: each stage's prediction beside its Timeline, a miss (over ``MISS``) naming its
    worst term."""

    checks: list[StageCheck]
    prediction: PredictedStepTime
    steps: int = 1  # timelines the measured figures are the median of

    @property
    def ok(self) -> bool:
        return not any(c.missed for c in self.checks)

    @property
    def misses(self) -> list[StageCheck]:
        return [c for c in self.checks if c.missed]

    def __str__(self) -> str:
        compared = self.checks[0].predicted if self.checks else {}
        terms = [t for t in compared if any(c.predicted[t] or c.measured[t] for c in self.checks)]
        rows = []
        for c in self.checks:
            cells = [f"{_ms(c.predicted[t])} / {_ms(c.measured[t])}" for t in terms]
            verdict = f"miss: {c.worst}" if c.missed else "ok"
            rows.append([c.stage, c.device, *cells, f"{_ms(sum(c.predicted.values()))} / "
                         f"{_ms(sum(c.measured.values()))}", f"{100 * c.error:+.1f}%", verdict])
        table = tabulate(rows, headers=["stage", "device", *(f"{t} (ms)" for t in terms), "step (ms)", "error", ""])
        p = self.prediction
        untimed = ", ".join(f"stage {s.stage} {name} {_ms(getattr(s, name))} ms" for s in p
                            for name in ("loss", "send", "receive", "accumulate") if getattr(s, name)
                            and name not in compared and not (name == "accumulate" and s.sums_in_tasks))
        devices = sorted({c.device for c in self.checks})
        per_device = ", ".join(
            f"{d}: {_ms(sum(sum(c.predicted.values()) for c in self.checks if c.device == d))} / "
            f"{_ms(sum(sum(c.measured.values()) for c in self.checks if c.device == d))}" for d in devices)
        lines = [f"Predicted / measured per stage ({p.schedule}, M={p.chunks}, checkpoint={p.checkpoint!r}; measured: "
                 f"the median of {self.steps} step(s); a miss: more than {MISS:.0%} off, naming its worst term)", table,
                 f"per device (the stages it holds), predicted / measured (ms): {per_device}",
                 f"{'all within' if self.ok else f'{len(self.misses)} stage(s) not within'} {MISS:.0%}"]
        if untimed:
            lines.append(f"predicted, not in the Timeline's tasks: {untimed}")
        return "\n".join(lines)

    __repr__ = __str__


def validate(prediction: PredictedStepTime, timelines: Timed | Sequence[Timed]) -> Validation:
    """Each stage's predicted timed terms against a Timeline's tasks, summed per (stage, kind); given several
    timelines (one per step), the median step's."""
    timelines = [timelines] if hasattr(timelines, "events") else list(timelines)
    if not timelines or not all(t.events for t in timelines):
        raise ValueError("a timeline has no tasks: run a step (pipe.step or a forward and backward) before "
                         "validating the plan's predicted step time against it")
    # the loss is a task of pipe.step's alone: after pipe(x) and the caller's own backward it is not the stages'
    terms = [t for kind, t in TIMED.items() if kind != "loss" or any(e.kind == "loss" for tl in timelines
                                                                     for e in tl.events)]
    steps = []
    for timeline in timelines:
        measured = {(s.stage, term): 0.0 for s in prediction for term in terms}
        for e in timeline.events:
            if (e.stage, TIMED.get(e.kind)) in measured:
                measured[e.stage, TIMED[e.kind]] += e.end - e.start
        steps.append(measured)
    median = {key: statistics.median(step[key] for step in steps) for key in steps[0]}
    checks = [StageCheck(s.stage, s.device, {t: s.term(t) for t in terms}, {t: median[s.stage, t] for t in terms})
              for s in prediction]
    return Validation(checks, prediction, len(timelines))


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:.2f}"
