"""A step's execution in one process: the compiled programs, the autograd Function whose backward drives the
stages' backward, the anchors that hand parameter gradients to the engine, and one mini-batch's run through them.
The nn.Module a user holds is pipeline.py's Pipeline (why not one graph across stages: Note [anchors])."""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from autopipe.ir.batch import carries_batch
from autopipe.ir.schedule import Schedule, Task

from . import microbatch
from .cuda_graphs import use_cuda_graphs
from .executor import run_tasks
from .gradients import accumulate_grads, sum_grads
from .loss import Loss, scaled
from .step_state import StepState
from .task import StageRunner
from .threads import Mailbox, run_on_workers


@dataclass
class Program:
    """One traced graph, planned and generated: what a micro-batch runs."""

    traced: Any                 # passes.trace.TracedModel
    plan: Any                   # autopipe.plan.Plan
    stages: list                # passes.codegen.Stage
    # a micro-batch's count of targets per output merged by count: codegen's count program (None: no output needs it)
    counts: torch.fx.GraphModule | None = None
    runners: list[StageRunner] = field(init=False)
    readers: dict[str, int] = field(init=False)  # how many gradients a value gets: its consumer stages, the output

    def __post_init__(self):
        self.runners = [StageRunner(s) for s in self.stages]
        readers = collections.Counter(id(p) for r in self.runners for p in r.params)
        shared = frozenset(i for i in readers if readers[i] > 1)
        lock = threading.RLock() if shared else None  # Note [one stage at a time in a shared module table]
        replicated = any(i in r.replicas for r in self.runners for i in shared)
        for runner in self.runners:  # Note [no hook on a tensor two threads differentiate]
            runner.shared, runner.shared_replicas = shared, replicated
            runner.table_lock = lock if any(id(p) in shared for p in runner.params) else None
        self.readers = {name: len(set(t.consumers)) + t.is_output for name, t in self.plan.tensors.items()}
        if self.plan.cuda_graphs is not None:  # cuda_graphs=True: the stages its capture report lets replay as graphs
            use_cuda_graphs(self)

    def count_targets(self, flat: list) -> dict[str, float]:
        """Each output merged by count -> this micro-batch's count of its targets (one host sync)."""
        if self.counts is None:
            return {}
        names = [n for n in self.plan.graph_outputs if self.plan.tensors[n].count]
        with torch.no_grad():
            return dict(zip(names, torch.stack([c.double() for c in self.counts(*flat)]).tolist()))


@dataclass
class Compiled:
    """Everything the runtime needs for one input signature; built by autopipe.compile.

    ``programs`` maps a micro-batch size to its Program; a model traced with a dynamic
    batch has one, under None. A model that specialises on the batch size is traced once
    per micro-batch size it runs at (passes/trace.py, ``static_batch``)."""

    programs: dict[int | None, Program]
    example_dtypes: list[torch.dtype]

    @property
    def parameters(self) -> list[torch.nn.Parameter]:
        """Every parameter a stage holds, once, in stage order (cached: a walk over the model every call would be part
        of each step's fixed cost, Note [a step's fixed cost is its lines])."""
        cached = getattr(self, "_parameters", None)
        if cached is None or cached[0] != len(self.programs):  # programs grow for new static sizes
            unique = {id(p): p for program in self.programs.values() for r in program.runners for p in r.params}
            self._parameters = cached = (len(self.programs), list(unique.values()))
        return cached[1]

    @property
    def uses_rng(self) -> bool:
        return any(s.uses_rng for program in self.programs.values() for s in program.stages)

    main = property(lambda self: next(iter(self.programs.values())), doc="The first Program (the only one, mostly).")
    traced = property(lambda self: self.main.traced)
    plan = property(lambda self: self.main.plan)
    stages = property(lambda self: self.main.stages)

    def program(self, size: int) -> Program:
        return self.programs.get(size) or self.programs[None]

    def covers(self, sizes: Sequence[int]) -> bool:
        return None in self.programs or all(s in self.programs for s in sizes)


class _PipelineFunction(torch.autograd.Function):
    """The pipeline as one autograd node: its backward drives the stages' backward. Its inputs are the call's
    tensors and one anchor per device (_Anchor), which hands the parameters' gradients on."""

    @staticmethod
    def forward(ctx, run: "Run", *inputs_and_anchors: torch.Tensor):
        with torch.enable_grad():  # once here, not in every task (a Function's forward runs without grad)
            outputs = run.forward()
        ctx.run = run
        # an output the loss does not read gets None, so its parameters get None, not zeros
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*[o for o in outputs if not (o.is_floating_point() or o.is_complex())])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        run = ctx.run
        if torch.is_grad_enabled():  # the engine runs a backward with grad mode on only for create_graph=True
            raise RuntimeError("a backward with create_graph=True through the pipeline (a gradient penalty, MAML, a "
                               "Hessian-vector product) is not supported: the stages' gradients carry no graph of "
                               "their own, so a second backward would miss them; compute such a term on the plain "
                               "model")
        if run is None:
            raise RuntimeError("the pipeline's backward can run once per forward; call the pipeline again "
                               "(retain_graph=True is not supported)")
        ctx.run = None
        input_grads, param_grads = run.backward(grad_outputs)
        return (None, *input_grads, *[anchor.deliver(param_grads) for anchor in run.anchors])


# Note [anchors]: the step's parameter gradients reach the engine through one persistent node per device whose
# inputs are that device's trainable parameters: the pipeline Function's backward leaves them in the anchor's box,
# tagged with the engine's graph task, and the engine takes them into AccumulateGrad, hooks and captures, only if
# it will run the anchor (torch.autograd.grad(out, [x]) leaves nothing behind). Parameters as the Function's inputs
# did the same at a cost per parameter per step. One graph across stages would serialise CPU backward.
class _Anchor(torch.autograd.Function):
    """A persistent autograd node whose inputs are one device's trainable parameters, and whose output feeds every
    step's _PipelineFunction. A step's backward leaves the gradients in its box for the engine to take, tagged with
    its graph task (Note [anchors]). Built once per parameter list and current stream (the stream the engine orders
    the gradients on)."""

    @staticmethod
    def forward(ctx, box: "_Box", *params: torch.Tensor):
        ctx.box = box  # not the Anchor: its tensor holds this node, and the cycle would keep the parameters alive
        return torch.zeros((), device=params[0].device)

    @staticmethod
    def backward(ctx, _):
        (task, grads), ctx.box.left = ctx.box.left, (None, None)
        return (None, *(grads if task == torch._C._current_graph_task_id() else [None] * ctx.box.count))


@dataclass
class _Box:
    count: int
    left: tuple = (None, None)  # (graph task, gradients) a backward left for the anchor


class Anchor:
    def __init__(self, params: list[torch.nn.Parameter], positions: list[int]):
        self.positions = positions  # of its parameters in the step's trainable list
        self.device = params[0].device
        self.stream = torch.cuda.current_stream(self.device) if self.device.type == "cuda" else None
        self.box = _Box(len(params))
        self.every = positions == list(range(len(positions)))  # all the step's parameters, in order: no reordering
        with torch.enable_grad():
            self.tensor = _Anchor.apply(self.box, *params)
        self.zero = torch.zeros_like(self.tensor)

    def deliver(self, grads: list[torch.Tensor | None]) -> torch.Tensor | None:
        """Leave this device's gradients for the anchor, if this backward runs it (not for autograd.grad(out, x)),
        added to what an earlier pipeline call of the same backward left."""
        if not torch._C._will_engine_execute_node(self.tensor.grad_fn):
            return None
        task, mine = torch._C._current_graph_task_id(), grads if self.every else [grads[k] for k in self.positions]
        if self.box.left[0] == task:
            mine = [sum_grads(pair) for pair in zip(self.box.left[1], mine)]
        self.box.left = (task, mine)
        return self.zero


class Run:
    """One mini-batch through the pipeline."""

    def __init__(self, pipe: torch.nn.Module, compiled: Compiled, flat: list[torch.Tensor], sizes: list[int],
                 training: bool):
        self.pipe = pipe
        self.compiled = compiled
        self.plan = compiled.plan
        self.batch = flat[0].shape[0]
        self.sizes = sizes
        self.chunks = len(self.sizes)
        self.programs = [compiled.program(size) for size in self.sizes]
        self.flat = flat
        self.training = training
        self.schedule = pipe.schedule_for(self.chunks)
        self.state = StepState.start(
            training=training, random=pipe.model.training and compiled.uses_rng, checkpoint=pipe.checkpoint,
            schedule=self.schedule if training else pipe.schedule_for(self.chunks, forward_only=True),
            deferred_model=pipe.model if pipe.deferred_batch_norm else None, track_memory=pipe.track_memory,
            devices=pipe.devices)
        self.input_grad = [training and t.requires_grad for t in flat]
        rows = microbatch.split(flat, self.sizes)
        self.counts = [program.count_targets(row) for program, row in zip(self.programs, rows)]  # by output name
        self.mailbox = Mailbox(self.programs, rows, self.input_grad)
        self.runners_all = sorted({id(r): r for p in self.programs for r in p.runners}.values(), key=lambda r: r.index)
        for r in self.runners_all:
            r.start_step(self.state)
        # not nn.Module's __setattr__ (Note [a step's fixed cost is its lines])
        vars(pipe).update(timeline=self.state.timeline, memory=self.state.memory or pipe.memory)
        # so does one CPU worker with the caller's thread count (Note [inline under a profiler or a mode])
        workers = pipe.workers
        alone = len(workers) == 1 and workers[0].device.type == "cpu" and \
            workers[0].intra_op_threads == torch.get_num_threads()
        self.inline = alone or bool(self.state.ambient.inline_reason)
        self.params = self._trainable() if training else []
        self.anchors: list[Anchor] = []  # pipe(x)'s, set by Pipeline.forward; pipe.step needs none

    def _trainable(self) -> list[torch.nn.Parameter]:
        """The trainable parameters, each once, in stage order: the order of the step's gradient list."""
        if len(self.runners_all) == 1:
            return self.state.stages[id(self.runners_all[0])].trainable
        return list({id(p): p for r in self.runners_all for p in self.state.stages[id(r)].trainable}.values())

    def _runner(self, task: Task) -> StageRunner:
        return self.programs[task.micro_batch].runners[task.stage]

    def _execute(self, schedule: Schedule, kinds: str, loss: Loss | None = None, inline: bool = False) -> None:
        state, mailbox = self.state, self.mailbox
        if inline or self.inline:
            run_tasks(self.pipe.orders(schedule, kinds, inline=True)[0], self._runner, mailbox, state, loss)
            return
        jobs = [lambda order=order: run_tasks(order, self._runner, mailbox, state, loss)
                for order in self.pipe.orders(schedule, kinds)]
        run_on_workers(self.pipe.workers, jobs, mailbox)

    # Note [allocator peaks are the user's]: the allocator's peak statistics belong to the user, so the report never
    # resets them: a step's peak is reported where the step raised the device's peak, and not otherwise. Stages on
    # one GPU share one allocator, and the report says so.
    def _note_peaks(self) -> None:
        """The caller's peak statistics are never reset: a step's CUDA peak is known where it raised the peak (Note
        [allocator peaks are the user's])."""
        self.peaks_before = {} if self.state.memory is None else \
            {s.device: torch.cuda.max_memory_allocated(s.device)
             for s in self.compiled.stages if s.device.type == "cuda"}

    def through_autograd(self, flat: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """``forward`` as one autograd node (_PipelineFunction) over the call's tensors and the anchors: its backward
        drives the stages' backward (``pipe(x)`` in training)."""
        return _PipelineFunction.apply(self, *flat, *[a.tensor for a in self.anchors])

    def forward(self) -> list[torch.Tensor]:
        self._note_peaks()
        self._execute(self.schedule, "F")
        if self.state.deferred is not None:
            self.state.deferred.commit()
        tensors = self.plan.tensors
        return [microbatch.merge(self._parts(name), self.sizes, tensors.get(name), f"the model's output {name}",
                                 self._counts(name)) for name in self.plan.graph_outputs]

    def _counts(self, name: str) -> list[float] | None:
        """Each micro-batch's count of the targets output ``name`` averages over, where it merges by count."""
        return [c[name] for c in self.counts] if self.counts[0] and name in self.counts[0] else None

    def _parts(self, name: str) -> list[torch.Tensor]:
        return [self.mailbox.value(i, name) for i in range(self.chunks)]

    def backward(self, grad_outputs: Sequence[torch.Tensor | None]):
        parts = [microbatch.split_grad(grad, self._parts(name), self.sizes, self.plan.tensors.get(name),
                                       self._counts(name)) for name, grad in zip(self.plan.graph_outputs, grad_outputs)]
        for i in range(self.chunks):
            self.mailbox.send_final_grads(i, [p[i] for p in parts])
        # The autograd engine runs CUDA backward on one thread per device: issuing each stage's
        # backward from the engine thread lets the devices overlap there, as in torchgpipe.
        inline = any(s.device.type == "cuda" for s in self.compiled.stages)
        self._execute(self.schedule, "B", inline=inline)
        self._cuda_peaks()
        return self._input_grads(), self._param_grads()

    def _cuda_peaks(self) -> None:
        for stage in self.compiled.stages if self.peaks_before else ():
            if stage.device in self.peaks_before:
                peak = torch.cuda.max_memory_allocated(stage.device)
                if peak > self.peaks_before[stage.device]:
                    report = self.state.memory.stages[stage.index]
                    report.cuda_peak, report.device = peak, str(stage.device)

    def step(self, targets: Sequence[Any], loss_fn: Callable) -> torch.Tensor:
        loss = Loss(fn=loss_fn, rebuild=self.compiled.traced.rebuild_output, targets=targets, sizes=self.sizes,
                    plan=self.plan, output_counts=self.counts)
        self._note_peaks()
        self._execute(self.schedule, "FB", loss=loss)
        self._cuda_peaks()
        if self.state.deferred is not None:
            self.state.deferred.commit()
        accumulate_grads(scaled(list(zip(self.params, self._param_grads())), loss.grad_scale))
        return loss.total

    def _input_grads(self) -> list[torch.Tensor | None]:
        grads = []
        for k, needed in enumerate(self.input_grad):
            if not needed:
                grads.append(None)
                continue
            parts = [self.mailbox.grad(i, self.programs[i].plan.graph_inputs[k]) for i in range(self.chunks)]
            if all(p is None for p in parts):
                grads.append(None)
                continue
            rows = microbatch.split([self.flat[k]], self.sizes)  # each part on the input's device
            parts = [torch.zeros_like(r[0]) if p is None else p.to(r[0].device) for p, r in zip(parts, rows)]
            grads.append(torch.cat(parts) if carries_batch(self.flat[k], self.batch) else sum(parts))
        return grads

    def _param_grads(self) -> list[torch.Tensor | None]:
        """Per parameter: the stages' sums added in stage order (tied weights: one sum)."""
        runners = self.runners_all
        if len(runners) == 1 and not runners[0].replicas:  # one stage: its gradients as they are, in params' order
            one = self.state.stages[id(runners[0])]
            grads, one.param_grads = one.param_grads, []
            return grads or [None] * len(self.params)
        totals: dict[int, torch.Tensor] = {}
        for runner in runners:
            for p, g in runner.take_grads(self.state):
                g = g.to(p.device) if runner.replicas and g.device != p.device else g
                totals[id(p)] = g if id(p) not in totals else totals[id(p)] + g
        return [totals.get(id(p)) for p in self.params]


def model_loss(output, target) -> torch.Tensor:
    """The loss a model computes itself: the output, ``output.loss`` or ``output["loss"]``."""
    loss = output["loss"] if isinstance(output, dict) and "loss" in output else getattr(output, "loss", output)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError("pipe.step needs a scalar loss: pass loss_fn=..., or return a loss from the model")
    return loss
