"""Each stage's predicted memory (parameters, gradients, optimizer state, kept activations, the recompute peak, CUDA
graph slots) and the busiest device's step time, for one schedule, checkpoint mode and chunks."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable

from tabulate import tabulate

from autopipe.ir.capture import graph_slots
from autopipe.ir.checkpoint import checkpoints
from autopipe.ir.plan import Plan
from autopipe.ir.plan import human_bytes as _human
from autopipe.ir.schedule import Schedule

from ..cost import CostedGraph
from .saved_tensors import SavedTensors, saved_tensors

# optimizer state per trainable parameter byte
OPTIMIZER_STATE = {None: 0, "none": 0, "sgd": 0, "momentum": 1, "sgd_momentum": 1, "adagrad": 1, "rmsprop": 1,
                   "adam": 2, "adamw": 2}
BACKWARD_FACTOR = 2.0   # backward FLOPs per forward FLOP (grad of the input + grad of the weight)
RECOMPUTE_FACTOR = 1.0  # a recompute is one more forward
# What a (stage, micro-batch) task costs beyond its FLOPs, as FLOPs of the 2-core CPU the benchmarks ran on.
# DEVICE_FLOPS: benchmarks/results/overhead.txt's transformer_like step, its FLOPs over its seconds. TASK_SECONDS: the
# runtime's hand-off, what one worker at chunks=1 adds to the small-op GPT's two tasks there. OP_SECONDS: each op's
# dispatch, which a small micro-batch no longer hides (notes/distributed.md).
DEVICE_FLOPS = 1.4e11
TASK_SECONDS = 0.7e-3
OP_SECONDS = 15e-6


@dataclass(frozen=True)
class MemoryPrediction:
    """Predicted bytes of one stage for one (schedule, checkpoint, chunks, optimizer)."""

    stage: int
    device: int                 # stage % K: the device that holds it
    params: int                 # parameters and buffers
    grads: int                  # one gradient per trainable parameter
    optimizer_state: int
    kept_activations: int       # most bytes held between forwards and their backwards at once
    recompute_peak: int         # one recomputed micro-batch's activations, during its backward
    in_flight: int              # Schedule.max_in_flight(stage)
    kept_all: int               # kept bytes summed over all micro-batches: what pipe.memory's `kept` counts
    formula: str                # the kept term, with its numbers
    graph_slots: int = 0        # cuda_graphs=True, a captured stage: (forward, backward) pairs it replays into at once
    graph_bytes: int = 0        # their static memory: graph_slots x one slot's bytes

    @property
    def activations_peak(self) -> int:  # what pipe.memory's `peak` measures
        return self.kept_activations + self.recompute_peak

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_state + self.activations_peak + self.graph_bytes


class PredictedMemory(list):
    """``list[MemoryPrediction]``, one per stage, that prints as a table with its formula."""

    def __init__(self, stages: Iterable[MemoryPrediction], **settings):
        super().__init__(stages)
        self.__dict__.update(settings)  # schedule, checkpoint, chunks, virtual_stages, n_devices, optimizer, bubble

    def per_device(self) -> list[int]:
        """Total bytes per device: the sum over the stages it holds (v of them when interleaved)."""
        return [sum(p.total for p in self if p.device == d) for d in range(self.n_devices)]

    @property
    def peak(self) -> int:
        return max(self.per_device(), default=0)

    def __str__(self) -> str:
        formula = (f"total = params + grads + optimizer ({self.optimizer or 'none'}: {OPTIMIZER_STATE[self.optimizer]} "
                   f"x trainable bytes) + kept + recompute\nkept = in_flight x (inputs/M if recomputed else "
                   f"activations/M), in_flight = micro-batches whose forward is done and backward not "
                   f"(Schedule.max_in_flight: M for gpipe, K - s for 1f1b, K for zb-h1)\nzb-h1, zbv, dualpipev: "
                   f"a stage whose W runs apart holds a micro-batch's activations (recomputed or not) and the "
                   f"gradients B kept for W from B until W\nrecompute = activations/M of one recomputed micro-batch, "
                   f"held while its backward runs\nactivations = what autograd saves in one forward of the stage, "
                   f"plus inputs no op saves")
        graphs = any(p.graph_slots for p in self)
        if graphs:
            formula += ("\ngraphs = slots x (activations + outputs + output and input gradients)/M + slots x parameter "
                        "gradients: each micro-batch a captured stage holds at once has its own captured forward and "
                        "backward in a memory pool of its own (runtime/cuda_graphs.py); a recomputed micro-batch keeps "
                        "its inputs outside them (kept) and is recomputed inside a slot")
        rows = [[p.stage, p.device, _human(p.params), _human(p.grads), _human(p.optimizer_state), p.in_flight,
                 _human(p.kept_activations), _human(p.recompute_peak),
                 *([f"{p.graph_slots} x {_human(p.graph_bytes / p.graph_slots)}" if p.graph_slots else "eager"]
                   if graphs else []), _human(p.total), p.formula] for p in self]
        table = tabulate(rows,
                         headers=["stage", "device", "params", "grads", "optimizer", "in flight", "kept", "recompute",
                                  *(["graphs"] if graphs else []), "total", "kept ="])
        head = (f"Predicted memory: {self.schedule} (v={self.virtual_stages}), checkpoint={self.checkpoint!r}, "
                f"M={self.chunks} micro-batches on {self.n_devices} device(s)")
        devices = "per device: " + ", ".join(f"{d}: {_human(b)}" for d, b in enumerate(self.per_device()))
        return "\n".join([head, table, devices, formula])

    __repr__ = __str__


def predict_memory(costed: CostedGraph, plan: Plan, schedule_name: str = "gpipe", checkpoint: str = "except_last",
                   chunks: int | None = None, virtual_stages: int = 1, optimizer: str | None = "adam", *,
                   saved: SavedTensors | None = None) -> PredictedMemory:
    """Per stage of ``plan``: parameters, gradients, optimizer state, kept activations and the recompute peak; a split
    schedule's kept gradients too (Note [memory held from B to W])."""
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"optimizer must be one of {[k for k in OPTIMIZER_STATE if k]} or None, got {optimizer!r}")
    saved = saved or saved_tensors(costed)
    trainable = {n for n, p in costed.traced.graph_module.named_parameters(remove_duplicate=False) if p.requires_grad}
    chunks = chunks or plan.chunks
    rows = costed.traced.batch_size or chunks  # the figures' rows (unknown: M micro-batches alike)
    batch = rows * chunks if costed.traced.static_batch else rows  # a graph specialised on one micro-batch's rows
    n = min(chunks, batch)  # micro-batch i holds rows_i of the figures' rows, as the runtime splits the batch
    fractions = [(batch // n + (i < batch % n)) / rows for i in range(n)]
    recomputed = [checkpoints(checkpoint, i, n) for i in range(n)]
    schedule = Schedule.build(schedule_name, plan.n_stages // virtual_stages, n, virtual_stages)
    stages = []
    for s in plan.stages:
        received = [(name, t) for name in s.inputs if (t := plan.tensors.get(name)) is not None]
        held = {k for name in (*s.nodes, *s.replicated) for k in saved.saves.get(name, ())}
        # the runtime holds a stage's inputs until its backward, saved or not
        held |= {k for name, t in received if t.kind == "tensor" for k in saved.value_storages.get(name, ())}
        activations = sum(saved.storage_bytes[k] for k in held)
        inputs = sum(t.nbytes for _, t in received if t.batched)
        fixed = sum(t.nbytes for _, t in received if not t.batched)
        act = [activations * x for x in fractions]
        kept = [inputs * x + fixed if r else a for x, r, a in zip(fractions, recomputed, act)]
        split = _split_micro_batches(schedule, s.index, n, _needs_input_grads(received))
        gradients = sum(saved.storage_bytes[k] for k in _kept_gradients(costed, s, trainable, saved)) if any(split) \
            else 0.0
        stash = [x * gradients if apart else 0.0 for x, apart in zip(fractions, split)]
        peak, formula = _held(schedule.stage_order(s.index), kept, act, stash, recomputed, split,
                              {"inputs": inputs / n + fixed, "activations": activations / n,
                               "kept gradients": gradients * fractions[0]})
        # a split micro-batch's recompute is in `peak`
        recompute = max((a for a, r, apart in zip(act, recomputed, split) if r and not apart), default=0.0)
        grads = sum(costed.tensor_bytes.get(p, 0) for p in s.params if p in trainable)
        slots = slot_bytes = 0
        if plan.cuda_graphs is not None and plan.cuda_graphs.captured(s.index):
            slots = graph_slots(schedule.stage_order(s.index), recomputed)
            slot_bytes = _slot_bytes(plan, s, received, activations) * fractions[0] + grads
            held = _recomputed_in_flight(schedule.stage_order(s.index), recomputed)
            peak, recompute = held * (inputs * fractions[0] + fixed), 0.0
            formula = f"{held} x inputs/M ({_human(inputs / n + fixed)}), recomputed" if held else "0"
        stages.append(MemoryPrediction(s.index, schedule.device_of(s.index), s.param_bytes, grads,
                                       OPTIMIZER_STATE[optimizer] * grads, round(peak), round(recompute),
                                       schedule.max_in_flight(s.index), round(sum(kept)), formula, slots,
                                       round(slots * slot_bytes)))
    return PredictedMemory(stages, schedule=schedule_name, checkpoint=checkpoint, chunks=chunks, optimizer=optimizer,
                           virtual_stages=virtual_stages, n_devices=schedule.n_devices, bubble=schedule.bubble_fraction)


def _slot_bytes(plan: Plan, stage: Any, received: list, activations: float) -> float:
    """One graph slot of ``stage`` at the whole batch, but for the parameter gradients each slot's backward writes into
    its own pool (the caller scales this to a micro-batch and adds them): saved activations (with the static inputs),
    static outputs and their gradients, the input gradients."""
    outputs = [plan.tensors[n] for n in stage.outputs if n in plan.tensors and plan.tensors[n].kind == "tensor"]
    floating = lambda t: t.dtype.is_floating_point or t.dtype.is_complex
    per_batch = activations + sum(t.nbytes * (1 + floating(t)) for t in outputs) + sum(
        t.nbytes for _, t in received if t.kind == "tensor" and t.producer >= 0 and floating(t))
    return per_batch


def _recomputed_in_flight(order: list, recomputed: list[bool]) -> int:
    """Most recomputed micro-batches whose forward ran and whose backward did not: their inputs are kept outside the
    graphs."""
    live = peak = 0
    for t in order:
        if recomputed[t.micro_batch] and t.kind in "FB":
            live += 1 if t.kind == "F" else -1
            peak = max(peak, live)
    return peak


def _split_micro_batches(schedule: Schedule, stage: int, chunks: int, needs_input_grads: bool) -> list[bool]:
    """Per micro-batch, whether the stage runs its W apart from B: under a split schedule, where its input needs a
    gradient and B is not a full backward (dualpipev's)."""
    split = schedule.splits_backward and needs_input_grads
    return [split and (stage, i) not in schedule.full_backwards for i in range(chunks)]


def _needs_input_grads(received: list) -> bool:
    """Whether a stage receives a floating tensor from another stage: its B computes input gradients, and its W runs
    apart (a stage reading only the model's inputs does all in B: runtime/split_backward.py)."""
    return any(t.kind == "tensor" and (t.dtype.is_floating_point or t.dtype.is_complex) for _, t in received)


def _kept_gradients(costed: CostedGraph, stage: Any, trainable: set[str], saved: SavedTensors) -> set[int]:
    """Storages of the outputs of the stage's nodes that read a trainable parameter: their gradients are what B keeps
    for W (the sources' arriving gradients), at the whole batch."""
    gm, found = costed.traced.graph_module, set()
    nodes = {n.name: n for n in gm.graph.nodes}
    for name in (*stage.nodes, *stage.replicated):
        node = nodes[name]
        if node.op == "call_module":
            reads = any(f"{node.target}.{k}" in trainable for k, _ in gm.get_submodule(node.target).named_parameters())
        else:
            reads = any(a.op == "get_attr" and a.target in trainable for a in node.all_input_nodes)
        if reads:
            found |= saved.value_storages.get(name, frozenset())
    return found


def _held(order: list, kept: list[float], act: list[float], stash: list[float], recomputed: list[bool],
          split: list[bool], each: dict[str, float]) -> tuple[float, str]:
    """The most bytes a stage holds at once under its task order, and the formula of that moment. A forward keeps
    ``kept``; a fused B frees it. Where micro-batch i's W runs apart (``split[i]``), B re-materialises (``act``) and
    keeps its gradients for W (``stash``), and W frees them all (ZB's price: Qi et al. sec. 3.2, the activations live
    until W)."""
    live, peak, phase, at_peak = 0.0, 0.0, {}, {}
    for t in order:
        i = t.micro_batch
        if t.kind == "F":
            live, phase[i] = live + kept[i], "F"
        elif t.kind == "B" and split[i]:
            live, phase[i] = live + act[i] - kept[i] + stash[i], "B"
        elif t.kind == ("W" if split[i] else "B"):
            live -= (act[i] + stash[i]) if split[i] else kept[i]
            del phase[i]
        if live > peak:
            peak, at_peak = live, dict(phase)
    counts = {"inputs": sum(p == "F" and recomputed[i] for i, p in at_peak.items()),
              "activations": sum(p == "F" and not recomputed[i] for i, p in at_peak.items())}
    after_b = sum(p == "B" for p in at_peak.values())
    terms = [f"{k} x {what}/M ({_human(each[what])})" for what, k in counts.items() if k]
    if after_b:
        both = _human(each["activations"] + each["kept gradients"])
        terms.append(f"{after_b} x (activations + kept gradients)/M ({both})")
    return peak, " + ".join(terms) or "0"


def predicted_step_time(plan: Plan, schedule_name: str = "gpipe", checkpoint: str = "except_last",
                        chunks: int | None = None, virtual_stages: int = 1, *,
                        task_overhead: float | None = None) -> float:
    """The busiest device's forwards, backwards, recomputes and ``task_overhead`` per (stage, micro-batch) task
    (None: DEVICE_FLOPS x (TASK_SECONDS + OP_SECONDS per op)), in the plan's cost units, over (1 - the bubble)."""
    chunks = chunks or plan.chunks
    schedule = Schedule.build(schedule_name, plan.n_stages // virtual_stages, chunks, virtual_stages)
    recomputed = sum(checkpoints(checkpoint, i, chunks) for i in range(chunks))
    flops = sum(s.flops for s in plan.stages)
    per_flop = plan.total_cost / flops if flops else 0.0
    work = [0.0] * schedule.n_devices
    for s in plan.stages:
        seconds = TASK_SECONDS + OP_SECONDS * (len(s.nodes) + len(s.replicated))
        overhead = per_flop * DEVICE_FLOPS * seconds if task_overhead is None else task_overhead
        received = [(name, t) for name in s.inputs if (t := plan.tensors.get(name)) is not None]
        tasks = 2 * chunks + sum(_split_micro_batches(schedule, s.index, chunks, _needs_input_grads(received))) \
            + recomputed  # W: one more where it runs apart
        compute = s.cost * (1 + BACKWARD_FACTOR + RECOMPUTE_FACTOR * recomputed / chunks)
        work[schedule.device_of(s.index)] += compute + overhead * tasks
    busy = 1.0 - schedule.bubble_fraction
    return max(work) / busy if busy > 0 else math.inf
