"""What autograd saves in one whole-batch forward of the traced graph, counted on fake tensors with pipe.memory's hook:
the memory model's activations."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensorMode

from autopipe import random_ops

from ..cost import CostedGraph
from ..fake_shapes import fake_errors_unlogged


@dataclass
class SavedTensors:
    """What autograd saves in one whole-batch forward; a tensor and its views share one storage key."""

    saves: dict[str, frozenset[int]]           # node name -> storages its forward saves for backward
    storage_bytes: dict[int, int]              # storage key -> bytes at the whole batch
    value_storages: dict[str, frozenset[int]]  # graph value (placeholder / node) -> storages it lives in


def saved_tensors(costed: CostedGraph) -> SavedTensors:
    """Per node, the storages autograd saves (parameters and buffers excluded), from one run on fake tensors."""
    gm = costed.traced.graph_module
    real = [*_tensors([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]), *gm.parameters()]
    device = next((t.device for t in real if t.device.type != "meta"), torch.device("cpu"))
    keep: list[torch.Tensor] = []  # every tensor stays alive: no storage key is reused while counting
    storage_bytes: dict[int, int] = {}
    resident, current = set(), set()  # storage keys: of parameters and buffers; of what the running node saves

    def key(t: torch.Tensor) -> int:
        keep.append(t)
        storage = t.untyped_storage()
        storage_bytes[storage._cdata] = storage.nbytes()
        return storage._cdata

    def fake(val: Any, grad: bool = False) -> Any:  # inside the fake mode: allocates nothing
        if isinstance(val, (list, tuple)) and not isinstance(val, torch.Size):
            return type(val)(fake(v, grad) for v in val)
        if not isinstance(val, torch.Tensor):
            return int(val) if isinstance(val, torch.SymInt) else val
        t = torch.empty(tuple(int(d) for d in val.shape), dtype=val.dtype, device=device)
        return t.requires_grad_(grad and (t.is_floating_point() or t.is_complex()))

    @functools.cache  # one fake per parameter or buffer (a tensor hashes by identity)
    def resident_fake(t: torch.Tensor) -> torch.Tensor:
        resident.add(key(f := fake(t, isinstance(t, torch.nn.Parameter) and t.requires_grad)))
        return f

    def pack(t: torch.Tensor) -> torch.Tensor:
        if (k := key(t)) not in resident:
            current.add(k)
        return t

    env: dict[fx.Node, Any] = {}
    saves: dict[str, frozenset[int]] = {}
    values: dict[str, frozenset[int]] = {}
    with FakeTensorMode(allow_non_fake_inputs=True), torch.inference_mode(False), torch.enable_grad(), \
            fake_errors_unlogged():
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                env[node] = fake(node.meta.get("val"))
            elif node.op == "get_attr":
                value = functools.reduce(getattr, node.target.split("."), gm)
                env[node] = resident_fake(value) if isinstance(value, torch.Tensor) else value
            elif node.op != "output":
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
                current.clear()
                try:
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        env[node] = _run_node(gm, node, args, kwargs, resident_fake)
                except Exception:  # count what it reads and returns, if anything needs a gradient
                    current.clear()
                    inputs = _tensors((args, kwargs))
                    grad = any(t.requires_grad for t in inputs) or node.op == "call_module" and any(
                        p.requires_grad for p in gm.get_submodule(node.target).parameters())
                    env[node] = fake(node.meta.get("val"), grad)
                    if grad:
                        current.update(k for t in inputs + _tensors(env[node]) if (k := key(t)) not in resident)
                saves[node.name] = frozenset(current)
            if node.op != "output":
                values[node.name] = frozenset(key(t) for t in _tensors(env[node]))
    return SavedTensors(saves, storage_bytes, values)


def _run_node(gm: fx.GraphModule, node: fx.Node, args, kwargs, resident_fake: Callable) -> Any:
    """One node on fake tensors, random ops as codegen emits them (passes/random_routes.py ``route``)."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        fn, constants_of = random_ops.MODULES.get(type(module), (None, None))
        if fn is not None and random_ops.draws(constants := constants_of(module)):
            return fn(args[0] if args else kwargs["input"], **constants)
        owned = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        return torch.func.functional_call(module, {name: resident_fake(t) for name, t in owned}, tuple(args),
                                          dict(kwargs), strict=False)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    target = node.target
    if target in random_ops.FUNCTIONS and random_ops.draws(random_ops.bind(target, node.args, node.kwargs) or {}):
        fn, extra = random_ops.FUNCTIONS[target]
        renamed = "train" not in getattr(random_ops.signature_of(fn), "parameters", {})  # aten's train, F's training
        return fn(*args, **({("training" if k == "train" and renamed else k): v for k, v in kwargs.items()} | extra))
    return target(*args, **kwargs)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(value) if isinstance(t, torch.Tensor)]
