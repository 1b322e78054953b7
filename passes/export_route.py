"""The torch.export route of the trace pass: non-strict export with one dynamic batch dimension, unlifted to a
graph of the model's own parameters and buffers in trace.py's flat calling convention, in the model's train/eval
mode. An unpassed ``use_cache`` is False (no KV cache in training). Export's checks of the example (asserts, range
constraints, _guards_fn) are dropped: they would pin tensors across cuts. Later nodes get the batch by sym_size."""
from __future__ import annotations

import inspect
import re
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import nn

from autopipe.random_ops import op_name
from .trace import TracedModel, flat_root, module_state_kept, specialises_batch, user_frame


class ExportRouteError(RuntimeError):
    """torch.export could not capture the model (the cause is chained)."""


@dataclass
class ExportedGraph(TracedModel):
    """A TracedModel by torch.export, with what export knows besides."""

    training: bool = False  # the mode the graph was captured in: dropout and BatchNorm behave as in it
    batch_symbol: Any = None  # sympy symbol of the batch dimension in node.meta["val"]; None when static


def export_flat_graph(model: nn.Module, bound: dict[str, Any], batch_size: int, *, dynamic_batch: bool = True) -> ExportedGraph:
    """``model`` called with ``bound`` (its forward's bound arguments) as a flat graph. Dim 0 of each tensor with
    ``batch_size`` rows is one dynamic dimension, unless not ``dynamic_batch``. Raises ExportRouteError."""
    signature = inspect.signature(model.forward)
    forced = {"use_cache": False} if "use_cache" in signature.parameters and "use_cache" not in bound else {}
    eg = ExportedGraph.for_call(signature, bound, route="export", batch_size=batch_size, forced_kwargs=forced, training=model.training)
    tensors = eg.flatten_inputs(bound)
    is_batch = [t.dim() > 0 and t.shape[0] == batch_size for t in tensors]
    if not any(is_batch):
        raise ValueError(f"no tensor input of {type(model).__name__} has batch_size={batch_size} rows in dim 0 "
                         f"(tensor inputs: {dict(zip(eg.input_names, (tuple(t.shape) for t in tensors)))})")
    dynamic = [b and dynamic_batch for b in is_batch]
    batch = torch.export.Dim("batch", min=1)
    try:
        with module_state_kept(model), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The tensor attribute")  # said once, by compile, with what it means here
            ep = torch.export.export(flat_root(model, eg, model), tuple(map(_fresh, tensors, dynamic)), strict=False,
                                     dynamic_shapes=tuple({0: batch} if d else None for d in dynamic))
    except Exception as e:
        hint = (f"\nThe model treats the batch size as a constant (e.g. reshape({batch_size}, ...)), so it cannot "
                f'run on smaller micro-batches; TORCH_LOGS="+dynamic" shows where it specialised.'
                if dynamic_batch and specialises_batch(e) else "")
        how = f"dim 0 of size {batch_size} dynamic" if dynamic_batch else f"static shapes, batch {batch_size}"
        raise ExportRouteError(f"torch.export (non-strict, {how}) failed on {type(model).__name__}"
                               f"{user_frame(e, model)}: {type(e).__name__}: {e}{hint}") from e

    eg.assigned = [a for a in eg.assigned if a not in model._buffers]  # export writes the root's own buffers back (register_buffer_assignment_hook)
    unlifted = ep.module()
    graph = unlifted.graph
    graph._codegen = fx.graph.CodeGen()  # plain flat inputs and outputs, not export's pytree calling convention
    for node in reversed(graph.nodes):
        if _is_check(node):
            graph.erase_node(node)
    names, modules = iter(eg.input_names), dict(model.named_modules())
    for node in graph.nodes:
        if "nn_module_stack" in node.meta:  # the model's modules only, not export's entries for hooks
            node.meta["nn_module_stack"] = {k: v for k, v in node.meta["nn_module_stack"].items() if v[0] in modules}
        if node.op == "placeholder":
            node.name = node.target = next(names)  # fx would rename an argument that shadows a builtin (input)
        elif node.op == "call_function":
            innermost = [v[0] for v in node.meta.get("nn_module_stack", {}).values() if v[0]][-1:]
            node._rename(re.sub(r"\W", "_", "_".join([*innermost, op_name(node.target) or "op"])))
    output = graph.output_node()
    output.args = (tuple(output.args[0]),)
    eg.graph_module = gm = fx.GraphModule(unlifted, graph, class_name=f"{type(model).__name__}Graph")
    if not {id(p) for p in gm.parameters()} <= {id(p) for p in model.parameters()}:
        raise ExportRouteError("torch.export gave the graph a Parameter the model does not have")
    graph.eliminate_dead_code()
    # export puts every get_attr first: each goes just before its first user, for cuts to keep them together
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in [n for n in graph.find_nodes(op="get_attr") if n.users]:
        min(node.users, key=order.__getitem__).prepend(node)
    graph.lint()
    gm.recompile()
    sizes = [n.meta["val"].shape[0] for n, d in zip(graph.find_nodes(op="placeholder"), dynamic) if d]
    eg.batch_symbol = next((s.node.expr for s in sizes if isinstance(s, torch.SymInt)), None)
    return eg


def _fresh(x: torch.Tensor, twice: bool) -> torch.Tensor:
    """A copy with the same strides (export would tie inputs that are one tensor), two rows for a dynamic batch
    of one (export specialises a size-1 dimension)."""
    x0 = torch.cat([x.detach(), x.detach()]) if twice and x.shape[0] == 1 else x.detach()
    if 0 in x0.stride() and x0.numel() > 1:  # expanded: its memory overlaps
        return x0.clone().requires_grad_(x.requires_grad)
    y = torch.empty_strided(x0.shape, x0.stride(), dtype=x0.dtype, device=x0.device)
    return (y if y.device.type == "meta" else y.copy_(x0)).requires_grad_(x.requires_grad)


def _is_check(node: fx.Node) -> bool:
    """Export's re-checks of facts about the example: aten asserts and range constraints, its _guards_fn."""
    if node.op == "call_module":
        return str(node.target).startswith("_guards_fn")
    name = op_name(node.target) if node.op == "call_function" else ""
    return "assert" in name or "constrain_range" in name
