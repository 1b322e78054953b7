"""``compile(..., cuda_graphs=True)``: a stage's forward, backward and recompute replayed as CUDA graphs, one launch a
task. NOT YET RUN ON A GPU: written against torch 2.11's ``torch.cuda.graphs`` (``CUDAGraph``, ``graph``,
``graph_pool_handle``, ``CUDAGraph.register_generator_state``) and following ``make_graphed_callables`` closely:
warm-up iterations on a side stream, then the forward captured with autograd recording, then the backward captured as
``torch.autograd.grad`` of the static outputs towards the static inputs and the parameters; a replay copies the
inputs (or output gradients) into static buffers and launches the graph.

Slots. A captured forward keeps its saved activations at fixed addresses until its backward replays, so each
micro-batch in flight needs its own (forward, backward) pair: a slot. Each slot has its own memory pool. torch lets
graphs share a pool only when they always replay in the order they were captured and never concurrently
(docs "Graph memory management"; ``make_graphed_callables`` captures all forwards, then all backwards in reverse, for
that reason); a pipeline stage replays its slots' forwards and backwards in an order that changes with the schedule
and its warm-up and cool-down (1F1B: F0 F1 B0 F2 B1 ...), so a shared pool would let one slot's replay write over
another's saved activations. ``graph_slots`` counts the slots a schedule needs; memory_model.py prices them.

Recompute is the forward replayed: a micro-batch that is re-materialised replays the forward graph into a slot with
its outputs copied out and the slot handed back at once, then replays it again (same inputs, same generator seed, same
kernels: bit for bit) before its backward. Dropout draws from the task's generator, registered with the forward graph
(``register_generator_state``): a replay reads the generator's seed and offset when it is launched
(CUDAGeneratorState::replay_prologue), and the task seeds it before each replay as an eager task does.

What runs eagerly instead: a stage the capture check (passes/graph_capture.py) or codegen (written buffers) blocks; a
step that is not a training step, or one under a profiler, a TorchDispatchMode, inference mode or saved-tensor hooks; a
parameter with a gradient hook; a task that finds every slot busy; the first step at each input signature (it is the
warm-up, and gives the inputs the capture copies). Captures happen in ``start_step``, on the calling thread before any
task of the step runs, so no other thread of the pipeline launches work while a capture is underway (torch: "no
non-captured CUDA work may run in this process while capture is underway").
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from autopipe.ir.capture import CaptureBlocker, CaptureReport, StageCapture, graph_slots

from .gradients import add_param_grads, differentiable
from .step_state import StepState, task_seed
from .task import Saved, StageRunner, swapped
from .transfers import moved

WARMUP_ITERATIONS = 2  # make_graphed_callables' default is 3; the eager step before the capture is one more


def use_cuda_graphs(program: Any) -> None:
    """``program``'s runners made graphed where its plan's capture report lets them; a stage that writes buffers (a
    training BatchNorm, an in-place buffer write codegen found) is added to the report as eager."""
    report: CaptureReport = program.plan.cuda_graphs
    for stage in program.stages:
        written = list(stage.running_buffers) + list(stage.written_buffers)
        if written and report.captured(stage.index):
            why = (f"writes {len(written)} buffer(s) in place; each task runs on its own copy of a buffer it writes, "
                   f"which a replay, bound to one address, cannot follow")
            report.stages[stage.index] = StageCapture(stage.index, (CaptureBlocker("-", "buffer write",
                                                                                   f"stage {stage.index}", why),))
    runners = []
    for stage, runner in zip(program.stages, program.runners):
        if report.captured(stage.index) and stage.device.type == "cuda":
            runner = GraphedStageRunner(stage)
            runner.report = report
        runners.append(runner)
    program.runners = runners


@dataclass
class _Replayed:
    """A graphed micro-batch between its forward and backward: its slot, or (recomputed) its inputs until then."""

    key: tuple
    inputs: list | None
    slot: "_Slot | None"


class GraphedStageRunner(StageRunner):
    """A StageRunner whose training tasks replay CUDA graphs; a task it cannot replay runs as StageRunner's (the one
    place that chooses: ``_eager_reason`` and a free slot)."""

    def __post_init__(self):
        super().__post_init__()
        self.report: CaptureReport | None = None
        self.slots: dict[tuple, list[_Slot]] = {}
        self.samples: dict[tuple, tuple[list, tuple]] = {}  # an eager task's inputs per signature: captured next step
        self.seen: dict[tuple, int] = {}  # micro-batches per signature in the last step: no more slots than that
        self.capture_stream: Any = None

    def start_step(self, step: StepState) -> None:
        super().start_step(step)
        if self.samples and self._eager_reason(step) is None:
            self._capture(step)
        self.seen = {}

    def _eager_reason(self, step: StepState) -> str | None:
        if self.report is not None and not self.report.captured(self.index):
            return "blocked"
        a = step.ambient
        if not step.training or step.memory is not None or step.deferred is not None or step.split_backward \
                or a.inference or a.saved_tensors_hooks is not None or a.inline_reason is not None:
            return "step"
        return "hooked parameter" if step.stages[id(self)].alias_slots else None

    def _key(self, step: StepState, inputs: list, needs_grad: Sequence[bool]) -> tuple:
        shapes = tuple((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else ("value", repr(x)) for x in inputs)
        grads = tuple(bool(g) and differentiable(x) for x, g in zip(inputs, needs_grad))
        return (shapes, grads, tuple(sorted(step.ambient.autocast.items())),
                tuple(map(id, step.stages[id(self)].wrt_params)))

    def _free(self, key: tuple) -> "_Slot | None":
        return next((s for s in self.slots.get(key, ()) if s.owner is None or s.owner() is None), None)

    # -- the three tasks ------------------------------------------------------------
    def forward(self, step: StepState, i: int, inputs: list, needs_grad: list[bool]) -> list:
        if self._eager_reason(step) is not None:
            return super().forward(step, i, inputs, needs_grad)
        key = self._key(step, inputs, needs_grad)
        self.seen[key] = self.seen.get(key, 0) + 1
        slot = self._free(key)
        if slot is None:  # captured at the next step, from these inputs
            self.samples.setdefault(key, ([x.detach() if isinstance(x, torch.Tensor) else x for x in inputs], key[1]))
            return super().forward(step, i, inputs, needs_grad)
        inputs = [self._leaf(x, False, step) for x in inputs]
        begun = step.timeline.begin(self.stage.device)
        slot.replay_forward(self, step, i, inputs)
        outputs = slot.copied_outputs()
        step.timeline.end(begun, self.index, i, "forward", self.stage.device)
        recomputed = step.recomputes(i)
        slot.owner = None if recomputed else weakref.ref(step)
        step.stages[id(self)].saved[i] = _Replayed(key, inputs if recomputed else None, None if recomputed else slot)
        return outputs

    def rematerialise(self, step: StepState, i: int) -> None:
        mine = step.stages[id(self)]
        saved = mine.saved.get(i)
        if not isinstance(saved, _Replayed):
            return super().rematerialise(step, i)
        if saved.slot is not None:
            return
        slot = self._free(saved.key)
        if slot is None:  # every slot busy: the eager recompute, from the same inputs and seed
            mine.saved[i] = Saved([self._leaf(x, g, step) for x, g in zip(saved.inputs, saved.key[1])], None, None)
            return super().rematerialise(step, i)
        begun = step.timeline.begin(self.stage.device)
        slot.replay_forward(self, step, i, saved.inputs)
        step.timeline.end(begun, self.index, i, "recompute", self.stage.device)
        slot.owner, saved.slot, saved.inputs = weakref.ref(step), slot, None

    def backward(self, step: StepState, i: int, output_grads: list) -> list:
        self.rematerialise(step, i)
        mine = step.stages[id(self)]
        saved = mine.saved.get(i)
        if not isinstance(saved, _Replayed):
            return super().backward(step, i, output_grads)
        del mine.saved[i]
        slot = saved.slot
        if all(g is None for g in output_grads):
            slot.owner = None
            return [None] * len(slot.inputs)
        begun = step.timeline.begin(self.stage.device)
        grads = [g if g is None or g.device == self.stage.device else
                 moved(g, self.stage.device, self.copy_streams, step.ambient.streams) for g in output_grads]
        input_grads, param_grads = slot.replay_backward(grads, first=not mine.param_grads)
        step.timeline.end(begun, self.index, i, "backward", self.stage.device)
        slot.owner = None
        if param_grads:
            add_param_grads(mine, param_grads)
        return input_grads

    # -- capture --------------------------------------------------------------------
    def _capture(self, step: StepState) -> None:
        """The slots each signature seen in an eager task needs, captured now, before any task of the step runs."""
        schedule = step.timeline.schedule
        needed = graph_slots(schedule.stage_order(self.index), [step.recomputes(i) for i in range(step.chunks)])
        samples, self.samples = self.samples, {}
        device = self.stage.device
        if self.capture_stream is None:  # a stage's own stream (devices= gave one), else a side stream
            self.capture_stream = getattr(self, "stream", None) or torch.cuda.Stream(device)
        for key, (inputs, grads) in samples.items():
            if key != self._key(step, inputs, grads):  # made under other settings (autocast, trainable parameters)
                continue
            have = self.slots.setdefault(key, [])
            while len(have) < min(needed, self.seen.get(key, needed)):
                try:
                    have.append(_Slot(self, step, inputs, grads, self.capture_stream))
                except Exception as e:  # the stage runs eagerly from now on, and its plan says why
                    self._give_up(f"capture failed: {str(e).strip().splitlines()[0] if str(e).strip() else type(e)}")
                    return

    def _give_up(self, why: str) -> None:
        self.slots.clear()
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(self.stage.device)
        if self.report is not None:
            self.report.stages[self.index] = StageCapture(self.index, (CaptureBlocker("-", "capture",
                                                                                      f"stage {self.index}", why),))


def _grad(outputs: list, inputs: list, params: list, grad_outputs: list | None) -> tuple:
    roots = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
    wrt = [x for x in inputs if isinstance(x, torch.Tensor) and x.requires_grad] + list(params)
    if not roots or not wrt:
        return ()
    grad_outputs = grad_outputs if grad_outputs is not None else [torch.empty_like(r) for r in roots]
    return torch.autograd.grad(roots, wrt, grad_outputs, allow_unused=True)


class _Slot:
    """One captured forward and backward of a stage at one input signature: static inputs, outputs, saved activations
    and gradients, in a memory pool of its own. ``owner``: a weak reference to the step holding it (None: free; a step
    dropped before its backward frees it when collected)."""

    def __init__(self, runner: GraphedStageRunner, step: StepState, sample: list, grads: tuple, stream: Any):
        self.owner = None
        params = list(step.stages[id(runner)].wrt_params)
        with torch.cuda.device(runner.stage.device):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.inputs = [x.detach().clone().requires_grad_(g) if isinstance(x, torch.Tensor) else x
                               for x, g in zip(sample, grads)]
                with _capturing(runner, step):  # warm-up on the side stream (torch's docs, make_graphed_callables)
                    for _ in range(WARMUP_ITERATIONS):
                        _grad(self._run(runner), self.inputs, params, None)
                torch.cuda.synchronize()
                pool = torch.cuda.graph_pool_handle()
                self.forward_graph, self.backward_graph = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
                if runner.generator is not None:
                    self.forward_graph.register_generator_state(runner.generator)
                with _capturing(runner, step):
                    with torch.cuda.graph(self.forward_graph, pool=pool, stream=stream):
                        self.outputs = self._run(runner)
                    differentiated = [k for k, o in enumerate(self.outputs)
                                      if isinstance(o, torch.Tensor) and o.requires_grad]
                    self.grad_outputs = {k: torch.empty_like(self.outputs[k]) for k in differentiated}
                    got: tuple = ()
                    if differentiated:
                        with torch.cuda.graph(self.backward_graph, pool=pool, stream=stream):
                            got = _grad(self.outputs, self.inputs, params, list(self.grad_outputs.values()))
                    else:
                        self.backward_graph = None
            torch.cuda.current_stream().wait_stream(stream)
        wanted = [k for k, x in enumerate(self.inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
        self.input_grads: list = [None] * len(self.inputs)
        for k, g in zip(wanted, got):
            self.input_grads[k] = g
        self.param_grads = list(got[len(wanted):]) if got else [None] * len(params)

    def _run(self, runner: GraphedStageRunner) -> list:
        kwargs = {"generator": runner.generator} if runner.generator is not None else {}
        return list(runner.stage(*self.inputs, **kwargs))

    def replay_forward(self, runner: GraphedStageRunner, step: StepState, i: int, inputs: list) -> None:
        with torch.no_grad():
            for static, x in zip(self.inputs, inputs):
                if isinstance(static, torch.Tensor) and static.data_ptr() != x.data_ptr():
                    static.copy_(x)
        if runner.generator is not None:  # as StageRunner._run seeds it: the same draws, fresh at each step
            runner.generator.manual_seed(task_seed(step.seed, runner.stage.index, i))
        self.forward_graph.replay()

    def copied_outputs(self) -> list:
        """The outputs, out of the slot's static memory: the next replay overwrites it."""
        return [o.detach().clone() if isinstance(o, torch.Tensor) else o for o in self.outputs]

    def replay_backward(self, grads: list, first: bool) -> tuple[list, list]:
        """Input gradients (copied out) and parameter gradients: copied where they start the step's sum (``first``),
        else read in stream order by the sum before any later replay writes them."""
        with torch.no_grad():
            for k, static in self.grad_outputs.items():
                if grads[k] is None:  # no gradient reaches this output: zero, as the eager backward leaves it out
                    static.zero_()
                else:
                    static.copy_(grads[k])
        if self.backward_graph is not None:
            self.backward_graph.replay()
        inputs = [None if g is None else g.clone() for g in self.input_grads]
        return inputs, [g.clone() if first and g is not None else g for g in self.param_grads]


@contextlib.contextmanager
def _capturing(runner: GraphedStageRunner, step: StepState):
    """What a task enters around the stage (StageRunner._run, _enter): grad mode, the caller's autocast without its
    cache (make_graphed_callables refuses the cache: cached casts would live in the graph's pool), the replicas of tied
    weights."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch.enable_grad())
        enabled, dtype = step.ambient.autocast.get("cuda", (False, None))
        if enabled:
            stack.enter_context(torch.autocast("cuda", dtype=dtype, cache_enabled=False))
        if runner._replica_slots:
            stack.enter_context(swapped(runner._replica_slots))
        yield
