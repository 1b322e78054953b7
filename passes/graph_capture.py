"""Capture check (``cuda_graphs=True``): which stages of a plan can be captured as CUDA graphs, and for each one that
cannot, the node, the op and the source line that stop it. Runs after partition, on the traced graph.

torch's CUDA graph constraints (docs "CUDA Graphs", "Constraints"; torch/cuda/graphs.py): no host synchronisation
during capture (``.item()``, ``.tolist()``, ``bool(t)``: ``aten._local_scalar_dense``), no shapes set by values (the
size of ``nonzero``, ``masked_select``, ``x[mask]``, ``unique`` is read back to the host), no CPU work (it is not
captured: a copy to the host, a CPU tensor, ``.numpy()``), no generator state read or set on the host during capture
(autopipe lends the device's default generator the task's state for fused attention dropout: ``on_default_generator``),
and every replay reads and writes the same addresses: a buffer the stage writes (BatchNorm's running statistics) is
swapped for a copy per task, which a replay cannot follow.

How: each node runs once more on fake tensors (FakeTensorMode, no memory, no device) under a dispatch mode that sees
every aten op it runs, also inside modules fx keeps whole, Python functions and custom autograd Functions; an op that
synchronises, or whose fake kernel says its output size depends on values, blocks its stage.

Assumed (printed with the report): a custom autograd.Function's backward is not run here; it is taken to be
capturable. A stage whose capture still fails at run time runs eagerly, and the report on its plan says why.
"""
from __future__ import annotations

import functools
import operator
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from autopipe.ir.capture import CaptureBlocker, CaptureReport, StageCapture
from autopipe.ir.plan import Plan

from .custom_gradients import FunctionCall
from .diagnostics import node_where
from .fake_shapes import fake_errors_unlogged
from .traced_model import TracedModel

ASSUMPTIONS = ("a custom autograd.Function's backward is not run by this check and is taken to be capturable; "
               "a stage whose capture fails at run time runs eagerly, with the reason in this report",)

# aten ops that read a value back to the host: the capture would end in an error
_HOST_SYNCS = {
    "_local_scalar_dense": "reads a value back to the host (.item(), .tolist(), bool(t), int(t))",
    "item": "reads a value back to the host (.item())",
    "equal": "returns a Python bool (torch.equal): a host sync",
    "is_nonzero": "returns a Python bool: a host sync",
    "allclose": "returns a Python bool (torch.allclose): a host sync",
    "_assert_scalar": "asserts on a value read back to the host",
}
# aten ops whose output size is set by values: the host reads the size before allocating it
_VALUE_SIZED = {"nonzero", "masked_select", "_unique", "_unique2", "unique_dim", "unique_consecutive",
                "unique_dim_consecutive", "bincount", "argwhere", "masked_scatter"}
_HOST_METHODS = {"item": "reads a value back to the host (.item())", "tolist": "copies to a Python list (.tolist())",
                 "numpy": "copies to a NumPy array (.numpy())", "cpu": "copies to a CPU tensor (.cpu())"}


class _Blocked(Exception):
    def __init__(self, op: str, why: str):
        super().__init__(op)
        self.op, self.why = op, why


class _Watch(TorchDispatchMode):
    """Raises _Blocked at the first aten op that a capture forbids."""

    def __init__(self, host: torch.device):
        super().__init__()
        self.host = host  # the device the graph's values live on when traced

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        if name in _HOST_SYNCS:
            raise _Blocked(str(func), _HOST_SYNCS[name])
        if name in _VALUE_SIZED or (name == "repeat_interleave" and kwargs.get("output_size") is None
                                    and isinstance(args[0] if args else None, torch.Tensor) and len(args) == 1):
            raise _Blocked(str(func), "its output size is set by values, which the host reads before allocating it")
        if name in ("index", "index_put", "index_put_", "_index_put_impl_") and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in pytree.tree_leaves(args[1:2])):
            raise _Blocked(str(func), "indexes by a boolean mask (x[mask]): the host counts the rows it selects")
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            raise _Blocked(str(func), "its output size depends on values, which the host reads") from None
        moved = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.device.type == "cpu"]
        if moved and self.host.type != "cpu":
            raise _Blocked(str(func), "makes a CPU tensor inside a CUDA stage: CPU work is not captured")
        return out


def graph_capture(traced: TracedModel, plan: Plan) -> CaptureReport:
    """Each stage of ``plan``: captured, or the nodes that keep it eager (CaptureBlocker: node, op, line, why)."""
    gm = traced.graph_module
    stage_of = {name: s.index for s in plan.stages for name in (*s.nodes, *s.replicated)}
    blockers: dict[int, list[CaptureBlocker]] = {s.index: [] for s in plan.stages}
    for node, op, why in _blocking_nodes(gm):
        for stage in _stages_running(node.name, plan, stage_of):
            blockers[stage].append(CaptureBlocker(node.name, op, node_where(node), why))
    return CaptureReport([StageCapture(s.index, tuple(blockers[s.index])) for s in plan.stages], ASSUMPTIONS)


def _stages_running(name: str, plan: Plan, stage_of: dict[str, int]) -> list[int]:
    """The stage that owns node ``name`` and those that recompute it (replicated cheap nodes)."""
    return sorted({stage_of[name], *(s.index for s in plan.stages if name in s.replicated)}) if name in stage_of \
        else []


def _blocking_nodes(gm: fx.GraphModule):
    """(node, op, why) for each node a capture forbids, from its target and one run on fake tensors."""
    values = [n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"]
    host = next((v.device for v in pytree.tree_leaves(values) if isinstance(v, torch.Tensor)), torch.device("cpu"))
    env: dict[fx.Node, Any] = {}
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, fake_errors_unlogged(), \
            torch.inference_mode(False), torch.enable_grad():
        for node in gm.graph.nodes:
            if node.op == "output":
                continue
            found = _by_target(gm, node)
            if node.op == "placeholder" or node.op == "get_attr" or found is not None:
                env[node] = _fake(mode, node.meta.get("val"), host) if node.op != "get_attr" else \
                    functools.reduce(getattr, node.target.split("."), gm)
                if found is not None:
                    yield node, *found
                continue
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            try:
                with _Watch(host):
                    env[node] = _call(gm, node, args, kwargs)
            except _Blocked as blocked:
                yield node, blocked.op, blocked.why
                env[node] = _fake(mode, node.meta.get("val"), host)
            except Exception:  # not this check's to judge (the trace ran it): go on from its traced value
                env[node] = _fake(mode, node.meta.get("val"), host)


def _by_target(gm: fx.GraphModule, node: fx.Node) -> tuple[str, str] | None:
    """(op, why) where the node's target or trace's facts alone block the capture."""
    if node.op == "call_method" and node.target in _HOST_METHODS:
        return f"Tensor.{node.target}", _HOST_METHODS[node.target]
    if node.meta.get("data_dependent") and not any(a.meta.get("data_dependent") for a in node.all_input_nodes):
        return str(node.target), "its output size is set by values (trace found a size no shape fixes), which the " \
            "host reads"
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase)
                 and m.training and m.track_running_stats]
        if norms:
            return type(norms[0]).__name__, _WRITES_BUFFERS
        return None
    target = node.target
    if target is F.batch_norm or getattr(target, "__name__", "") in ("batch_norm", "native_batch_norm"):
        training = node.kwargs.get("training", node.args[5] if len(node.args) > 5 else False)
        running = node.kwargs.get("running_mean", node.args[1] if len(node.args) > 1 else None)
        if training and running is not None:
            return str(target), _WRITES_BUFFERS
    if target is F.scaled_dot_product_attention or "scaled_dot_product" in getattr(target, "__name__", ""):
        dropout = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
        if dropout and gm.training:
            return str(getattr(target, "__name__", target)), (
                "attention dropout draws from the device's default generator, which autopipe lends the task's "
                "state on the host (random_ops.on_default_generator): a replay would not see it")
    if node.op == "call_method" and node.target in ("to", "copy_") and any(
            (isinstance(a, str) and a.startswith("cpu")) or (isinstance(a, torch.device) and a.type == "cpu")
            for a in (*node.args[1:], *node.kwargs.values())):
        return f"Tensor.{node.target}", "copies to the CPU: CPU work is not captured"
    return None


_WRITES_BUFFERS = ("writes running statistics (a training BatchNorm): each task runs on its own copy of a buffer it "
                   "writes, which a replay, bound to one address, cannot follow")


def _fake(mode: FakeTensorMode, val: Any, host: torch.device) -> Any:
    """A fresh fake of a traced value (the trace's own fakes belong to its mode)."""
    if isinstance(val, (list, tuple)) and not isinstance(val, torch.Size):
        return type(val)(_fake(mode, v, host) for v in val)
    if isinstance(val, torch.SymInt):
        return int(val)
    if not isinstance(val, torch.Tensor):
        return val
    t = torch.empty(tuple(int(d) for d in val.shape), dtype=val.dtype, device=val.device)
    return t.requires_grad_(bool(val.requires_grad) and (t.is_floating_point() or t.is_complex()))


def _call(gm: fx.GraphModule, node: fx.Node, args: tuple, kwargs: dict) -> Any:
    if node.op == "call_module":
        return gm.get_submodule(node.target)(*args, **kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    target = node.target
    if isinstance(target, FunctionCall):
        return target(*args, **kwargs)
    if target is operator.getitem and not isinstance(args[0], torch.Tensor):
        return args[0][args[1]]
    return target(*args, **kwargs)
