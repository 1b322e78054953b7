"""The "auto" choice: every (schedule, checkpoint, chunks) weighed by the predicted memory and step time, the fastest
that fits ``memory_cap`` kept (``choose_configuration -> AutoChoice``)."""
from __future__ import annotations

import functools
import textwrap
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from tabulate import tabulate

from autopipe.ir.checkpoint import CHECKPOINT_MODES
from autopipe.ir.plan import Plan
from autopipe.ir.plan import human_bytes as _human
from autopipe.ir.schedule import NAMES as SCHEDULES, Schedule, stages_per_device

from ..cost import CostedGraph
from ..cut_solver import NoFeasiblePlan
from .prediction import PredictedMemory, predict_memory, predicted_step_time
from .saved_tensors import SavedTensors, saved_tensors


@dataclass(eq=False)
class Candidate:
    """One configuration weighed; its settings, peak and bubble read through from its predicted memory."""

    plan: Plan
    memory: PredictedMemory
    time: float
    fits: bool

    def __getattr__(self, name: str) -> Any:
        if name in ("schedule", "virtual_stages", "checkpoint", "chunks", "peak", "bubble"):
            return getattr(self.memory, name)
        raise AttributeError(name)


@dataclass
class AutoChoice:
    """The configuration ``choose_configuration`` picked (its fields read through), and every one it weighed."""

    chosen: Candidate | None  # None: nothing fits, and this only lists the alternatives for the error
    candidates: list[Candidate]
    memory_cap: float
    n_devices: int
    batch_size: int
    ideal: float          # 3 x total cost / K: a perfectly balanced pipeline without bubble or overhead
    optimizer: str | None
    unplanned: list[str]  # alternatives that could not be weighed, and why

    def __getattr__(self, name: str) -> Any:
        if name in ("plan", "schedule", "virtual_stages", "checkpoint", "chunks", "memory", "time"):
            return getattr(self.chosen, name)
        raise AttributeError(name)

    def table(self, full: bool = False) -> str:
        """Every alternative with ``full``; else the best of each (schedule, checkpoint)."""
        shown: dict[Any, Candidate] = {}
        for c in sorted(self.candidates, key=_rank):
            shown.setdefault(id(c) if full else (c.schedule, c.virtual_stages, c.checkpoint), c)
        rows = [["->" if c is self.chosen else "",
                 c.schedule + (f" v={c.virtual_stages}" if c.virtual_stages > 1 else ""), c.checkpoint, c.chunks,
                 " ".join(_human(b) for b in c.memory.per_device()), _human(c.peak), f"{c.bubble:.3f}",
                 f"{c.time / self.ideal:.3f}", "fits" if c.fits else f"over by {_human(c.peak - self.memory_cap)}"]
                for c in shown.values()]
        headers = ["", "schedule", "checkpoint", "chunks", "peak per device", "max peak", "bubble", "time (x ideal)",
                   f"cap {_human(self.memory_cap)}"]
        return "\n".join([tabulate(rows, headers=headers, tablefmt="simple"),
                          *(f"not weighed: {textwrap.shorten(u, 110)}" for u in self.unplanned)])

    def __str__(self) -> str:
        c = self.chosen
        v = f" (virtual_stages={c.virtual_stages})" if c.virtual_stages > 1 else ""
        return (f"Chosen: schedule={c.schedule!r}{v}, checkpoint={c.checkpoint!r}, chunks={c.chunks}: predicted peak "
                f"{_human(c.peak)} per device (cap {_human(self.memory_cap)}), bubble {c.bubble:.3f}, step "
                f"{c.time / self.ideal:.2f}x ideal\nAlternatives weighed (batch {self.batch_size}, {self.n_devices} "
                f"device(s), optimizer {self.optimizer or 'none'}; time in ideal steps, 3 x total cost / K, with a "
                f"fixed cost per task; the fastest that fits wins; shown: the best per schedule and checkpoint of "
                f"{len(self.candidates)}, all in .table(full=True)):\n" + self.table())

    __repr__ = __str__


def choose_configuration(plan_for: Callable[[int], tuple[Plan, CostedGraph]], *, batch_size: int, n_devices: int,
                         memory_cap: float, schedules: Sequence[str] = SCHEDULES,
                         checkpoint_modes: Sequence[str] = CHECKPOINT_MODES, chunks: int | Sequence[int] | None = None,
                         optimizer: str | None = "adam", task_overhead: float | None = None) -> AutoChoice:
    """The fastest (schedule, checkpoint, chunks) that fits ``memory_cap`` bytes per device; ``plan_for(n_stages)``
    gives an uncapped Plan and its CostedGraph. ``chunks=None`` weighs powers of two and the batch size; "interleaved"
    runs 2 virtual stages per device."""
    auto = chunks is None
    counts = {2 ** k for k in range(batch_size.bit_length())} | {max(batch_size, 1)} if auto else chunks
    counts = [counts] if isinstance(counts, int) else sorted(set(counts))
    plan_for = functools.cache(plan_for)  # one plan per stage count
    candidates: list[Candidate] = []
    unplanned: list[str] = []
    saved: dict[int, SavedTensors] = {}  # one fake run per graph (kept alive by plan_for's cache: ids stay unique)
    for name in schedules:
        v = stages_per_device(name, 2 if name == "interleaved" else 1)  # zbv: 2K stages in a V
        try:
            plan, costed = plan_for(n_devices * v)
        except (ValueError, NoFeasiblePlan) as e:
            unplanned.append(f"{name}: no {n_devices * v}-stage plan: {e}")
            continue
        saved[id(costed)] = saved.get(id(costed)) or saved_tensors(costed)
        for m in counts:
            try:
                Schedule.build(name, n_devices, m, v)
            except ValueError as e:  # no interleaved table for these chunks: listed only when asked for
                if not auto:
                    unplanned.append(f"{name}, chunks={m}: {e}")
                continue
            for mode in checkpoint_modes:
                memory = predict_memory(costed, plan, name, mode, m, v, optimizer, saved=saved[id(costed)])
                time = predicted_step_time(plan, name, mode, m, v, task_overhead=task_overhead)
                candidates.append(Candidate(plan, memory, time, memory.peak <= memory_cap))
    ideal = (3 * candidates[0].plan.total_cost / n_devices if candidates else 0.0) or 1.0
    least = min(candidates, key=_rank, default=None)  # the fastest that fits, else the smallest peak
    choice = AutoChoice(None, candidates, memory_cap, n_devices, batch_size, ideal, optimizer, unplanned)
    if least is None:
        raise NoFeasiblePlan("no configuration could be planned:\n" + choice.table())
    if least.fits:
        return replace(choice, chosen=least)
    worst = max(range(n_devices), key=least.memory.per_device().__getitem__)
    raise NoFeasiblePlan(f"no configuration fits memory_cap={_human(memory_cap)} per device on {n_devices} device(s): "
                         f"the smallest predicted peak is {_human(least.peak)} ({least.schedule}, checkpoint="
                         f"{least.checkpoint!r}, chunks={least.chunks}, device {worst}). Raise memory_cap to at least "
                         f"{_human(least.peak)}, add devices or use a lighter optimizer:\n{choice.table()}")


def _rank(c: Candidate) -> tuple:
    """Fitting first, then the fastest (on a tie: less memory, fewer chunks, less recompute); else the least peak."""
    speed = (round(c.time, 9), c.peak) if c.fits else (c.peak, c.time)
    return (not c.fits, *speed, c.chunks, ("never", "except_last", "always").index(c.checkpoint))
