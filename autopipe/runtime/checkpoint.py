"""Checkpoints under torchrun: the pipeline's module tree is the model's, restricted to this rank's stages, so
torch.distributed.checkpoint (``get_state_dict`` / ``set_state_dict``, ``dcp.save`` / ``dcp.load``) works on the
pipeline and its optimizer under the model's own names, and reshards between layouts; a Hugging Face safetensors
checkpoint loads per stage, each rank reading only its own tensors. docs/torchrun.md has the recipes.

Note [the pipeline's module tree]: DCP finds a parameter's name by walking ``getattr`` down from the module it is
given (torch/distributed/checkpoint/state_dict.py, ``_get_fqns``). The pipeline registers, at each of the model's
paths, the module a stage holds there (the user's own module on the fx route, the stage's container otherwise), so
the walk reaches the very tensors the stages read, and the parameters FSDP2 registers on those modules. Two stages
of one rank with different modules at one path (a module whose tensors two stages split) are merged into a module of
the pipeline's own that holds both's tensors.
"""
from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["adopt_module_tree", "load_pretrained"]


class _Node(torch.nn.Module):
    """A module of the pipeline's tree on a path no stage holds a module at (or two stages hold two)."""

    def forward(self, *args: Any) -> Any:
        raise RuntimeError("a module of the pipeline's checkpoint tree holds tensors; call the pipeline (pipe.step)")


def adopt_module_tree(pipe: torch.nn.Module, stages: list[torch.nn.Module], model: torch.nn.Module) -> None:
    """Register in ``pipe`` the modules ``stages`` hold, each at its path in the model (Note [the pipeline's module
    tree]); a root-level parameter or buffer (a model's ``cls_token``) on ``pipe`` itself. A tensor the model knows by
    several names (a tied weight) is under each of them: the pipeline's state dict has every key of the model's
    whose tensor this rank holds."""
    for stage in stages:
        _take_tensors(pipe, stage, "")
        for path, module in stage.named_modules():
            if path and (module._parameters or module._buffers):
                _place(pipe, path, module)
    own = pipe.state_dict(keep_vars=True)
    held = {id(t) for t in own.values()}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) in held and name not in own:
            *parents, leaf = name.split(".")
            at = pipe
            for k, part in enumerate(parents):
                child = at._modules.get(part)
                if child is None:
                    _free(at, part, ".".join(parents[:k]))
                    child = _Node()
                    at.add_module(part, child)
                at = child if isinstance(child, _Node) else _merged(at, part)
            _free(at, leaf, ".".join(parents))
            if isinstance(t, torch.nn.Parameter):
                at.register_parameter(leaf, t)
            else:
                at.register_buffer(leaf, t)


def _take_tensors(node: torch.nn.Module, module: torch.nn.Module, where: str) -> None:
    for name, p in module._parameters.items():
        if p is not None and node._parameters.get(name) is not p:
            _free(node, name, where)
            node.register_parameter(name, p)
    for name, b in module._buffers.items():
        if b is not None and node._buffers.get(name) is not b:
            _free(node, name, where)
            node.register_buffer(name, b, persistent=name not in module._non_persistent_buffers_set)


def _free(node: torch.nn.Module, name: str, where: str) -> None:
    attribute = name in node.__dict__ or any(name in vars(c) for c in type(node).__mro__)
    if name in node._parameters or name in node._buffers or name in node._modules or attribute:
        raise ValueError(f"the model's {where + '.' if where else ''}{name} has the name of the pipeline's own "
                         f"attribute {name!r}, so the pipeline cannot hold it under the model's name; rename it")


def _place(root: torch.nn.Module, path: str, module: torch.nn.Module) -> None:
    *parents, leaf = path.split(".")
    at, walked = root, []
    for part in parents:
        walked.append(part)
        child = at._modules.get(part)
        if child is None:
            _free(at, part, ".".join(walked[:-1]))
            child = _Node()
            at.add_module(part, child)
        elif not isinstance(child, _Node):
            if _holds(child, path[len(".".join(walked)) + 1:], module):
                return  # a stage's module above this one holds it: it came with that module
            child = _merged(at, part)
        at = child
    there = at._modules.get(leaf)
    if there is None:
        _free(at, leaf, ".".join(parents))
        at.add_module(leaf, module)
    elif there is not module:
        merged = there if isinstance(there, _Node) else _merged(at, leaf)
        _take_tensors(merged, module, path)
        for name, child in module._modules.items():
            if child is not None:
                _place(merged, name, child)


def _holds(module: torch.nn.Module, rest: str, target: torch.nn.Module) -> bool:
    try:
        return module.get_submodule(rest) is target
    except AttributeError:
        return False


def _merged(parent: torch.nn.Module, name: str) -> _Node:
    """The module at ``parent.name`` replaced in the tree by a _Node holding its tensors and children."""
    old, node = parent._modules[name], _Node()
    _take_tensors(node, old, name)
    for child_name, child in old._modules.items():
        if child is not None:
            node.add_module(child_name, child)
    parent._modules[name] = node
    return node


def load_pretrained(pipe: torch.nn.Module, model: torch.nn.Module, path: str | os.PathLike) -> None:
    """``dcp.load`` of a safetensors checkpoint into this rank's tensors (``pipe.state_dict()``: under FSDP2 each rank
    reads only its shard's rows), through ``HuggingFaceStorageReader``. The checkpoint's names must be the model's:
    else refused naming the first missing and the first unexpected key, before anything is read. A tied weight's
    other name (``save_pretrained`` leaves out ``lm_head.weight`` tied to the embedding) reads the name it holds."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    reader = HuggingFaceStorageReader(os.fspath(path))
    held = set(reader.read_metadata().state_dict_metadata)
    names_of: dict[int, list[str]] = {}  # a tensor -> its names in the model's state dict (a tie has several)
    for name, t in model.state_dict(keep_vars=True).items():
        names_of.setdefault(id(t), []).append(name)
    read_as = {n: next((m for m in names if m in held), n) for names in names_of.values() for n in names}
    missing = sorted(n for n, m in read_as.items() if m not in held)
    unexpected = sorted(held - set(read_as))
    if missing or unexpected:
        raise ValueError(f"the checkpoint at {os.fspath(path)} does not hold the model's names: "
                         + ", ".join([f"first missing key {missing[0]!r} ({len(missing)} missing)"] * bool(missing)
                                     + [f"first unexpected key {unexpected[0]!r} ({len(unexpected)} unexpected)"]
                                     * bool(unexpected))
                         + "; load a checkpoint of this model, or rename its keys")
    target: dict[str, torch.Tensor] = {}
    for name, t in pipe.state_dict().items():
        target.setdefault(read_as[name], t)
    dcp.load(target, storage_reader=reader)
