"""A rank holds its own stages' tensors and nothing else: on its device, materialised from meta directly into the
tensors the stages read, every other stage's tensors left on meta (docs/architecture.md, "Under torchrun").

Note [tensors swapped by identity]: a tensor is shared by every module table that holds it: the model's modules, the
stages' own containers (fx's ``_copy_attr`` makes fresh ``Module()``s on the way to a ``get_attr``; the export route's
stages hold only such containers), the traced graph's, and the lists a stage keeps (``running_buffers``). A tensor that
moves (meta to a device, or a device to meta) is replaced in all of them at once, keyed by the old tensor's identity,
so a tied weight stays one tensor and a stage never reads a copy its model no longer holds.
"""
from __future__ import annotations

import contextlib
import hashlib
import inspect
import itertools
import math
import os
import warnings
from typing import Any, Iterable, Iterator

import torch

__all__ = ["rank_device", "hold_only", "adopt", "on_meta_for_tracing", "rebind", "keep_persistence", "Elsewhere"]

META = torch.device("meta")


def rank_device(device: Any, model: torch.nn.Module) -> torch.device:
    """Where this rank's stages run: ``device`` when given (``"cuda"``: this local rank's GPU); else the model's GPU
    where the user put the whole model on one; else ``cuda:LOCAL_RANK`` where CUDA is present; else the CPU."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is not None:
        chosen = torch.device(device)
        return torch.device("cuda", local_rank) if chosen.type == "cuda" and chosen.index is None else chosen
    found = {t.device for t in itertools.chain(model.parameters(), model.buffers()) if t.device.type != "meta"}
    if len(found) == 1 and (only := next(iter(found))).type == "cuda":
        return only
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if local_rank >= torch.cuda.device_count():
        raise ValueError(f"local rank {local_rank} would run on cuda:{local_rank}, but this host has "
                         f"{torch.cuda.device_count()} GPU(s): pass device= to autopipe.compile (e.g. device='cpu', "
                         f"or the GPU this rank shares)")
    return torch.device("cuda", local_rank)


def tables(modules: Iterable[torch.nn.Module]) -> Iterator[tuple[dict, str, torch.Tensor]]:
    """(table, name, tensor) for each parameter and buffer slot of ``modules`` (each module once)."""
    seen: set[int] = set()
    for module in modules:
        if id(module) in seen:
            continue
        seen.add(id(module))
        for table in (module._parameters, module._buffers):
            for name, t in list(table.items()):
                if t is not None:
                    yield table, name, t


def rebind(modules: Iterable[torch.nn.Module], new: dict[int, tuple[torch.Tensor, torch.Tensor]],
           stages: Iterable[Any] = ()) -> None:
    """Every slot of ``modules`` holding a key of ``new`` (the id of an old tensor -> (old, new)) holds the new one;
    so do the stages' buffer lists (Note [tensors swapped by identity])."""
    for table, name, t in tables(modules):
        if id(t) in new:
            table[name] = new[id(t)][1]
    for stage in stages:
        for kept in (stage.running_buffers, stage.written_buffers):
            kept[:] = [new[id(b)][1] if id(b) in new else b for b in kept]


def _like(t: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` as the kind of tensor ``t`` is: a Parameter with its requires_grad, or a buffer."""
    return torch.nn.Parameter(value, t.requires_grad) if isinstance(t, torch.nn.Parameter) else value


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return _like(t, torch.empty(t.shape, dtype=t.dtype, device=META))


@contextlib.contextmanager
def on_meta_for_tracing(model: torch.nn.Module) -> Iterator[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """The model traced again (a new input signature) after this rank released the other stages: its tensors are on
    meta and on the rank's device, which no fake-tensor trace can mix. Every real tensor is swapped for a meta twin
    while the passes run; yields twin id -> (twin, the real tensor), for the stages the passes make from the twins."""
    devices = {t.device for _, _, t in tables(model.modules())}
    if len(devices) <= 1:
        yield {}
        return
    real = {id(t): t for _, _, t in tables(model.modules()) if t.device.type != "meta"}
    twins = {i: (t, _on_meta(t)) for i, t in real.items()}
    rebind(model.modules(), twins)
    try:
        yield {id(twin): (twin, t) for t, twin in twins.values()}
    finally:
        rebind(model.modules(), {id(twin): (twin, t) for t, twin in twins.values()})


class Elsewhere(torch.nn.Module):
    """A stage another rank runs, in this rank's program: it holds none of that stage's tensors (a StageRunner built
    over it allocates nothing)."""

    uses_rng = False

    def __init__(self, index: int):
        super().__init__()
        self.index, self.device = index, META
        self.running_buffers, self.written_buffers = [], []


def hold_only(model: torch.nn.Module, stages: list, mine: Iterable[int], device: torch.device,
              rank: int) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """This rank's stages' tensors on ``device`` (a tensor on meta made there and initialised), every other tensor of
    the model on meta, the other stages replaced by :class:`Elsewhere` in ``stages``; returns the moves (old id ->
    (old, new)), which the caller applies to what else holds the model's tensors (the traced graph)."""
    mine = sorted(mine)
    own = {id(t): t for s in mine for _, _, t in tables(stages[s].modules())}
    for s in range(len(stages)):
        if s not in mine:
            stages[s] = Elsewhere(s)
    moved = {i: (t, _like(t, torch.empty(t.shape, dtype=t.dtype, device=device) if t.is_meta
                          else t.detach().to(device)))
             for i, t in own.items() if t.device != device}
    born = [new for i, (old, new) in moved.items() if old.is_meta]
    moved.update({id(t): (t, _on_meta(t)) for _, _, t in tables(model.modules())
                  if id(t) not in own and not t.is_meta})
    everything = [*model.modules(), *(m for s in mine for m in stages[s].modules())]
    rebind(everything, moved, [stages[s] for s in mine])
    keep_persistence([stages[s] for s in mine], model)
    if born:
        with torch.device(device):
            initialise(model, born, [m for s in mine for m in stages[s].modules()], rank)
    return moved


def adopt(model: torch.nn.Module, stages: list, mine: Iterable[int],
          twins: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
    """A later program's stages (a new input signature, traced on the meta twins of :func:`on_meta_for_tracing`)
    read the tensors this rank holds; the other stages are :class:`Elsewhere`."""
    mine = sorted(mine)
    for s in range(len(stages)):
        if s not in mine:
            stages[s] = Elsewhere(s)
    rebind([m for s in mine for m in stages[s].modules()], twins, [stages[s] for s in mine])
    keep_persistence([stages[s] for s in mine], model)


def keep_persistence(stages: Iterable[torch.nn.Module], model: torch.nn.Module) -> None:
    """A stage's buffer is in its state dict only where it is in the model's: fx's ``_copy_attr`` registers every
    tensor a ``get_attr`` reads as a persistent buffer of a fresh container (torch/fx/graph_module.py), a non-persistent
    buffer (a rotary ``inv_freq``) and a tensor the trace made (``_tensor_constant0``) alike."""
    for stage in stages:
        for path, module in stage.named_modules():
            try:
                owner = model.get_submodule(path)
            except AttributeError:
                owner = None
            for name in module._buffers:
                if owner is None or name not in owner._buffers or name in owner._non_persistent_buffers_set:
                    module._non_persistent_buffers_set.add(name)


# Note [meta weights seeded by name]: a rank materialises only its stages' tensors, swapped by identity so ties
# survive. Only the module owning a tensor's canonical name is reset, with a generator seeded from that name, so
# every rank that holds a tied weight initialises it alike.
@contextlib.contextmanager
def _seeded_by(name: str):
    """The generators seeded from a module's name, restored afterwards: every rank initialises a module alike (tied
    weights agree), and the user's RNG state is left as it was."""
    digest = hashlib.blake2b(name.encode(), digest_size=8).digest()
    gpus = list(range(torch.cuda.device_count())) if torch.cuda.is_available() else []
    with torch.random.fork_rng(devices=gpus):
        torch.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
        yield


def initialise(model: torch.nn.Module, born: list[torch.Tensor], stage_modules: list, rank: int) -> None:
    """The tensors made from meta get values: each owner module's ``reset_parameters`` (Note [meta weights seeded by
    name]); a non-persistent buffer the value its constructor gives (:func:`constructed_buffers`), or a refusal naming
    it. The values land in the tensors the stages read, even where an init assigns new tensors."""
    ids = {id(t) for t in born}
    names = {id(t): n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if id(t) in ids}
    orphans = [n for m in stage_modules for n, t in m.named_buffers(recurse=False) if id(t) in ids and id(t) not in
               names]
    if orphans:
        raise ValueError(f"rank {rank}: the tensor {orphans[0]!r} the trace made is on the meta device and no module "
                         f"of the model holds it, so nothing can give it a value; build the model on the CPU, or "
                         f"make that tensor in the forward from real values")
    owners = {o: model.get_submodule(o) for o in dict.fromkeys(n.rpartition(".")[0] for n in names.values())}
    slots = [(table, name, t) for table, name, t in tables(model.modules()) if id(t) in ids]
    for owner, module in owners.items():
        if hasattr(module, "reset_parameters"):
            with _seeded_by(owner), torch.no_grad():
                module.reset_parameters()
    _put_back(slots)
    for owner, module in owners.items():
        lost = [b for b in module._non_persistent_buffers_set if id(module._buffers.get(b)) in ids]
        if lost:
            with _seeded_by(owner), torch.no_grad():
                for b, value in constructed_buffers(model, owner, lost).items():
                    module._buffers[b].copy_(value)
            _put_back(slots)
    unset = [o for o, m in owners.items() if not hasattr(m, "reset_parameters") and any(
        id(t) in ids and n not in m._non_persistent_buffers_set for n, t in itertools.chain(
            m.named_parameters(recurse=False), m.named_buffers(recurse=False)))]
    if unset:
        warnings.warn(f"rank {rank}: modules {unset[:5]}{'...' if len(unset) > 5 else ''} were on the meta device and "
                      f"have no reset_parameters(): their tensors hold uninitialised memory until you load them "
                      f"(pipe.load_state_dict, dcp.load: docs/torchrun.md)", stacklevel=5)


def _put_back(slots: list[tuple[dict, str, torch.Tensor]]) -> None:
    """An init that assigned a new tensor (``self.weight = ...``): its value copied into the one the stages read."""
    with torch.no_grad():
        for table, name, ours in slots:
            if table.get(name) is not ours:
                ours.copy_(table[name])
                table[name] = ours


_REBUILT_AT_MOST = 1 << 20  # elements of parameters a module may own to be built again for its buffers


def constructed_buffers(model: torch.nn.Module, owner: str, names: list[str]) -> dict[str, torch.Tensor]:
    """The values the constructor of module ``owner`` gives its non-persistent buffers ``names``: by transformers'
    ``_init_weights`` where a PreTrainedModel holds the module and sets them (what ``from_pretrained`` runs for keys no
    checkpoint carries), else by building a small module again from its same-named attributes, twice under two seeds
    to check the values do not depend on the RNG. Raises ValueError naming the buffer where neither applies."""
    module = model.get_submodule(owner)
    where = f"{owner + '.' if owner else ''}{names[0]} ({type(module).__name__})"
    if (values := _by_transformers(model, owner, names)) is not None:
        return values
    try:
        if sum(p.numel() for p in module.parameters()) > _REBUILT_AT_MOST:
            raise LookupError("the module is too large to build again")
        arguments = {}
        for name, p in list(inspect.signature(type(module).__init__).parameters.items())[1:]:
            if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or (p.default is not p.empty and not hasattr(module, name)):
                continue
            if not hasattr(module, name):
                raise LookupError(f"its __init__ takes {name!r}, which it does not keep as an attribute")
            arguments[name] = getattr(module, name)
        built = []
        for seed in (0, 1):
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                fresh = type(module)(**arguments)
            built.append({b: fresh._buffers[b] for b in names})
    except Exception as e:  # noqa: BLE001 - any failure to rebuild is the refusal below
        raise ValueError(f"the non-persistent buffer {where} was on the meta device and autopipe cannot know its "
                         f"value ({type(e).__name__}: {str(e)[:80]}); build the model on the CPU, or give the module a "
                         f"reset_parameters() that sets it (docs/faithfulness.md)") from e
    if any(not torch.equal(built[0][b], built[1][b]) for b in names):
        raise ValueError(f"the non-persistent buffer {where} was on the meta device and its constructor draws it at "
                         f"random, so no rank can know the plain model's value; build the model on the CPU")
    return built[0]


def _by_transformers(model: torch.nn.Module, owner: str, names: list[str]) -> dict[str, torch.Tensor] | None:
    """The buffers as the nearest transformers PreTrainedModel's ``_init_weights`` sets them; None where there is
    none, or it leaves one of them as it was (it knows only the modules of its library: filled with a marker first)."""
    module, parts = model.get_submodule(owner), owner.split(".") if owner else []
    for k in range(len(parts), -1, -1):
        ancestor = model.get_submodule(".".join(parts[:k]))
        if callable(getattr(ancestor, "_init_weights", None)) and hasattr(ancestor, "config") and \
                any(c.__name__ == "PreTrainedModel" for c in type(ancestor).__mro__):
            marked = {b: module._buffers[b].clone().fill_(_marker(module._buffers[b])) for b in names}
            for b in names:
                module._buffers[b].copy_(marked[b])
            ancestor._init_weights(module)
            if any(torch.equal(module._buffers[b], marked[b]) for b in names) or \
                    any(module._buffers[b].is_floating_point() and module._buffers[b].isnan().any() for b in names):
                return None
            return {b: module._buffers[b] for b in names}
    return None


def _marker(t: torch.Tensor) -> float | int:
    return math.nan if t.is_floating_point() else torch.iinfo(t.dtype).min if t.dtype != torch.bool else False
