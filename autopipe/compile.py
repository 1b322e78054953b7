"""compile() and plan(): run the passes trace -> cost -> partition -> codegen, then build the runtime."""
from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

import torch

from autopipe.passes.codegen import codegen
from autopipe.passes.cost import cost
from autopipe.passes.partition import partition
from autopipe.passes.trace import trace
from autopipe.plan import Plan
from autopipe.progress import Progress
from autopipe.runtime.checkpoint import CHECKPOINT_MODES
from autopipe.runtime.distributed import DistributedPipeline, running_under_torchrun
from autopipe.runtime.microbatch import micro_batch_sizes
from autopipe.runtime.pipeline import Compiled, Pipeline

BALANCE_MODES = ("flops", "params", "time")


def resolve_devices(devices: int | Sequence[str | torch.device] | None) -> list[torch.device]:
    """``devices=N``: N CUDA devices, or N CPU workers without CUDA; or an explicit list."""
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if devices is None:
        devices = cuda_count or min(os.cpu_count() or 1, 8)
    if isinstance(devices, bool) or not isinstance(devices, (int, list, tuple)):
        raise TypeError(f"devices must be an int or a list of devices, got {devices!r}")
    if isinstance(devices, int):
        if devices < 1:
            raise ValueError(f"devices must be at least 1, got {devices}")
        if cuda_count:
            if devices > cuda_count:
                raise ValueError(f"devices={devices} asks for {devices} CUDA devices but this host has {cuda_count}; "
                                 f"pass devices={cuda_count} or a list such as ['cpu'] * {devices}")
            return [torch.device("cuda", i) for i in range(devices)]
        return [torch.device("cpu")] * devices
    if len(devices) == 0:
        raise ValueError("devices is an empty list: name at least one device, e.g. devices=['cpu', 'cpu']")
    resolved = []
    for d in devices:
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
        elif device.type not in ("cpu",):
            raise ValueError(f"devices: {d!r}: autopipe runs stages on 'cpu' or 'cuda' devices")
        resolved.append(device)
    return resolved


def _check_options(chunks: int, checkpoint: str, balance: Any) -> None:
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive int (micro-batches per mini-batch), got {chunks!r}")
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
    if isinstance(balance, str) and balance not in BALANCE_MODES:
        raise ValueError(f"balance must be one of {BALANCE_MODES} or a list of per-stage weights, got {balance!r}")


def _as_tuple(example_inputs: Any) -> tuple:
    if example_inputs is None:
        return ()
    return tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)


def _plan(model, args, kwargs, devices, chunks, balance, leaf_modules, tolerance, memory_cap, route,
          progress: Progress | None = None):
    # Tracing runs the model's Python (fake tensors, export): it must not move the user's RNG.
    cuda_devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda_devices):
        return _run_passes(model, args, kwargs, devices, chunks, balance, leaf_modules, tolerance, memory_cap, route,
                           progress or Progress())


def _run_passes(model, args, kwargs, devices, chunks, balance, leaf_modules, tolerance, memory_cap, route,
                progress: Progress):
    n_params = sum(p.numel() for p in model.parameters())
    progress.say(f"planning {type(model).__name__} ({n_params / 1e6:,.1f} M parameters) as {len(devices)} stages "
                 f"x {chunks} micro-batches")
    with progress.run("trace") as report:
        traced = trace(model, args, kwargs, leaf_modules=leaf_modules, route=route)
        report["detail"] = f"{traced.route}, {len(traced.graph_module.graph.nodes)} graph nodes"
    measure = None
    if balance == "time":
        measure = traced.flat_inputs(args, kwargs)
        if any(t.device.type == "meta" for t in measure) or any(p.device.type == "meta" for p in model.parameters()):
            raise ValueError("balance='time' runs the model to time it; it needs real weights and inputs, not meta")
        # A stage runs one micro-batch at a time: time the nodes at that size, where fixed per-op
        # costs weigh as they will when the pipeline runs, not at the whole batch's size.
        batch = traced.batch_size
        rows = micro_batch_sizes(batch, chunks)[0]
        measure = [t[:rows] if t.dim() > 0 and t.shape[0] == batch else t for t in measure]
    with progress.run("cost") as report:
        costed = cost(traced, measure_inputs=measure)
        report["detail"] = f"balance={balance!r}" if isinstance(balance, str) else "balance=given weights"
    with progress.run("partition") as report:
        plan = partition(costed, len(devices), devices=devices, chunks=chunks, balance=balance,
                         tolerance=tolerance, memory_cap=memory_cap)
        report["detail"] = f"{plan.n_stages} stages, imbalance {plan.imbalance:.3f}"
    plan.notes.extend(traced.notes)
    plan.pass_seconds = progress.seconds  # the same dict: codegen's seconds join it later
    return traced, plan


def _codegen(graph_module, plan: Plan, progress: Progress):
    with progress.run("codegen") as report:
        stages = codegen(graph_module, plan)
        report["detail"] = f"{len(stages)} stage modules"
    return stages


def plan(
    model: torch.nn.Module,
    example_inputs: Any = None,
    *,
    example_kwargs: dict[str, Any] | None = None,
    devices: int | Sequence[str | torch.device] | None = None,
    chunks: int = 8,
    balance: str | Sequence[float] = "flops",
    leaf_modules: Iterable[type | str] = (),
    tolerance: float = 0.03,
    memory_cap: float | None = None,
    route: str = "auto",
    verbose: bool = False,
) -> Plan:
    """Plan only: trace, cost and partition, no runtime and no memory. Works for a model on meta.

    ``devices`` here only names stages: an int plans that many stages without checking they exist.
    ``verbose=True`` reports each pass on stderr (they always go to the ``autopipe`` logger)."""
    _check_options(chunks, "except_last", balance)
    if isinstance(devices, int):
        if devices < 1:
            raise ValueError(f"devices must be at least 1, got {devices}")
        device_list = [torch.device("cuda", i) if torch.cuda.is_available() and i < torch.cuda.device_count()
                       else torch.device("cpu") for i in range(devices)]
    else:
        device_list = resolve_devices(devices)
    _, result = _plan(model, _as_tuple(example_inputs), example_kwargs or {}, device_list, chunks, balance,
                      leaf_modules, tolerance, memory_cap, route, Progress(verbose))
    return result


def compile(
    model: torch.nn.Module,
    devices: int | Sequence[str | torch.device] | None = None,
    chunks: int = 8,
    *,
    example_inputs: Any = None,
    example_kwargs: dict[str, Any] | None = None,
    checkpoint: str = "except_last",
    balance: str | Sequence[float] = "flops",
    leaf_modules: Iterable[type | str] = (),
    tolerance: float = 0.03,
    memory_cap: float | None = None,
    intra_op_threads: int | None = None,
    deferred_batch_norm: bool = False,
    data_parallel: int = 1,
    timeout: float = 300.0,
    route: str = "auto",
    verbose: bool = False,
) -> Pipeline | DistributedPipeline:
    """Compile ``model`` into a GPipe pipeline over ``devices`` with ``chunks`` micro-batches.

    Without example inputs the pipeline compiles on its first call, from that call's inputs.
    The model is not copied: stages hold its own parameters, and gradients land on them.
    ``deferred_batch_norm=True`` tracks BatchNorm running statistics over the whole mini-batch
    (torchgpipe's DeferredBatchNorm), so they equal the plain model's.

    Under torchrun with ``devices=None``: one stage per rank over torch.distributed
    (``data_parallel`` replicas of the pipeline; ``timeout`` seconds bound any wait on a peer).

    ``verbose=True`` reports each compiler pass and its seconds on stderr as it finishes (rank 0
    only under torchrun); the reports always go to the ``autopipe`` logger, and the seconds to
    ``pipe.plan.pass_seconds``.
    """
    _check_options(chunks, checkpoint, balance)
    if devices is None and running_under_torchrun():
        speaks = verbose and int(os.environ.get("RANK", "0")) == 0
        pipe = DistributedPipeline(
            model, chunks, checkpoint,
            plan_fn=lambda args, kwargs, devs: _plan(model, args, kwargs, devs, chunks, balance, leaf_modules,
                                                     tolerance, memory_cap, route, Progress(speaks)),
            codegen_fn=lambda graph_module, result: _codegen(graph_module, result,
                                                             Progress(speaks, seconds=result.pass_seconds)),
            data_parallel=data_parallel, timeout=timeout, deferred_batch_norm=deferred_batch_norm)
        if example_inputs is not None or example_kwargs:
            pipe.build(_as_tuple(example_inputs), example_kwargs or {})
        return pipe
    if data_parallel != 1:
        raise ValueError("data_parallel needs torchrun: run one process per stage and replica (world = K x D)")
    device_list = resolve_devices(devices)
    if any(p.device.type == "meta" for p in model.parameters()):
        raise ValueError(f"{type(model).__name__} has parameters on the meta device: autopipe.compile needs real weights "
                         f"(use autopipe.plan to plan a meta model, or materialise it with to_empty() and load a state dict)")

    def build(args: Sequence[Any], kwargs: dict[str, Any]) -> Compiled:
        progress = Progress(verbose)
        traced, result = _plan(model, args, kwargs, device_list, chunks, balance, leaf_modules, tolerance,
                               memory_cap, route, progress)
        _place(model, result)
        stages = _codegen(traced.graph_module, result, progress)
        example = traced.flat_inputs(args, kwargs)
        return Compiled(traced=traced, plan=result, stages=stages, example_dtypes=[t.dtype for t in example])

    pipe = Pipeline(model, device_list, chunks, checkpoint, build, intra_op_threads=intra_op_threads,
                    deferred_batch_norm=deferred_batch_norm)
    if example_inputs is not None or example_kwargs:
        pipe.compile_for(_as_tuple(example_inputs), example_kwargs or {})
    return pipe


def _place(model: torch.nn.Module, result: Plan) -> None:
    """Move each parameter and buffer to the device of the first stage that holds it.
    Parameter objects stay the same (``.data`` is replaced), so optimizers keep working."""
    if all(s.device.type == "cpu" for s in result.stages):
        return
    placed: set[str] = set()
    for stage in result.stages:
        for name in stage.params:
            if name in placed:
                continue
            placed.add(name)
            module_name, _, attr = name.rpartition(".")
            owner = model.get_submodule(module_name)
            tensor = getattr(owner, attr)
            if tensor.device != stage.device:
                with torch.no_grad():
                    tensor.data = tensor.data.to(stage.device)
