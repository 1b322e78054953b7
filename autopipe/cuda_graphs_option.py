"""``cuda_graphs=True`` at compile time, in one place: the option's refusals (``check_option`` when Options are made,
``check_graphs`` before compile traces or moves anything), and its one hook in the chain (``graphs_planned``): which
stages replay as graphs (passes/graph_capture.py) before the memory model prices their slots, and the plan refused
after where they pass ``memory_cap``. The runtime replays what the plan's report captures (runtime/cuda_graphs.py)."""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from autopipe.devices import resolve_devices
from autopipe.ir.capture import CaptureReport
from autopipe.ir.plan import Plan, human_bytes
from autopipe.ir.schedule import SPLIT
from autopipe.passes.graph_capture import graph_capture
from autopipe.runtime.distributed import running_under_torchrun


def check_option(cuda_graphs: Any, schedule: str) -> None:
    """The option itself, for every entry point: a bool, and a schedule whose backward the capture can replay."""
    if not isinstance(cuda_graphs, bool):
        raise TypeError(f"cuda_graphs must be True or False, got {cuda_graphs!r}")
    if cuda_graphs and schedule in SPLIT:
        raise ValueError(f"cuda_graphs=True with schedule={schedule!r} is not supported yet: its backward is "
                         f"split in two (input gradients, then parameter gradients), which the captured backward "
                         f"does not do; use 'gpipe', '1f1b' or 'interleaved', or cuda_graphs=False")


def check_graphs(devices: Any, **refused: bool) -> None:
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


def _within_cap(plan: Plan, memory_cap: float) -> None:
    """cuda_graphs=True keeps each micro-batch a captured stage holds in static memory of its own: refused before any
    runs where the predicted peak with those graphs passes ``memory_cap``."""
    per_device = plan.memory.per_device()
    device = max(range(len(per_device)), key=per_device.__getitem__)
    if per_device[device] > memory_cap:
        graphs = sum(p.graph_bytes for p in plan.memory if p.device == device)
        raise ValueError(f"cuda_graphs=True: device {device} is predicted to hold {human_bytes(per_device[device])} "
                         f"({human_bytes(graphs)} in graph slots), over memory_cap={human_bytes(memory_cap)}. Use "
                         f"checkpoint='always' (fewer slots), fewer chunks, a larger memory_cap or cuda_graphs=False; "
                         f"print(autopipe.plan(..., cuda_graphs=True)) shows the slots (docs/gpus.md)")


def capture_report(traced: Any, plan: Plan, options: Any) -> CaptureReport | None:
    """With ``options.cuda_graphs``, which stages of ``plan`` can replay as CUDA graphs, and why not; else None."""
    return graph_capture(traced, plan) if options.cuda_graphs else None


@contextlib.contextmanager
def graphs_planned(traced: Any, plan: Plan, options: Any) -> Iterator[None]:
    """Around the memory model's prediction in the chain: with ``options.cuda_graphs``, the capture report first (the
    prediction prices each captured stage's slots), the refusal over ``options.memory_cap`` after."""
    if options.cuda_graphs:
        plan.cuda_graphs = graph_capture(traced, plan)
    yield
    if options.cuda_graphs and options.memory_cap is not None:
        _within_cap(plan, options.memory_cap)
