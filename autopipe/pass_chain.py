"""``run_passes``: the one chain of passes (trace -> micro-batch analysis -> cost -> partition -> codegen) that every
entry point calls with one :class:`~autopipe.options.Options`; a model that specialises on the batch size is traced
once per micro-batch size."""
from __future__ import annotations

import warnings
from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from autopipe.cuda_graphs_option import graphs_planned
from autopipe.global_state import autocast_cache_off, preserved_global_state
from autopipe.ir.plan import Plan
from autopipe.options import Options, stage_holders
from autopipe.passes.batch_mixing import refuse_batch_mixing_outputs
from autopipe.passes.codegen import codegen
from autopipe.passes.cost import cost
from autopipe.passes.diagnostics import failures_named, listed
from autopipe.passes.memory_model import predict_memory
from autopipe.passes.microbatch_analysis import analyse_micro_batches
from autopipe.passes.node_times import train_seconds
from autopipe.passes.partition import partition
from autopipe.passes.target_counts import count_program
from autopipe.passes.trace import BatchSpecialised, trace
from autopipe.progress import Progress
from autopipe.runtime.microbatch import micro_batch_sizes
from autopipe.runtime.step import Compiled, Program


def run_passes(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any], options: Options, *,
               generate: bool = True, before_codegen: Callable[[Plan], None] | None = None,
               after_codegen: Callable[[list], None] | None = None, cut_of: Plan | None = None) -> Compiled:
    """The passes under ``preserved_global_state`` (Note [global state across tracing]); a model that specialises on
    the batch size is traced once per micro-batch size (Note [batch-specialised models]). ``before_codegen(plan)``:
    where the torchrun runtime materialises its meta weights. ``after_codegen(stages)``: where compile places the
    tensors the stages read on their devices, before the runners look at where they are. ``cut_of``: a plan of the
    same model at other input shapes whose cut to keep (the torchrun runtime's, Note [one cut for every shape])."""
    progress = Progress(options.verbose)
    args, kwargs = on_model_device(model, args, kwargs)

    def program(static_batch: int | None = None, specialised: BatchSpecialised | None = None) -> Program:
        traced, analysis, costed = trace_analyse_and_cost(model, args, kwargs, options, static_batch, progress)
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
        # Note [a plan's cut given as the balance]
        given = options.balance if isinstance(options.balance, Plan) else None
        with progress.run("partition", model) as report:
            plan = partition(costed, len(options.devices), devices=options.devices, chunks=options.chunks, notes=notes,
                             balance="flops" if given is not None else options.balance, tolerance=options.tolerance,
                             memory_cap=options.memory_cap, analysis=analysis, cut_of=cut_of or given,
                             crossing_price=options.crossing_price, holders=stage_holders(options))
            if given is not None:  # the shares printed are FLOPs'; the cut is the given plan's
                plan.notes.append(f"the cut is the given plan's (balanced by {given.balance})")
            plan.pass_seconds = progress.seconds  # the running dict: later passes' seconds join it
            for message in plan.across_micro_batches:
                warnings.warn(f"autopipe: {message}", stacklevel=4)
            with graphs_planned(traced, plan, options):  # cuda_graphs=True: the memory model prices their slots
                plan.memory = predict_memory(costed, plan, options.schedule, options.checkpoint, options.chunks,
                                             options.virtual_stages, options.optimizer)
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
        return Program(traced=traced, plan=plan, stages=stages, counts=count_program(traced.graph_module, plan))

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
                # Note [eager runs at the whole batch]
                refuse_batch_mixing_outputs(model, args, kwargs, e.batch_size, programs.values())
    example = next(iter(programs.values())).traced.flat_inputs(args, kwargs)
    return Compiled(programs=programs, example_dtypes=[t.dtype for t in example])


# Note [example inputs on the model's device]: a DataLoader gives CPU batches to a model on a GPU. Stage 0 moves
# them itself, but the passes would trace and time a model with mixed devices: the chain takes the example
# inputs to the model's device first.
def on_model_device(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any]):
    """The example inputs on the model's device (Note [example inputs on the model's device])."""
    devices = {t.device for t in (*model.parameters(), *model.buffers())}
    if len(devices) != 1 or (device := devices.pop()).type == "meta":
        return args, kwargs
    move = lambda t: t.to(device) if t.device != device and t.device.type != "meta" else t
    return pytree.tree_map_only(torch.Tensor, move, (tuple(args), dict(kwargs or {})))


def trace_analyse_and_cost(model, args, kwargs, options: Options, static_batch: int | None, progress: Progress):
    """The passes before the cut: trace, the micro-batch analysis of its graph (timed with trace: compile reports four
    passes), cost."""
    with progress.run("trace", model) as report:
        traced = trace(model, args, kwargs, leaf_modules=options.leaf_modules, route=options.route,
                       static_batch=static_batch)
        with failures_named("micro-batch analysis", model):
            analysis = analyse_micro_batches(traced)
        report["detail"] = f"{traced.route}, {len(traced.graph_module.graph.nodes)} graph nodes"
    measure = None
    if options.balance in ("time", "train_time"):
        measure = traced.flat_inputs(args, kwargs)
        if any(t.device.type == "meta" for t in measure) or any(p.device.type == "meta" for p in model.parameters()):
            raise ValueError(f"balance={options.balance!r} runs the model to time it; it needs real weights and "
                             f"inputs, not meta (under torchrun: plan in one process and give the plan as balance=, "
                             f"docs/torchrun.md)")
        # a stage runs one micro-batch at a time: time the nodes at that size, where fixed per-op costs weigh as in the
        # pipeline
        rows = static_batch or micro_batch_sizes(traced.batch_size, options.chunks)[0]
        batch = traced.batch_size if static_batch is None else measure[0].shape[0]
        measure = [t[:rows] if t.dim() > 0 and t.shape[0] == batch else t for t in measure]
    with progress.run("cost", model) as report:
        costed = cost(traced, measure_inputs=measure if options.balance == "time" else None)
        if options.balance == "train_time":
            workers = max(1, len(options.devices) // options.virtual_stages)
            costed.train_seconds = train_seconds(traced.graph_module, measure, workers,
                                                 on_cpu=all(d.type == "cpu" for d in options.devices),
                                                 recompute=options.checkpoint != "never")
        given = {tuple: "given weights", Plan: "a given plan's cut"}.get(type(options.balance))
        report["detail"] = f"balance={given or repr(options.balance)}"
    return traced, analysis, costed
