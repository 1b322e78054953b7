"""``chunks``/``schedule``/``checkpoint="auto"`` for ``autopipe.plan``: trace and cost once, partition once per stage
count, and let the memory model pick the fastest predicted configuration that fits ``memory_cap``."""
from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import torch

from autopipe.cuda_graphs_option import capture_report
from autopipe.global_state import autocast_cache_off, preserved_global_state
from autopipe.ir.checkpoint import CHECKPOINT_MODES
from autopipe.ir.plan import Plan
from autopipe.ir.schedule import NAMES as SCHEDULES, device_of_stage, is_v_layout
from autopipe.options import Options
from autopipe.pass_chain import on_model_device, trace_analyse_and_cost
from autopipe.passes.memory_model import choose_configuration
from autopipe.passes.partition import partition
from autopipe.progress import Progress


def choose(model, args, kwargs, options: Options, devices: Sequence[torch.device], auto: list[str]) -> Plan:
    """``chunks``/``schedule``/``checkpoint="auto"``: trace and cost once, partition once per stage
    count, and keep the fastest predicted configuration whose memory fits ``memory_cap``."""
    if options.memory_cap is None:
        raise ValueError(f"{', '.join(f'{k}=auto' for k in auto)} picks the fastest configuration that fits the "
                         f"memory: give memory_cap (bytes per device)")
    if isinstance(options.balance, Plan):
        raise ValueError(f"{', '.join(f'{k}=auto' for k in auto)} picks among cuts, and balance= a plan fixes one: "
                         f"give {', '.join(auto)} yourself, or a balance mode")
    progress = Progress(options.verbose)
    args, kwargs = on_model_device(model, args, kwargs)  # as run_passes: a GPU model's CPU example batch
    with preserved_global_state(), torch.inference_mode(False), autocast_cache_off():
        traced, analysis, costed = trace_analyse_and_cost(model, args, kwargs, options, None, progress)
        K = len(devices)

        def plan_for(n_stages: int):
            planned = partition(costed, n_stages, devices=[devices[s % K] for s in range(n_stages)], chunks=1,
                                balance=options.balance, tolerance=options.tolerance, notes=traced.notes,
                                analysis=analysis)
            planned.cuda_graphs = capture_report(traced, planned, options)
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
            holders = [device_of_stage(choice.schedule, K, s) for s in range(2 * K)]
            choice.chosen.plan = partition(costed, 2 * K, devices=[devices[d] for d in holders], chunks=1,
                                           balance=options.balance, tolerance=options.tolerance, notes=traced.notes,
                                           analysis=analysis, holders=holders)
    result = replace(choice.plan, chunks=choice.chunks, notes=list(choice.plan.notes))
    result.memory, result.choice, result.pass_seconds = choice.memory, choice, progress.seconds
    return result
