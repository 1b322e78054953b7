"""Where the tensors the stages read live: each on the device of the first stage that reads it, moved there in place
after codegen (compile's ``after_codegen``), and each stage's CUDA stream where ``devices=`` named one."""
from __future__ import annotations

import operator
from typing import Sequence

import torch
import torch.fx as fx

from autopipe.passes.codegen import Stage
from autopipe.runtime.streams import StageStream


# Note [placement by the stages]: each tensor a stage reads goes to the device of the first stage that reads it,
# by replacing .data, so the objects stay the same. The tensors are found on the stages (get_attr, modules called
# or fetched whole, subgraphs), not by the plan's names in the model, which a trace's own constants are not:
# fx's _tensor_constant* and export's lifted_tensor_* raised KeyError on CUDA and AttributeError under torchrun.
def place(stages: Sequence[Stage]) -> Sequence[Stage]:
    """Move each tensor the stages read to its ``placement``. The tensor objects stay the same (``.data`` is replaced),
    so optimizers keep working and every stage, program and the model see the move (Note [placement by the
    stages])."""
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
    another device runs on a replica (runtime/task.py). Found on the stages, not by name in the model (Note
    [placement by the stages])."""
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
