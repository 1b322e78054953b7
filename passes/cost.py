"""Cost pass: per-node FLOPs, parameter bytes and output bytes (and seconds, if asked).

FLOPs come from torch.utils.flop_counter.FlopCounterMode run node by node on
fake tensors, so costing needs no memory and works for a model on meta.
FlopCounterMode counts 0 for scaled_dot_product_attention on CPU tensors
(docs/architecture.md, pitfalls), so attention gets its own formula; ops it does not
count at all (elementwise, norms, softmax) are charged one FLOP per output
element, so that memory-bound work still weighs something when balancing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry as _REGISTRY

from .trace import TracedModel, scalar_buffers_kept


@dataclass(frozen=True)
class NodeCost:
    flops: int            # forward FLOPs of the node at the traced batch size
    out_bytes: int        # bytes of the tensors it outputs
    params: tuple[str, ...]  # qualified names of the parameters and buffers it reads directly
    seconds: float | None = None  # measured forward time, when balance="time"


@dataclass
class CostedGraph:
    traced: TracedModel
    costs: dict[str, NodeCost]        # by node name, for every call_* node
    tensor_bytes: dict[str, int]      # by qualified name: every parameter and buffer used

    @property
    def graph(self) -> fx.Graph:
        return self.traced.graph_module.graph

    @property
    def total_flops(self) -> int:
        return sum(c.flops for c in self.costs.values())


_ATTENTION = {F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default}


def cost(traced: TracedModel, *, measure_inputs: Sequence[torch.Tensor] | None = None, repeats: int = 3) -> CostedGraph:
    """Cost every call node of ``traced``; time them on ``measure_inputs`` if given."""
    gm = traced.graph_module
    canonical = _canonical_names(gm)
    tensor_bytes = {}
    node_params: dict[str, tuple[str, ...]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr":
            value = _attr(gm, node.target)
            if isinstance(value, torch.Tensor):
                tensor_bytes[canonical.get(node.target, node.target)] = _nbytes(value)
        elif node.op == "call_module":
            names = []
            sub_module = gm.get_submodule(node.target)
            for kind in (sub_module.named_parameters(remove_duplicate=False), sub_module.named_buffers(remove_duplicate=False)):
                for sub, t in kind:
                    full = canonical.get(f"{node.target}.{sub}", f"{node.target}.{sub}")
                    tensor_bytes[full] = _nbytes(t)
                    names.append(full)
            node_params[node.name] = tuple(dict.fromkeys(names))

    with scalar_buffers_kept(gm):
        flops = _count_flops(gm)
    seconds = {}
    if measure_inputs is not None:
        with scalar_buffers_kept(gm, every_buffer=True):  # timing runs the model: running stats must not move
            seconds = _measure(gm, measure_inputs, repeats)
    costs = {}
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        direct = tuple(canonical.get(a.target, a.target) for a in node.all_input_nodes
                       if a.op == "get_attr" and canonical.get(a.target, a.target) in tensor_bytes)
        costs[node.name] = NodeCost(
            flops=flops.get(node.name, 0),
            out_bytes=_value_bytes(node.meta.get("val")),
            params=node_params.get(node.name, ()) + direct,
            seconds=seconds.get(node.name),
        )
    return CostedGraph(traced=traced, costs=costs, tensor_bytes=tensor_bytes)


def _canonical_names(gm: fx.GraphModule) -> dict[str, str]:
    """Every name of a parameter or buffer -> its first name: tied weights are one tensor."""
    first: dict[int, str] = {}
    canonical = {}
    for name, t in list(gm.named_parameters(remove_duplicate=False)) + list(gm.named_buffers(remove_duplicate=False)):
        canonical[name] = first.setdefault(id(t), name)
    return canonical


def _count_flops(gm: fx.GraphModule) -> dict[str, int]:
    """FLOPs of each node: from its shapes where the op is known (no dispatch at all), else by
    running it once on fake copies of its inputs' meta["val"] under FlopCounterMode."""
    counts: dict[str, int] = {}
    unknown = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        flops = _formula_flops(gm, node)
        if flops is None:
            unknown.append(node)
        else:
            counts[node.name] = flops or _numel(node.meta.get("val"))
    if unknown:
        counts.update(_measured_flops(gm, set(unknown)))
    return counts


_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.mm, torch.bmm, torch.Tensor.mm, torch.Tensor.bmm,
            __import__("operator").matmul, torch.ops.aten.mm.default, torch.ops.aten.bmm.default,
            torch.ops.aten.matmul.default, torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default,
            torch.addmm, torch.baddbmm, torch.einsum}
_LINEARS = {F.linear, torch.ops.aten.linear.default}
_CONVS = {F.conv1d, F.conv2d, F.conv3d, torch.ops.aten.conv1d.default, torch.ops.aten.conv2d.default,
          torch.ops.aten.conv3d.default, torch.ops.aten.convolution.default}
_CONV_TRANSPOSES = {F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d,
                    torch.ops.aten.conv_transpose1d.default, torch.ops.aten.conv_transpose2d.input,
                    torch.ops.aten.conv_transpose3d.input}
# Modules whose work is elementwise or a gather: one FLOP per output element is the estimate.
_CHEAP_MODULES = (torch.nn.modules.activation.__dict__.get("ReLU"), torch.nn.GELU, torch.nn.SiLU, torch.nn.Tanh,
                  torch.nn.Sigmoid, torch.nn.Dropout, torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.Embedding,
                  torch.nn.modules.batchnorm._BatchNorm, torch.nn.Identity, torch.nn.Softmax, torch.nn.Flatten,
                  torch.nn.modules.pooling._MaxPoolNd, torch.nn.modules.pooling._AvgPoolNd,
                  torch.nn.modules.pooling._AdaptiveAvgPoolNd, torch.nn.LeakyReLU, torch.nn.Hardswish,
                  torch.nn.Mish, torch.nn.modules.dropout._DropoutNd, torch.nn.RMSNorm, torch.nn.Softplus,
                  torch.nn.ELU, torch.nn.Upsample, torch.nn.PixelShuffle, torch.nn.ReLU6, torch.nn.Hardtanh)


def _formula_flops(gm: fx.GraphModule, node: fx.Node) -> int | None:
    """Forward FLOPs from shapes (the formulas of torch.utils.flop_counter); None when unknown."""
    out = node.meta.get("val")
    vals = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args]
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if isinstance(module, torch.nn.Linear):
            return 2 * _numel(out) * module.in_features
        if isinstance(module, torch.nn.modules.conv._ConvTransposeNd):
            return 2 * _numel(vals[0]) * module.weight.shape[1] * _prod(module.weight.shape[2:])
        if isinstance(module, torch.nn.modules.conv._ConvNd):
            return 2 * _numel(out) * module.weight.shape[1] * _prod(module.weight.shape[2:])
        if isinstance(module, _CHEAP_MODULES):
            return 0
        return None
    target = node.target
    if target in _ATTENTION:
        kwargs = {k: (v.meta.get("val") if isinstance(v, fx.Node) else v) for k, v in node.kwargs.items()}
        return _attention_flops(vals, kwargs)
    if target in _LINEARS:
        weight = vals[1] if len(vals) > 1 else node.kwargs["weight"].meta["val"]
        return 2 * _numel(out) * weight.shape[-1]
    if target in _MATMULS and target is not torch.einsum:
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        if len(tensors) >= 2 and tensors[-2].dim() >= 1:
            return 2 * _numel(out) * tensors[-2].shape[-1]
        return None
    if target in _CONVS:
        weight = vals[1]
        return 2 * _numel(out) * weight.shape[1] * _prod(weight.shape[2:])
    if target in _CONV_TRANSPOSES:
        weight = vals[1]
        return 2 * _numel(vals[0]) * weight.shape[1] * _prod(weight.shape[2:])
    if node.op == "call_method" and target in ("matmul", "mm", "bmm", "__matmul__"):
        return 2 * _numel(out) * vals[0].shape[-1] if isinstance(vals[0], torch.Tensor) else None
    if target is torch.einsum or (node.op == "call_function" and not isinstance(target, torch._ops.OpOverload)
                                  and getattr(target, "__module__", "") not in ("torch", "_operator", "torch._C._nn",
                                                                                "torch.nn.functional", "builtins",
                                                                                "torch._C._VariableFunctions")):
        return None  # a user function or einsum: count it by running it
    if isinstance(target, torch._ops.OpOverload) and target.overloadpacket in _REGISTRY:
        return None
    return 0


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def _measured_flops(gm: fx.GraphModule, nodes: set) -> dict[str, int]:
    """Run each node once on fake copies of its inputs' meta["val"] under FlopCounterMode."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    counts: dict[str, int] = {}
    env: dict[fx.Node, Any] = {}
    with mode:
        for node in gm.graph.nodes:
            if node not in nodes:
                continue
            args = fx.node.map_arg(node.args, lambda n: _fake_of(n, mode, env))
            kwargs = fx.node.map_arg(node.kwargs, lambda n: _fake_of(n, mode, env))
            counter = FlopCounterMode(display=False)
            try:  # grad mode too: export's wrap_with_set_grad_enabled leaves it off when its body raises
                with counter, torch.set_grad_enabled(torch.is_grad_enabled()):
                    out = _run_node(gm, node, args, kwargs)
            except Exception:
                out = node.meta.get("val")
            env[node] = out
            counted = counter.get_total_flops()
            if node.target in _ATTENTION and counted == 0:
                counted = _attention_flops(args, kwargs)
            counts[node.name] = int(counted) or _numel(node.meta.get("val"))
    return counts


def _fake_of(node: fx.Node, mode: FakeTensorMode, env: dict) -> Any:
    if node in env:
        return env[node]
    value = node.meta.get("val")
    if isinstance(value, torch.Tensor) and not isinstance(value, torch._subclasses.FakeTensor):
        value = mode.from_tensor(value)
    elif isinstance(value, torch._subclasses.FakeTensor) and value.fake_mode is not mode:
        value = mode.from_tensor(value)
    env[node] = value
    return value


def _run_node(gm: fx.GraphModule, node: fx.Node, args, kwargs):
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    if node.op == "call_method":
        self_obj, *rest = args
        return getattr(self_obj, node.target)(*rest, **kwargs)
    return node.target(*args, **kwargs)


def _attention_flops(args, kwargs) -> int:
    """2 matmuls (QK^T and PV) of 2*L*S*E each per batch and head (torch.utils.flop_counter.sdpa_flop_count)."""
    q, k, v = (list(args) + [kwargs.get(n) for n in ("query", "key", "value")])[:3]
    *batch, length, embed = q.shape
    source = k.shape[-2]
    value_embed = v.shape[-1]
    batch_heads = 1
    for b in batch:
        batch_heads *= int(b)
    return 2 * batch_heads * length * source * (embed + value_embed)


def _measure(gm: fx.GraphModule, inputs: Sequence[torch.Tensor], repeats: int) -> dict[str, float]:
    """Median wall time of each node, run eagerly on real inputs (balance="time")."""
    samples: dict[str, list[float]] = {}
    for _ in range(repeats):
        env: dict[fx.Node, Any] = {}
        placeholders = iter(inputs)
        with torch.no_grad():
            for node in gm.graph.nodes:
                if node.op == "placeholder":
                    env[node] = next(placeholders)
                    continue
                if node.op == "output":
                    continue
                args = fx.node.map_arg(node.args, lambda n: env[n])
                kwargs = fx.node.map_arg(node.kwargs, lambda n: env[n])
                if node.op == "get_attr":
                    env[node] = _attr(gm, node.target)
                    continue
                start = time.perf_counter()
                env[node] = _run_node(gm, node, args, kwargs)
                samples.setdefault(node.name, []).append(time.perf_counter() - start)
    return {name: sorted(s)[len(s) // 2] for name, s in samples.items()}


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _numel(value: Any) -> int:
    return sum(v.numel() for v in _tensors(value))


def _value_bytes(value: Any) -> int:
    return sum(_nbytes(v) for v in _tensors(value))


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []
