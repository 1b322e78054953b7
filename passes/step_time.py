"""After partition, the step-time model: ``predict_step_time(costed, plan, times, ...) -> PredictedStepTime``: what each
stage spends in one step, term by term, as its tasks run under a schedule and checkpoint mode (autopipe/ir/step_time.py
holds the result and its check against a Timeline, ``plan.validate(timeline)``). Also ``measure_link``: a transport's
latency and bandwidth by a ping-pong, measured once."""
from __future__ import annotations

import datetime
import math
import queue
import statistics
import threading
import time

import torch
import torch.distributed as dist

from autopipe.ir.checkpoint import checkpoints
from autopipe.ir.plan import Plan, TensorInfo
from autopipe.ir.schedule import Schedule
from autopipe.ir.step_time import SAME_DEVICE, Link, PredictedStepTime, StageTime

from .cost import CostedGraph
from .node_times import NodeTimes


def predict_step_time(costed: CostedGraph, plan: Plan, times: NodeTimes, schedule: str = "1f1b",
                      checkpoint: str = "except_last", chunks: int | None = None, virtual_stages: int = 1, *,
                      link: Link = SAME_DEVICE, loss_seconds: float = 0.0,
                      cores: int | None = None, sums_in_tasks: bool = False) -> PredictedStepTime:
    """Per stage of ``plan``, summed over its micro-batches: the forwards of its nodes (owned and replicated), the
    recomputes ``checkpoint`` adds, the backward (B alone where the schedule runs W apart, else fused) and W, from
    ``times`` (measure_node_times at one micro-batch, scaled by each micro-batch's rows; B and W apart as a split
    schedule runs them where it timed them so, Note [B and W timed apart]); ``loss_seconds`` (the loss
    function's forward and backward on one micro-batch's outputs) on the last stage; the crossing bytes over ``link``;
    each later micro-batch's parameter gradients added to the step's sum (Note [a micro-batch's gradients added to
    the step's]), inside the task that makes them where ``sums_in_tasks`` (a torchrun rank's runtime adds them as the
    engine makes them, and copies the first: Note [a step's first gradient copied to fresh pages]), else after it.
    ``cores``: CPU workers sharing that many cores (Note [workers sharing cores]). The result is also set as
    ``plan.step_time``, which ``plan.validate(timeline)`` reads."""
    missing = [name for s in plan.stages for name in s.nodes if name not in times.forward]
    if missing:
        raise ValueError(f"the node times are of another graph: {len(missing)} of the plan's nodes have none (first "
                         f"{missing[0]!r}); measure them on the graph the plan was cut from (its costed.traced)")
    chunks = chunks or plan.chunks
    built = Schedule.build(schedule, plan.n_stages // _per_device(schedule, virtual_stages), chunks, virtual_stages)
    batch = costed.traced.batch_size or chunks
    n = min(chunks, batch)
    stretch = _stretch(built, cores)
    scale = [(batch // n + (i < batch % n)) / times.rows for i in range(n)]  # each micro-batch's rows, measured at
    stages = []
    for s in plan.stages:
        names = (*s.nodes, *s.replicated)
        forward = sum(times.forward.get(name, 0.0) for name in names)
        w_only = sum(times.weight(name) for name in s.nodes)
        fused = sum(times.backward.get(name, 0.0) for name in s.nodes)
        b_only = fused - w_only  # B + W is the fused backward, each node's W at least 0
        b_apart = sum(times.input_grad_split(name) for name in s.nodes) if times.input_grad_apart else b_only
        w_apart = sum(times.weight_split(name) for name in s.nodes)  # Note [B and W timed apart]
        apart = [built.splits_backward and _inputs_need_grads(plan, s.inputs) and (s.index, i) not in
                 built.full_backwards for i in range(n)]
        recomputed = [checkpoints(checkpoint, i, n) for i in range(n)]
        added = sum(times.accumulate.get(name, 0.0) for name in s.params)  # one micro-batch's adds to the sums
        # a rank's copy of the first micro-batch's gradients (Note [a step's first gradient copied to fresh pages])
        first = sum(times.first_sum.get(name, times.accumulate.get(name, 0.0)) for name in s.params) \
            if sums_in_tasks and n > 1 else 0.0
        received = _crossing(plan, s.inputs)
        sent = [t for name in s.outputs if (t := plan.tensors.get(name)) is not None and t.consumers]
        stages.append(StageTime(
            stage=s.index, device=built.device_of(s.index), forward=stretch * forward * sum(scale),
            recompute=stretch * forward * sum(x for x, r in zip(scale, recomputed) if r),
            backward=stretch * sum(x * (b_apart if a else fused) for x, a in zip(scale, apart)),
            weight=stretch * sum(x * w_apart for x, a in zip(scale, apart) if a),
            loss=loss_seconds * sum(scale) if s.index == plan.n_stages - 1 else 0.0,
            send=_moved(link, sent, n), receive=_moved(link, received, n),
            accumulate=stretch * (added * (n - 1) + first),
            accumulate_in_weight=stretch * (added * sum(apart[1:]) + first * apart[0]),
            sums_in_tasks=sums_in_tasks))
    prediction = PredictedStepTime(stages, schedule=schedule, chunks=chunks, checkpoint=checkpoint,
                                   n_devices=built.n_devices, bubble=built.bubble_fraction, link=link,
                                   source=f"measured at {times.rows} rows on {times.threads} thread(s), median of "
                                          f"{times.repeats}, {times.peers} peer(s) running, forward "
                                          f"x{times.forward_scale:.2f} (the generated code)"
                                   if times.repeats else "from FLOPs at a stated rate",
                                   stretch=stretch)
    plan.step_time = prediction
    return prediction


# Note [workers sharing cores]: CPU workers each run on cores // workers intra-op threads (at least one), and share
# the process (its GIL), the memory bandwidth and, past one worker a core, the cores. Node times measured while K - 1
# peer threads run the graph (measure_node_times' ``peers``) carry that; measured alone, ``cores`` stretches them by
# the workers busy at once over the cores (on average K (1 - bubble)), where that is over one.
def _stretch(schedule: Schedule, cores: int | None) -> float:
    if not cores:
        return 1.0
    return max(1.0, schedule.n_devices * (1.0 - schedule.bubble_fraction) / cores)


def _per_device(schedule: str, virtual_stages: int) -> int:
    return 2 if schedule in ("zbv", "dualpipev") else virtual_stages


def _crossing(plan: Plan, names) -> list[TensorInfo]:
    """The tensors of ``names`` that another stage made (graph inputs are the caller's, not a link's)."""
    return [t for name in names if (t := plan.tensors.get(name)) is not None and t.producer >= 0]


def _inputs_need_grads(plan: Plan, names) -> bool:
    """A stage receiving a floating tensor computes input gradients in B and runs W apart under a split schedule (one
    reading only the model's inputs does all of it in B: runtime/split_backward.py)."""
    return any(t.kind == "tensor" and (t.dtype.is_floating_point or t.dtype.is_complex) for t in _crossing(plan, names))


def _moved(link: Link, tensors: list[TensorInfo], chunks: int) -> float:
    """One step's values over the link and, for floating tensors, their gradients back: a message per tensor and
    micro-batch each way; bytes at the whole mini-batch."""
    floating = [t for t in tensors if t.kind == "tensor" and (t.dtype.is_floating_point or t.dtype.is_complex)]
    nbytes = sum(t.nbytes for t in tensors) + sum(t.nbytes for t in floating)
    return link.seconds(nbytes, chunks * (len(tensors) + len(floating)))


def crossing_price(link: Link, units_per_second: float) -> float:
    """What a byte live across a cut costs a stage, in the plan's cost units (FLOPs: the device's FLOP/s; seconds:
    1.0), for partition's ``crossing_price``: the value forward and its gradient back, at the whole mini-batch."""
    return 2.0 * units_per_second / link.bandwidth if math.isfinite(link.bandwidth) else 0.0


def measure_link(transport: str = "gloo", sizes: tuple[int, int] = (1 << 10, 1 << 24), repeats: int = 20) -> Link:
    """A ping-pong of float32 tensors between two threads, over ``transport``: "gloo" (a gloo process group per thread
    on 127.0.0.1, as torchrun's ranks talk) or "threads" (a queue, as the in-process runtime hands values over by
    reference: latency only). Latency from the small size, bandwidth from the large one; one way is half a round
    trip."""
    if transport not in ("gloo", "threads"):
        raise ValueError(f"transport must be 'gloo' or 'threads', got {transport!r}")
    half_trips = [_round_trip(transport, size, repeats) / 2 for size in sizes]
    latency = half_trips[0]
    if transport == "threads":
        return Link(bandwidth=math.inf, latency=latency, how=f"ping-pong over threads, median of {repeats}")
    bandwidth = (sizes[1] - sizes[0]) / max(half_trips[1] - half_trips[0], 1e-12)
    return Link(bandwidth=bandwidth, latency=latency, how=f"ping-pong over gloo on 127.0.0.1, median of {repeats}")


def _round_trip(transport: str, nbytes: int, repeats: int) -> float:
    """Median seconds of a tensor of ``nbytes`` sent from thread 0 to thread 1 and back."""
    tensors = [torch.zeros(max(nbytes // 4, 1)) for _ in range(2)]
    trips: list[float] = []
    if transport == "threads":
        there, back = queue.Queue(), queue.Queue()
        peer = threading.Thread(target=lambda: [back.put(there.get()) for _ in range(repeats + 1)], daemon=True)
        peer.start()
        for k in range(repeats + 1):
            start = time.perf_counter()
            there.put(tensors[0])
            back.get()
            if k:
                trips.append(time.perf_counter() - start)
        peer.join()
        return statistics.median(trips)
    store = dist.HashStore()
    groups: dict[int, dist.ProcessGroup] = {}

    def join(rank: int):
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, datetime.timedelta(seconds=60))

    joining = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in joining:
        t.start()
    for t in joining:
        t.join()

    def echo():
        for _ in range(repeats + 1):
            groups[1].recv([tensors[1]], 0, 0).wait()
            groups[1].send([tensors[1]], 0, 0).wait()

    peer = threading.Thread(target=echo, daemon=True)
    peer.start()
    for k in range(repeats + 1):
        start = time.perf_counter()
        groups[0].send([tensors[0]], 1, 0).wait()
        groups[0].recv([tensors[0]], 1, 0).wait()
        if k:
            trips.append(time.perf_counter() - start)
    peer.join()
    return statistics.median(trips)
