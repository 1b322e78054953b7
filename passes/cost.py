"""Cost pass: per-node FLOPs, parameter bytes and output bytes (and seconds, if asked); where the FLOPs come from:
docs/architecture.md, "Contracts between passes". Uncounted ops (elementwise, norms): one FLOP per output element."""
from __future__ import annotations

import collections
import contextlib
import itertools
import math
import operator
import statistics
import time
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._pytree import tree_leaves, tree_map_only
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from .model_state import scalar_buffers_kept
from .fake_shapes import MutableArguments, fake_errors_unlogged, mutable
from .traced_model import TracedModel


@dataclass(frozen=True)
class NodeCost:
    flops: int  # forward FLOPs at the traced batch size
    out_bytes: int  # bytes of the tensors it outputs
    params: tuple[str, ...]  # qualified names of the parameters and buffers it reads directly
    seconds: float | None = None  # measured forward time, when balance="time"


@dataclass
class CostedGraph:
    traced: TracedModel
    costs: dict[str, NodeCost]  # by node name, for every call_* node
    tensor_bytes: dict[str, int]  # by qualified name: every parameter and buffer used
    # balance="train_time": per node, the measured seconds of a training step's micro-batch (forward, backward, and
    # the forward again where the checkpoint mode recomputes it), filled by the pass chain from passes/node_times.py
    train_seconds: dict[str, float] | None = None

    @property
    def total_flops(self) -> int:
        return sum(c.flops for c in self.costs.values())

    def training_flops(self) -> dict[str, float]:
        """Per node, a training step's FLOPs: its forward, the input gradient (as many again), and the weight gradient
        (as many again) where it reads a trainable parameter: balance="train_flops", the step-time model on FLOPs."""
        trainable = {name for name, p in self.traced.graph_module.named_parameters(remove_duplicate=False)
                     if p.requires_grad}
        return {name: float(c.flops) * (3 if trainable.intersection(c.params) else 2) for name, c in self.costs.items()}


def cost(traced: TracedModel, *, measure_inputs: Sequence[torch.Tensor] | None = None) -> CostedGraph:
    """Cost every call node of traced; time them on measure_inputs if given."""
    gm = traced.graph_module
    first: dict[int, str] = {}  # tied weights are one tensor, named by its first name
    tensors = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
    canonical = {name: first.setdefault(id(t), name) for name, t in tensors}
    tensor_bytes: dict[str, int] = {}
    params: dict[fx.Node, tuple[str, ...]] = {}
    for node in gm.graph.nodes:
        if node.op == "get_attr" and isinstance(value := operator.attrgetter(node.target)(gm), torch.Tensor):
            tensor_bytes[canonical.get(node.target, node.target)] = value.nbytes
        elif node.op in ("call_function", "call_method", "call_module"):
            names = []
            if node.op == "call_module":
                module = gm.get_submodule(node.target)
                for name, t in [*module.named_parameters(node.target, remove_duplicate=False),
                                *module.named_buffers(node.target, remove_duplicate=False)]:
                    names.append(canonical.get(name, name))
                    tensor_bytes[names[-1]] = t.nbytes
            names += [canonical.get(a.target, a.target) for a in node.all_input_nodes if a.op == "get_attr"]
            params[node] = tuple(dict.fromkeys(name for name in names if name in tensor_bytes))
    flops = {n: _formula_flops(gm, n) for n in params}
    flops.update(_measured_flops([n for n in params if flops[n] is None], gm))
    seconds: dict[str, list[float]] = collections.defaultdict(list)
    if measure_inputs is not None:
        with scalar_buffers_kept(gm, every_buffer=True), torch.no_grad():  # running stats must not move
            for _ in range(3):
                _Timer(gm, seconds).run(*measure_inputs)
    costs = {n.name: NodeCost(flops=int(flops[n]) or _numel(n.meta.get("val")), out_bytes=_nbytes(n.meta.get("val")),
                              params=params[n], seconds=statistics.median(seconds[n.name]) if seconds else None)
             for n in params}
    return CostedGraph(traced=traced, costs=costs, tensor_bytes=tensor_bytes)


aten = torch.ops.aten
_MATMULS = {torch.matmul, torch.Tensor.matmul, torch.mm, torch.bmm, torch.Tensor.mm, torch.Tensor.bmm, operator.matmul,
            torch.addmm, torch.baddbmm, aten.mm.default, aten.bmm.default, aten.matmul.default, aten.addmm.default,
            aten.baddbmm.default, "matmul", "mm", "bmm", "__matmul__"}  # the strings: call_method targets
_LINEAR_CONV = {F.linear, F.conv1d, F.conv2d, F.conv3d, aten.linear.default, aten.conv1d.default, aten.conv2d.default,
                aten.conv3d.default, aten.convolution.default}
_CONV_TRANSPOSE = {F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d, aten.conv_transpose1d.default,
                   aten.conv_transpose2d.input, aten.conv_transpose3d.input}
# Note [FLOPs of attention]: FlopCounterMode counts 0 FLOPs for F.scaled_dot_product_attention on CPU tensors and
# CPU fake tensors (it counts them on meta), which would plan every attention model unbalanced: attention has its
# own formula here.
_ATTENTION = {F.scaled_dot_product_attention, aten.scaled_dot_product_attention.default}
# elementwise work or a gather: one FLOP per output element
_CHEAP_MODULES = (nn.ReLU, nn.ReLU6, nn.LeakyReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.Hardswish, nn.Hardtanh,
                  nn.Mish, nn.Softplus, nn.ELU, nn.Softmax, nn.modules.dropout._DropoutNd, nn.LayerNorm, nn.GroupNorm,
                  nn.RMSNorm, nn.modules.batchnorm._BatchNorm, nn.Embedding, nn.Identity, nn.Flatten, nn.Upsample,
                  nn.PixelShuffle, nn.modules.pooling._MaxPoolNd, nn.modules.pooling._AvgPoolNd,
                  nn.modules.pooling._AdaptiveAvgPoolNd)
_TORCH_MODULES = {"torch", "_operator", "builtins", "torch._C._nn", "torch.nn.functional",
                  "torch._C._VariableFunctions"}


# Note [parametrized weights]: reading a parametrized module.weight computes it (spectral_norm's power iteration
# writes its buffers), which would change the user's model at compile; a weight_norm module has no .original.
# FLOPs of a Linear or a convolution come from the module's own sizes.
def _formula_flops(gm: fx.GraphModule, node: fx.Node) -> int | None:
    """Forward FLOPs from shapes, as torch.utils.flop_counter counts them; None: count by running it."""
    out, target = node.meta.get("val"), node.target
    vals, kwargs = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
    if node.op == "call_module":
        module = gm.get_submodule(target)
        if not isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)):
            return 0 if isinstance(module, _CHEAP_MODULES) else None
        transposed = isinstance(module, nn.modules.conv._ConvTransposeNd)
        # from the module's sizes, not its weight (Note [parametrized weights])
        per_element = module.in_features if isinstance(module, nn.Linear) else \
            (module.out_channels if transposed else module.in_channels) // module.groups * math.prod(module.kernel_size)
    elif target in _LINEAR_CONV or target in _CONV_TRANSPOSE:  # as conv_flop_count: per output (input) element
        weight = vals[1] if len(vals) > 1 else kwargs["weight"]
        transposed, per_element = target in _CONV_TRANSPOSE, math.prod(weight.shape[1:])
    elif target in _ATTENTION:  # QK^T and PV, 2*L*S*E each per batch and head, as sdpa_flop_count
        q, k, v = [*vals, *(kwargs.get(name) for name in ("query", "key", "value"))][:3]
        return 2 * math.prod(q.shape[:-2]) * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    elif target in _MATMULS:
        tensors = [v for v in vals if isinstance(v, torch.Tensor)]
        ok = len(tensors) >= 2 and tensors[-2].dim() >= 1
        return 2 * _numel(out) * tensors[-2].shape[-1] if ok else None
    elif isinstance(target, torch._ops.OpOverload):
        return None if target.overloadpacket in flop_registry else 0
    else:
        user_function = node.op == "call_function" and getattr(target, "__module__", "") not in _TORCH_MODULES
        return None if user_function or target is torch.einsum else 0
    return 2 * _numel(vals[0] if transposed else out) * per_element


# Note [FLOPs without global hooks]: FlopCounterMode's module tracker registers global module hooks, which reach
# every module of the process: a pipeline training on another thread while this one compiled failed inside
# autograd.grad. So the cost pass counts with a dispatch mode of its own over flop_registry.
class _Flops(TorchDispatchMode):
    """torch.utils.flop_counter's count (flop_registry, decomposing what it has no formula for), without
    FlopCounterMode's module tracker (Note [FLOPs without global hooks])."""

    # export's no_grad / autocast regions: their bodies are counted, as FlopCounterMode counts them
    supports_higher_order_operators = True

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return NotImplemented
        kwargs = kwargs or {}
        # prim::device: as FlopCounterMode
        if func.overloadpacket not in flop_registry and func is not torch.ops.prim.device.default:
            with self:  # its parts are counted (einsum's bmm)
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        if func.overloadpacket in flop_registry:
            self.total += flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
        return out


def _measured_flops(nodes: list[fx.Node], gm: fx.GraphModule) -> dict[fx.Node, int]:
    """Run each node once on fake copies of its inputs' meta["val"], counting as FlopCounterMode does (_Flops)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    runner = MutableArguments(gm)
    fake = lambda n: tree_map_only(torch.Tensor, mode.from_tensor, n.meta.get("val"))  # from_tensor memoises
    counts = {}
    with mode, scalar_buffers_kept(gm), fake_errors_unlogged():
        for node in nodes:
            counter = _Flops()
            # a failing op counts one FLOP per output element; grad mode is put back, as export's
            # wrap_with_set_grad_enabled leaves it off when its body raises
            with contextlib.suppress(Exception), counter, torch.set_grad_enabled(torch.is_grad_enabled()):
                args, kwargs = mutable(fx.node.map_arg((node.args, node.kwargs), fake))
                getattr(runner, node.op)(node.target, args, kwargs)
            counts[node] = counter.total
    return counts


class _Timer(MutableArguments):
    """Runs the graph eagerly on real inputs, adding each node's time to seconds (balance="time"): wall time on the
    CPU; on a GPU, CUDA events around the node, read once the run is done (the host clock would time only the kernel
    launch)."""

    def __init__(self, gm: fx.GraphModule, seconds: dict[str, list[float]]):
        super().__init__(gm)
        self.seconds = seconds
        self.events: list[tuple[str, Any, Any]] | None = None  # (node, begin, end) on a GPU

    def run_node(self, n: fx.Node):
        if self.events is None:
            start = time.perf_counter()
            result = super().run_node(n)
            self.seconds[n.name].append(time.perf_counter() - start)
        else:
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            result = super().run_node(n)
            end.record()
            self.events.append((n.name, begin, end))
        return result

    def run(self, *args):
        cuda = next((t.device for t in itertools.chain(args, self.module.parameters()) if isinstance(t, torch.Tensor)
                     and t.is_cuda), None)
        self.events = [] if cuda else None
        with torch.cuda.device(cuda) if cuda else contextlib.nullcontext():  # events on the model's GPU
            result = super().run(*args)
        for name, begin, end in self.events or []:
            end.synchronize()
            self.seconds[name].append(begin.elapsed_time(end) / 1e3)
        return result


def _numel(value: Any) -> int:
    return sum(t.numel() for t in tree_leaves(value) if isinstance(t, torch.Tensor))


def _nbytes(value: Any) -> int:
    return sum(t.nbytes for t in tree_leaves(value) if isinstance(t, torch.Tensor))
