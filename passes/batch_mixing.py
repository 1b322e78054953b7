"""A model traced per micro-batch size (static_batch) shows its outputs at that size alone: ``output_facts`` runs it
eagerly on fake inputs at the whole batch, and ``refuse_batch_mixing_outputs`` refuses, before anything runs, an output
that mixes the batch's rows there (Note [eager runs at the whole batch])."""
from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from autopipe.global_state import preserved_global_state
from autopipe.ir.batch import carries_batch

from .fake_shapes import fake_errors_unlogged
from .model_state import hooks_kept, module_state_kept, scalar_buffers_kept
from .traced_model import named_leaves, per_sample_lists


# Note [eager runs at the whole batch]: a model traced per micro-batch size can branch on that size (if len(a)
# == 1), so its two exports say nothing of what the whole batch computes. Compile also runs it eagerly on fake
# tensors at the whole batch and one row more, recording each aten op, and refuses an output computed from an op
# whose result holds the batch in two dims, or whose other dims grow with the batch.
def output_facts(model: torch.nn.Module, args: Sequence[Any], kwargs: dict[str, Any],
                 batch: int) -> list[tuple[str, tuple | None, str]] | None:
    """(path, shape, pairing op) of each of the model's output leaves, run eagerly on fake inputs at the whole batch: a
    model exported at its micro-batch size shows its outputs at that size alone. Shape None: not a tensor. The pairing
    op is the first op the leaf is computed from whose result holds the batch in two dims (contrastive logits), seen by
    a second run one row larger with the same ops ("": none, or the runs differ, as the two exports at the micro-batch
    size may where the whole batch's runs do not). None where the model cannot run on fake tensors."""
    runs = []
    for rows in (batch, batch + 1):
        try:
            with preserved_global_state(), module_state_kept(model), hooks_kept(model), \
                    scalar_buffers_kept(model, every_buffer=True), \
                    torch.no_grad(), fake_errors_unlogged(), FakeTensorMode(allow_non_fake_inputs=True) as mode:
                grow = lambda t: torch.cat([t, t[:1]]) if rows > batch and carries_batch(t, batch) else t  # noqa: E731
                fake_args, fake_kwargs = pytree.tree_map_only(torch.Tensor, lambda t: grow(mode.from_tensor(t)),
                                                              (tuple(args), dict(kwargs)))
                with _OpRecorder() as ops:
                    leaves = named_leaves(per_sample_lists(model(*fake_args, **fake_kwargs), rows))
            runs.append((leaves, ops.ops))
        except Exception:  # noqa: BLE001 - data-dependent ops: nothing learnt
            if not runs:
                return None
    (leaves, ops), mixed = runs[0], {}
    if len(runs) == 2 and [op[0] for op in ops] == [op[0] for op in runs[1][1]]:
        for (func, inputs, outputs), (_, _, grown) in zip(ops, runs[1][1]):
            source = next((mixed[id(t)] for t in inputs if id(t) in mixed), None)
            if source is None and any(a.dim() == b.dim() and sum(x != y for x, y in zip(a.shape, b.shape)) > 1
                                      for a, b in zip(outputs, grown)):
                source = str(func)
            mixed.update((id(t), source) for t in outputs if source)
    return [(path, tuple(t.shape) if isinstance(t, torch.Tensor) else None, mixed.get(id(t), "")) for path, t in leaves]


class _OpRecorder(TorchDispatchMode):
    """Each aten op with its tensor inputs and outputs, kept alive so that their ids stay theirs."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[Any, list[torch.Tensor], list[torch.Tensor]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = lambda tree: [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]  # noqa: E731
        self.ops.append((func, tensors((args, kwargs)), tensors(out)))
        return out


def refuse_batch_mixing_outputs(model, args, kwargs, batch: int, programs: Iterable[Any]) -> None:
    """Refused before anything runs, for a model exported at its micro-batch size: an output computed from a value
    holding the batch in two dims, or one whose other dims grow with the batch (CLIP's logits), seen in eager runs at
    the whole batch. The export one row larger finds these where the two exports have the same nodes; where they do not
    (a branch on len(x) == 1), these runs may (Note [eager runs at the whole batch]). ``programs``: run_passes's, each
    with its ``traced`` and ``plan``."""
    whole = output_facts(model, args, kwargs, batch)
    for path, _, pairing in whole or ():
        if pairing:
            raise ValueError(f"the model's {path} is computed from {pairing}, whose result holds the batch in two "
                             f"dims: it pairs the samples (u @ v.T), and a micro-batch holds only its own. Compute it "
                             f"outside the model from per-sample outputs, or run with chunks=1; see "
                             f"docs/faithfulness.md")
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
