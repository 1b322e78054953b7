"""compile() and plan(): one :class:`~autopipe.options.Options` for the chain of passes (autopipe/pass_chain.py's
``run_passes``), then a runtime: a Pipeline in one process, a DistributedPipeline under torchrun."""
from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

import torch
import torch.distributed as dist

from autopipe.auto_choice import choose
from autopipe.cuda_graphs_option import check_graphs
from autopipe.devices import device_streams, plan_devices, resolve_devices
from autopipe.ir.plan import Plan
from autopipe.options import Options, as_tuple
from autopipe.pass_chain import run_passes
from autopipe.placement import on_streams, place
from autopipe.runtime.distributed import DistributedPipeline, running_under_torchrun
from autopipe.runtime.mesh import pipeline_size
from autopipe.runtime.pipeline import Pipeline


def plan(model: torch.nn.Module, example_inputs: Any = None, *, example_kwargs: dict[str, Any] | None = None,
         devices: int | Sequence[str | torch.device] | None = None, chunks: int | str = 8,
         balance: str | Sequence[float] | Plan = "flops", leaf_modules: Iterable[type | str] = (),
         tolerance: float = 0.03, memory_cap: float | None = None, route: str = "auto", schedule: str = "gpipe",
         virtual_stages: int = 1, checkpoint: str = "except_last", optimizer: str | None = "adam",
         cuda_graphs: bool = False, crossing_price: float = 0.0, verbose: bool = False) -> Plan:
    """Plan only: trace, cost and partition, no runtime and no memory. Works for a model on meta.

    ``devices`` here only names stages: an int plans that many stages without checking they exist. The plan predicts
    each stage's memory for ``schedule``, ``checkpoint``, ``chunks`` and the ``optimizer``'s state. ``chunks``,
    ``schedule``, ``checkpoint`` may be ``"auto"`` (with ``memory_cap``): the fastest predicted configuration that fits,
    the alternatives in ``plan.choice``. ``crossing_price``: what a byte crossing a cut costs a stage, in the
    balance's units (passes/step_time.py: ``crossing_price(measure_link(), flops_per_second)``), so that the cut
    lands where the predicted step is fastest. ``balance="train_time"`` times each node's forward and backward on the
    real model; ``balance=`` a plan keeps that plan's cut, how torchrun's ranks get a measured cut
    (Note [a plan's cut given as the balance]). ``verbose=True``: each pass on stderr."""
    auto = [k for k, v in (("chunks", chunks), ("schedule", schedule), ("checkpoint", checkpoint)) if v == "auto"]
    stage_devices = plan_devices(devices)
    options = Options.make(stage_devices, streams=device_streams(devices), chunks=1 if "chunks" in auto else chunks,
                           balance=balance, leaf_modules=leaf_modules, tolerance=tolerance, memory_cap=memory_cap,
                           route=route,
                           verbose=verbose, schedule="gpipe" if "schedule" in auto else schedule,
                           virtual_stages=1 if "schedule" in auto else virtual_stages,
                           checkpoint="except_last" if "checkpoint" in auto else checkpoint, optimizer=optimizer,
                           cuda_graphs=cuda_graphs, crossing_price=crossing_price)
    args, kwargs = as_tuple(example_inputs), example_kwargs or {}
    if auto:
        return choose(model, args, kwargs, options, stage_devices, auto)
    return run_passes(model, args, kwargs, options, generate=False).plan


def compile(model: torch.nn.Module, devices: int | Sequence[str | torch.device] | None = None, chunks: int = 8, *,
            example_inputs: Any = None, example_kwargs: dict[str, Any] | None = None, checkpoint: str = "except_last",
            schedule: str = "gpipe", virtual_stages: int = 1, balance: str | Sequence[float] | Plan = "flops",
            leaf_modules: Iterable[type | str] = (), tolerance: float = 0.03, memory_cap: float | None = None,
            intra_op_threads: int | None = None, deferred_batch_norm: bool = False, track_memory: bool = False,
            data_parallel: int = 1, timeout: float = 300.0, route: str = "auto", cuda_graphs: bool = False,
            mesh: Any = None, device: str | torch.device | None = None, crossing_price: float = 0.0,
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
                  cuda_graphs=cuda_graphs, crossing_price=crossing_price)
    if cuda_graphs is True:  # every option checked first, then what graphs refuse
        Options((torch.device("cpu"),), **chosen)
        check_graphs(devices, deferred_batch_norm=deferred_batch_norm, track_memory=track_memory)
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
