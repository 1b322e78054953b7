"""compile() and plan(): ``run_passes``, the one chain of passes (trace -> micro-batch analysis -> cost -> partition ->
codegen) that every entry point calls with one :class:`Options`, then a runtime."""
from __future__ import annotations

import operator
import os
import warnings
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.utils._pytree as pytree

from autopipe.global_state import autocast_cache_off, preserved_global_state
from autopipe.memory_model import choose_configuration, predict_memory
from autopipe.passes.codegen import Stage, codegen
from autopipe.passes.cost import cost
from autopipe.passes.diagnostics import failures_named
from autopipe.passes.graph_capture import graph_capture
from autopipe.passes.microbatch_analysis import analyse_micro_batches
from autopipe.passes.partition import partition
from autopipe.passes.trace import BatchSpecialised, listed, output_facts, trace
from autopipe.plan import Plan, human_bytes
from autopipe.progress import Progress
from autopipe.runtime.cuda_graphs import use_cuda_graphs
from autopipe.runtime.distributed import DistributedPipeline, running_under_torchrun
from autopipe.runtime.mesh import pipeline_size
from autopipe.runtime.microbatch import micro_batch_sizes
from autopipe.runtime.pipeline import Pipeline
from autopipe.runtime.schedule import (NAMES as SCHEDULES, SPLIT, Schedule, device_of_stage, is_v_layout,
                                       stages_per_device)
from autopipe.runtime.step import Compiled, Program
from autopipe.runtime.streams import StageStream, as_stage_stream
from autopipe.runtime.task import CHECKPOINT_MODES

BALANCE_MODES = ("flops", "params", "time")


def positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


@dataclass(frozen=True)
class Options:
    """What every entry point fills once and every pass reads; checked when made."""

    devices: tuple[torch.device, ...]          # one per stage: K devices x v virtual stages, round robin (zbv: a V)
    chunks: int = 8
    balance: str | tuple[float, ...] = "flops"
    leaf_modules: tuple[type | str, ...] = ()
    tolerance: float = 0.03
    memory_cap: float | None = None
    route: str = "auto"
    verbose: bool = False
    schedule: str = "gpipe"
    virtual_stages: int = 1
    checkpoint: str = "except_last"
    optimizer: str | None = "adam"         # for the plan's memory prediction: "sgd", "momentum", "adam", None
    cuda_graphs: bool = False             # replay each stage's tasks as CUDA graphs (runtime/cuda_graphs.py)
    streams: tuple[StageStream | None, ...] = ()  # like devices, where devices= gave CUDA streams; else empty

    def __post_init__(self) -> None:
        if not positive_int(self.chunks):
            raise ValueError(f"chunks must be a positive int (micro-batches per mini-batch), got {self.chunks!r}")
        if self.checkpoint not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {self.checkpoint!r}")
        if isinstance(self.balance, str) and self.balance not in BALANCE_MODES:
            raise ValueError(f"balance must be one of {BALANCE_MODES} or a list of per-stage weights, got "
                             f"{self.balance!r}")
        if not positive_int(self.virtual_stages):
            raise ValueError(f"virtual_stages must be a positive int, got {self.virtual_stages!r}")
        Schedule.build(self.schedule, 1, 1, self.virtual_stages)  # names a bad schedule or virtual_stages
        if not isinstance(self.cuda_graphs, bool):
            raise TypeError(f"cuda_graphs must be True or False, got {self.cuda_graphs!r}")
        if self.cuda_graphs and self.schedule in SPLIT:
            raise ValueError(f"cuda_graphs=True with schedule={self.schedule!r} is not supported yet: its backward is "
                             f"split in two (input gradients, then parameter gradients), which the captured backward "
                             f"does not do; use 'gpipe', '1f1b' or 'interleaved', or cuda_graphs=False")
        object.__setattr__(self, "virtual_stages", stages_per_device(self.schedule, self.virtual_stages))
        object.__setattr__(self, "balance", self.balance if isinstance(self.balance, str) else tuple(self.balance))
        object.__setattr__(self, "leaf_modules", tuple(self.leaf_modules))

    @classmethod
    def make(cls, devices: Sequence[torch.device], **options: Any) -> "Options":
        """Options for K ``devices``: stage s of the K x virtual_stages stages runs on devices[s % K] (zbv: device d
        holds stages d and 2K-1-d, so the partitioner cuts 2K stages and balances them)."""
        checked, K = cls(tuple(devices), **options), len(devices)
        if checked.streams and len(checked.streams) != K:
            raise ValueError(f"Options.make: {len(checked.streams)} streams for {K} devices")
        where = [device_of_stage(checked.schedule, K, s) for s in range(K * checked.virtual_stages)]
        return replace(checked, devices=tuple(devices[d] for d in where),
                       streams=tuple(checked.streams[d] for d in where) if checked.streams else ())


def resolve_devices(devices: int | Sequence[str | torch.device] | None) -> list[torch.device]:
    """``devices=N``: N CUDA devices, or N CPU workers without CUDA; or an explicit list, where a CUDA stream stands
    for its GPU (``device_streams`` gives the streams)."""
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices is None:
        devices = cuda_count or min(os.cpu_count() or 1, 8)
    if isinstance(devices, bool) or not isinstance(devices, (int, list, tuple)):
        raise TypeError(f"devices must be an int or a list of devices, got {devices!r}")
    if isinstance(devices, int):
        if devices < 1:
            raise ValueError(f"devices must be at least 1, got {devices}")
        if devices > cuda_count > 0:
            raise ValueError(f"devices={devices} asks for {devices} CUDA devices but this host has {cuda_count}; "
                             f"pass devices={cuda_count} or a list such as ['cpu'] * {devices}")
        return [torch.device("cuda", i) for i in range(devices)] if cuda_count else [torch.device("cpu")] * devices
    if len(devices) == 0:
        raise ValueError("devices is an empty list: name at least one device, e.g. devices=['cpu', 'cpu']")
    resolved = []
    for d in devices:
        stream = as_stage_stream(d, cuda_count)
        if stream is not None:
            resolved.append(stream.device)
            continue
        try:
            device = torch.device(d)
        except (RuntimeError, TypeError) as e:
            raise ValueError(f"devices: {d!r} is not a device ({e})") from None
        if device.type == "cuda":
            if not cuda_count:
                raise ValueError(f"devices: {d!r} is a CUDA device but CUDA is not available here; use 'cpu' workers")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
            if device.index >= cuda_count:
                raise ValueError(f"devices: {d!r} does not exist: this host has {cuda_count} CUDA device(s) "
                                 f"(cuda:0..cuda:{cuda_count - 1})")
        elif device.type != "cpu":
            raise ValueError(f"devices: {d!r}: autopipe runs stages on 'cpu' or 'cuda' devices")
        resolved.append(device)
    return resolved


def device_streams(devices: Any) -> tuple[StageStream | None, ...]:
    """Per entry of a ``devices`` list, its StageStream where it is a CUDA stream, else None; () if it holds no
    stream (the common case: every stage on the caller's current stream of its device)."""
    if not isinstance(devices, (list, tuple)):
        return ()
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    streams = tuple(as_stage_stream(d, cuda_count) for d in devices)
    return streams if any(s is not None for s in streams) else ()


def plan_devices(devices: int | Sequence[str | torch.device] | None) -> list[torch.device]:
    """For planning only: an int names that many stages without checking they exist."""
    if not positive_int(devices):
        return resolve_devices(devices)
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [torch.device("cuda", i) if i < count else torch.device("cpu") for i in range(devices)]


def run_passes(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any], options: Options, *,
               generate: bool = True, before_codegen: Callable[[Plan], None] | None = None,
               after_codegen: Callable[[list], None] | None = None, cut_of: Plan | None = None) -> Compiled:
    """The passes under ``preserved_global_state``; a model that specialises on the batch size is traced once per
    micro-batch size. ``before_codegen(plan)``: where the torchrun runtime materialises its meta weights.
    ``after_codegen(stages)``: where compile places the tensors the stages read on their devices, before the runners
    look at where they are. ``cut_of``: a plan of the same model at other input shapes whose cut to keep (the torchrun
    runtime's, Note [one cut for every shape])."""
    progress = Progress(options.verbose)
    args, kwargs = _on_model_device(model, args, kwargs)

    def program(static_batch: int | None = None, specialised: BatchSpecialised | None = None) -> Program:
        traced, analysis, costed = _trace_analyse_and_cost(model, args, kwargs, options, static_batch, progress)
        if traced.assigned:
            warnings.warn(f"autopipe: {type(model).__name__}'s forward assigns {listed(traced.assigned)}: the pipeline "
                          f"runs the traced graph, which computes with the assigned values but does not store them, so "
                          f"the model keeps the values it had before (autopipe.verify shows them). Harmless for a "
                          f"cache the forward rebuilds (ConViT's rel_indices); state carried from call to call (a "
                          f"counter, a running value) is not the plain model's: a buffer updated in place "
                          f"(self.steps.add_(1)) is, once per micro-batch as BatchNorm's statistics", stacklevel=4)
        if traced.ambiguous_inputs:
            warnings.warn(f"autopipe: {type(model).__name__} is traced per micro-batch size, and "
                          f"{listed(traced.ambiguous_inputs)} has the batch size in dim 0 and in "
                          f"another dim: it is cut into micro-batches as rows of samples. If it is not "
                          f"per sample (a (seq, seq) mask whose seq equals the batch), the pipeline's "
                          f"values are wrong: use a batch of another size", stacklevel=4)
        notes = list(traced.notes) + [f"stage {s} computes on {stream}" for s, stream in enumerate(options.streams)
                                      if stream is not None]
        if specialised is not None:
            notes.append(f"traced at micro-batch size {static_batch}: {str(specialised).splitlines()[0]}")
        with progress.run("partition", model) as report:
            plan = partition(costed, len(options.devices), devices=options.devices, chunks=options.chunks, notes=notes,
                             balance=options.balance, tolerance=options.tolerance, memory_cap=options.memory_cap,
                             analysis=analysis, cut_of=cut_of)
            plan.pass_seconds = progress.seconds  # the running dict: later passes' seconds join it
            for message in plan.across_micro_batches:
                warnings.warn(f"autopipe: {message}", stacklevel=4)
            if options.cuda_graphs:  # which stages replay as graphs: the memory model prices their slots
                plan.cuda_graphs = graph_capture(traced, plan)
            plan.memory = predict_memory(costed, plan, options.schedule, options.checkpoint, options.chunks,
                                         options.virtual_stages, options.optimizer)
            if options.cuda_graphs and options.memory_cap is not None:
                _graphs_within_cap(plan, options.memory_cap)
            report["detail"] = f"{plan.n_stages} stages, imbalance {plan.imbalance:.3f}"
        if not generate:
            return Program(traced=traced, plan=plan, stages=[])
        if before_codegen is not None:
            before_codegen(plan)
        with progress.run("codegen", model) as report:
            stages = codegen(traced.graph_module, plan)
            report["detail"] = f"{len(stages)} stage modules"
        if after_codegen is not None:
            after_codegen(stages)
        compiled = Program(traced=traced, plan=plan, stages=stages)
        if options.cuda_graphs:
            use_cuda_graphs(compiled)
        return compiled

    # Planning under the caller's inference_mode would make the stages' constants inference tensors.
    with preserved_global_state(), torch.inference_mode(False), autocast_cache_off():
        n_params = sum(p.numel() for p in model.parameters())
        progress.say(f"planning {type(model).__name__} ({n_params / 1e6:,.1f} M parameters) as {len(options.devices)} "
                     f"stages x {options.chunks} micro-batches")
        try:
            programs = {None: program()}
        except BatchSpecialised as e:
            sizes = sorted(set(micro_batch_sizes(e.batch_size, options.chunks)), reverse=True)
            progress.say(f"the model specialises on the batch size: tracing at micro-batch size(s) {sizes}")
            programs = {size: program(size, e) for size in sizes}
            if options.chunks > 1:
                _refuse_batch_mixing_outputs(model, args, kwargs, e.batch_size, programs.values())
    example = next(iter(programs.values())).traced.flat_inputs(args, kwargs)
    return Compiled(programs=programs, example_dtypes=[t.dtype for t in example])


def _graphs_within_cap(plan: Plan, memory_cap: float) -> None:
    """cuda_graphs=True keeps each micro-batch a captured stage holds in static memory of its own: refused before any
    runs where the predicted peak with those graphs passes ``memory_cap``."""
    per_device = plan.memory.per_device()
    device = max(range(len(per_device)), key=per_device.__getitem__)
    if per_device[device] > memory_cap:
        graphs = sum(p.graph_bytes for p in plan.memory if p.device == device)
        raise ValueError(f"cuda_graphs=True: device {device} is predicted to hold {human_bytes(per_device[device])} "
                         f"with CUDA graphs ({human_bytes(graphs)} of them in graph slots), over memory_cap="
                         f"{human_bytes(memory_cap)}. Use checkpoint='always' or 'except_last' (fewer slots), fewer "
                         f"chunks, a larger memory_cap, or cuda_graphs=False (print(autopipe.plan(..., "
                         f"cuda_graphs=True)) shows each stage's slots)")


def _refuse_batch_mixing_outputs(model, args, kwargs, batch: int, programs: Iterable[Program]) -> None:
    """Refused before anything runs, for a model exported at its micro-batch size: an output computed from a value
    holding the batch in two dims, or one whose other dims grow with the batch (CLIP's logits), seen in eager runs at
    the whole batch. The export one row larger finds these where the two exports have the same nodes; where they do not
    (a branch on len(x) == 1), these runs may (docs/architecture.md, "Pitfalls measured")."""
    whole = output_facts(model, args, kwargs, batch)
    for path, _, pairing in whole or ():
        if pairing:
            raise ValueError(f"the model's {path} is computed from {pairing}, whose result holds the batch in two "
                             f"dims: it pairs the samples (contrastive logits u @ v.T, in-batch negatives); a "
                             f"micro-batch holds only its own samples, so no merge of the micro-batches' values is the "
                             f"plain model's; compute it outside the model from per-sample outputs, or run with "
                             f"chunks=1")
    for program in programs if whole is not None else ():
        plan, traced = program.plan, program.traced
        for name, position in zip(plan.graph_outputs, traced.output_positions):
            info, (path, shape, _) = plan.tensors.get(name), whole[position]
            if info is not None and info.shape and shape is not None and (shape[1:] != info.shape[1:]
                                                                          or shape[0] != info.rows_per_sample * batch):
                raise ValueError(f"the model's {path} has shape {shape} for a batch of {batch} and {info.shape} for a "
                                 f"micro-batch of {traced.batch_size}: it mixes the rows of the batch, so no "
                                 f"concatenation of the micro-batches' parts is the plain model's value; return it per "
                                 f"sample, compute it outside the model, or run with chunks=1")


def _on_model_device(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]):
    """The example inputs on the model's device, where stage 0 moves a DataLoader's CPU batch: the passes see the batch
    there."""
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    if len(devices) != 1 or (device := devices.pop()).type == "meta":
        return args, kwargs
    move = lambda t: t.to(device) if t.device != device and t.device.type != "meta" else t
    return pytree.tree_map_only(torch.Tensor, move, (tuple(args), dict(kwargs or {})))


def _trace_analyse_and_cost(model, args, kwargs, options: Options, static_batch: int | None, progress: Progress):
    """The passes before the cut: trace, the micro-batch analysis of its graph (timed with trace: compile reports four
    passes), cost."""
    with progress.run("trace", model) as report:
        traced = trace(model, args, kwargs, leaf_modules=options.leaf_modules, route=options.route,
                       static_batch=static_batch)
        with failures_named("micro-batch analysis", model):
            analysis = analyse_micro_batches(traced)
        report["detail"] = f"{traced.route}, {len(traced.graph_module.graph.nodes)} graph nodes"
    measure = None
    if options.balance == "time":
        measure = traced.flat_inputs(args, kwargs)
        if any(t.device.type == "meta" for t in measure) or any(p.device.type == "meta" for p in model.parameters()):
            raise ValueError("balance='time' runs the model to time it; it needs real weights and inputs, not meta")
        # a stage runs one micro-batch at a time: time the nodes at that size, where fixed per-op costs weigh as in the
        # pipeline
        rows = static_batch or micro_batch_sizes(traced.batch_size, options.chunks)[0]
        batch = traced.batch_size if static_batch is None else measure[0].shape[0]
        measure = [t[:rows] if t.dim() > 0 and t.shape[0] == batch else t for t in measure]
    with progress.run("cost", model) as report:
        costed = cost(traced, measure_inputs=measure)
        report["detail"] = f"balance={'given weights' if isinstance(options.balance, tuple) else repr(options.balance)}"
    return traced, analysis, costed


def _choose(model, args, kwargs, options: Options, devices: Sequence[torch.device], auto: list[str]) -> Plan:
    """``chunks``/``schedule``/``checkpoint="auto"``: trace and cost once, partition once per stage
    count, and keep the fastest predicted configuration whose memory fits ``memory_cap``."""
    if options.memory_cap is None:
        raise ValueError(f"{', '.join(f'{k}=auto' for k in auto)} picks the fastest configuration that fits the "
                         f"memory: give memory_cap (bytes per device)")
    progress = Progress(options.verbose)
    args, kwargs = _on_model_device(model, args, kwargs)  # as run_passes: a GPU model's CPU example batch
    with preserved_global_state(), torch.inference_mode(False), autocast_cache_off():
        traced, analysis, costed = _trace_analyse_and_cost(model, args, kwargs, options, None, progress)
        K = len(devices)

        def plan_for(n_stages: int):
            planned = partition(costed, n_stages, devices=[devices[s % K] for s in range(n_stages)], chunks=1,
                                balance=options.balance, tolerance=options.tolerance, notes=traced.notes,
                                analysis=analysis)
            planned.cuda_graphs = graph_capture(traced, planned) if options.cuda_graphs else None
            return planned, costed

        with progress.run("choose") as report:
            choice = choose_configuration(
                plan_for, batch_size=traced.batch_size, n_devices=K, memory_cap=options.memory_cap,
                optimizer=options.optimizer, chunks=None if "chunks" in auto else options.chunks,
                schedules=SCHEDULES if "schedule" in auto else (options.schedule,),
                checkpoint_modes=CHECKPOINT_MODES if "checkpoint" in auto else (options.checkpoint,))
            report["detail"] = (f"{choice.schedule}, checkpoint={choice.checkpoint!r}, chunks={choice.chunks} of "
                                f"{len(choice.candidates)} configurations")
        if is_v_layout(choice.schedule):  # plan_for laid 2K stages round robin; the V's device d holds d, 2K-1-d
            v_devices = [devices[device_of_stage(choice.schedule, K, s)] for s in range(2 * K)]
            choice.chosen.plan = partition(costed, 2 * K, devices=v_devices, chunks=1, balance=options.balance,
                                           tolerance=options.tolerance, notes=traced.notes, analysis=analysis)
    result = replace(choice.plan, chunks=choice.chunks, notes=list(choice.plan.notes))
    result.memory, result.choice, result.pass_seconds = choice.memory, choice, progress.seconds
    return result


def plan(model: torch.nn.Module, example_inputs: Any = None, *, example_kwargs: dict[str, Any] | None = None,
         devices: int | Sequence[str | torch.device] | None = None, chunks: int | str = 8,
         balance: str | Sequence[float] = "flops", leaf_modules: Iterable[type | str] = (), tolerance: float = 0.03,
         memory_cap: float | None = None, route: str = "auto", schedule: str = "gpipe", virtual_stages: int = 1,
         checkpoint: str = "except_last", optimizer: str | None = "adam", cuda_graphs: bool = False,
         verbose: bool = False) -> Plan:
    """Plan only: trace, cost and partition, no runtime and no memory. Works for a model on meta.

    ``devices`` here only names stages: an int plans that many stages without checking they exist. The plan predicts
    each stage's memory for ``schedule``, ``checkpoint``, ``chunks`` and the ``optimizer``'s state. ``chunks``,
    ``schedule``, ``checkpoint`` may be ``"auto"`` (with ``memory_cap``): the fastest predicted configuration that fits,
    the alternatives in ``plan.choice``. ``verbose=True``: each pass on stderr."""
    auto = [k for k, v in (("chunks", chunks), ("schedule", schedule), ("checkpoint", checkpoint)) if v == "auto"]
    stage_devices = plan_devices(devices)
    options = Options.make(stage_devices, streams=device_streams(devices), chunks=1 if "chunks" in auto else chunks,
                           balance=balance, leaf_modules=leaf_modules, tolerance=tolerance, memory_cap=memory_cap,
                           route=route,
                           verbose=verbose, schedule="gpipe" if "schedule" in auto else schedule,
                           virtual_stages=1 if "schedule" in auto else virtual_stages,
                           checkpoint="except_last" if "checkpoint" in auto else checkpoint, optimizer=optimizer,
                           cuda_graphs=cuda_graphs)
    args, kwargs = as_tuple(example_inputs), example_kwargs or {}
    if auto:
        return _choose(model, args, kwargs, options, stage_devices, auto)
    return run_passes(model, args, kwargs, options, generate=False).plan


def compile(model: torch.nn.Module, devices: int | Sequence[str | torch.device] | None = None, chunks: int = 8, *,
            example_inputs: Any = None, example_kwargs: dict[str, Any] | None = None, checkpoint: str = "except_last",
            schedule: str = "gpipe", virtual_stages: int = 1, balance: str | Sequence[float] = "flops",
            leaf_modules: Iterable[type | str] = (), tolerance: float = 0.03, memory_cap: float | None = None,
            intra_op_threads: int | None = None, deferred_batch_norm: bool = False, track_memory: bool = False,
            data_parallel: int = 1, timeout: float = 300.0, route: str = "auto", cuda_graphs: bool = False,
            mesh: Any = None, device: str | torch.device | None = None,
            verbose: bool = False) -> Pipeline | DistributedPipeline:
    """Compile ``model`` into a pipeline over ``devices`` with ``chunks`` micro-batches (options: README.md).

    The model is not copied: stages hold its own parameters, and gradients land on them. Without example inputs the
    pipeline compiles on its first call. "1f1b" and "interleaved" schedules train with ``pipe.step(x, target=y,
    loss_fn=f)``. ``deferred_batch_norm=True``: BatchNorm running statistics over the whole mini-batch. Under torchrun
    with ``devices=None``: one stage per rank over torch.distributed, each rank holding its own stages alone, on
    ``device`` (default: ``cuda:LOCAL_RANK`` where CUDA is present, else the CPU); ``mesh``: a DeviceMesh whose "pp"
    dim is the pipeline and whose "dp_shard" / "dp_replicate" dims run FSDP2 over each stage (``data_parallel=D``:
    D replicas); ``timeout`` seconds bound any wait on a peer (docs/torchrun.md)."""
    chosen = dict(chunks=chunks, balance=balance, checkpoint=checkpoint, leaf_modules=leaf_modules, route=route,
                  tolerance=tolerance, memory_cap=memory_cap, schedule=schedule, virtual_stages=virtual_stages,
                  cuda_graphs=cuda_graphs)
    if cuda_graphs is True:  # every option checked first, then what graphs refuse
        Options((torch.device("cpu"),), **chosen)
        _check_graphs(devices, deferred_batch_norm=deferred_batch_norm, track_memory=track_memory)
    if devices is None and running_under_torchrun():
        # every rank plans all K stages; the options and the mesh are checked before any tensor is allocated
        world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
        options = Options.make([torch.device("cpu")] * pipeline_size(mesh, world, data_parallel),
                               verbose=verbose and os.environ.get("RANK", "0") == "0", **chosen)
        pipe = DistributedPipeline(model, options, run_passes, mesh=mesh, data_parallel=data_parallel, device=device,
                                   timeout=timeout, deferred_batch_norm=deferred_batch_norm)
    else:
        for name, value in (("data_parallel", data_parallel != 1), ("mesh", mesh is not None),
                            ("device", device is not None)):
            if value:
                raise ValueError(f"{name}= is for torchrun (one process per stage, devices=None); in one process "
                                 f"give the stages' devices as devices=[...]")
        device_list, streams = resolve_devices(devices), device_streams(devices)
        options = Options.make(device_list, verbose=verbose, streams=streams, **chosen)
        if any(p.device.type == "meta" for p in model.parameters()):
            raise ValueError(f"{type(model).__name__} has parameters on the meta device: autopipe.compile needs real "
                             f"weights (use autopipe.plan to plan a meta model, or materialise it with to_empty() and "
                             f"load a state dict)")
        build = lambda args, kwargs: run_passes(model, args, kwargs, options,
                                                after_codegen=lambda stages: on_streams(place(stages), options.streams))
        pipe = Pipeline(model, device_list, chunks, checkpoint, build, intra_op_threads=intra_op_threads,
                        deferred_batch_norm=deferred_batch_norm, schedule=schedule, virtual_stages=virtual_stages,
                        track_memory=track_memory, streams=streams)
    if example_inputs is not None or example_kwargs:
        pipe.compile_for(as_tuple(example_inputs), example_kwargs or {})
    return pipe


def _check_graphs(devices: Any, **refused: bool) -> None:
    """``cuda_graphs=True``'s refusals, before anything is traced or moved: each names what to change."""
    if devices is None and running_under_torchrun():
        raise ValueError("cuda_graphs=True is not supported under torchrun yet (one stage per rank over "
                         "torch.distributed): compile in one process with devices=[...], or cuda_graphs=False")
    for name, on in refused.items():
        if on:
            raise ValueError(f"cuda_graphs=True with {name}=True is not supported yet: "
                             + {"deferred_batch_norm": "deferred BatchNorm gathers statistics on the host side of "
                                                       "each task, which a replay skips",
                                "track_memory": "the memory report counts what autograd saves in each task, and a "
                                                "replay saves nothing through autograd"}[name]
                             + f"; drop {name} or cuda_graphs")
    cpu = [str(d) for d in resolve_devices(devices) if d.type != "cuda"]
    if cpu:
        raise ValueError(f"cuda_graphs=True needs every stage on a CUDA device, but devices gives {cpu[0]!r}"
                         f"{' (CUDA is not available here)' if not torch.cuda.is_available() else ''}; use CUDA "
                         f"devices, or cuda_graphs=False (autopipe.plan(..., cuda_graphs=True) plans for graphs "
                         f"anywhere)")


def as_tuple(inputs: Any) -> tuple:
    return () if inputs is None else tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)


def place(stages: Sequence[Stage]) -> Sequence[Stage]:
    """Move each tensor the stages read to its ``placement``. The tensor objects stay the same (``.data`` is replaced),
    so optimizers keep working and every stage, program and the model see the move."""
    with torch.no_grad():
        for t, device in placement(stages):
            if t.device != device:
                t.data = t.data.to(device)
    return stages


def on_streams(stages: Sequence[Stage], streams: Sequence[StageStream | None]) -> None:
    """Each stage given a stream computes on it (its runner reads ``compute_stream``, runtime/task.py)."""
    for stage, stream in zip(stages, streams):
        stage.compute_stream = stream


def placement(stages: Sequence[Stage]) -> list[tuple[torch.Tensor, torch.device]]:
    """Each tensor the stages read (``tensors_read``) and the device of the first stage that reads it; a later stage on
    another device runs on a replica (runtime/task.py). Found on the stages, not by name in the model: a trace makes
    tensors the model does not hold (fx's ``_tensor_constant0``, export's ``lifted_tensor_0``), whose lookup in the
    model was issue 29's KeyError on CUDA."""
    first: dict[int, tuple[torch.Tensor, torch.device]] = {}
    for stage in stages:
        for t in tensors_read(stage):
            first.setdefault(id(t), (t, stage.device))
    return list(first.values())


def tensors_read(module: fx.GraphModule) -> list[torch.Tensor]:
    """Every tensor ``module``'s graph reads: by ``get_attr`` (parameters, buffers, fx's and export's constants),
    those of the modules it calls whole or gets, and those of its subgraphs (export's no_grad / autocast regions),
    each once."""
    found: dict[int, torch.Tensor] = {}
    for node in module.graph.nodes:
        if node.op not in ("get_attr", "call_module"):
            continue
        value = operator.attrgetter(node.target)(module)
        if isinstance(value, torch.Tensor):
            found.setdefault(id(value), value)
        elif isinstance(value, torch.nn.Module):
            for t in [*value.parameters(), *value.buffers(),
                      *(tensors_read(value) if isinstance(value, fx.GraphModule) else ())]:
                found.setdefault(id(t), t)
    return list(found.values())
