"""``cuda_graphs=True`` at compile time: what it refuses before anything is traced or moved, and the plan it refuses
once the memory model has priced its graph slots (runtime/cuda_graphs.py runs it)."""
from __future__ import annotations

from typing import Any

import torch

from autopipe.devices import resolve_devices
from autopipe.ir.plan import Plan, human_bytes
from autopipe.runtime.distributed import running_under_torchrun


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


def graphs_within_cap(plan: Plan, memory_cap: float) -> None:
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
