"""The in-process pipeline: ``pipe(x)`` / ``loss.backward()`` or ``pipe.step(...)``, stages on worker threads.

The merged outputs come out of one autograd Function whose inputs are the call's tensors and the model's
parameters; its backward runs each stage's backward tasks on their workers and returns the parameters'
gradients summed in a fixed order (docs/architecture.md, "Runtime": why not one graph across stages).
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from . import microbatch
from .executor import Loss, run_tasks
from .memory import MemoryReport
from .schedule import Schedule, Task
from .task import StageRunner, StepState, accumulate_grads
from .threads import Mailbox, Worker, run_on_workers
from .timeline import Timeline


@dataclass
class Program:
    """One traced graph, planned and generated: what a micro-batch runs."""

    traced: Any                 # passes.trace.TracedModel
    plan: Any                   # autopipe.plan.Plan
    stages: list                # passes.codegen.Stage
    runners: list[StageRunner] = field(init=False)
    readers: dict[str, int] = field(init=False)  # how many gradients a value gets: its consumer stages, the output

    def __post_init__(self):
        self.runners = [StageRunner(s) for s in self.stages]
        self.readers = {name: len(set(t.consumers)) + t.is_output for name, t in self.plan.tensors.items()}


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
        """Every parameter a stage holds, once, in stage order (cached: walking the model per call costs
        ~0.5 ms on a small GPT)."""
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
    def forward(ctx, run: "_Run", *inputs_and_anchors: torch.Tensor):
        with torch.enable_grad():  # once here, not in every task (a Function's forward runs without grad)
            outputs = run.forward()
        ctx.run = run
        ctx.mark_non_differentiable(*[o for o in outputs if not (o.is_floating_point() or o.is_complex())])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        run = ctx.run
        if run is None:
            raise RuntimeError("the pipeline's backward can run once per forward; call the pipeline again "
                               "(retain_graph=True is not supported)")
        ctx.run = None
        input_grads, param_grads = run.backward(grad_outputs)
        return (None, *input_grads, *[anchor.deliver(param_grads) for anchor in run.anchors])


class _Anchor(torch.autograd.Function):
    """A persistent autograd node whose inputs are one device's trainable parameters, and whose output feeds every
    step's _PipelineFunction. A step's backward leaves the gradients in its box for the engine to take, tagged with
    its graph task: parameters made inputs of _PipelineFunction instead would cost the engine ~2 us each, every step.
    Built once per parameter list and current stream (the stream the engine orders the gradients on)."""

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
            mine = [a if b is None else b if a is None else a + b for a, b in zip(self.box.left[1], mine)]
        self.box.left = (task, mine)
        return self.zero


class _Run:
    """One mini-batch through the pipeline."""

    def __init__(self, pipe: "Pipeline", compiled: Compiled, flat: list[torch.Tensor], sizes: list[int], training: bool):
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
        rows = microbatch.split(flat, compiled.traced.input_names, self.sizes)
        self.mailbox = Mailbox(self.programs, rows, self.input_grad)
        self.runners_all = sorted({id(r): r for p in self.programs for r in p.runners}.values(), key=lambda r: r.index)
        for r in self.runners_all:
            r.start_step(self.state)
        pipe.timeline, pipe.memory = self.state.timeline, self.state.memory or pipe.memory
        # One CPU worker with the caller's thread count has nothing to overlap: the calling thread runs
        # its tasks, with the same numerics and no hand-off between threads.
        workers = pipe.workers
        alone = len(workers) == 1 and workers[0].device.type == "cpu" and \
            workers[0].intra_op_threads == torch.get_num_threads()
        self.inline = alone or bool(self.state.ambient.inline_reason)
        self.params = self._trainable() if training else []
        self.anchors = pipe.anchors(self.params) if training else []

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

    def _note_peaks(self) -> None:
        """The caller's peak statistics are never reset: a step's CUDA peak is known where it raised the peak."""
        self.peaks_before = {s.device: torch.cuda.max_memory_allocated(s.device) for s in self.compiled.stages
                             if s.device.type == "cuda" and self.state.memory is not None}

    def forward(self) -> list[torch.Tensor]:
        self._note_peaks()
        self._execute(self.schedule, "F")
        if self.state.deferred is not None:
            self.state.deferred.commit()
        tensors = self.plan.tensors
        return [microbatch.merge(self._parts(name), self.sizes, tensors.get(name), f"the model's output {name}")
                for name in self.plan.graph_outputs]

    def _parts(self, name: str) -> list[torch.Tensor]:
        return [self.mailbox.value(i, name) for i in range(self.chunks)]

    def backward(self, grad_outputs: Sequence[torch.Tensor | None]):
        parts = [microbatch.split_grad(grad, self._parts(name), self.sizes, self.plan.tensors.get(name))
                 for name, grad in zip(self.plan.graph_outputs, grad_outputs)]
        for i in range(self.chunks):
            self.mailbox.send_final_grads(i, [p[i] for p in parts])
        # The autograd engine runs CUDA backward on one thread per device: issuing each stage's
        # backward from the engine thread lets the devices overlap there, as in torchgpipe.
        inline = any(s.device.type == "cuda" for s in self.compiled.stages)
        self._execute(self.schedule, "B", inline=inline)
        self._cuda_peaks()
        return self._input_grads(), self._param_grads()

    def _cuda_peaks(self) -> None:
        for stage in self.compiled.stages:
            if stage.device in self.peaks_before:
                peak = torch.cuda.max_memory_allocated(stage.device)
                if peak > self.peaks_before[stage.device]:
                    report = self.state.memory.stages[stage.index]
                    report.cuda_peak, report.device = peak, str(stage.device)

    def step(self, targets: Sequence[Any], loss_fn: Callable) -> torch.Tensor:
        loss = Loss(fn=loss_fn, rebuild=self.compiled.traced.rebuild_output, targets=targets,
                    weights=[s / self.batch for s in self.sizes], last_stage=self.compiled.plan.n_stages - 1)
        self._note_peaks()
        self._execute(self.schedule, "FB", loss=loss)
        self._cuda_peaks()
        if self.state.deferred is not None:
            self.state.deferred.commit()
        accumulate_grads(list(zip(self.params, self._param_grads())))
        return loss.total

    def _input_grads(self) -> list[torch.Tensor | None]:
        grads = []
        for k, (name, needed) in enumerate(zip(self.compiled.traced.input_names, self.input_grad)):
            if not needed:
                grads.append(None)
                continue
            parts = [self.mailbox.grad(i, self.programs[i].plan.graph_inputs[k]) for i in range(self.chunks)]
            if all(p is None for p in parts):
                grads.append(None)
                continue
            rows = microbatch.split([self.flat[k]], [name], self.sizes)  # each part on the input's device
            parts = [torch.zeros_like(r[0]) if p is None else p.to(r[0].device) for p, r in zip(parts, rows)]
            grads.append(sum(parts) if self.flat[k].dim() == 0 else torch.cat(parts))
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


def _close(workers: list[Worker]) -> None:
    for w in workers:
        w.close()


class Pipeline(torch.nn.Module):
    """A model compiled into a pipeline. Call it like the model.

    ``pipe.parameters()``, ``state_dict()``, ``train()``/``eval()`` are the model's own.
    """

    def __init__(self, model: torch.nn.Module, devices: list[torch.device], chunks: int, checkpoint: str,
                 build: Callable[[Sequence[Any], dict[str, Any]], Compiled], *, intra_op_threads: int | None = None,
                 deferred_batch_norm: bool = False, schedule: str = "gpipe", virtual_stages: int = 1,
                 track_memory: bool = False):
        super().__init__()
        object.__setattr__(self, "model", model)
        self.devices = devices
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.deferred_batch_norm = deferred_batch_norm
        self.schedule_name = schedule
        self.virtual_stages = virtual_stages
        self.track_memory = track_memory
        self._build = build
        self._compiled: dict[Any, Compiled] = {}
        self._seen: dict[tuple, Compiled] = {}  # calls of tensors only that passed _prepare's checks
        self._current: Compiled | None = None
        self._schedules: dict[tuple[int, bool], Schedule] = {}
        self._orders: dict[tuple, list[list[Task]]] = {}
        self._anchors: list[Anchor] = []
        self._anchor_key: tuple | None = None
        self.timeline = Timeline(self.schedule)  # of the last step; printable
        self.memory = MemoryReport.empty(len(devices) * virtual_stages, checkpoint)  # of the last step, with track_memory=True
        cpu_workers = sum(1 for d in devices if d.type == "cpu")
        self.intra_op_threads = intra_op_threads or max(1, (os.cpu_count() or 1) // max(cpu_workers, 1))
        self.workers = [Worker(d, f"autopipe-device{j}", self.intra_op_threads if d.type == "cpu" else None)
                        for j, d in enumerate(devices)]
        self._finalizer = weakref.finalize(self, _close, self.workers)

    # -- the model's own state (parameters(), state_dict(), ...: see _delegate below) ---
    def train(self, mode: bool = True):
        self.model.train(mode)
        self.training = mode
        return self

    def _apply(self, fn, recurse=True):
        raise RuntimeError("a compiled pipeline's placement is its plan's: pipe.to()/.cuda()/.half() would move every "
                           "stage to one device or dtype. Move or cast the model, then compile it again "
                           "(autopipe.compile(model.to(...), devices=[...]))")

    # -- what a user looks at ---------------------------------------------------
    @property
    def compiled(self) -> Compiled:
        if self._current is None:
            raise RuntimeError("the pipeline compiles on its first call: call it once, or pass example_inputs to autopipe.compile")
        return self._current

    plan = property(lambda self: self.compiled.plan, doc="The Plan of the last call's inputs.")
    stages = property(lambda self: self.compiled.stages, doc="The generated Stage modules (print stage.code).")
    schedule = property(lambda self: self.schedule_for(self.chunks), doc="The Schedule a step runs.")

    def schedule_for(self, chunks: int, forward_only: bool = False) -> Schedule:
        key = (chunks, forward_only)
        if key not in self._schedules:
            full = Schedule.build(self.schedule_name, len(self.devices), chunks, self.virtual_stages)
            self._schedules[key] = full.forward_only() if forward_only else full
        return self._schedules[key]

    def orders(self, schedule: Schedule, kinds: str, inline: bool = False) -> list[list[Task]]:
        """Each device's tasks of the given kinds in schedule order (or all of them in cycle order, inline);
        cached, so a step does no schedule work."""
        key = (id(schedule), kinds, inline)  # schedules are cached per chunks, so the id is stable
        if key not in self._orders:
            if inline:
                self._orders[key] = [[t for cycle in schedule.cycles for t in cycle if t.kind in kinds]]
            else:
                self._orders[key] = [[t for t in schedule.device_order(d) if t.kind in kinds]
                                     for d in range(schedule.n_devices)]
        return self._orders[key]

    def anchors(self, params: list[torch.nn.Parameter]) -> list[Anchor]:
        """One Anchor per device the parameters are on, rebuilt when the parameters or that device's stream change."""
        key = tuple(map(id, params))
        if self._anchor_key != key or any(a.stream is not None and a.stream != torch.cuda.current_stream(a.device)
                                           for a in self._anchors):
            devices = list(dict.fromkeys(p.device for p in params))
            self._anchors = [Anchor([p for p in params if p.device == d], [k for k, p in enumerate(params) if p.device == d])
                             for d in devices]
            self._anchor_key = key
        return self._anchors

    def save_code(self, directory) -> list[str]:
        """Write one ``stage_<i>.py`` per stage; returns the paths."""
        return [stage.save(directory) for stage in self.stages]

    def __repr__(self) -> str:
        state = "compiled" if self._current is not None else "not compiled yet"
        return (f"Pipeline({type(self.model).__name__}, devices={[str(d) for d in self.devices]}, "
                f"chunks={self.chunks}, schedule={self.schedule_name!r}, checkpoint={self.checkpoint!r}, {state})")

    # -- running ----------------------------------------------------------------
    def compile_for(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Compiled:
        key = self._key(args, kwargs)
        compiled = self._compiled.get(key)
        if compiled is None:
            if self._current is not None:
                self._check_same_kinds(self._current, args, kwargs)
            compiled = self._build(args, kwargs)
            self._compiled[key] = compiled
        self._current = compiled
        return compiled

    @staticmethod
    def _check_same_kinds(compiled: Compiled, args, kwargs) -> None:
        """A new shape or a different set of keyword arguments re-plans; a tensor argument
        that became something else is a mistake, named here before anything runs."""
        signature = compiled.traced.signature
        try:
            now = signature.bind(*args, **kwargs).arguments
        except TypeError as e:
            raise TypeError(f"the pipeline's model cannot take these arguments: {e}") from None
        before = compiled.traced.example_arguments
        for name, value in now.items():
            was = before.get(name)
            if isinstance(was, torch.Tensor) and value is not None and not isinstance(value, torch.Tensor):
                raise TypeError(f"argument {name!r} must be a tensor with the batch in dim 0 (it was one when the "
                                f"pipeline was compiled), got {type(value).__name__}")

    def _key(self, args, kwargs):
        leaves, spec = pytree.tree_flatten((args, kwargs))
        shapes = tuple(tuple(t.shape[1:]) if isinstance(t, torch.Tensor) else ("const", repr(t)) for t in leaves)
        return (self.model.training, spec, shapes)

    def _prepare(self, args, kwargs) -> tuple[Compiled, list[torch.Tensor], list[int]]:
        # a call of tensors only, like one that passed every check below: its compiled program again
        seen = None if kwargs or not all(type(a) is torch.Tensor for a in args) else \
            (self.model.training, tuple((a.shape[1:], a.dtype, a.device) for a in args))
        compiled = self._seen.get(seen) if seen is not None else None
        if compiled is not None:
            self._current = compiled
            sizes = microbatch.micro_batch_sizes(args[0].shape[0], self.chunks)
            if compiled.covers(sizes):
                return compiled, list(args), sizes
        compiled = self.compile_for(args, kwargs)
        flat = compiled.traced.flat_inputs(args, kwargs)
        sizes = microbatch.micro_batch_sizes(flat[0].shape[0], self.chunks)
        if not compiled.covers(sizes):  # traced at static micro-batch sizes: trace the new ones
            compiled.programs.update(self._build(args, kwargs).programs)
        self._check_inputs(compiled, flat)
        if seen is not None and len(flat) == len(args) and all(f is a for f, a in zip(flat, args)):
            self._seen[seen] = compiled
        return compiled, flat, sizes

    def forward(self, *args, **kwargs):
        compiled, flat, sizes = self._prepare(args, kwargs)
        training = torch.is_grad_enabled() and (any(p.requires_grad for p in compiled.parameters) or
                                                any(t.requires_grad for t in flat))
        if training and self.schedule_name != "gpipe":
            raise RuntimeError(f"schedule={self.schedule_name!r} interleaves forward and backward, so it needs the "
                               f"loss per micro-batch: train with pipe.step(x, target=y, loss_fn=f) (pipe(x) works "
                               f"under torch.no_grad() or for GPipe)")
        run = _Run(self, compiled, flat, sizes, training)
        outputs = _PipelineFunction.apply(run, *flat, *[a.tensor for a in run.anchors]) if training else run.forward()
        return compiled.traced.rebuild_output(list(outputs))

    def step(self, *args, target: Any = None, loss_fn: Callable | None = None, **kwargs) -> torch.Tensor:
        """Forward and backward of one mini-batch under the schedule; returns the detached loss.

        ``loss_fn(output, target)`` runs per micro-batch (on the micro-batch's rows of the output
        and of ``target``), weighted by its share of the batch, so the gradients equal those of
        ``loss_fn(model(x), target)`` for a mean-reduced loss. Without ``loss_fn`` the model's
        output must be (or hold, as ``.loss``) a scalar loss. Gradients accumulate into ``.grad``."""
        compiled, flat, sizes = self._prepare(args, kwargs)
        run = _Run(self, compiled, flat, sizes, training=True)
        if loss_fn is None:
            loss_fn = model_loss
        targets = microbatch.split_target(target, run.sizes)
        return run.step(targets, loss_fn)

    def _check_inputs(self, compiled: Compiled, flat: list[torch.Tensor]) -> None:
        allowed = {d for d in self.devices} | {torch.device("cpu")}
        for name, t, dtype in zip(compiled.traced.input_names, flat, compiled.example_dtypes):
            if t.device not in allowed and not (t.device.type == "cuda" and t.device.index is None):
                raise ValueError(
                    f"argument {name!r} is on {t.device}, but the pipeline's stages are on "
                    f"{sorted({str(d) for d in self.devices})}; move it to the CPU or to the first stage's device")
            if t.dtype != dtype:
                raise TypeError(
                    f"argument {name!r} has dtype {t.dtype}, but the pipeline was compiled for {dtype}; "
                    f"cast it (e.g. {name}.to({dtype})) or compile with example inputs of this dtype")

    def close(self) -> None:
        """Stop the worker threads (they also stop when the pipeline is garbage-collected)."""
        _close(self.workers)


def _delegate(name: str) -> Callable:
    def method(self, *args, **kwargs):
        return getattr(self.model, name)(*args, **kwargs)
    method.__name__, method.__doc__ = name, f"The model's own ``{name}``: the pipeline holds no state of its own."
    return method


for _name in ("parameters", "named_parameters", "buffers", "named_buffers", "state_dict", "load_state_dict",
              "zero_grad"):
    setattr(Pipeline, _name, _delegate(_name))


def model_loss(output, target) -> torch.Tensor:
    """The loss a model computes itself: the output, ``output.loss`` or ``output["loss"]``."""
    loss = output["loss"] if isinstance(output, dict) and "loss" in output else getattr(output, "loss", output)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise TypeError("pipe.step needs a scalar loss: pass loss_fn=..., or return a loss from the model")
    return loss

