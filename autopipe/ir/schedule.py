"""Schedules as tables of clock cycles of (stage, micro-batch, F|B|W) tasks; see docs/architecture.md, "Schedules".
GPipe: Huang et al. 2019, fig. 2c; 1F1B and interleaved 1F1B: Narayanan et al. 2021 (Megatron-LM sec. 2.2); ZB-H1 and
ZB-V: Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024 (secs. 3 and 6), whose tables split a stage's backward
into B (input gradients) and W (parameter gradients); DualPipeV: DeepSeek-AI, "DeepSeek-V3 Technical Report", 2024
(sec. 3.2.1, DualPipe) cut in half into ZB-V's V, as torch's ScheduleDualPipeV."""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass
from typing import Callable, Literal, Sequence

NAMES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv", "dualpipev")
SPLIT = ("zb-h1", "zbv", "dualpipev")   # schedules whose backward is two tasks, B and W
V_LAYOUT = ("zbv", "dualpipev")         # schedules of 2K stages in a V


def is_v_layout(name: str) -> bool:
    """Whether the schedule lays 2K stages out in a V (``device_of_stage``)."""
    return name in V_LAYOUT


def stages_per_device(name: str, virtual_stages: int = 1) -> int:
    """zbv and dualpipev always run two stages per device (a V); the others run ``virtual_stages``."""
    return 2 if is_v_layout(name) else virtual_stages


def device_of_stage(name: str, n_devices: int, stage: int) -> int:
    """Round robin (stage s on device s % K), or for zbv and dualpipev the V: device d holds stages d and 2K-1-d (ZB-V,
    sec. 6), so the first and last stages share a device and the loss's gradient turns round without a message."""
    if is_v_layout(name) and stage >= n_devices:
        return 2 * n_devices - 1 - stage
    return stage % n_devices


@dataclass(frozen=True, order=True)
class Task:
    stage: int          # pipeline stage index (a virtual stage for interleaved and the V: 0 .. K*v-1)
    micro_batch: int
    kind: Literal["F", "B", "W"]  # forward; backward (input gradients only where a W follows); parameter gradients

    def __str__(self) -> str:
        return f"{self.kind}{self.micro_batch}"


def _deps(t: Task, n_stages: int) -> list[Task]:
    """What a task waits for: its input activation; its output gradient and its own forward; its own B."""
    if t.kind == "W":
        return [Task(t.stage, t.micro_batch, "B")]
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
    name: str                # one of NAMES
    n_stages: int            # stages (K*v for interleaved, 2K in the V)
    n_devices: int           # K; stage s runs on device_of(s)
    chunks: int              # micro-batches M
    cycles: tuple[tuple[Task, ...], ...]   # tasks that may run at the same clock cycle
    # (stage, micro-batch) whose B is a full backward under a split schedule (pipelining's FULL_BACKWARD): it computes
    # the parameter gradients too, and its W, next in the device's order, only adds them
    full_backwards: frozenset[tuple[int, int]] = frozenset()

    @classmethod
    def gpipe(cls, n_stages: int, chunks: int, backward: bool = True) -> Schedule:
        """All forwards, then all backwards in reverse: stage j runs forward i at clock i + j."""
        backwards = range(chunks - 1, -1, -1) if backward else ()
        orders = [[Task(j, i, "F") for i in range(chunks)] + [Task(j, i, "B") for i in backwards]
                  for j in range(n_stages)]
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
        """As torch's ScheduleInterleaved1F1B: forwards depth first in rounds of `per_round` micro-batches through the
        device's v stages, backwards the same from the last stage; warm-up (v-1)*per_round + 2*(K-d-1) forwards
        (`_get_warmup_ops`), then F,B pairs."""
        K, v, M = n_devices, virtual_stages, chunks
        if K < 1 or M < 1:
            raise ValueError(f"a schedule needs at least one device and one micro-batch (got K={K}, M={M})")
        if v < 2:
            raise ValueError(f"interleaved needs virtual_stages >= 2 stages per device (got {v}); with one stage per "
                             f"device use '1f1b'")
        if not _interleavable(K, M):
            below = next(m for m in range(M, 0, -1) if _interleavable(K, m))
            above = next(m for m in range(M, M + K + 1) if _interleavable(K, m))
            raise ValueError(f"interleaved needs chunks to be a multiple of max(1, chunks // n_devices) = {M // K} "
                             f"(got chunks={M}, n_devices={K}); any multiple of n_devices works: nearest valid chunks "
                             f"are {below} and {above}")
        per_round, total = M // max(1, M // K), v * M
        mb = [k // (per_round * v) * per_round + k % per_round for k in range(total)]
        orders = [_one_f_one_b([Task((k // per_round) % v * K + d, mb[k], "F") for k in range(total)],
                               [Task((v - 1 - (k // per_round) % v) * K + d, mb[k], "B") for k in range(total)],
                               min(total, (v - 1) * per_round + 2 * (K - d - 1))) for d in range(K)]
        return cls._pack("interleaved", K * v, K, M, orders)

    @classmethod
    def zb_h1(cls, n_stages: int, chunks: int) -> Schedule:
        """ZB-H1 (Qi et al. sec. 3.1): 1F1B with each backward split into B and W, and device d's W deferred by d
        backwards, so W fills the bubble 1F1B leaves while the first micro-batch's gradient travels back; at most K-d
        micro-batches in flight on device d, as in 1F1B. As torch's ScheduleInterleavedZeroBubble with one stage per
        rank (``_get_1f1b_rank_ops`` with ``enable_zero_bubble``, ``num_1f1b_microbatches = rank``)."""
        orders = []
        for d in range(n_stages):
            warmup = min(chunks, n_stages - d - 1)
            order = [Task(d, i, "F") for i in range(warmup)]
            for j in range(chunks):
                order += [Task(d, warmup + j, "F")] if warmup + j < chunks else []
                order += [Task(d, j, "B")] + ([Task(d, j - d, "W")] if j >= d else [])
            orders.append(order + [Task(d, i, "W") for i in range(max(0, chunks - d), chunks)])
        return cls._pack("zb-h1", n_stages, n_stages, chunks, orders)

    @classmethod
    def zbv(cls, n_devices: int, chunks: int) -> Schedule:
        """ZB-V (Qi et al. sec. 6): 2K stages in a V, device d holding stages d and 2K-1-d; with F, B and W of equal
        time its bubble nears zero at 1F1B's activation memory. Device orders as torch's ScheduleZBVZeroBubble
        (``_calculate_single_rank_operations``): warm-up forwards down the V, steady F,B,W of one stage then the other,
        cool-down backwards, then the deferred Ws; micro-batches past M dropped as there."""
        K, M = n_devices, chunks
        if K < 1 or M < 1:
            raise ValueError(f"a schedule needs at least one device and one micro-batch (got K={K}, M={M})")
        return cls._pack("zbv", 2 * K, K, M, [_zbv_order(K, M, d) for d in range(K)])

    @classmethod
    def dualpipev(cls, n_devices: int, chunks: int) -> Schedule:
        """DualPipeV: ZB-V's V, device orders as torch's ScheduleDualPipeV (``_calculate_single_rank_operations``), so
        DeepSeek's DualPipe cut in half: warm-up forwards, then pairs of a forward of one stage and a full backward
        of the other (pipelining's OVERLAP_F_B, which runs them one after the other; see Note [overlapped F and B]),
        then backwards, their second half split in B and W to fill the cool-down. Torch asks M >= 2K; with fewer the
        orders of 2K micro-batches run with those past M dropped, as zbv's do."""
        K, M = n_devices, chunks
        if K < 1 or M < 1:
            raise ValueError(f"a schedule needs at least one device and one micro-batch (got K={K}, M={M})")
        orders, full = zip(*(_dualpipev_order(K, M, d) for d in range(K)))
        return cls._pack("dualpipev", 2 * K, K, M, orders, frozenset().union(*full))

    @classmethod
    def build(cls, name: str, n_devices: int, chunks: int, virtual_stages: int = 1) -> Schedule:
        """By name: 'gpipe' | '1f1b' | 'zb-h1' (a stage per device) | 'interleaved' (virtual_stages >= 2) | 'zbv' |
        'dualpipev' (2)."""
        if name not in NAMES:
            raise ValueError(f"unknown schedule {name!r}; choose one of {', '.join(NAMES)}")
        if name == "interleaved":
            return cls.interleaved(n_devices, virtual_stages, chunks)
        if is_v_layout(name):
            if virtual_stages not in (1, 2):
                raise ValueError(f"{name!r} runs two stages per device, in a V (got virtual_stages={virtual_stages}); "
                                 f"leave virtual_stages out, or use 'interleaved' for {virtual_stages}")
            return cls.zbv(n_devices, chunks) if name == "zbv" else cls.dualpipev(n_devices, chunks)
        if virtual_stages != 1:
            raise ValueError(f"{name!r} runs one stage per device (got virtual_stages={virtual_stages}); "
                             f"use 'interleaved' for several")
        builder = {"gpipe": cls.gpipe, "1f1b": cls.one_f_one_b, "zb-h1": cls.zb_h1}[name]
        return builder(n_devices, chunks)

    @classmethod
    def _pack(cls, name: str, n_stages: int, n_devices: int, chunks: int, orders: Sequence[Sequence[Task]],
              full_backwards: frozenset[tuple[int, int]] = frozenset()) -> Schedule:
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
        s = cls(name, n_stages, n_devices, chunks, tuple(cycles), full_backwards)
        s.validate()
        return s

    @property
    def virtual_stages(self) -> int:
        return self.n_stages // self.n_devices

    @property
    def splits_backward(self) -> bool:
        """Whether a backward is two tasks, B (input gradients) and W (parameter gradients)."""
        return self.name in SPLIT

    def device_of(self, stage: int) -> int:
        return device_of_stage(self.name, self.n_devices, stage)

    def stages_on(self, device: int) -> list[int]:
        return [s for s in range(self.n_stages) if self.device_of(s) == device]

    def device_order(self, device: int) -> list[Task]:  # the order its worker runs them in
        return [t for cycle in self.cycles for t in cycle if self.device_of(t.stage) == device]

    def stage_order(self, stage: int) -> list[Task]:
        return [t for cycle in self.cycles for t in cycle if t.stage == stage]

    def forward_only(self) -> Schedule:
        """The same device orders without backwards, re-packed (inference / no-grad steps)."""
        orders = [[t for t in self.device_order(d) if t.kind == "F"] for d in range(self.n_devices)]
        return self._pack(self.name, self.n_stages, self.n_devices, self.chunks, orders)

    def max_in_flight(self, stage: int) -> int:
        """Most micro-batches whose forward ran and whose graph is not yet freed (by B, or by W where the backward is
        split and B was not a full backward): M for GPipe, K - stage for 1F1B and ZB-H1."""
        steps = (1 if t.kind == "F" else -1 for t in self.stage_order(stage) if t.kind == "F" or t.kind == (
            "W" if self.splits_backward and (stage, t.micro_batch) not in self.full_backwards else "B"))
        return max(itertools.accumulate(steps, initial=0))

    @property
    def bubble_fraction(self) -> float:
        """Idle share of the device-cycles: (K-1)/(M+K-1) for GPipe and 1F1B, (K-1)/(v*M+K-1) interleaved (M >= K).
        Cycles are unit tasks: F = B (fused) for those, F = B = W for the zero-bubble ones; ``simulate`` weighs
        others."""
        return 1 - sum(len(c) for c in self.cycles) / (len(self.cycles) * self.n_devices)

    def simulate(self, duration: Callable[[Task], float]) -> tuple[float, float]:
        """(makespan, bubble) when each device runs its order strictly in turn, a task starting once its device is free
        and what it waits for has finished, and ``duration(task)`` long; bubble = idle share of K x makespan."""
        finish: dict[Task, float] = {}
        free = [0.0] * self.n_devices
        for cycle in self.cycles:  # the cycles order every task after what it waits for
            for t in cycle:
                d = self.device_of(t.stage)
                start = max([free[d]] + [finish[p] for p in _deps(t, self.n_stages)])
                finish[t] = free[d] = start + duration(t)
        span = max(free)
        busy = sum(duration(t) for t in finish)
        return span, (1 - busy / (span * self.n_devices)) if span else 0.0

    def validate(self) -> None:
        """Raise ValueError naming the first broken rule. Dependencies in strictly earlier cycles and at most
        one task per device per cycle make every device order agree with the cycles: no deadlock."""
        if min(self.n_devices, self.chunks, self.n_stages) < 1 or self.n_stages % self.n_devices:
            raise ValueError(f"a schedule needs at least one device and micro-batch, and stages that split evenly "
                             f"over the devices (got K={self.n_devices}, stages={self.n_stages}, M={self.chunks})")
        when: dict[Task, int] = {}
        for c, cycle in enumerate(self.cycles):
            for t in cycle:
                if not (0 <= t.stage < self.n_stages and 0 <= t.micro_batch < self.chunks and t.kind in "FBW"):
                    raise ValueError(f"task {t!r} at cycle {c} is out of range")
                if t in when:
                    raise ValueError(f"task {t!r} runs twice (cycles {when[t]} and {c})")
                when[t] = c
            busy = [self.device_of(t.stage) for t in cycle]
            if len(set(busy)) < len(busy):
                raise ValueError(f"device {next(d for d in busy if busy.count(d) > 1)} runs two tasks at cycle {c}")
        if any(not (0 <= s < self.n_stages and 0 <= i < self.chunks) for s, i in self.full_backwards) or (
                self.full_backwards and not self.splits_backward):
            raise ValueError(f"full backwards {sorted(self.full_backwards)} name tasks out of range, or the schedule "
                             f"does not split its backward (a full backward is a B that does its W's work)")
        present = {t.kind for t in when}
        kinds = "FBW" if "W" in present else "FB" if "B" in present else "F"
        every = {Task(s, i, k) for s in range(self.n_stages) for i in range(self.chunks) for k in kinds}
        if (t := min(every - set(when), default=None)) is not None:
            raise ValueError(f"missing {t.kind} of micro-batch {t.micro_batch} on stage {t.stage}: "
                             f"every (stage, micro-batch) needs one {' and one '.join(kinds)}")
        for t, c in when.items():
            for p in _deps(t, self.n_stages):
                if when[p] >= c:
                    raise ValueError(f"dependency broken: {t!r} at cycle {c} does not come after {p!r} at cycle "
                                     f"{when[p]}")

    def __str__(self) -> str:
        v = self.virtual_stages
        grid = [[next((f"{t}.{t.stage}" if v > 1 else str(t) for t in c if self.device_of(t.stage) == d), ".")
                 for c in self.cycles] for d in range(self.n_devices)]
        width = max([2, len(str(len(self.cycles) - 1))] + [len(cell) for row in grid for cell in row])
        what = "forward / input gradients / parameter gradients" if self.splits_backward else "forward / backward"
        cells = " / ".join(f"{k}<i>{'.<s>' if v > 1 else ''}" for k in self.kinds)
        note = f"cells: {cells} = {what} of micro-batch i{' through stage s' if v > 1 else ''}, . = idle" + (
            f"; {len(self.full_backwards)} full backwards (Schedule.full_backwards): each one's B computes its W's "
            f"gradients too" if self.full_backwards else "")
        rows = [f"{self.name} schedule: K={self.n_devices} devices, v={v} stages per device, M={self.chunks} "
                f"micro-batches, {len(self.cycles)} clock cycles, bubble {self.bubble_fraction:.3f}", note,
                "cycle     " + " ".join(f"{c:>{width}}" for c in range(len(self.cycles)))]
        rows += [f"device {d:<2} " + " ".join(f"{cell:>{width}}" for cell in row) for d, row in enumerate(grid)]
        return "\n".join(rows)

    __repr__ = __str__

    @property
    def kinds(self) -> str:
        return "FBW" if self.splits_backward else "FB"


def _zbv_order(K: int, M: int, d: int) -> list[Task]:
    """Device d's tasks under ZB-V, as torch's ScheduleZBVZeroBubble lists them (no-ops dropped)."""
    n = max(2 * K - 1, M)  # enough micro-batches to fill the V; those past M are dropped at the end
    down, up = d, 2 * K - 1 - d  # the device's stage on the way down and on the way up
    count = {(s, k): 0 for s in (down, up) for k in "FBW"}
    order: list[Task] = []

    def add(stage: int, kind: str) -> None:  # each stage's Fs, Bs and Ws each run in micro-batch order
        order.append(Task(stage, count[(stage, kind)], kind))
        count[(stage, kind)] += 1

    for _ in range(2 * (K - d) - 1):
        add(down, "F")
    for _ in range(d):
        add(up, "F"), add(down, "F")
    for _ in range(K - d):
        add(up, "F"), add(up, "B"), add(up, "W")
    while count[(up, "F")] < count[(down, "F")] or count[(down, "F")] < n:
        if count[(down, "F")] < n:
            add(down, "F")
        add(down, "B"), add(down, "W"), add(up, "F"), add(up, "B"), add(up, "W")
    for _ in range(d):
        add(down, "B"), add(up, "B")
    for _ in range(K - d):
        add(down, "B"), add(down, "W")
    while count[(up, "W")] < count[(up, "B")]:
        add(up, "W")
    while count[(down, "W")] < count[(down, "B")]:
        add(down, "W")
    return [t for t in order if t.micro_batch < M]


# Note [overlapped F and B]: DualPipe's pairs overlap one micro-batch's forward with another's backward only through a
# model's own ``overlapped_forward_backward``, which hides one's expert-parallel all-to-all under the other's compute;
# DeepSeek's example, and torch.distributed.pipelining's OVERLAP_F_B (``_PipelineScheduleRuntime`` runs
# ``for sub_a in action.sub_actions: _perform_action(sub_a)``, on the rank's one stream), run the two one after the
# other. autopipe does the same: the pair is the forward task, then the backward task, on the device's worker; what
# still overlaps is what does under every schedule, the messages (received ahead, sent without waiting: p2p.py).


def _dualpipev_order(K: int, M: int, d: int) -> tuple[list[Task], set[tuple[int, int]]]:
    """Device d's tasks under DualPipeV as torch's ScheduleDualPipeV lists them, an OVERLAP_F_B as its forward then
    its backward, a FULL_BACKWARD as B then W; and the (stage, micro-batch) of those full backwards."""
    n = max(2 * K, M)  # torch's least; those past M are dropped at the end
    down, up = d, 2 * K - 1 - d
    count = {(s, k): 0 for s in (down, up) for k in "FB"}
    order: list[Task] = []
    full: set[tuple[int, int]] = set()
    weights: collections.deque[Task] = collections.deque()  # the Ws of split backwards, oldest first

    def add(stage: int, kind: str, split: bool = True) -> None:  # each stage's Fs and Bs run in micro-batch order
        i = count[(stage, kind)]
        count[(stage, kind)] += 1
        order.append(Task(stage, i, kind))
        if kind == "B" and split:
            weights.append(Task(stage, i, "W"))
        elif kind == "B":
            order.append(Task(stage, i, "W"))
            full.add((stage, i))

    def weight() -> None:
        if weights:
            order.append(weights.popleft())

    for _ in range(2 * (K - d - 1)):
        add(down, "F")
    for _ in range(d + 1):
        add(down, "F"), add(up, "F")
    for _ in range(K - d - 1):
        add(up, "B"), weight(), add(up, "F")
    for _ in range(n - 2 * K + d + 1):  # torch's overlapped pairs, and its one pair on the last device it keeps apart
        add(down, "F"), add(up, "B", split=False), add(up, "F"), add(down, "B", split=False)
    for _ in range(K - d - 1):
        add(up, "B", split=False), add(up, "F"), add(down, "B", split=False)
    split = False
    for i in range(d + 1):  # the second half of these backwards split, their Ws deferred
        split = split or (i == (d + 1) // 2 and d % 2 == 1)
        add(up, "B", split)
        split = split or (i == (d + 1) // 2 and d % 2 == 0)
        add(down, "B", split)
    for _ in range(K - d - 1):
        weight(), add(down, "B", split)
    while weights:
        weight()
    return [t for t in order if t.micro_batch < M], {(s, i) for s, i in full if i < M}
