"""The in-process pipeline as an nn.Module: ``pipe(x)`` / ``loss.backward()`` or ``pipe.step(...)``, stages on
worker threads. It compiles per input signature, checks a call's inputs, caches schedules and anchors, and hands
each mini-batch to step.py's Run."""
from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from autopipe.ir.batch import InputMismatch, batch_rows, carries_batch
from autopipe.ir.schedule import Schedule, Task, stages_per_device

from . import microbatch
from .clipping import clip_grad_norm_
from .memory import MemoryReport
from .step import Anchor, Compiled, Run, model_loss
from .threads import Worker
from .timeline import Timeline


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
                 track_memory: bool = False, streams: Sequence[Any] = ()):
        super().__init__()
        object.__setattr__(self, "model", model)
        self.devices = devices
        # how each device prints: a stage's own stream where devices= gave one (runtime/streams.py)
        self.device_labels = [str(s or d) for d, s in zip(devices, streams or [None] * len(devices))]
        self.chunks = chunks
        self.checkpoint = checkpoint
        self.deferred_batch_norm = deferred_batch_norm
        self.schedule_name = schedule
        self.virtual_stages = virtual_stages = stages_per_device(schedule, virtual_stages)  # zbv: two, in a V
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
        # of the last step, with track_memory=True
        self.memory = MemoryReport.empty(len(devices) * virtual_stages, checkpoint)
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
            raise RuntimeError("the pipeline compiles on its first call: call it once, or pass example_inputs to "
                               "autopipe.compile")
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
        """Each device's tasks of the given kinds in schedule order (or all of them in cycle order, inline); "B" means
        the whole backward, W included where it is split. Cached, so a step does no schedule work."""
        kinds += "W" if "B" in kinds else ""
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
            self._anchors = [Anchor([p for p in params if p.device == d],
                                    [k for k, p in enumerate(params) if p.device == d]) for d in devices]
            self._anchor_key = key
        return self._anchors

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False,
                        foreach: bool | None = None) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``, returning the total norm. The same call under
        torchrun reduces the norm over every stage's rank (Note [clipping over ranks], runtime/clipping.py), so a
        training loop is the same in both."""
        return clip_grad_norm_(self.model.parameters(), max_norm, norm_type, error_if_nonfinite=error_if_nonfinite,
                               foreach=foreach)

    def save_code(self, directory) -> list[str]:
        """Write one ``stage_<i>.py`` per stage; returns the paths."""
        return [stage.save(directory) for stage in self.stages]

    def __repr__(self) -> str:
        state = "compiled" if self._current is not None else "not compiled yet"
        return (f"Pipeline({type(self.model).__name__}, devices={self.device_labels}, "
                f"chunks={self.chunks}, schedule={self.schedule_name!r}, checkpoint={self.checkpoint!r}, {state})")

    # -- running ----------------------------------------------------------------
    def compile_for(self, args: Sequence[Any], kwargs: dict[str, Any]) -> Compiled:
        key = signature_key(self.model, args, kwargs)
        compiled = self._compiled.get(key)
        if compiled is None:
            if self._current is not None:
                check_same_kinds(self._current.traced, self.chunks, args, kwargs)
            compiled = self._build(args, kwargs)
            self._compiled[key] = compiled
        self._current = compiled
        return compiled

    def _prepare(self, args, kwargs) -> tuple[Compiled, list[torch.Tensor], list[int]]:
        # a call of tensors only, like one that passed every check below: its compiled program again
        seen = None if kwargs or not args or not all(type(a) is torch.Tensor for a in args) or not args[0].dim() else \
            (self.model.training, autocast_key(),
             tuple((microbatch.shape_key(a, args[0].shape[0]), a.dtype, a.device) for a in args))
        compiled = self._seen.get(seen) if seen is not None else None
        if compiled is not None:
            vars(self)["_current"] = compiled  # past nn.Module.__setattr__, as step.py sets the timeline
            sizes = microbatch.micro_batch_sizes(args[0].shape[0], self.chunks)
            if compiled.covers(sizes):
                compiled.traced.check_grad_flags(self.model, args)
                return compiled, list(args), sizes
        compiled = self.compile_for(args, kwargs)
        flat = compiled.traced.flat_inputs(args, kwargs)
        sizes = microbatch.micro_batch_sizes(flat[0].shape[0], self.chunks)
        if not compiled.covers(sizes):  # traced at static micro-batch sizes: trace the new ones
            compiled.programs.update(self._build(args, kwargs).programs)
        self._check_inputs(compiled, flat)
        compiled.traced.check_grad_flags(self.model, flat)
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
        run = Run(self, compiled, flat, sizes, training)
        if not training:
            return compiled.traced.rebuild_output(run.forward())
        run.anchors = self.anchors(run.params)
        outputs = run.through_autograd(flat)
        return compiled.traced.rebuild_output(list(outputs))

    def step(self, *args, target: Any = None, loss_fn: Callable | None = None, **kwargs) -> torch.Tensor:
        """Forward and backward of one mini-batch under the schedule; returns the detached loss.

        ``loss_fn(output, target)`` runs per micro-batch (on the micro-batch's rows of the output
        and of ``target``), weighted by its share of the batch, so the gradients equal those of
        ``loss_fn(model(x), target)`` for a mean-reduced loss. Without ``loss_fn`` the model's
        output must be (or hold, as ``.loss``) a scalar loss. Gradients accumulate into ``.grad``."""
        compiled, flat, sizes = self._prepare(args, kwargs)
        run = Run(self, compiled, flat, sizes, training=True)
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


def signature_key(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple:
    """What a compiled program is for: the model's mode, the call's structure, each tensor's shape but the batch (all
    of a tensor given whole to every micro-batch) and every other argument's value. A call of another key plans anew;
    the key is the same on every rank for the same arguments."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    batch = batch_rows(model, args, kwargs)
    shapes = tuple(microbatch.shape_key(t, batch) if isinstance(t, torch.Tensor) else ("const", repr(t))
                   for t in leaves)
    return (model.training, autocast_key(), spec, shapes)


def autocast_key() -> tuple:
    """The caller's autocast, which a program is planned under: the dtypes its values cross the cuts in (the wire's
    buffers under torchrun), and the casts the export route records."""
    if not torch._C._is_any_autocast_enabled():
        return ()
    return tuple((d, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d))


def check_same_kinds(traced: Any, chunks: int, args: Sequence[Any], kwargs: dict[str, Any]) -> None:
    """A new shape or a different set of keyword arguments re-plans; a tensor argument that became something else,
    or a tensor given whole to every micro-batch whose dim 0 now equals the batch (or the other way round), is a
    mistake, named here before anything runs. ``traced``: the TracedModel of a program compiled before."""
    signature = traced.signature
    try:
        now = signature.bind(*args, **kwargs).arguments
    except TypeError as e:
        raise TypeError(f"the pipeline's model cannot take these arguments: {e}") from None
    before = traced.example_arguments
    for name, value in now.items():
        was = before.get(name)
        if isinstance(was, torch.Tensor) and value is not None and not isinstance(value, torch.Tensor):
            raise TypeError(f"argument {name!r} must be a tensor (it was one when the pipeline was compiled), got "
                            f"{type(value).__name__}")
    try:
        flat = traced.flatten_inputs(now)
    except InputMismatch:
        return  # other arguments: planned anew
    batch = flat[0].shape[0] if flat[0].dim() else None
    if batch is None or min(batch, chunks) < 2:  # one micro-batch: cut or whole, it gets all of it
        return
    for name, t, was in zip(traced.input_names, flat, traced.batch_inputs):
        if carries_batch(t, batch) != was:
            raise InputMismatch(
                f"argument {name!r} of shape {tuple(t.shape)} "
                f"{'was cut into micro-batches' if was else 'went whole to every micro-batch'} when the pipeline "
                f"was compiled, and its dim 0 {'no longer equals' if was else 'now equals'} the batch ({batch}): "
                f"use batches of another size than its dim 0, or a new pipeline; see docs/faithfulness.md")


def _delegate(name: str) -> Callable:
    def method(self, *args, **kwargs):
        return getattr(self.model, name)(*args, **kwargs)
    method.__name__, method.__doc__ = name, f"The model's own ``{name}``: the pipeline holds no state of its own."
    return method


for _name in ("parameters", "named_parameters", "buffers", "named_buffers", "state_dict", "load_state_dict",
              "zero_grad"):
    setattr(Pipeline, _name, _delegate(_name))
