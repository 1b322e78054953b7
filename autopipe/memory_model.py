"""What a plan holds and how long its step takes, per schedule, re-materialisation mode and micro-batch count.

Pure functions and dataclasses over a Plan (and the CostedGraph it came from):
no runtime is started and no real memory is touched. The runtime's schedule
tables (``autopipe.runtime.schedule``) give the in-flight counts and bubbles;
the runtime's ``checkpoints`` rule gives which micro-batches are recomputed.

Per stage (all figures in bytes)::

    params           parameter and buffer bytes the stage holds (a tied weight counts on every stage using it)
    grads            one gradient per trainable parameter
    optimizer_state  m x trainable bytes: m = 0 (sgd, or None), 1 (momentum), 2 (adam, adamw)
    kept             max over the stage's task order of the sum over micro-batches in flight
                     (forward done, backward not) of inputs_i if i is recomputed else activations_i;
                     = in_flight x (inputs/M if recomputed else activations/M) when every micro-batch is alike,
                     in_flight = Schedule.max_in_flight(stage): M for GPipe, K - s for 1F1B
    recompute_peak   activations/M of one recomputed micro-batch, held while its backward runs
    total            params + grads + optimizer_state + kept + recompute_peak   (pipe.memory's "peak" + weights)

``activations`` is what autograd saves in one whole-batch forward of the stage
(``stage_activation_bytes``): the stage's nodes are run on fake tensors under
``torch.autograd.graph.saved_tensors_hooks``, the same hook ``pipe.memory``
counts with, so the op-by-op choices autograd makes (a Linear saves its input,
ReLU its output, GELU its input, a dropout its mask, SDPA q, k, v, out and
logsumexp, a view nothing) come from PyTorch itself. Distinct storages count
once per stage (the q, k, v views of one qkv projection are one tensor);
parameters and buffers are resident and not counted. A stage input that no op
saves is still held by the runtime until backward and is added. Random ops are
run as codegen emits them (``autopipe.random_ops``: dropout keeps a mask of the
input's dtype, not a bool mask). A node that cannot run on fake tensors falls
back to a rule (``_rule``), named in ``SavedTensors.estimated``. Micro-batch
``i`` of ``rows_i`` rows holds ``rows_i / batch`` of the whole-batch figures
(activations are taken as linear in the batch) and every unbatched input whole.

Not modelled: the backward's transient gradient buffers, the allocator's
fragmentation and workspace, the loss outside the pipeline, and messages in
transit (on CPU a received tensor shares the sender's storage).

Step time (``predicted_step_time``), in the plan's cost units (``balance``:
FLOPs by default, forward only): backward = 2 x forward, a recompute = 1 x
forward (so ~1/3 of forward + backward) per recomputed micro-batch, plus an
optional fixed ``task_overhead`` per (stage, micro-batch) task. The busiest
device's work, spread over the schedule's clock cycles:

    time = max_d (sum_{s on d} cost_s x (3 + recomputed/M) + task_overhead x tasks_d) / (1 - bubble)

with the bubble of the schedule's own table (Schedule.bubble_fraction: GPipe and
1F1B (K-1)/(M+K-1), interleaved (K-1)/(vM+K-1)). One device running the plain
model takes 3 x total_cost.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.fx as fx
from tabulate import tabulate

from autopipe import random_ops
from autopipe.passes.cost import CostedGraph
from autopipe.passes.partition import NoFeasiblePlan
from autopipe.plan import Plan
from autopipe.plan import human_bytes as _human
from autopipe.runtime.schedule import NAMES as SCHEDULES
from autopipe.runtime.schedule import Schedule
from autopipe.runtime.task import CHECKPOINT_MODES, checkpoints

# optimizer state per trainable parameter byte
OPTIMIZER_STATE = {None: 0, "none": 0, "sgd": 0, "momentum": 1, "sgd_momentum": 1, "adagrad": 1, "rmsprop": 1,
                   "adam": 2, "adamw": 2}
BACKWARD_FACTOR = 2.0   # backward FLOPs per forward FLOP (grad of the input + grad of the weight)
RECOMPUTE_FACTOR = 1.0  # a recompute is one more forward


# ---- what autograd saves, node by node ----------------------------------------------------------------


@dataclass
class SavedTensors:
    """What autograd saves in one whole-batch forward of the traced graph, node by node.

    Storages are named by integer keys; a tensor and its views share one key."""

    saves: dict[str, frozenset[int]]          # node name -> storages its forward saves for backward
    storage_bytes: dict[int, int]             # storage key -> bytes (at the whole batch)
    value_storages: dict[str, frozenset[int]]  # graph value (placeholder / node) -> storages it lives in
    estimated: tuple[str, ...] = ()           # nodes the fake run could not execute: _rule's estimate
    method: str = "fake"                      # "fake" (PyTorch's own saves on fake tensors) or "rule"

    def bytes_of(self, keys: Iterable[int]) -> int:
        return sum(self.storage_bytes[k] for k in set(keys))


def saved_tensors(costed: CostedGraph, method: str = "fake") -> SavedTensors:
    """Run the traced graph once at the whole batch, on fake tensors (no memory, a meta model works),
    recording for every node the storages autograd saves. ``method="rule"`` runs nothing and applies
    ``_rule`` to every node (cruder; kept for comparison and as the fallback of a node that fails)."""
    if method == "fake":
        return _fake_saves(costed)
    if method == "rule":
        return _rule_saves(costed)
    raise ValueError(f"method must be 'fake' or 'rule', got {method!r}")


def _fake_saves(costed: CostedGraph) -> SavedTensors:
    from torch._subclasses.fake_tensor import FakeTensorMode

    gm = costed.traced.graph_module
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    keep: list[torch.Tensor] = []      # every tensor seen stays alive: no storage address is reused while counting
    storage_bytes: dict[int, int] = {}
    resident: set[int] = set()         # storages of parameters and buffers
    fakes: dict[int, torch.Tensor] = {}  # id(real parameter or buffer) -> its fake
    device = _graph_device(gm)

    def key(t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        k = storage._cdata
        storage_bytes[k] = storage.nbytes()
        return k

    def fake_of(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:  # called inside ``with mode``: a fake tensor
            f = torch.empty(tuple(int(d) for d in t.shape), dtype=t.dtype, device=device)
            if isinstance(t, torch.nn.Parameter) and t.requires_grad:
                f.requires_grad_(True)
            keep.append(f)
            fakes[id(t)] = f
            resident.add(key(f))
        return fakes[id(t)]

    current: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        keep.append(t)
        k = key(t)
        if k not in resident:
            current.add(k)
        return t

    env: dict[fx.Node, Any] = {}
    saves: dict[str, frozenset[int]] = {}
    value_storages: dict[str, frozenset[int]] = {}
    estimated: list[str] = []
    with mode, torch.inference_mode(False), torch.enable_grad():
        for node in gm.graph.nodes:
            if node.op == "output":
                continue
            if node.op == "placeholder":
                env[node] = _fake_value(node.meta.get("val"), mode, device, requires_grad=False)
            elif node.op == "get_attr":
                value = _attr(gm, node.target)
                env[node] = fake_of(value) if isinstance(value, torch.Tensor) else value
            else:
                args = fx.node.map_arg(node.args, env.__getitem__)
                kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
                current.clear()
                try:
                    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                        env[node] = _run_node(gm, node, args, kwargs, fake_of)
                    saves[node.name] = frozenset(current)
                except Exception:
                    grad = any(isinstance(a, torch.Tensor) and a.requires_grad
                               for a in _flatten((args, kwargs)))
                    env[node] = _fake_value(node.meta.get("val"), mode, device, requires_grad=grad)
                    estimated.append(node.name)
                    saves[node.name] = frozenset(_rule_keys(node, gm, env, key, resident, keep))
            tensors = [t for t in _flatten(env[node]) if isinstance(t, torch.Tensor)]
            keep.extend(tensors)
            value_storages[node.name] = frozenset(key(t) for t in tensors)
    return SavedTensors(saves=saves, storage_bytes=storage_bytes, value_storages=value_storages,
                        estimated=tuple(estimated), method="fake")


def _run_node(gm: fx.GraphModule, node: fx.Node, args, kwargs, fake_of: Callable) -> Any:
    """One node on fake tensors, random ops as codegen emits them (passes/codegen.py ``_route``)."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if type(module) in random_ops.MODULES:
            fn, constants = random_ops.MODULES[type(module)]
            constants = constants(module)
            if random_ops.draws(constants):
                return fn(args[0] if args else kwargs["input"], **constants)
        owned = [*module.named_parameters(remove_duplicate=False), *module.named_buffers(remove_duplicate=False)]
        tensors = {name: fake_of(t) for name, t in owned}
        return torch.func.functional_call(module, tensors, tuple(args), dict(kwargs), strict=False)
    if node.op == "call_method":
        self_obj, *rest = args
        return getattr(self_obj, node.target)(*rest, **kwargs)
    target = node.target
    if target in random_ops.FUNCTIONS and random_ops.is_random_target(target):
        bound = random_ops.bind(target, node.args, node.kwargs)
        if bound is None or random_ops.draws(bound):
            fn, extra = random_ops.FUNCTIONS[target]
            signature = random_ops.signature_of(fn)
            parameters = signature.parameters if signature is not None else {}
            kwargs = {("training" if k == "train" and "train" not in parameters else k): v for k, v in kwargs.items()}
            return fn(*args, **{**kwargs, **extra})
    return target(*args, **kwargs)


def _fake_value(val: Any, mode, device: torch.device, requires_grad: bool) -> Any:
    if isinstance(val, torch.Tensor):  # called inside ``with mode``: a fake tensor
        t = torch.empty(tuple(int(d) for d in val.shape), dtype=val.dtype, device=device)
        if requires_grad and (t.is_floating_point() or t.is_complex()):
            t.requires_grad_(True)
        return t
    if isinstance(val, (list, tuple)) and not isinstance(val, torch.Size):
        return type(val)(_fake_value(v, mode, device, requires_grad) for v in val)
    if isinstance(val, torch.SymInt):
        return int(val)
    return val


def _graph_device(gm: fx.GraphModule) -> torch.device:
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.device.type != "meta":
            return val.device
    for t in list(gm.parameters()) + list(gm.buffers()):
        if t.device.type != "meta":
            return t.device
    return torch.device("cpu")


def _flatten(value: Any) -> list:
    if isinstance(value, (list, tuple)):
        return [x for v in value for x in _flatten(v)]
    if isinstance(value, dict):
        return [x for v in value.values() for x in _flatten(v)]
    return [value]


def _attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


# ---- the rule: which values a node saves, from its op alone -----------------------------------------------
#
# A node saves nothing unless some input requires grad. Then, by op:
#   products (linear, matmul, conv, einsum, embedding: the indices) save their non-parameter tensor inputs;
#   output-savers (relu, sigmoid, tanh, softmax, exp, ...) save their output;
#   mul / div save their tensor operands; scaled_dot_product_attention saves q, k, v and its output;
#   pointwise and normalisation ops with a non-linear derivative (gelu, silu, layer_norm, batch_norm, ...) save
#   their input; dropout saves a mask the size of its output (codegen's mask has the input's dtype);
#   max pooling saves its input and int64 indices;
#   views, reshapes, adds, concatenation, reductions to a sum or mean, copies and factories save nothing;
#   anything else saves its tensor inputs (conservative).
# A view's output lives in its base's storage, so a saved view counts as its base, once per stage.

_VIEWS = {"view", "reshape", "transpose", "permute", "t", "getitem", "split", "chunk", "unbind", "unsqueeze",
          "squeeze", "flatten", "unflatten", "expand", "expand_as", "narrow", "select", "as_strided", "view_as",
          "detach", "contiguous", "movedim", "swapaxes", "split_with_sizes", "slice", "alias", "_unsafe_view",
          "reshape_as", "identity", "getattr"}
_PRODUCTS = {"linear", "matmul", "mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "einsum", "conv1d",
             "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "convolution",
             "__matmul__", "embedding", "bilinear", "tensordot", "outer", "dot"}
_OUTPUT_SAVERS = {"relu", "sigmoid", "tanh", "softmax", "log_softmax", "exp", "sqrt", "rsqrt", "hardtanh",
                  "relu6", "elu", "celu", "selu", "threshold", "reciprocal"}
_MULS = {"mul", "div", "truediv", "__mul__", "__truediv__", "__rmul__", "__rtruediv__", "true_divide", "multiply",
         "divide"}
_FREE = {"add", "sub", "__add__", "__sub__", "__radd__", "__rsub__", "neg", "__neg__", "cat", "concat", "concatenate",
         "stack", "sum", "mean", "size", "dim", "to", "float", "half", "double", "bfloat16", "type", "clone",
         "arange", "zeros", "ones", "full", "empty", "zeros_like", "ones_like", "full_like", "empty_like", "tril",
         "triu", "masked_fill", "where", "pad", "repeat", "tile", "flip", "roll", "index_select", "gather", "copy_",
         "eq", "ne", "lt", "le", "gt", "ge", "logical_not", "logical_and", "logical_or", "sym_size", "numel",
         "adaptive_avg_pool1d", "adaptive_avg_pool2d", "adaptive_avg_pool3d", "avg_pool1d", "avg_pool2d",
         "avg_pool3d", "fill_", "zero_", "add_", "sub_", "iadd", "isub", "setitem", "long", "int", "bool"}
_DROPOUTS = {"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
             "feature_dropout", "native_dropout"}
_MAXPOOLS = {"max_pool1d", "max_pool2d", "max_pool3d", "max_pool1d_with_indices", "max_pool2d_with_indices",
             "max_pool3d_with_indices", "adaptive_max_pool1d", "adaptive_max_pool2d", "adaptive_max_pool3d"}
_MODULE_OUTPUT_SAVERS = (torch.nn.ReLU, torch.nn.Sigmoid, torch.nn.Tanh, torch.nn.Softmax, torch.nn.LogSoftmax,
                         torch.nn.Hardtanh, torch.nn.ELU, torch.nn.CELU, torch.nn.SELU, torch.nn.Threshold)
_MODULE_FREE = (torch.nn.Identity, torch.nn.Flatten, torch.nn.Unflatten, torch.nn.modules.pooling._AvgPoolNd,
                torch.nn.modules.pooling._AdaptiveAvgPoolNd)
_MODULE_PRODUCTS = (torch.nn.Linear, torch.nn.modules.conv._ConvNd, torch.nn.Bilinear, torch.nn.Embedding,
                    torch.nn.EmbeddingBag)
_MODULE_INPUT_SAVERS = (torch.nn.LayerNorm, torch.nn.GroupNorm, torch.nn.modules.batchnorm._NormBase, torch.nn.RMSNorm,
                        torch.nn.GELU, torch.nn.SiLU, torch.nn.Mish, torch.nn.Hardswish, torch.nn.Hardsigmoid,
                        torch.nn.LeakyReLU, torch.nn.Softplus, torch.nn.PReLU, torch.nn.LocalResponseNorm)


def _op(node: fx.Node) -> str:
    if node.target is operator.getitem:
        return "getitem"
    name = random_ops.op_name(node.target) if node.op != "call_method" else node.target
    return {"mul": "mul", "truediv": "div", "matmul": "matmul", "add": "add", "sub": "sub"}.get(name, name)


def _rule(node: fx.Node, gm: fx.GraphModule, requires_grad: Callable[[Any], bool]) -> tuple[list, int]:
    """(the input nodes whose values it saves + "out" for its own output, extra bytes it saves beside them)."""
    inputs = [a for a in node.all_input_nodes if a.op != "get_attr"]
    own = node.op == "call_module" and any(p.requires_grad for p in gm.get_submodule(node.target).parameters())
    if not own and not any(requires_grad(a) for a in node.all_input_nodes):
        return [], 0
    out_bytes = _value_bytes(node.meta.get("val"))
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            return ([], out_bytes) if module.training and module.p > 0 else ([], 0)
        if isinstance(module, _MODULE_FREE):
            return [], 0
        if isinstance(module, _MODULE_OUTPUT_SAVERS):
            return ["out"], 0
        if isinstance(module, torch.nn.modules.pooling._MaxPoolNd):
            return inputs, 2 * out_bytes
        if isinstance(module, _MODULE_PRODUCTS + _MODULE_INPUT_SAVERS):
            return inputs, 0
        return inputs + ["out"], 0  # a module we cannot see into: its inputs and output
    name = _op(node)
    base = name.rstrip("_") if name not in ("__matmul__",) else name
    if name in _VIEWS or base in _FREE or name in _FREE:
        return [], 0
    if base in _DROPOUTS:
        return [], out_bytes
    if base in _OUTPUT_SAVERS:
        return ["out"], 0
    if base in _MAXPOOLS:
        return inputs, 2 * out_bytes
    if name == "scaled_dot_product_attention":
        return inputs[:3] + ["out"], 0
    if base in _MULS:
        return [a for a in inputs if isinstance(a.meta.get("val"), torch.Tensor)], 0
    return [a for a in inputs if isinstance(a.meta.get("val"), torch.Tensor)], 0


def _value_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _flatten(value) if isinstance(t, torch.Tensor))


def _rule_keys(node: fx.Node, gm: fx.GraphModule, env: dict, key: Callable, resident: set[int],
               keep: list) -> set[int]:
    """_rule on the fake run's values (a node that would not run): storage keys of what it saves."""
    def requires_grad(a: fx.Node) -> bool:
        return any(isinstance(t, torch.Tensor) and t.requires_grad for t in _flatten(env.get(a)))

    values, extra = _rule(node, gm, requires_grad)
    keys = set()
    for v in values:
        for t in _flatten(env[node] if v == "out" else env[v]):
            if isinstance(t, torch.Tensor) and key(t) not in resident:
                keys.add(key(t))
    if extra:
        mask = torch.empty(extra, dtype=torch.uint8)  # (fake) a stand-in storage of the right size
        keep.append(mask)
        keys.add(key(mask))
    return keys


def _rule_saves(costed: CostedGraph) -> SavedTensors:
    """The rule on every node, without running anything: a view's value is its base's storage."""
    gm = costed.traced.graph_module
    storage_bytes: dict[int, int] = {}
    root: dict[fx.Node, fx.Node] = {}
    grad: dict[fx.Node, bool] = {}
    saves: dict[str, frozenset[int]] = {}
    value_storages: dict[str, frozenset[int]] = {}
    ids = iter(range(1, 1 << 62))

    def is_param(n: fx.Node) -> bool:
        if n.op != "get_attr":
            return False
        value = _attr(gm, n.target)
        return isinstance(value, torch.nn.Parameter)

    def requires_grad(a: fx.Node) -> bool:
        return grad.get(a, False)

    node_key: dict[fx.Node, int] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        if node.op == "get_attr":
            value = _attr(gm, node.target)
            grad[node] = isinstance(value, torch.nn.Parameter) and value.requires_grad
            continue
        grad[node] = any(grad.get(a, False) for a in node.all_input_nodes) or (
            node.op == "call_module" and any(p.requires_grad for p in gm.get_submodule(node.target).parameters()))
        source = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
        if node.op != "placeholder" and _op(node) in _VIEWS and source is not None and not is_param(source):
            root[node] = root.get(source, source)
        else:
            root[node] = node
            k = next(ids)
            node_key[node] = k
            storage_bytes[k] = (costed.costs[node.name].out_bytes if node.name in costed.costs
                                else _value_bytes(node.meta.get("val")))
        if node.op == "placeholder":
            value_storages[node.name] = frozenset({node_key[node]})
            continue
        values, extra = _rule(node, gm, requires_grad)
        keys = set()
        for v in values:
            r = root[node] if v == "out" else root.get(v, v)
            if r in node_key:
                keys.add(node_key[r])
        if extra:
            k = next(ids)
            storage_bytes[k] = extra
            keys.add(k)
        saves[node.name] = frozenset(keys)
        r = root[node]
        value_storages[node.name] = frozenset({node_key[r]}) if r in node_key else frozenset()
    return SavedTensors(saves=saves, storage_bytes=storage_bytes, value_storages=value_storages, method="rule")


# ---- per stage ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StageFootprint:
    """Whole-batch byte figures of one stage; predictions scale them per micro-batch."""

    index: int
    params: int             # bytes of the parameters and buffers it holds
    trainable: int          # bytes of those that get a gradient (and optimizer state)
    activations: int        # what autograd saves in one whole-batch forward of the stage (+ inputs no op saves)
    inputs: int             # batched tensor inputs (graph inputs and values from earlier stages), whole batch
    fixed_inputs: int = 0   # tensor inputs without a batch dimension: every micro-batch holds them whole
    rows: int | None = None  # rows the figures are for: the traced batch (None: the plan's batch)
    static: bool = False    # traced at one micro-batch's rows (a model specialised on the batch size)


def stage_activation_bytes(costed: CostedGraph, plan: Plan, *, saved: SavedTensors | None = None,
                           method: str = "fake") -> list[int]:
    """Per stage, the bytes one whole-batch forward saves for backward: the distinct storages autograd
    saves in the stage's nodes (replicated ones included), parameters and buffers excluded; the
    figure ``pipe.memory.stages[j].kept`` measures at checkpoint="never" summed over micro-batches."""
    saved = saved or saved_tensors(costed, method)
    return [saved.bytes_of(_stage_saves(saved, s)) for s in plan.stages]


def stage_input_bytes(plan: Plan) -> list[int]:
    """Per stage, the whole-batch bytes of the tensors it receives (graph inputs it reads and values
    from earlier stages): what a re-materialised stage keeps per micro-batch, times M."""
    return [sum(plan.tensors[n].nbytes for n in s.inputs if n in plan.tensors) for s in plan.stages]


def stage_footprints(costed: CostedGraph, plan: Plan, *, saved: SavedTensors | None = None,
                     method: str = "fake") -> list[StageFootprint]:
    """Everything ``predict_memory`` needs from the graph, per stage."""
    saved = saved or saved_tensors(costed, method)
    gm = costed.traced.graph_module
    trainable_names = {name for name, p in gm.named_parameters(remove_duplicate=False) if p.requires_grad}
    out = []
    for s in plan.stages:
        keys = _stage_saves(saved, s)
        held = set(keys)
        for name in s.inputs:  # the runtime holds a stage's inputs until its backward, saved or not
            info = plan.tensors.get(name)
            if info is not None and info.kind == "tensor":
                held |= saved.value_storages.get(name, frozenset())
        batched = sum(plan.tensors[n].nbytes for n in s.inputs if n in plan.tensors and plan.tensors[n].batched)
        fixed = sum(plan.tensors[n].nbytes for n in s.inputs if n in plan.tensors and not plan.tensors[n].batched)
        out.append(StageFootprint(
            index=s.index,
            params=s.param_bytes,
            trainable=sum(costed.tensor_bytes.get(p, 0) for p in s.params if p in trainable_names),
            activations=saved.bytes_of(held),
            inputs=batched,
            fixed_inputs=fixed,
            rows=costed.traced.batch_size,
            static=costed.traced.static_batch is not None,
        ))
    return out


def _stage_saves(saved: SavedTensors, stage) -> set[int]:
    keys: set[int] = set()
    for name in tuple(stage.nodes) + tuple(stage.replicated):
        keys |= saved.saves.get(name, frozenset())
    return keys


# ---- memory prediction ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryPrediction:
    """Predicted bytes of one stage for one (schedule, checkpoint, chunks, optimizer)."""

    stage: int
    device: int                 # stage % K: the device that holds it
    params: int                 # parameters and buffers
    grads: int                  # one gradient per trainable parameter
    optimizer_state: int
    kept_activations: int       # most bytes held between forwards and their backwards at once
    recompute_peak: int         # one recomputed micro-batch's activations, during its backward
    in_flight: int              # Schedule.max_in_flight(stage)
    kept_all: int               # kept bytes summed over all micro-batches: what pipe.memory's `kept` counts today
    formula: str                # the kept term, with its numbers

    @property
    def activations_peak(self) -> int:
        """kept + recompute: what pipe.memory's `peak` measures (saved activations only)."""
        return self.kept_activations + self.recompute_peak

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_state + self.kept_activations + self.recompute_peak


class PredictedMemory(list):
    """``list[MemoryPrediction]``, one per stage, that prints as a table with its formula."""

    def __init__(self, stages: Iterable[MemoryPrediction], *, schedule: str, checkpoint: str, chunks: int,
                 virtual_stages: int, n_devices: int, optimizer: str | None, method: str):
        super().__init__(stages)
        self.schedule, self.checkpoint, self.chunks = schedule, checkpoint, chunks
        self.virtual_stages, self.n_devices, self.optimizer, self.method = virtual_stages, n_devices, optimizer, method

    def per_device(self) -> list[int]:
        """Total bytes per device: the sum over the stages it holds (v of them when interleaved)."""
        totals = [0] * self.n_devices
        for p in self:
            totals[p.device] += p.total
        return totals

    @property
    def peak(self) -> int:
        return max(self.per_device(), default=0)

    def formula(self) -> str:
        m = OPTIMIZER_STATE.get(self.optimizer, 0)
        return "\n".join([
            f"total = params + grads + optimizer ({self.optimizer or 'none'}: {m} x trainable bytes) "
            "+ kept + recompute",
            "kept = max over the stage's task order of sum over micro-batches in flight (forward done, backward "
            "not) of (inputs/M if recomputed else activations/M)",
            "     = in_flight x (inputs/M if recomputed else activations/M), "
            "in_flight = Schedule.max_in_flight(stage): M for gpipe, K - s for 1f1b",
            "recompute = activations/M of one recomputed micro-batch, held while its backward runs",
            f"activations = what autograd saves in one forward of the stage ({self.method} estimate) plus inputs no "
            "op saves; inputs = the tensors the stage receives",
        ])

    def __str__(self) -> str:
        rows = [[p.stage, p.device, _human(p.params), _human(p.grads), _human(p.optimizer_state), p.in_flight,
                 _human(p.kept_activations), _human(p.recompute_peak), _human(p.total), p.formula] for p in self]
        table = tabulate(rows, headers=["stage", "device", "params", "grads", "optimizer", "in flight", "kept",
                                        "recompute", "total", "kept ="], tablefmt="simple")
        head = (f"Predicted memory: {self.schedule} (v={self.virtual_stages}), checkpoint={self.checkpoint!r}, "
                f"M={self.chunks} micro-batches on {self.n_devices} device(s)")
        devices = "per device: " + ", ".join(f"{d}: {_human(b)}" for d, b in enumerate(self.per_device()))
        return "\n".join([head, table, devices, self.formula()])

    __repr__ = __str__


def predict_memory(source: CostedGraph | Sequence[StageFootprint] | Sequence[int], plan: Plan,
                   schedule_name: str = "gpipe", checkpoint: str = "except_last", chunks: int | None = None,
                   virtual_stages: int = 1, optimizer: str | None = "adam", *,
                   batch_size: int | None = None, method: str = "fake",
                   schedule: Schedule | None = None) -> PredictedMemory:
    """Per stage of ``plan``: parameters, gradients, optimizer state, kept activations and the recompute
    peak under ``schedule_name`` with ``chunks`` micro-batches (module docstring has the formulas).

    ``source``: the CostedGraph the plan came from, its ``stage_footprints``, or per-stage whole-batch
    activation bytes (then every parameter byte counts as trainable). ``batch_size`` defaults to dim 0
    of the plan's batched graph inputs (times ``chunks`` for a graph traced at one micro-batch's rows,
    ``static_batch``); micro-batch i holds rows_i/traced rows of the graph's figures."""
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
    if optimizer not in OPTIMIZER_STATE:
        raise ValueError(f"optimizer must be one of {sorted(k for k in OPTIMIZER_STATE if k)} or None, "
                         f"got {optimizer!r}")
    footprints = _footprints(source, plan, method)
    chunks = chunks or plan.chunks
    if plan.n_stages % virtual_stages:
        raise ValueError(f"{plan.n_stages} stages do not split into {virtual_stages} virtual stages per device")
    n_devices = plan.n_stages // virtual_stages
    schedule = schedule or Schedule.build(schedule_name, n_devices, chunks, virtual_stages)
    traced_rows = footprints[0].rows if footprints else None
    batch = batch_size or (traced_rows * chunks if footprints and footprints[0].static and traced_rows
                           else traced_rows) or _batch_size(plan)
    sizes = _micro_batch_sizes(batch, chunks) if batch else [None] * chunks
    figures_for = traced_rows or batch  # the rows the whole-graph figures were taken at
    fractions = [1 / len(sizes) if rows is None else rows / figures_for for rows in sizes]
    orders = _stage_orders(schedule)
    multiple = OPTIMIZER_STATE[optimizer]
    stages = []
    for f in footprints:
        recomputed = [checkpoints(checkpoint, i, len(sizes)) for i in range(len(sizes))]
        act = [f.activations * x for x in fractions]
        inp = [f.inputs * x + f.fixed_inputs for x in fractions]
        kept_i = [inp[i] if recomputed[i] else act[i] for i in range(len(sizes))]
        live = peak = 0.0
        in_flight: set[int] = set()
        at_peak: tuple[int, int] = (0, 0)
        most = 0
        for t in orders.get(f.index, []):
            if t.micro_batch >= len(sizes):
                continue
            if t.kind == "F":
                live += kept_i[t.micro_batch]
                in_flight.add(t.micro_batch)
                most = max(most, len(in_flight))
                if live > peak:
                    peak = live
                    rec = sum(1 for i in in_flight if recomputed[i])
                    at_peak = (rec, len(in_flight) - rec)
            else:
                live -= kept_i[t.micro_batch]
                in_flight.discard(t.micro_batch)
        recompute = max((act[i] for i in range(len(sizes)) if recomputed[i]), default=0.0)
        parts = []
        if at_peak[0]:
            parts.append(f"{at_peak[0]} x inputs/M ({_human(f.inputs / len(sizes) + f.fixed_inputs)})")
        if at_peak[1]:
            parts.append(f"{at_peak[1]} x activations/M ({_human(f.activations / len(sizes))})")
        stages.append(MemoryPrediction(
            stage=f.index, device=schedule.device_of(f.index), params=f.params, grads=f.trainable,
            optimizer_state=multiple * f.trainable, kept_activations=round(peak), recompute_peak=round(recompute),
            in_flight=most, kept_all=round(sum(kept_i)), formula=" + ".join(parts) or "0"))
    return PredictedMemory(stages, schedule=schedule_name, checkpoint=checkpoint, chunks=chunks,
                           virtual_stages=virtual_stages, n_devices=n_devices, optimizer=optimizer,
                           method=method)


def beside_measured(predicted: PredictedMemory, measured) -> str:
    """Predicted and measured saved activations per stage, side by side. ``measured`` is
    ``pipe.memory`` (a MemoryReport: ``.stages[j].kept`` / ``.recompute_peak``). pipe.memory's
    ``kept`` adds every micro-batch's saves, whatever the schedule, so it is set beside
    ``kept_all``; the in-flight ``kept`` is what a device holds at once."""
    rows = []
    for p, m in zip(predicted, measured.stages):
        rows.append([p.stage, _human(p.kept_all), _human(m.kept), _ratio(m.kept, p.kept_all),
                     _human(p.recompute_peak), _human(m.recompute_peak), _ratio(m.recompute_peak, p.recompute_peak),
                     _human(p.kept_activations), p.in_flight])
    return (f"Saved activations, predicted vs measured ({predicted.schedule}, checkpoint={predicted.checkpoint!r}, "
            f"M={predicted.chunks}):\n"
            + tabulate(rows, headers=["stage", "kept (all M) pred", "measured", "meas/pred", "recompute pred",
                                      "measured", "meas/pred", "kept in flight pred", "in flight"], tablefmt="simple"))


def _footprints(source, plan: Plan, method: str) -> list[StageFootprint]:
    if isinstance(source, CostedGraph):
        return stage_footprints(source, plan, method=method)
    source = list(source)
    if len(source) != plan.n_stages:
        raise ValueError(f"{len(source)} per-stage figures for a plan of {plan.n_stages} stages")
    if all(isinstance(f, StageFootprint) for f in source):
        return source
    inputs = stage_input_bytes(plan)
    fixed = [sum(plan.tensors[n].nbytes for n in s.inputs if n in plan.tensors and not plan.tensors[n].batched)
             for s in plan.stages]
    return [StageFootprint(index=s.index, params=s.param_bytes, trainable=s.param_bytes, activations=int(a),
                           inputs=i - x, fixed_inputs=x)
            for s, a, i, x in zip(plan.stages, source, inputs, fixed)]


def _batch_size(plan: Plan) -> int | None:
    rows = [t.shape[0] for n, t in plan.tensors.items() if n in plan.graph_inputs and t.batched and t.shape]
    return max(rows) if rows else None


def _micro_batch_sizes(batch: int, chunks: int) -> list[int]:
    """autopipe.runtime.microbatch.micro_batch_sizes, without its warning."""
    chunks = min(chunks, max(batch, 1))
    base, extra = divmod(batch, chunks)
    return [base + (1 if i < extra else 0) for i in range(chunks)]


def _stage_orders(schedule: Schedule) -> dict[int, list]:
    orders: dict[int, list] = {}
    for cycle in schedule.cycles:
        for t in cycle:
            orders.setdefault(t.stage, []).append(t)
    return orders


# ---- step time ----------------------------------------------------------------------------------------------


def predicted_step_time(plan: Plan, schedule_name: str = "gpipe", checkpoint: str = "except_last",
                        chunks: int | None = None, virtual_stages: int = 1, *, task_overhead: float = 0.0,
                        schedule: Schedule | None = None) -> float:
    """One training step in the plan's cost units (forward FLOPs with balance="flops"): the busiest
    device's forward + backward (2 x forward) + recompute (1 x forward per recomputed micro-batch) +
    ``task_overhead`` per task, over (1 - the schedule's bubble). The plain model on one device: 3 x total."""
    chunks = chunks or plan.chunks
    if plan.n_stages % virtual_stages:
        raise ValueError(f"{plan.n_stages} stages do not split into {virtual_stages} virtual stages per device")
    n_devices = plan.n_stages // virtual_stages
    schedule = schedule or Schedule.build(schedule_name, n_devices, chunks, virtual_stages)
    recomputed = sum(checkpoints(checkpoint, i, chunks) for i in range(chunks))
    work = [0.0] * n_devices
    for s in plan.stages:
        d = schedule.device_of(s.index)
        work[d] += s.cost * (1 + BACKWARD_FACTOR + RECOMPUTE_FACTOR * recomputed / chunks)
        work[d] += task_overhead * (2 * chunks + recomputed)
    busy = 1.0 - schedule.bubble_fraction
    return max(work) / busy if busy > 0 else math.inf


# ---- choosing a configuration ---------------------------------------------------------------------------------


@dataclass
class Candidate:
    schedule: str
    virtual_stages: int
    checkpoint: str
    chunks: int
    per_device: list[int] = field(default_factory=list)  # predicted total bytes per device
    bubble: float = 0.0
    time: float = math.inf
    fits: bool = False
    memory: PredictedMemory | None = None
    plan: Plan | None = None
    problem: str | None = None   # why it could not be weighed (no plan, no valid schedule)

    @property
    def peak(self) -> int:
        return max(self.per_device, default=0)


@dataclass
class AutoChoice:
    """The configuration ``choose_configuration`` picked, and every alternative it weighed."""

    chosen: Candidate
    candidates: list[Candidate]
    memory_cap: float
    n_devices: int
    batch_size: int
    ideal: float          # 3 x total cost / K: a perfectly balanced pipeline without bubble
    optimizer: str | None

    @property
    def plan(self) -> Plan:
        return self.chosen.plan

    @property
    def schedule(self) -> str:
        return self.chosen.schedule

    @property
    def virtual_stages(self) -> int:
        return self.chosen.virtual_stages

    @property
    def checkpoint(self) -> str:
        return self.chosen.checkpoint

    @property
    def chunks(self) -> int:
        return self.chosen.chunks

    @property
    def memory(self) -> PredictedMemory:
        return self.chosen.memory

    @property
    def time(self) -> float:
        return self.chosen.time

    def table(self, full: bool = False) -> str:
        """The alternatives weighed: with ``full``, every one; else the best of each (schedule, checkpoint):
        its fastest chunks that fit, or its smallest peak when none does."""
        return _candidates_table(self.candidates if full else _best_per_kind(self.candidates, self.chosen),
                                 self.memory_cap, self.ideal, self.chosen)

    def __str__(self) -> str:
        c = self.chosen
        return "\n".join([
            f"Chosen: schedule={c.schedule!r}"
            + (f" (virtual_stages={c.virtual_stages})" if c.virtual_stages > 1 else "")
            + f", checkpoint={c.checkpoint!r}, chunks={c.chunks}: predicted peak {_human(c.peak)} per device "
            f"(cap {_human(self.memory_cap)}), bubble {c.bubble:.3f}, step {c.time / self.ideal:.2f}x ideal",
            f"Alternatives weighed (batch {self.batch_size}, {self.n_devices} device(s), optimizer "
            f"{self.optimizer or 'none'}; time in units of the ideal step, 3 x total cost / K; fastest that fits "
            f"wins; best chunks per schedule and checkpoint shown, {len(self.candidates)} weighed in all: "
            f".table(full=True)):",
            self.table(),
        ])

    __repr__ = __str__


def choose_configuration(
    plan_for: Callable[[int], tuple[Plan, "CostedGraph | Sequence[StageFootprint] | Sequence[int]"]],
    *,
    batch_size: int,
    n_devices: int,
    memory_cap: float,
    schedules: Sequence[str] = SCHEDULES,
    checkpoint_modes: Sequence[str] = ("never", "except_last", "always"),
    chunks: int | Sequence[int] | None = None,
    virtual_stages: int = 2,
    optimizer: str | None = "adam",
    task_overhead: float = 0.0,
    method: str = "fake",
) -> AutoChoice:
    """The fastest (schedule, checkpoint, chunks) whose predicted peak fits ``memory_cap`` bytes on every device.

    ``plan_for(n_stages)`` returns a Plan with that many stages and what ``predict_memory`` reads
    (the CostedGraph, or footprints); it is called once per distinct stage count (K, and K*v for
    interleaved), since the cuts depend on the stage count only. Partition without a memory cap
    there: this function applies the cap. ``chunks=None`` weighs powers of two up to the batch
    size (and the batch size itself); interleaved only where its table exists (M a multiple of
    max(1, M // K)). Raises NoFeasiblePlan naming the smallest peak found when nothing fits."""
    for name in schedules:
        if name not in SCHEDULES:
            raise ValueError(f"unknown schedule {name!r}; choose from {SCHEDULES}")
    for mode in checkpoint_modes:
        if mode not in CHECKPOINT_MODES:
            raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {mode!r}")
    if chunks is None:
        counts = sorted({2 ** k for k in range(int(math.log2(max(batch_size, 1))) + 1)} | {max(batch_size, 1)})
    else:
        counts = [chunks] if isinstance(chunks, int) else sorted(set(chunks))
    plans: dict[int, tuple[Plan | None, Any, str | None]] = {}
    saved_by_graph: dict[int, tuple[CostedGraph, SavedTensors]] = {}

    def planned(n_stages: int):
        if n_stages not in plans:
            try:
                plan, source = plan_for(n_stages)
                if isinstance(source, CostedGraph):  # one fake run per graph, whatever the stage count
                    graph, saved = saved_by_graph.get(id(source), (None, None))
                    if graph is not source:
                        saved = saved_tensors(source, method)
                        saved_by_graph[id(source)] = (source, saved)
                    source = stage_footprints(source, plan, saved=saved)
                plans[n_stages] = (plan, source, None)
            except (ValueError, NoFeasiblePlan) as e:
                plans[n_stages] = (None, None, f"no {n_stages}-stage plan: {e}")
        return plans[n_stages]

    candidates: list[Candidate] = []
    ideal = None
    for name in schedules:
        v = virtual_stages if name == "interleaved" else 1
        if name == "interleaved" and v < 2:
            continue
        plan, source, problem = planned(n_devices * v)
        for m in counts:
            try:
                table = Schedule.build(name, n_devices, m, v) if plan is not None else None
                invalid = None
            except ValueError as e:
                table, invalid = None, str(e)
            if invalid is not None and name == "interleaved" and chunks is None:
                continue  # not a valid table: not an alternative worth listing
            for mode in checkpoint_modes:
                c = Candidate(name, v, mode, m, plan=plan)
                c.problem = problem or invalid
                if c.problem is None:
                    if ideal is None:
                        ideal = 3 * plan.total_cost / n_devices
                    c.memory = predict_memory(source, plan, name, mode, m, v, optimizer, batch_size=batch_size,
                                              schedule=table)
                    c.per_device = c.memory.per_device()
                    c.bubble = table.bubble_fraction
                    c.time = predicted_step_time(plan, name, mode, m, v, task_overhead=task_overhead, schedule=table)
                    c.fits = c.peak <= memory_cap
                candidates.append(c)
    ideal = ideal or 1.0
    weighed = [c for c in candidates if c.problem is None]
    fitting = [c for c in weighed if c.fits]
    if not fitting:
        table = _candidates_table(_best_per_kind(candidates, None), memory_cap, ideal, None)
        if not weighed:
            raise NoFeasiblePlan("no configuration could be planned:\n" + table)
        least = min(weighed, key=lambda c: (c.peak, c.time))
        worst = max(range(n_devices), key=lambda d: least.per_device[d])
        resident = sum(p.params + p.grads + p.optimizer_state for p in least.memory if p.device == worst)
        raise NoFeasiblePlan(
            f"no configuration fits memory_cap={_human(memory_cap)} per device on {n_devices} device(s): the smallest "
            f"predicted peak is {_human(least.peak)} (schedule={least.schedule!r}, checkpoint={least.checkpoint!r}, "
            f"chunks={least.chunks}), on device {worst}, of which {_human(resident)} are parameters, gradients and "
            f"optimizer state ({optimizer or 'none'}). Raise memory_cap to at least {_human(least.peak)}, add devices, "
            f"use a lighter optimizer, or a smaller batch.\nAlternatives weighed:\n{table}")
    best = min(fitting, key=lambda c: (round(c.time, 9), c.peak, c.chunks))
    return AutoChoice(chosen=best, candidates=candidates, memory_cap=memory_cap, n_devices=n_devices,
                      batch_size=batch_size, ideal=ideal, optimizer=optimizer)


def _rank(c: Candidate) -> tuple:
    """Weighable first, fitting first; then the fastest that fits, or the smallest peak that does not."""
    return (c.problem is not None, not c.fits, c.time if c.fits else c.peak, c.peak if c.fits else c.time)


def _best_per_kind(candidates: list[Candidate], chosen: Candidate | None) -> list[Candidate]:
    best: dict[tuple, Candidate] = {}
    for c in candidates:
        kind = (c.schedule, c.virtual_stages, c.checkpoint)
        if kind not in best or _rank(c) < _rank(best[kind]):
            best[kind] = c
    shown = list(best.values())
    if chosen is not None and chosen not in shown:
        shown.append(chosen)
    return shown


def _candidates_table(candidates: list[Candidate], cap: float, ideal: float, chosen: Candidate | None) -> str:
    def order(c: Candidate):
        return (c.problem is not None, not c.fits, c.time, c.peak)

    rows = []
    for c in sorted(candidates, key=order):
        if c.problem is not None:
            rows.append(["", c.schedule + (f" v={c.virtual_stages}" if c.virtual_stages > 1 else ""), c.checkpoint,
                         c.chunks, "-", "-", "-", "-", _shorten(c.problem)])
            continue
        rows.append(["->" if c is chosen else "",
                     c.schedule + (f" v={c.virtual_stages}" if c.virtual_stages > 1 else ""), c.checkpoint, c.chunks,
                     " ".join(_human(b) for b in c.per_device), _human(c.peak), f"{c.bubble:.3f}",
                     f"{c.time / ideal:.3f}", "fits" if c.fits else f"over by {_human(c.peak - cap)}"])
    return tabulate(rows, headers=["", "schedule", "checkpoint", "chunks", "peak per device", "max peak", "bubble",
                                   "time (x ideal)", f"cap {_human(cap)}"], tablefmt="simple")


def _ratio(measured: float, predicted: float) -> str:
    return f"{measured / predicted:.3f}" if predicted else ("-" if not measured else "inf")


def _shorten(text: str, width: int = 70) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= width else text[: width - 3] + "..."


__all__ = ["AutoChoice", "Candidate", "MemoryPrediction", "PredictedMemory", "SavedTensors", "StageFootprint",
           "beside_measured", "choose_configuration", "predict_memory", "predicted_step_time", "saved_tensors",
           "stage_activation_bytes", "stage_footprints", "stage_input_bytes", "OPTIMIZER_STATE"]
