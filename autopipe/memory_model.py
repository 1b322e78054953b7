"""What a plan holds in memory and how long its step takes, per schedule, checkpoint mode and chunks: pure functions
over a Plan and its CostedGraph, no runtime starts and no real memory is touched. Activations are what autograd saves,
counted on fake tensors with pipe.memory's hook. Not modelled: the backward's transient gradients, the allocator, the
loss outside the pipeline."""
from __future__ import annotations

import functools
import math
import textwrap
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from tabulate import tabulate

from autopipe import random_ops
from autopipe.passes.cost import CostedGraph
from autopipe.passes.partition import NoFeasiblePlan
from autopipe.passes.trace import fake_errors_unlogged
from autopipe.plan import Plan
from autopipe.plan import human_bytes as _human
from autopipe.runtime.cuda_graphs import graph_slots
from autopipe.runtime.schedule import NAMES as SCHEDULES, Schedule, stages_per_device
from autopipe.runtime.task import CHECKPOINT_MODES, checkpoints

# optimizer state per trainable parameter byte
OPTIMIZER_STATE = {None: 0, "none": 0, "sgd": 0, "momentum": 1, "sgd_momentum": 1, "adagrad": 1, "rmsprop": 1,
                   "adam": 2, "adamw": 2}
BACKWARD_FACTOR = 2.0   # backward FLOPs per forward FLOP (grad of the input + grad of the weight)
RECOMPUTE_FACTOR = 1.0  # a recompute is one more forward
# What a (stage, micro-batch) task costs beyond its FLOPs, as FLOPs of the 2-core CPU the benchmarks ran on (1.4e11
# FLOP/s: overhead.txt's transformer_like
# step, 3 x 70.9 GFLOP in 1.54 s). TASK_SECONDS: the runtime's hand-off (overhead.txt: one worker at chunks=1 adds ~1.4
# ms to the small-op GPT's 2 tasks);
# OP_SECONDS: each op's dispatch, which a small micro-batch no longer hides (notes/distributed.md: ~10-20 us an op).
DEVICE_FLOPS = 1.4e11
TASK_SECONDS = 0.7e-3
OP_SECONDS = 15e-6


@dataclass
class SavedTensors:
    """What autograd saves in one whole-batch forward; a tensor and its views share one storage key."""

    saves: dict[str, frozenset[int]]           # node name -> storages its forward saves for backward
    storage_bytes: dict[int, int]              # storage key -> bytes at the whole batch
    value_storages: dict[str, frozenset[int]]  # graph value (placeholder / node) -> storages it lives in


def saved_tensors(costed: CostedGraph) -> SavedTensors:
    """Per node, the storages autograd saves (parameters and buffers excluded), from one run on fake tensors."""
    gm = costed.traced.graph_module
    real = [*_tensors([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]), *gm.parameters()]
    device = next((t.device for t in real if t.device.type != "meta"), torch.device("cpu"))
    keep: list[torch.Tensor] = []  # every tensor stays alive: no storage key is reused while counting
    storage_bytes: dict[int, int] = {}
    resident, current = set(), set()  # storage keys: of parameters and buffers; of what the running node saves

    def key(t: torch.Tensor) -> int:
        keep.append(t)
        storage = t.untyped_storage()
        storage_bytes[storage._cdata] = storage.nbytes()
        return storage._cdata

    def fake(val: Any, grad: bool = False) -> Any:  # inside the fake mode: allocates nothing
        if isinstance(val, (list, tuple)) and not isinstance(val, torch.Size):
            return type(val)(fake(v, grad) for v in val)
        if not isinstance(val, torch.Tensor):
            return int(val) if isinstance(val, torch.SymInt) else val
        t = torch.empty(tuple(int(d) for d in val.shape), dtype=val.dtype, device=device)
        return t.requires_grad_(grad and (t.is_floating_point() or t.is_complex()))

    @functools.cache  # one fake per parameter or buffer (a tensor hashes by identity)
    def resident_fake(t: torch.Tensor) -> torch.Tensor:
        resident.add(key(f := fake(t, isinstance(t, torch.nn.Parameter) and t.requires_grad)))
        return f

    def pack(t: torch.Tensor) -> torch.Tensor:
        if (k := key(t)) not in resident:
            current.add(k)
        return t

    env: dict[fx.Node, Any] = {}
    saves: dict[str, frozenset[int]] = {}
    values: dict[str, frozenset[int]] = {}
    with FakeTensorMode(allow_non_fake_inputs=True), torch.inference_mode(False), torch.enable_grad(), \
            fake_errors_unlogged():
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = fake(node.meta.get("val"))
            elif node.op == "get_attr":
                value = functools.reduce(getattr, node.target.split("."), gm)
                env[node] = resident_fake(value) if isinstance(value, torch.Tensor) else value
            elif node.op != "output":
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                current.clear()
                try:
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        env[node] = _run_node(gm, node, args, kwargs, resident_fake)
                except Exception:  # count what it reads and returns, if anything needs a gradient
                    current.clear()
                    inputs = _tensors((args, kwargs))
                    grad = any(t.requires_grad for t in inputs) or node.op == "call_module" and any(
                        p.requires_grad for p in gm.get_submodule(node.target).parameters())
                    env[node] = fake(node.meta.get("val"), grad)
                    if grad:
                        current.update(k for t in inputs + _tensors(env[node]) if (k := key(t)) not in resident)
                saves[node.name] = frozenset(current)
            if node.op != "output":
                values[node.name] = frozenset(key(t) for t in _tensors(env[node]))
    return SavedTensors(saves, storage_bytes, values)


def _run_node(gm: fx.GraphModule, node: fx.Node, args, kwargs, resident_fake: Callable) -> Any:
    """One node on fake tensors, random ops as codegen emits them (passes/codegen.py ``_route``)."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        fn, constants_of = random_ops.MODULES.get(type(module), (None, None))
        if fn is not None and random_ops.draws(constants := constants_of(module)):
            return fn(args[0] if args else kwargs["input"], **constants)
        owned = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        return torch.func.functional_call(module, {name: resident_fake(t) for name, t in owned}, tuple(args),
                                          dict(kwargs), strict=False)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    target = node.target
    if target in random_ops.FUNCTIONS and random_ops.draws(random_ops.bind(target, node.args, node.kwargs) or {}):
        fn, extra = random_ops.FUNCTIONS[target]
        renamed = "train" not in getattr(random_ops.signature_of(fn), "parameters", {})  # aten's train, F's training
        return fn(*args, **({("training" if k == "train" and renamed else k): v for k, v in kwargs.items()} | extra))
    return target(*args, **kwargs)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]


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
    """Per stage of ``plan``: parameters, gradients, optimizer state, kept activations and the recompute peak."""
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
    resident = sum(p.params + p.grads + p.optimizer_state for p in least.memory if p.device == worst)
    raise NoFeasiblePlan(f"no configuration fits memory_cap={_human(memory_cap)} per device on {n_devices} device(s): "
                         f"the smallest predicted peak is {_human(least.peak)} (schedule={least.schedule!r}, "
                         f"checkpoint={least.checkpoint!r}, chunks={least.chunks}), on device {worst}, of which "
                         f"{_human(resident)} are parameters, gradients and optimizer state ({optimizer or 'none'}). "
                         f"Raise memory_cap to at least {_human(least.peak)}, add devices, use a lighter optimizer, or "
                         f"a smaller batch.\nAlternatives weighed:\n{choice.table()}")


def _rank(c: Candidate) -> tuple:
    """Fitting first, then the fastest (on a tie: less memory, fewer chunks, less recompute); else the least peak."""
    speed = (round(c.time, 9), c.peak) if c.fits else (c.peak, c.time)
    return (not c.fits, *speed, c.chunks, ("never", "except_last", "always").index(c.checkpoint))
