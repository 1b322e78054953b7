"""Schedules as tables of clock cycles of (stage, micro-batch, F|B) tasks; see docs/architecture.md, "Schedules".
GPipe: Huang et al. 2019, fig. 2c; 1F1B and interleaved 1F1B: Narayanan et al. 2021 (Megatron-LM sec. 2.2)."""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import Literal, Sequence

NAMES = ("gpipe", "1f1b", "interleaved")


@dataclass(frozen=True, order=True)
class Task:
    stage: int          # pipeline stage index (a virtual stage for interleaved: 0 .. K*v-1)
    micro_batch: int
    kind: Literal["F", "B"]

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


def _deps(t: Task, n_stages: int) -> list[Task]:
    """What a task waits for: its input activation, or its output gradient and its own forward."""
    if t.kind == "F":
        return [Task(t.stage - 1, t.micro_batch, "F")] if t.stage > 0 else []
    deps = [Task(t.stage, t.micro_batch, "F")]
    return deps + [Task(t.stage + 1, t.micro_batch, "B")] if t.stage < n_stages - 1 else deps


def _one_f_one_b(forwards: list[Task], backwards: list[Task], warmup: int) -> list[Task]:
    """One device's order: ``warmup`` forwards, then F,B pairs, then the remaining backwards."""
    pairs = [t for f, b in zip(forwards[warmup:], backwards) for t in (f, b)]
    return forwards[:warmup] + pairs + backwards[len(forwards) - warmup:]


def _interleavable(n_devices: int, chunks: int) -> bool:
    """torch's rule, Megatron's M % K == 0 relaxed: micro-batches split into max(1, M // K) equal rounds."""
    return chunks % max(1, chunks // n_devices) == 0


@dataclass(frozen=True)
class Schedule:
    name: str                # "gpipe" | "1f1b" | "interleaved"
    n_stages: int            # stages (K*v for interleaved)
    n_devices: int           # K; stage s runs on device s % n_devices
    chunks: int              # micro-batches M
    cycles: tuple[tuple[Task, ...], ...]   # tasks that may run at the same clock cycle

    @classmethod
    def gpipe(cls, n_stages: int, chunks: int, backward: bool = True) -> Schedule:
        """All forwards, then all backwards in reverse: stage j runs forward i at clock i + j."""
        backwards = range(chunks - 1, -1, -1) if backward else ()
        orders = [[Task(j, i, "F") for i in range(chunks)] + [Task(j, i, "B") for i in backwards] for j in range(n_stages)]
        return cls._pack("gpipe", n_stages, n_stages, chunks, orders)

    @classmethod
    def one_f_one_b(cls, n_stages: int, chunks: int) -> Schedule:
        """PipeDream-flush: K-d-1 warm-up forwards on device d (Megatron's `num_warmup_microbatches`), then
        F,B pairs, then the remaining backwards; at most K-d micro-batches in flight. With M < K it is GPipe."""
        orders = [_one_f_one_b([Task(d, i, "F") for i in range(chunks)], [Task(d, i, "B") for i in range(chunks)],
                               min(chunks, n_stages - d - 1)) for d in range(n_stages)]
        return cls._pack("1f1b", n_stages, n_stages, chunks, orders)

    @classmethod
    def interleaved(cls, n_devices: int, virtual_stages: int, chunks: int) -> Schedule:
        """As torch's ScheduleInterleaved1F1B: forwards depth first in rounds of `per_round` micro-batches through the device's v stages,
        backwards the same from the last stage; warm-up (v-1)*per_round + 2*(K-d-1) forwards (`_get_warmup_ops`), then F,B pairs."""
        K, v, M = n_devices, virtual_stages, chunks
        if K < 1 or M < 1:
            raise ValueError(f"a schedule needs at least one device and one micro-batch (got K={K}, M={M})")
        if v < 2:
            raise ValueError(f"interleaved needs virtual_stages >= 2 stages per device (got {v}); with one stage per device use '1f1b'")
        if not _interleavable(K, M):
            below = next(m for m in range(M, 0, -1) if _interleavable(K, m))
            above = next(m for m in range(M, M + K + 1) if _interleavable(K, m))
            raise ValueError(f"interleaved needs chunks to be a multiple of max(1, chunks // n_devices) = {M // K} (got chunks={M}, "
                             f"n_devices={K}); any multiple of n_devices works: nearest valid chunks are {below} and {above}")
        per_round, total = M // max(1, M // K), v * M
        mb = [k // (per_round * v) * per_round + k % per_round for k in range(total)]
        orders = [_one_f_one_b([Task((k // per_round) % v * K + d, mb[k], "F") for k in range(total)],
                               [Task((v - 1 - (k // per_round) % v) * K + d, mb[k], "B") for k in range(total)],
                               min(total, (v - 1) * per_round + 2 * (K - d - 1))) for d in range(K)]
        return cls._pack("interleaved", K * v, K, M, orders)

    @classmethod
    def build(cls, name: str, n_devices: int, chunks: int, virtual_stages: int = 1) -> Schedule:
        """By name: 'gpipe' | '1f1b' (one stage per device) | 'interleaved' (virtual_stages >= 2)."""
        if name not in NAMES:
            raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(NAMES)}")
        if name == "interleaved":
            return cls.interleaved(n_devices, virtual_stages, chunks)
        if virtual_stages != 1:
            raise ValueError(f"{name!r} runs one stage per device (got virtual_stages={virtual_stages}); use 'interleaved' for several")
        return cls.gpipe(n_devices, chunks) if name == "gpipe" else cls.one_f_one_b(n_devices, chunks)

    @classmethod
    def _pack(cls, name: str, n_stages: int, n_devices: int, chunks: int, orders: Sequence[Sequence[Task]]) -> Schedule:
        """Per-device orders -> clock cycles: each device starts its next task at the first cycle after
        that task's inputs are done. Raises if the orders deadlock, so no worker can hang on them."""
        pending = [collections.deque(order) for order in orders]
        done: set[Task] = set()
        cycles: list[tuple[Task, ...]] = []
        while any(pending):
            now = [queue.popleft() for queue in pending if queue and all(p in done for p in _deps(queue[0], n_stages))]
            if not now:
                raise ValueError(f"{name} orders deadlock: devices wait on {[queue[0] for queue in pending if queue]}")
            done.update(now)
            cycles.append(tuple(sorted(now)))
        s = cls(name, n_stages, n_devices, chunks, tuple(cycles))
        s.validate()
        return s

    @property
    def virtual_stages(self) -> int:
        return self.n_stages // self.n_devices

    def device_of(self, stage: int) -> int:
        return stage % self.n_devices

    def stages_on(self, device: int) -> list[int]:
        return list(range(device, self.n_stages, self.n_devices))

    def device_order(self, device: int) -> list[Task]:  # the order its worker runs them in
        return [t for cycle in self.cycles for t in cycle if self.device_of(t.stage) == device]

    def stage_order(self, stage: int) -> list[Task]:
        return [t for cycle in self.cycles for t in cycle if t.stage == stage]

    def forward_only(self) -> Schedule:
        """The same device orders without backwards, re-packed (inference / no-grad steps)."""
        orders = [[t for t in self.device_order(d) if t.kind == "F"] for d in range(self.n_devices)]
        return self._pack(self.name, self.n_stages, self.n_devices, self.chunks, orders)

    def max_in_flight(self, stage: int) -> int:
        """Most micro-batches whose forward ran but backward not yet: M for GPipe, K - stage for 1F1B."""
        return max(itertools.accumulate((1 if t.kind == "F" else -1 for t in self.stage_order(stage)), initial=0))

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the device-cycles: (K-1)/(M+K-1) for GPipe and 1F1B, (K-1)/(v*M+K-1) interleaved (M >= K)."""
        return 1 - sum(len(c) for c in self.cycles) / (len(self.cycles) * self.n_devices)

    def validate(self) -> None:
        """Raise ValueError naming the first broken rule. Dependencies in strictly earlier cycles and at most
        one task per device per cycle make every device order agree with the cycles: no deadlock."""
        if min(self.n_devices, self.chunks, self.n_stages) < 1 or self.n_stages % self.n_devices:
            raise ValueError(f"a schedule needs at least one device and micro-batch, and stages that split evenly "
                             f"over the devices (got K={self.n_devices}, stages={self.n_stages}, M={self.chunks})")
        when: dict[Task, int] = {}
        for c, cycle in enumerate(self.cycles):
            for t in cycle:
                if not (0 <= t.stage < self.n_stages and 0 <= t.micro_batch < self.chunks and t.kind in ("F", "B")):
                    raise ValueError(f"task {t!r} at cycle {c} is out of range")
                if t in when:
                    raise ValueError(f"task {t!r} runs twice (cycles {when[t]} and {c})")
                when[t] = c
            busy = [self.device_of(t.stage) for t in cycle]
            if len(set(busy)) < len(busy):
                raise ValueError(f"device {next(d for d in busy if busy.count(d) > 1)} runs two tasks at cycle {c}")
        kinds = ("F", "B") if any(t.kind == "B" for t in when) else ("F",)
        every = {Task(s, i, k) for s in range(self.n_stages) for i in range(self.chunks) for k in kinds}
        if (t := min(every - set(when), default=None)) is not None:
            raise ValueError(f"missing {t.kind} of micro-batch {t.micro_batch} on stage {t.stage}: "
                             f"every (stage, micro-batch) needs one {' and one '.join(kinds)}")
        for t, c in when.items():
            for p in _deps(t, self.n_stages):
                if when[p] >= c:
                    raise ValueError(f"dependency broken: {t!r} at cycle {c} does not come after {p!r} at cycle {when[p]}")

    def __str__(self) -> str:
        v = self.virtual_stages
        grid = [[next((f"{t}.{t.stage}" if v > 1 else str(t) for t in c if self.device_of(t.stage) == d), ".")
                 for c in self.cycles] for d in range(self.n_devices)]
        width = max([2, len(str(len(self.cycles) - 1))] + [len(cell) for row in grid for cell in row])
        note = ("cells: F<i>.<s> / B<i>.<s> = forward / backward of micro-batch i through stage s"
                if v > 1 else "cells: F<i> / B<i> = forward / backward of micro-batch i") + ", . = idle"
        rows = [f"{self.name} schedule: K={self.n_devices} devices, v={v} stages per device, M={self.chunks} micro-batches, "
                f"{len(self.cycles)} clock cycles, bubble {self.bubble_fraction:.3f}", note,
                "cycle     " + " ".join(f"{c:>{width}}" for c in range(len(self.cycles)))]
        rows += [f"device {d:<2} " + " ".join(f"{cell:>{width}}" for cell in row) for d, row in enumerate(grid)]
        return "\n".join(rows)

    __repr__ = __str__
