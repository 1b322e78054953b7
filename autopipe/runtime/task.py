"""One task: a stage's forward, re-materialisation or backward for one micro-batch, for every transport.

Re-materialisation (GPipe sec. 2.3) runs the first forward with grad mode on, so the recompute repeats the
same kernels on the same inputs with the same generator seed: bit for bit (Note [recompute under grad mode], Note [one
generator per task]). Parameter gradients come from the engine and are summed in schedule order (runtime/gradients.py).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from .batchnorm import DeferredBatchNorm
from .gradients import add_param_grads, differentiable, summed_as_made
from .memory import SavedBytes, tensor_bytes
from .split_backward import WeightWork, backward_input, engine_grad
from .step_state import StepState, task_seed
from .streams import detached
from .transfers import moved


@contextlib.contextmanager
def swapped(slots: list[tuple[dict, str, torch.Tensor, torch.Tensor]]):
    """Module tables (``_parameters``, ``_buffers``) pointing at stand-ins for one task: ``(table, name, original,
    stand_in)``. The user's modules hold their own tensors again afterwards."""
    for table, name, _, stand_in in slots:
        table[name] = stand_in
    try:
        yield
    finally:
        for table, name, original, _ in slots:
            table[name] = original


@dataclass
class Saved:
    inputs: list
    outputs: list | None   # None: dropped, to be recomputed
    state: list | None = None  # the written buffers as this forward found them, for the recompute


@dataclass
class StageStep:
    """A runner's part of one step. The step's, not the runner's: a second pipeline call may run before the first
    one's backward (two views of a batch, one loss)."""

    trainable: list[torch.nn.Parameter]   # the parameters with requires_grad as the step started
    wrt_params: list[torch.Tensor]  # what autograd differentiates for them: each, its replica or a hook-free alias
    alias_slots: list
    saved: dict[int, Saved] = field(default_factory=dict)
    weights: dict[int, Any] = field(default_factory=dict)  # B's result for W: a WeightWork, the gradients, or None
    param_grads: list[torch.Tensor | None] = field(default_factory=list)  # per trainable parameter, once a backward ran
    owned: list[bool] = field(default_factory=list)  # param_grads[k] is a sum made here, safe to add to in place


@dataclass
class StageRunner:
    """Runs one stage's tasks (see module docstring); one per stage and compiled program."""

    stage: Any                                     # passes.codegen.Stage
    params: list[torch.nn.Parameter] = field(init=False)
    generator: torch.Generator | None = field(init=False)
    param_ids: set[int] = field(init=False)

    def __post_init__(self):
        self.generator = torch.Generator(device=self.stage.device) if self.stage.uses_rng else None
        self.state = list(self.stage.written_buffers)  # not BatchNorm's statistics, which training never reads
        where = {id(b): k for k, b in enumerate(self.state)}
        self._state_slots = [(m._buffers, name, where[id(b)]) for m in self.stage.modules()
                             for name, b in m._buffers.items() if id(b) in where]
        self.shared: frozenset[int] = frozenset()  # parameters another stage reads too (set by its Program)
        self.sum_as_made = False  # a rank's runners only: Note [no hook on a tensor two threads differentiate]
        self.table_lock: Any = None  # shared with the other stages that read one of its parameters (its Program)
        self.shared_replicas = False  # a stage holds a replica of a shared parameter
        self._locking = False
        self.take_parameters()
        self.copy_streams: dict[torch.device, Any] = {}  # per device, for transfers onto this stage's device
        own = getattr(self.stage, "compute_stream", None)  # a StageStream: devices= gave this stage a stream
        self.stream = own.stream if own is not None else None

    def summing(self, mine: Any, step: Any):
        """Around an engine call: the gradients summed as the engine makes them, where this runner does so."""
        return summed_as_made(mine, step.chunks > 1) if self.sum_as_made else contextlib.nullcontext()

    def take_parameters(self) -> None:
        """The parameters as the stage's modules hold them now: when built, and at each step's start under FSDP2,
        which registers the unsharded parameters on the modules for the step (runtime/sharding.py)."""
        unique = {id(p): p for p in self.stage.parameters()}
        self.params = list(unique.values())
        where = {id(b) for b in self.state}
        # a tied weight (or shared buffer) placed on another stage's device: a replica here, refreshed every step;
        # its gradient goes to the user's Parameter (step.py sums the stages' gradients on its device)
        self.replicas: dict[int, torch.Tensor] = {}
        self._replica_slots = []
        self._slots_of: dict[int, list] = {}  # a parameter's places in the stage's module tables
        for table in (t for m in self.stage.modules() for t in (m._parameters, m._buffers)):
            for name, t in table.items():
                if t is not None and t.device != self.stage.device and id(t) not in where:
                    if id(t) not in self.replicas:
                        replica = torch.empty_like(t, device=self.stage.device)
                        self.replicas[id(t)] = replica.requires_grad_(t.requires_grad)
                    self._replica_slots.append((table, name, t, self.replicas[id(t)]))
                elif isinstance(t, torch.nn.Parameter):
                    self._slots_of.setdefault(id(t), []).append((table, name))
        self._wrt = [self.replicas.get(id(p), p) for p in self.params]  # what autograd differentiates
        self.param_ids = {p.untyped_storage().data_ptr() for p in self._wrt if not is_traceable_wrapper_subclass(p)}

    @property
    def index(self) -> int:
        return self.stage.index

    # Note [one stage at a time in a shared module table]: stages that read one parameter (a tied weight) read it from
    # one module table, the model's own. A stage that swaps that slot for a task (a hooked parameter's alias, a
    # replica on another device) would hand it to the other stage's worker thread mid-task: that stage then computed
    # with the wrong alias and its gradient went to the other's sum (test_step's tied heads lost one part of a.weight
    # 7 runs in 8). Where a shared parameter is swapped, the stages that read it run their tasks one at a time.
    # Note [parameter hooks on an alias]: a parameter with a gradient hook is differentiated through a hook-free alias
    # of the same storage, so the hook runs once, on the step's whole gradient (in the engine for pipe(x), through
    # accumulate_grads for pipe.step), as in the plain model, not once per micro-batch.
    def start_step(self, step: StepState) -> None:
        self._locking = self.table_lock is not None and (self.shared_replicas or any(
            p._backward_hooks for p in self.params if id(p) in self.shared))
        if self._replica_slots:
            with torch.no_grad():
                for _, _, original, replica in self._replica_slots:
                    replica.copy_(original, non_blocking=True)
        if not step.training:
            step.stages[id(self)] = StageStep([], [], [])
            return
        # a hook-free alias per hooked parameter; map/compress: every parameter is looked at every step, in C loops
        # (Note [a step's fixed cost is its lines])
        hooked = {id(p): p.detach().requires_grad_() for p in self.params if p._backward_hooks
                  and id(p) in self._slots_of} \
            if any(map(attrgetter("_backward_hooks"), self.params)) else {}
        alias_slots = [(table, name, p, hooked[id(p)]) for p in self.params if id(p) in hooked
                       for table, name in self._slots_of[id(p)]] if hooked else []
        wrt = [hooked.get(id(p), w) for p, w in zip(self.params, self._wrt)] if hooked else self._wrt
        flags = list(map(attrgetter("requires_grad"), self.params))
        step.stages[id(self)] = StageStep(self.params, wrt, alias_slots) if all(flags) else \
            StageStep(list(compress(self.params, flags)), list(compress(wrt, flags)), alias_slots)

    # -- forward ------------------------------------------------------------------
    # Note [recompute under grad mode]: some models pick other CPU kernels under no_grad (T5), so a first forward
    # under no_grad and its recompute with grad differ. The first forward of a micro-batch that will be recomputed
    # runs with grad mode on and its graph is dropped at once: the recompute then runs the same kernels on the same
    # inputs with the same seed, bit for bit.
    # Note [buffers written in place per task]: a buffer the model writes in place and reads (Stage.written_buffers,
    # not BatchNorm's statistics) is copied for each task and copied back after the forward, so a micro-batch's graph
    # keeps the value it saw; a recompute runs on a copy of the value its forward started from.
    def forward(self, step: StepState, i: int, inputs: list, needs_grad: list[bool]) -> list:
        """Outputs of micro-batch ``i``, detached; ``needs_grad[k]``: whether input k gets a gradient."""
        keep = step.training and not step.recomputes(i)
        private = step.training and step.deferred is None  # deferred BatchNorm knows the buffers by identity
        inputs = [self._leaf(x, g and step.training, step) for x, g in zip(inputs, needs_grad)]
        state = [b.clone() for b in self.state] if private and self.state and not keep else None
        copies = [b.clone() for b in self.state] if private else []
        if copies:
            with self._own_state(copies):
                outputs = self._run(step, i, inputs, first=True)
            with torch.no_grad():
                for buffer, copy in zip(self.state, copies):
                    buffer.copy_(copy)
        else:
            outputs = self._run(step, i, inputs, first=True)
        if step.training:
            step.stages[id(self)].saved[i] = Saved(inputs, outputs if keep else None, state)
        return [o.detach() if isinstance(o, torch.Tensor) else o for o in outputs]

    def rematerialise(self, step: StepState, i: int) -> None:
        """The forward again, from the saved inputs: before the gradient arrives, off the critical path; on a copy of
        the written buffers its forward started from (Note [buffers written in place per task])."""
        saved = step.stages[id(self)].saved[i]
        if saved.outputs is None:
            own = {id(b) for b in self.state} if saved.state is not None else set()
            snapshot = [(b, b.clone()) for b in self.stage.running_buffers if id(b) not in own] \
                if self.stage.training else []
            with self._own_state(saved.state or []):
                saved.outputs = self._run(step, i, saved.inputs, first=False)
            # Running statistics move once per micro-batch, in the forward. Through .data: the
            # recompute's graph saved these buffers, and a tracked write would fail its backward.
            for buffer, before in snapshot:
                buffer.data.copy_(before)

    def _leaf(self, x: Any, needs_grad: bool, step: StepState) -> Any:
        """A stage input as a leaf of the task's own autograd graph, on the stage's device (a transport delivers
        values where they were made, or received: the host for gloo)."""
        if not isinstance(x, torch.Tensor):
            return x
        x = moved(detached(x), self.stage.device, self.copy_streams, step.ambient.streams)
        return x.requires_grad_() if needs_grad and differentiable(x) else x

    # Note [the caller's stream]: a CUDA stage computes on the caller's current stream of its device (torchgpipe's
    # compute streams are current_stream too), captured when the step starts and entered around the whole task,
    # transport waits and sends included: the step is ordered after what the caller queued and before what it does
    # next, with no synchronisation. Only the pipeline's GPUs are made current (that creates a CUDA context there).
    def on_device(self, step: StepState) -> contextlib.AbstractContextManager:
        """Around a whole task (executor.run_tasks): a CUDA stage's device made current, and on it the stage's own
        stream or else the caller's, so the step is ordered after the caller's work and before what it does with the
        results (Note [the caller's stream]; streams.py: a stage stream joins the caller's at each phase's start and
        end)."""
        if self.stage.device.type != "cuda":
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(torch.cuda.device(self.stage.device))
        own = self.stream if self.stream is not None else step.ambient.streams.get(self.stage.device)
        stack.enter_context(torch.cuda.stream(own))
        return stack

    def _own_state(self, copies: list):
        """The written buffers swapped for ``copies`` while a task runs: its graph saves its own copy, which no
        later micro-batch writes, and a recompute runs on a copy of the value its forward started from."""
        return swapped([(table, name, self.state[k], copies[k]) for table, name, k in self._state_slots]) if copies \
            else contextlib.nullcontext()

    def _run(self, step: StepState, i: int, inputs: list, first: bool) -> list:
        stage, a = self.stage, step.ambient
        begun = step.timeline.begin(stage.device)
        kwargs = {}
        if self.generator is not None:
            self.generator.manual_seed(task_seed(step.seed, stage.index, i))
            kwargs["generator"] = self.generator
        if a.plain and not (a.inference or self._replica_slots or step.stages[id(self)].alias_slots or step.deferred
                            or step.memory) \
                and torch.is_grad_enabled() == step.training:  # nothing to enter: a task's least work
            outputs = stage(*inputs, **kwargs)
            step.timeline.end(begun, stage.index, i, "forward" if first else "recompute", stage.device)
            return list(outputs)
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(step.training))
            counter = self._enter(stack, step, first)
            outputs = stage(*inputs, **kwargs)
        step.timeline.end(begun, stage.index, i, "forward" if first else "recompute", stage.device)
        if counter is not None:
            if first:
                kept = counter.total if not step.recomputes(i) else tensor_bytes(inputs)
                step.memory.add_kept(stage.index, kept)
            if not first or step.recomputes(i):
                step.memory.add_recompute(stage.index, counter.total)
        return list(outputs)

    def _enter(self, stack: contextlib.ExitStack, step: StepState, first: bool) -> SavedBytes | None:
        """The task's contexts besides grad mode; the saved-bytes counter where memory is tracked."""
        stage = self.stage
        if step.ambient.inference and not step.training:
            stack.enter_context(torch.inference_mode())
        step.ambient.enter(stack, stage.device)
        if self._locking:  # Note [one stage at a time in a shared module table]
            stack.enter_context(self.table_lock)
        if self._replica_slots or step.stages[id(self)].alias_slots:
            stack.enter_context(swapped(self._replica_slots + step.stages[id(self)].alias_slots))
        if step.deferred is not None and stage.running_buffers:
            stack.enter_context(DeferredBatchNorm(step.deferred, accumulate=first))
        if step.memory is not None and step.training:
            return stack.enter_context(SavedBytes(self.param_ids))
        return None

    # -- backward -----------------------------------------------------------------
    def backward(self, step: StepState, i: int, output_grads: list) -> list:
        """Gradients of the stage's inputs for micro-batch ``i`` (None where there is none); parameter gradients are
        added to the step's, in the order tasks run. Under a split schedule this is B, and W adds them later."""
        self.rematerialise(step, i)
        mine = step.stages[id(self)]
        saved = mine.saved.pop(i)
        roots, grads = self._roots(step, saved, output_grads)
        wrt_inputs = [k for k, x in enumerate(saved.inputs) if isinstance(x, torch.Tensor) and x.requires_grad]
        input_grads: list = [None] * len(saved.inputs)
        if not roots or not (wrt_inputs or mine.wrt_params):
            mine.weights[i] = None
            return input_grads
        begun = step.timeline.begin(self.stage.device)
        inputs = [saved.inputs[k] for k in wrt_inputs]
        with step.ambient.entered(self.stage.device), self.summing(mine, step):
            if step.split_backward and wrt_inputs and mine.wrt_params and (self.index, i) not in step.full_backwards:
                got, mine.weights[i] = backward_input(roots, grads, inputs, mine.wrt_params)
            else:  # fused; the first stage's B too, where no input needs a gradient (nothing waits on it), and a full
                # backward: its W adds what this computed
                got = _grad(roots, grads, inputs + mine.wrt_params)
                mine.weights[i] = list(got[len(wrt_inputs):])
        step.timeline.end(begun, self.index, i, "backward", self.stage.device)
        for k, g in zip(wrt_inputs, got):
            input_grads[k] = g
        if not step.split_backward:
            self.backward_weight(step, i)
        return input_grads

    def backward_weight(self, step: StepState, i: int) -> None:
        """W: the parameter gradients of micro-batch ``i``, from what its B kept, added to the step's in task order;
        then its graph is freed."""
        mine = step.stages[id(self)]
        work = mine.weights.pop(i)
        if isinstance(work, WeightWork):
            begun = step.timeline.begin(self.stage.device)
            with step.ambient.entered(self.stage.device), self.summing(mine, step):
                work = work.run()
            step.timeline.end(begun, self.index, i, "weight", self.stage.device)
        if work is not None:
            add_param_grads(mine, work)

    def _roots(self, step: StepState, saved: Saved, output_grads: list) -> tuple[list, list]:
        """The outputs that get a gradient, and their gradients on the stage's device."""
        roots, grads = [], []
        for out, g in zip(saved.outputs, output_grads):
            if g is not None and isinstance(out, torch.Tensor) and out.requires_grad:
                roots.append(out)
                grads.append(g if g.device == out.device else moved(g, out.device, self.copy_streams,
                                                                     step.ambient.streams))
        return roots, grads

    def take_grads(self, step: StepState) -> list[tuple[torch.nn.Parameter, torch.Tensor]]:
        """The step's (parameter, gradient) pairs, forgotten here: AccumulateGrad then takes each without a copy."""
        mine = step.stages[id(self)]
        grads, mine.param_grads = mine.param_grads, []
        return [(p, g) for p, g in zip(mine.trainable, grads) if g is not None]


# Note [a step's fixed cost is its lines]: a step's own Python runs with cold caches, so its fixed cost is the
# number of distinct lines it runs, not their speed in a loop. The runtime reads per-parameter flags in C loops
# (map(attrgetter(...))), enters no context manager that has nothing to do, and calls the engine as
# torch.autograd.grad ends up doing, without its per-input Python checks.
def _grad(roots: list, grads: list, wrt: list) -> tuple:
    """``torch.autograd.grad(roots, wrt, grads, allow_unused=True)`` without its per-input Python checks: the engine
    call it ends in (torch/autograd/__init__.py, ``_engine_run_backward``; Note [a step's fixed cost is its lines])."""
    return engine_grad(roots, grads, wrt, keep_graph=False)
