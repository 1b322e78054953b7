"""The in-process pipeline: stages on worker threads under the GPipe schedule.

Forward: each worker runs its stage's forward tasks in schedule order; a task
waits only for the tensors it reads (dataflow), so a tensor that skips stages
goes straight from producer to consumer. Every stage input is a detached leaf,
so each (stage, micro-batch) has its own small autograd graph.

Backward: the merged outputs come out of one autograd Function. PyTorch's
engine runs all CPU backward work on the thread that called backward(), so a
single autograd graph across stages (torchgpipe's fork/join design) would
serialise the backward on CPU. Instead that Function's backward hands each
(stage, micro-batch) backward to the stage's worker, in GPipe order, and
gradients flow between stages as tensors. Parameter gradients accumulate
straight into the model's own Parameter objects.
"""
from __future__ import annotations

import contextlib
import os
import threading
import weakref
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from autopipe.random_ops import is_random_module, is_random_target

from . import microbatch
from .batchnorm import DeferredBatchNorm, DeferredStatistics
from .checkpoint import TaskRandomness, checkpoints, generator_for, task_seed
from .memory import MemoryReport, SavedBytes, StageMemory, tensor_bytes
from .schedule import Schedule
from .timeline import Clock, Timeline
from .worker import Worker


class StageFailure(RuntimeError):
    """Marks a task that stopped because another task of the step failed."""


@dataclass
class Compiled:
    """Everything the runtime needs for one input signature; built by autopipe.compile."""

    traced: Any                 # passes.trace.TracedModel
    plan: Any                   # autopipe.plan.Plan
    stages: list                # passes.codegen.Stage
    uses_rng: list[bool] = field(default_factory=list)
    running_buffers: list[list[torch.Tensor]] = field(default_factory=list)
    mutated_inputs: list[set[int]] = field(default_factory=list)
    example_dtypes: list[torch.dtype] = field(default_factory=list)

    def __post_init__(self):
        self.uses_rng = [_uses_rng(s) for s in self.stages]
        self.running_buffers = [_running_buffers(s) for s in self.stages]
        self.mutated_inputs = [_mutated_inputs(s) for s in self.stages]


def _uses_rng(stage) -> bool:
    for node in stage.graph.nodes:
        if node.op == "call_module" and is_random_module(stage.get_submodule(node.target)):
            return True
        if node.op in ("call_function", "call_method") and is_random_target(node.target):
            return True
    return False


def _running_buffers(stage) -> list[torch.Tensor]:
    """Buffers a forward updates (BatchNorm running statistics): recomputation must not update them twice."""
    buffers = []
    for node in stage.graph.nodes:
        if node.op == "call_module":
            for m in stage.get_submodule(node.target).modules():
                if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats:
                    buffers.extend(b for b in m.buffers() if b is not None)
        elif node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
            for arg in node.all_input_nodes:
                if arg.op == "get_attr":
                    value = stage.get_buffer(arg.target) if _has_buffer(stage, arg.target) else None
                    if value is not None:
                        buffers.append(value)
    unique = {id(b): b for b in buffers}
    return list(unique.values())


def _has_buffer(stage, target: str) -> bool:
    try:
        stage.get_buffer(target)
        return True
    except AttributeError:
        return False


def _mutated_inputs(stage) -> set[int]:
    """Positions of stage inputs that the stage writes in place (x += y at a cut)."""
    import operator
    placeholders = [n for n in stage.graph.nodes if n.op == "placeholder"]
    mutated = set()
    for pos, p in enumerate(placeholders):
        for user in p.users:
            inplace = (
                (user.op == "call_method" and str(user.target).endswith("_") and user.args and user.args[0] is p)
                or (user.op == "call_function" and user.target in (operator.iadd, operator.isub, operator.imul,
                                                                   operator.itruediv, operator.setitem) and user.args[0] is p)
                or (isinstance(user.target, torch._ops.OpOverload) and user.target._schema.is_mutable)
            )
            if inplace:
                mutated.add(pos)
    return mutated


class _Step:
    """One mini-batch through the pipeline: forward, then (when training) backward."""

    def __init__(self, pipe: "Pipeline", compiled: Compiled, inputs: list[torch.Tensor], sizes: list[int], training: bool):
        self.pipe = pipe
        self.compiled = compiled
        self.plan = compiled.plan
        self.stages = compiled.stages
        self.sizes = sizes
        self.chunks = len(sizes)
        self.training = training
        self.checkpoint = pipe.checkpoint if training else "never"
        self.schedule = Schedule.gpipe(len(self.stages), self.chunks, backward=training)
        self.values: dict[tuple[int, str], torch.Tensor] = {}
        self.requires_grad: dict[tuple[int, str], bool] = {}
        self.saved: dict[tuple[int, int], tuple] = {}
        self.grads: dict[tuple[int, str], torch.Tensor] = {}
        self.grad_lock = threading.Lock()
        self.forward_done: dict[tuple[int, int], Future] = {}
        self.backward_done: dict[tuple[int, int], Future] = {}
        self.abort = threading.Event()
        self.failure: BaseException | None = None
        # Random ops follow the model's train mode, not autograd: dropout is on under no_grad too.
        self.routes_rng = pipe.model.training and any(compiled.uses_rng)
        self.step_seed = int(torch.randint(0, 2**62, ()).item()) if self.routes_rng else 0
        self.autocast = {dev: (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev)) for dev in ("cpu", "cuda")}
        self.input_names = self.plan.graph_inputs
        for i, row in enumerate(microbatch.split(inputs, self.input_names, sizes)):
            for name, t, source in zip(self.input_names, row, inputs):
                self.values[(i, name)] = t.detach()
                self.requires_grad[(i, name)] = training and source.requires_grad
        self.param_requires_grad = [any(p.requires_grad for p in s.parameters()) for s in self.stages]
        self.generators = {}
        self.timeline = Timeline(len(self.stages), self.chunks)
        self.clock = Clock(self.timeline)
        self.memory = MemoryReport([StageMemory() for _ in self.stages], self.checkpoint)
        self.deferred = DeferredStatistics(pipe.model) if training and pipe.deferred_batch_norm else None
        self.param_ids = [{p.untyped_storage().data_ptr() for p in s.parameters()} for s in self.stages]

    # -- forward -------------------------------------------------------------
    def forward(self) -> list[torch.Tensor]:
        for stage in self.stages:
            if stage.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(stage.device)
        for j, worker in enumerate(self.pipe.workers):
            for task in self.schedule.stage_order(j):
                if task.kind == "F":
                    self.forward_done[(j, task.micro_batch)] = self._submit(worker, task, self._forward_task)
        self._wait(list(self.forward_done.values()))
        if self.deferred is not None:
            self.deferred.commit()
        return self._merge_outputs()

    def _forward_task(self, j: int, i: int):
        stage = self.stages[j]
        for name in stage.input_names:
            producer = self._producer(name)
            if producer >= 0:
                self.forward_done[(producer, i)].result()
        inputs = []
        for name in stage.input_names:
            x = self.values[(i, name)]
            if not isinstance(x, torch.Tensor):  # a size or other Python value computed upstream
                inputs.append(x)
                continue
            x = x.detach()
            if x.device != stage.device:
                with self.clock(j, i, "copy"):
                    x = x.to(stage.device)
            if self.requires_grad[(i, name)] and (x.is_floating_point() or x.is_complex()):
                x.requires_grad_(True)
            inputs.append(x)
        recompute = self.training and checkpoints(self.checkpoint, i, self.chunks)
        keep_graph = self.training and not recompute
        with self.clock(j, i, "forward"), self._task_context(j, i, grad=keep_graph), SavedBytes(self.param_ids[j]) as saved:
            outputs = stage(*self._stage_args(j, inputs))
        self.saved[(j, i)] = (inputs, None if recompute else outputs)
        if self.training:
            self.memory.add_kept(j, tensor_bytes(inputs) if recompute else saved.total)
        any_grad = self.param_requires_grad[j] or any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)
        for name, out in zip(stage.output_names, outputs):
            if not isinstance(out, torch.Tensor):
                self.values[(i, name)] = out
                self.requires_grad[(i, name)] = False
                continue
            self.values[(i, name)] = out.detach()
            differentiable = out.is_floating_point() or out.is_complex()
            self.requires_grad[(i, name)] = self.training and differentiable and (out.requires_grad if keep_graph else any_grad)

    def _stage_args(self, j: int, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        mutated = self.compiled.mutated_inputs[j]
        return [x.clone() if k in mutated else x for k, x in enumerate(inputs)] if mutated else inputs

    def _merge_outputs(self) -> list[torch.Tensor]:
        merged = []
        for name in self.plan.graph_outputs:
            parts = [self.values[(i, name)] for i in range(self.chunks)]
            merged.append(microbatch.merge(parts, self.sizes))
        return merged

    # -- backward ------------------------------------------------------------
    def backward(self, grad_outputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor | None]:
        for name, grad in zip(self.plan.graph_outputs, grad_outputs):
            like = self.values[(0, name)]
            for i, g in enumerate(microbatch.split_grad(grad, like, self.sizes)):
                if g is not None:
                    self._add_grad(i, name, g)
        inline = any(s.device.type == "cuda" for s in self.stages)
        # Last stage first: a backward task waits on later stages' futures, which must exist by then.
        for j, worker in reversed(list(enumerate(self.pipe.workers))):
            for task in self.schedule.stage_order(j):
                if task.kind == "B":
                    if inline:  # see Pipeline docstring: CUDA backward runs on the engine's device threads
                        future: Future = Future()
                        self.backward_done[(j, task.micro_batch)] = future
                    else:
                        self.backward_done[(j, task.micro_batch)] = self._submit(worker, task, self._backward_task)
        if inline:
            for cycle in self.schedule.cycles:
                for task in cycle:
                    if task.kind == "B":
                        self._run_inline(task)
        self._wait(list(self.backward_done.values()))
        for j, stage in enumerate(self.stages):
            if stage.device.type == "cuda":
                self.memory.stages[j].cuda_peak = torch.cuda.max_memory_allocated(stage.device)
        input_grads = []
        for name in self.input_names:
            parts = [self.grads.pop((i, name), None) for i in range(self.chunks)]
            if any(p is not None for p in parts) and self.requires_grad[(0, name)]:
                parts = [p if p is not None else torch.zeros_like(self.values[(i, name)]) for i, p in enumerate(parts)]
                broadcast = self.values[(0, name)].dim() == 0  # every micro-batch read the same scalar
                input_grads.append(sum(parts) if broadcast else torch.cat(parts))
            else:
                input_grads.append(None)
        self.saved.clear()
        self.values.clear()
        return input_grads

    def _run_inline(self, task) -> None:
        future = self.backward_done[(task.stage, task.micro_batch)]
        try:
            self._guarded(task, self._backward_task)()
            future.set_result(None)
        except BaseException as e:
            future.set_exception(e)
            raise

    def _backward_task(self, j: int, i: int):
        stage = self.stages[j]
        inputs, outputs = self.saved.pop((j, i))
        if outputs is None:
            # Re-materialise before waiting for the gradients: it needs only the saved inputs, so it
            # runs while later stages are still in their backward, off the critical path.
            outputs = self._recompute(j, i, inputs)
        for name in stage.output_names:
            for consumer in self.plan.tensors[name].consumers:
                if consumer != j:
                    self.backward_done[(consumer, i)].result()
        with self.clock(j, i, "backward"):
            self._backward_compute(j, i, inputs, outputs)

    def _recompute(self, j: int, i: int, inputs: list):
        """The forward again, with the same inputs and random stream; running statistics untouched."""
        stage = self.stages[j]
        snapshot = [(b, b.clone()) for b in self.compiled.running_buffers[j]] if stage.training else []
        with self.clock(j, i, "recompute"), self._task_context(j, i, grad=True, recompute=True), SavedBytes(self.param_ids[j]) as saved:
            outputs = stage(*self._stage_args(j, inputs))
        with torch.no_grad():
            for buffer, before in snapshot:
                buffer.copy_(before)
        self.memory.add_recompute(j, saved.total)
        return outputs

    def _backward_compute(self, j: int, i: int, inputs: list, outputs):
        stage = self.stages[j]
        roots, root_grads = [], []
        for name, out in zip(stage.output_names, outputs):
            with self.grad_lock:
                g = self.grads.pop((i, name), None)
            if g is not None and isinstance(out, torch.Tensor) and out.requires_grad:
                roots.append(out)
                root_grads.append(g.to(out.device) if g.device != out.device else g)
        if roots:
            with self._device_context(stage.device):
                torch.autograd.backward(roots, root_grads)
        for name, x in zip(stage.input_names, inputs):
            if isinstance(x, torch.Tensor) and x.requires_grad and x.grad is not None:
                self._add_grad(i, name, x.grad)

    def _add_grad(self, i: int, name: str, grad: torch.Tensor) -> None:
        producer = self._producer(name)
        if producer >= 0:
            target = self.stages[producer].device
        else:
            target = self.values[(i, name)].device
        if grad.device != target:
            grad = grad.to(target)
        with self.grad_lock:
            previous = self.grads.get((i, name))
            self.grads[(i, name)] = grad if previous is None else previous + grad

    # -- machinery -------------------------------------------------------------
    def _producer(self, name: str) -> int:
        info = self.plan.tensors.get(name)
        return info.producer if info is not None else -1

    def _submit(self, worker: Worker, task, fn: Callable[[int, int], Any]) -> Future:
        return worker.submit(self._guarded(task, fn))

    def _guarded(self, task, fn):
        def run():
            if self.abort.is_set():
                raise StageFailure("step aborted")
            try:
                return fn(task.stage, task.micro_batch)
            except BaseException as e:
                if not getattr(e, "_autopipe_noted", False) and not isinstance(e, StageFailure):
                    e._autopipe_noted = True
                    kind = "forward" if task.kind == "F" else "backward"
                    stage = self.stages[task.stage]
                    e.add_note(f"autopipe: raised in stage {task.stage} ({stage.device}) on micro-batch "
                               f"{task.micro_batch} during {kind}; see pipe.stages[{task.stage}].code")
                    if self.failure is None:
                        self.failure = e
                self.abort.set()
                raise
        return run

    def _wait(self, futures: list[Future]) -> None:
        try:
            pending = set(futures)
            while pending and not self.abort.is_set():
                _, pending = wait(pending, timeout=0.1, return_when=FIRST_EXCEPTION)
        except KeyboardInterrupt:
            self.abort.set()
            wait(futures)
            raise
        if self.abort.is_set():
            wait(futures)
            failure = self.failure or next((f.exception() for f in futures if f.exception() is not None), None)
            raise failure if failure is not None else StageFailure("pipeline step aborted")

    @contextlib.contextmanager
    def _task_context(self, j: int, i: int, grad: bool, recompute: bool = False):
        stage = self.stages[j]
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.set_grad_enabled(grad))
            stack.enter_context(self._device_context(stage.device))
            enabled, dtype = self.autocast.get(stage.device.type, (False, None))
            if enabled:
                stack.enter_context(torch.autocast(stage.device.type, dtype=dtype))
            if self.routes_rng and self.compiled.uses_rng[j]:
                generator = self._generator(j)
                generator.manual_seed(task_seed(self.step_seed, j, i))
                stack.enter_context(TaskRandomness(generator))
            if self.deferred is not None and self.compiled.running_buffers[j]:
                stack.enter_context(DeferredBatchNorm(self.deferred, accumulate=not recompute))
            yield

    def _generator(self, j: int) -> torch.Generator:
        if j not in self.generators:
            self.generators[j] = generator_for(self.stages[j].device)
        return self.generators[j]

    @staticmethod
    def _device_context(device: torch.device):
        return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


class _PipelineFunction(torch.autograd.Function):
    """The pipeline as one autograd node: its backward drives the stages' backward."""

    @staticmethod
    def forward(ctx, step: _Step, anchor: torch.Tensor, *inputs_requiring_grad: torch.Tensor):
        outputs = step.forward()
        ctx.step = step
        ctx.n_inputs = len(inputs_requiring_grad)
        ctx.mark_non_differentiable(*[o for o in outputs if not (o.is_floating_point() or o.is_complex())])
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grad_outputs):
        step = ctx.step
        if step is None:
            raise RuntimeError("the pipeline's backward can run once per forward; call the pipeline again")
        ctx.step = None
        grads = step.backward(grad_outputs)
        needed = [g for g, name in zip(grads, step.input_names) if step.requires_grad[(0, name)]]
        return (None, None, *needed[: ctx.n_inputs])


def _close(workers: list[Worker]) -> None:
    for w in workers:
        w.close()


class Pipeline(torch.nn.Module):
    """A model compiled into a GPipe pipeline. Call it like the model.

    ``pipe.parameters()``, ``state_dict()``, ``train()``/``eval()`` are the
    model's own. CUDA note: the autograd engine runs CUDA backward on one
    thread per device, so with CUDA stages the per-stage backward calls are
    issued in GPipe order from the engine's thread (inline) and the devices
    overlap through the engine's device threads, as in torchgpipe.
    """

    def __init__(self, model: torch.nn.Module, devices: list[torch.device], chunks: int, checkpoint: str,
                 build: Callable[[Sequence[Any], dict[str, Any]], Compiled], intra_op_threads: int | None = None,
                 deferred_batch_norm: bool = False):
        super().__init__()
        object.__setattr__(self, "model", model)
        self.devices = devices
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.deferred_batch_norm = deferred_batch_norm
        self._build = build
        self._compiled: dict[Any, Compiled] = {}
        self._current: Compiled | None = None
        self.timeline = Timeline(len(devices), chunks)  # of the last step; printable
        self.memory = MemoryReport([StageMemory() for _ in devices], checkpoint)  # of the last step
        cpu_workers = sum(1 for d in devices if d.type == "cpu")
        self.intra_op_threads = intra_op_threads or max(1, (os.cpu_count() or 1) // max(cpu_workers, 1))
        self.workers = [Worker(d, f"autopipe-stage{j}", self.intra_op_threads if d.type == "cpu" else None)
                        for j, d in enumerate(devices)]
        self._finalizer = weakref.finalize(self, _close, self.workers)

    # -- the model's own state ------------------------------------------------
    def parameters(self, recurse: bool = True):
        return self.model.parameters(recurse)

    def named_parameters(self, *args, **kwargs):
        return self.model.named_parameters(*args, **kwargs)

    def buffers(self, recurse: bool = True):
        return self.model.buffers(recurse)

    def named_buffers(self, *args, **kwargs):
        return self.model.named_buffers(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.model.load_state_dict(*args, **kwargs)

    def train(self, mode: bool = True):
        self.model.train(mode)
        self.training = mode
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.model.zero_grad(set_to_none)

    # -- what a user looks at ---------------------------------------------------
    @property
    def compiled(self) -> Compiled:
        if self._current is None:
            raise RuntimeError("the pipeline compiles on its first call: call it once, or pass example_inputs to autopipe.compile")
        return self._current

    @property
    def plan(self):
        return self.compiled.plan

    @property
    def stages(self):
        return self.compiled.stages

    @property
    def schedule(self) -> Schedule:
        return Schedule.gpipe(len(self.devices), self.chunks)

    def save_code(self, directory) -> list[str]:
        from autopipe.passes.codegen import save_code
        return save_code(self.stages, directory)

    def __repr__(self) -> str:
        state = "compiled" if self._current is not None else "not compiled yet"
        return (f"Pipeline({type(self.model).__name__}, devices={[str(d) for d in self.devices]}, "
                f"chunks={self.chunks}, checkpoint={self.checkpoint!r}, {state})")

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
        import torch.utils._pytree as pytree
        leaves, spec = pytree.tree_flatten((args, kwargs))
        shapes = tuple(tuple(t.shape[1:]) if isinstance(t, torch.Tensor) else ("const", repr(t)) for t in leaves)
        return (self.model.training, str(spec), shapes)

    def forward(self, *args, **kwargs):
        compiled = self.compile_for(args, kwargs)
        flat = compiled.traced.flat_inputs(args, kwargs)
        self._check_inputs(compiled, flat)
        batch = flat[0].shape[0]
        sizes = microbatch.micro_batch_sizes(batch, self.chunks)
        training = torch.is_grad_enabled() and (
            any(p.requires_grad for p in self.model.parameters()) or any(t.requires_grad for t in flat))
        step = _Step(self, compiled, flat, sizes, training)
        self.timeline, self.memory = step.timeline, step.memory
        if training:
            anchor = torch.empty(0, requires_grad=True)
            needing = [t for t in flat if t.requires_grad]
            outputs = _PipelineFunction.apply(step, anchor, *needing)
        else:
            outputs = step.forward()
        return compiled.traced.rebuild_output(list(outputs))

    def step(self, *args, target: Any = None, loss_fn: Callable | None = None, **kwargs):
        """Forward and backward of one mini-batch; returns the detached loss.

        With ``loss_fn``: loss = loss_fn(output, target); without it the model's
        output must be (or hold, as ``.loss``) a scalar loss."""
        output = self(*args, **kwargs)
        if loss_fn is not None:
            loss = loss_fn(output, target)
        else:
            loss = getattr(output, "loss", output)
            if isinstance(output, dict) and "loss" in output:
                loss = output["loss"]
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            raise TypeError("pipe.step needs a scalar loss: pass loss_fn=..., or return a loss from the model")
        loss.backward()
        return loss.detach()

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
