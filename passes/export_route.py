"""The torch.export route of the trace pass: non-strict export with one dynamic batch dimension, unlifted to a graph of
the model's own parameters and buffers in trace.py's flat calling convention, in the model's train/eval mode. An
unpassed ``use_cache`` is False (no KV cache in training). Export's checks of the example (asserts, range constraints,
_guards_fn) are dropped: they would pin tensors across cuts; but for the conditions of branches on tensor values, which
a second export with real values takes the example's way (BranchesTaken). Later nodes get the batch by sym_size."""
from __future__ import annotations

import contextlib
import inspect
import io
import logging
import re
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn
from torch._functorch import config as functorch_config
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from autopipe.random_ops import is_random_target, op_name
from .custom_gradients import backward_hooked, calls_restored, exporting
from .diagnostics import causes, node_where, specialises_batch, user_frame
from .model_state import module_state_kept
from .traced_model import TracedModel, flat_root


class ExportRouteError(RuntimeError):
    """torch.export could not capture the model (the cause is chained)."""


@dataclass
class ExportedGraph(TracedModel):
    """A TracedModel by torch.export, with what export knows besides."""

    training: bool = False  # the mode the graph was captured in: dropout and BatchNorm behave as in it
    batch_symbol: Any = None  # sympy symbol of the batch dimension in node.meta["val"]; None when static
    # branches on values traced the example's way, each checked at run time
    branches_taken: list[str] = field(default_factory=list)


def export_flat_graph(model: nn.Module, bound: dict[str, Any], batch_size: int, *,
                      dynamic_batch: bool = True) -> ExportedGraph:
    """``model`` called with ``bound`` (its forward's bound arguments) as a flat graph. Dim 0 of each tensor with
    ``batch_size`` rows is one dynamic dimension, unless not ``dynamic_batch``. Raises ExportRouteError."""
    if hooked := backward_hooked(model):  # Note [module backward hooks]
        raise ExportRouteError(f"module {hooked[0] or type(model).__name__!r} has a backward hook "
                               f"(register_full_backward_hook): torch.export records the forward alone, and the hook "
                               f"would never run; fx keeps such a module whole (make the model fx-traceable), or "
                               f"register the hook on a tensor (tensor.register_hook)")
    signature = inspect.signature(model.forward)
    forced = {"use_cache": False} if "use_cache" in signature.parameters and "use_cache" not in bound else {}
    eg = ExportedGraph.for_call(signature, bound, route="export", batch_size=batch_size, forced_kwargs=forced,
                                training=model.training)
    tensors = eg.flatten_inputs(bound)
    is_batch = [t.dim() > 0 and t.shape[0] == batch_size for t in tensors]
    if not any(is_batch):
        raise ValueError(f"no tensor input of {type(model).__name__} has batch_size={batch_size} rows in dim 0 "
                         f"(tensor inputs: {dict(zip(eg.input_names, (tuple(t.shape) for t in tensors)))})")
    dynamic = [b and dynamic_batch for b in is_batch]
    batch = torch.export.Dim("batch", min=1)
    root, example = flat_root(model, eg, model), tuple(map(_fresh, tensors, dynamic))
    shapes = tuple({0: batch} if d else None for d in dynamic)
    retried = False  # exported a second time, with real values
    with BranchesTaken(model) as branches, exporting() as function_calls:
        try:
            ep = _exported(model, root, example, shapes)
        except Exception as e:
            ep, failure, retried = None, e, True
            on_values = any(isinstance(c, GuardOnDataDependentSymNode)
                            for c in causes(e))  # if mask.any(): a branch on a tensor's value
            if dynamic_batch and on_values and not any(t.is_meta
                                                       for t in (*tensors, *model.parameters(), *model.buffers())):
                with contextlib.suppress(Exception), functorch_config.patch(fake_tensor_propagate_real_tensors=True):
                    ep = _exported(model, root, example, shapes)
    if ep is None:
        hint = (f"\nThe model treats the batch size as a constant (e.g. reshape({batch_size}, ...)), so it cannot "
                f'run on smaller micro-batches; TORCH_LOGS="+dynamic" shows where it specialised.'
                if dynamic_batch and specialises_batch(failure) else "")
        how = f"dim 0 of size {batch_size} dynamic" if dynamic_batch else f"static shapes, batch {batch_size}"
        raise ExportRouteError(f"torch.export (non-strict, {how}) failed on {type(model).__name__}"
                               f"{user_frame(failure, model)}: {type(failure).__name__}: {failure}{hint}") from failure

    # export writes the root's own buffers back (register_buffer_assignment_hook)
    eg.assigned = [a
                   for a in eg.assigned if a not in model._buffers]
    unlifted = ep.module()
    graph = unlifted.graph
    graph._codegen = fx.graph.CodeGen()  # plain flat inputs and outputs, not export's pytree calling convention
    calls_restored(unlifted, function_calls)
    batch = {s.node.expr for n, d in zip(graph.find_nodes(op="placeholder"), dynamic) if d
             and isinstance(s := n.meta["val"].shape[0], torch.SymInt)}
    for node in reversed(graph.nodes):
        if branches.guards(node):
            eg.branches_taken.append(node.meta["branch_taken"])
            if (why := _not_one_way(node, batch)) is not None:
                raise ExportRouteError(f"{node.meta['branch_taken']}, {why}")
        elif _is_check(node):
            graph.erase_node(node)
    unchecked = sorted(set(branches.where) - branches.checked)
    # a way taken that no check holds to, or not heard (another torch's log): never silently
    if unchecked or retried and not branches.where:
        where = branches.where[unchecked[0]][0] if unchecked else ""
        raise ExportRouteError(f"torch.export took a branch on a tensor's value{where} the example's way but autopipe "
                               f"found no check of it in the graph, so a micro-batch could go the other way unseen; "
                               f"write the branch without Python control flow on tensor values (torch.where, "
                               f"torch.cond)")
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
    if eg.branches_taken:
        _example_goes_the_traced_way(gm, example)
    eg.batch_symbol = next(iter(batch), None)
    return eg


# Note [branches one way for every micro-batch]: a condition reading batch rows through any, all, max or min of
# one value reduced to a single number has the whole batch's value of one micro-batch, so every micro-batch going
# the traced way means the plain model goes it too. Through a sum or mean over the batch, a vector of such values,
# or two of them (x.max() > y.min()) it need not: refused, naming the ops. Refused, not warned: a wrong way runs
# other code, not other rounding. A graph of one static size has no batch symbol to tell by: refused too.
def _not_one_way(guard: fx.Node, batch: set) -> str | None:
    """Why the branch a guard checks could go one way in every micro-batch and another in the plain model, or None
    (Note [branches one way for every micro-batch]). A random number goes either way at random, unless rand is
    compared only with a bound it never crosses (LayerDrop at 0: ``torch.rand([]) < 0.0``; rand is in [0, 1))."""
    seen, stack = {guard}, [guard]
    while stack:
        for a in stack.pop().all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)

    def holds_batch(n: fx.Node) -> bool:
        sizes = [d for v in pytree.tree_leaves(n.meta.get("val"))
                 for d in (v.shape if isinstance(v, torch.Tensor) else [v])]
        return any(isinstance(d, torch.SymInt) and d.node.expr.free_symbols & batch for d in sizes)

    reductions = []  # where the condition reads the batch: values over it made from batch rows
    for a in (n for n in guard.graph.nodes if n in seen and n.op == "call_function"):
        if is_random_target(a.target) and not (op_name(a.target) == "rand"
                                               and all(op_name(u.target) in ("lt", "ge") and u.args[0] is a
                                                       and isinstance(u.args[1], (int, float))
                                                       and not 0 < u.args[1] < 1 for u in a.users if u in seen)):
            return (f"on a random number ({node_where(a)}): one graph holds one way, and a micro-batch that draws the "
                    f"other would stop the step. Set its probability to 0 (LayerDrop: config.layerdrop, "
                    f"encoder_layerdrop, decoder_layerdrop), or compile the model in eval mode")
        if not holds_batch(a) and any(map(holds_batch, a.all_input_nodes)):
            reductions.append(a)
    selective = all(op_name(a.target) in ("any", "all", "amax", "amin", "max", "min")
                    and isinstance(v := a.meta.get("val"), torch.Tensor) and v.numel() == 1
                    for a in reductions)  # x.amax(0) is a vector whose entries may come from several micro-batches
    # x.max() > y.min(): each micro-batch's pair is its own, the whole batch's pair from two
    if len(reductions) > 1 or not selective:
        return (f"on {'values' if len(reductions) > 1 else 'a value'} over the batch "
                f"({'; '.join(map(node_where, reductions))}): each micro-batch would check "
                f"{'them' if len(reductions) > 1 else 'it'} over its own samples, and all of them going one way need "
                f"not mean the whole batch does (as it does for one any, all, max or min); compute it outside the "
                f"model, or write the branch without Python control flow on tensor values (torch.where, torch.cond)")
    return None


# Note [real values export computes]: the real values export computes beside the fake ones are wrong where they
# come from parameters that require grad, or where the batch is dynamic (weight.sum() > 100 read False for a
# weight of 160; an embedding read as NaN); conditions on inputs come out right. So the graph runs once on the
# example at compile, and a branch its own example goes the other way in is refused there, not at the first step.
# A model on meta has no values to go by; a condition on a random draw goes either way at random: both refused.
def _example_goes_the_traced_way(gm: fx.GraphModule, example: tuple[torch.Tensor, ...]) -> None:
    """Runs the graph on the example itself: a graph its own example goes the other way in would stop every step (Note
    [real values export computes]). (trace puts back the RNG and the buffers this run touches.)"""
    try:
        with torch.no_grad():
            gm(*example)
    except Exception as e:  # anything else is the pipeline's to meet, as the plain model's
        if _OTHER_WAY in str(e):
            raise ExportRouteError(f"torch.export, taking a branch on a tensor's value the example's way, took it the "
                                   f"other way: torch reads values beside the fake tensors unreliably where they come "
                                   f"from parameters ({e}); write the branch without Python control flow on tensor "
                                   f"values (torch.where, torch.cond)") from e


# Note [export's partial graph on stderr]: torch prints the partial graph of a failed export to stderr
# (export/_trace.py); on the way to a second attempt that is noise the user cannot act on, so stderr is passed on
# without it.
def _exported(model: nn.Module, root: nn.Module, example: tuple[torch.Tensor, ...],
              shapes: tuple) -> torch.export.ExportedProgram:
    """torch.export's program; what it prints to stderr is passed on, but for the partial graph of a failed export
    (Note [export's partial graph on stderr])."""
    said, graph = io.StringIO(), ""
    try:
        with module_state_kept(model), warnings.catch_warnings(), contextlib.redirect_stderr(said):
            warnings.filterwarnings("ignore", "The tensor attribute")  # said once, by compile, with what it means here
            return torch.export.export(root, example, strict=False, dynamic_shapes=shapes)
    except Exception as e:
        graph = str(e.partial_fx_graph) if getattr(e, "partial_fx_graph", None) is not None else ""
        raise
    finally:
        sys.stderr.write(said.getvalue().replace(graph + "\n", "") if graph else said.getvalue())


_OTHER_WAY = "autopipe: a micro-batch goes the other way"  # how a kept check's message starts


# Note [branches taken the example's way]: where fx and export both stop at a branch on a tensor's value, we
# export again with real values beside the fake ones (draft_export's mode): a guard on an unbacked symbol takes
# the example's value, and ShapeEnv turns it into a deferred runtime assert. This log filter hears each decision
# while it is made, so the Python stack is the model's: that names the branch's line. Those asserts stay in the
# graph with that line in their message (export's other checks are dropped); partition never replicates them.
class BranchesTaken(logging.Filter):
    """Export with real tensors beside the fake ones (Note [branches taken the example's way]): this filter hears
    ShapeEnv's warning at each decision (symbolic_shapes.py, ShapeEnv._evaluate_expr), and ``where`` names each
    unbacked symbol's branch; the kept asserts make each micro-batch check that it goes the way the graph holds."""

    def __init__(self, model: nn.Module):
        super().__init__()
        # an unbacked symbol (u0) -> (where its branch is, the expression, the value it took)
        self.model, self.where = model, {}
        self.checked: set[str] = set()  # the symbols a kept assert checks
        self.logger = logging.getLogger("torch.fx.experimental.symbolic_shapes")

    def __enter__(self) -> BranchesTaken:
        self.logger.addFilter(self)
        return self

    def __exit__(self, *exc):
        self.logger.removeFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith("propagate_real_tensors evaluate_expr"):
            return False  # torch's chatter about an export that stops at such a branch, told by its exception
        expr, value = record.args
        for symbol in sorted(map(str, expr.free_symbols)):
            self.where.setdefault(symbol, (user_frame(None, self.model), expr, value))
        return False  # heard here, told by the guard's message and the plan's note

    def guards(self, node: fx.Node) -> bool:
        """Is ``node`` a runtime assert of a branch taken here? Then its message says, to a user, which branch and what
        to do."""
        if node.op != "call_function" or op_name(node.target) != "_assert_scalar" or len(node.args) < 2:
            return False
        symbols = [u for u in re.findall(r"\bu\d+\b", str(node.args[1])) if u in self.where]
        if not symbols:
            return False
        self.checked.update(symbols)
        where, expr, value = self.where[symbols[0]]
        # bool(tensor): .item() of a bool is 1
        truth = isinstance(expr, sympy.Eq) and expr.lhs.is_Symbol and expr.rhs == 1
        reads = " and ".join(sorted(map(str, expr.free_symbols)))
        tested = f"the tensor it tests was {value}" if truth else f"{expr} was {value}, {reads} being what it reads"
        node.meta["branch_taken"] = (f"a branch on a tensor's value{where or ' (source not found)'} was traced the way "
                                     f"the example inputs took ({tested})")
        node.args = (node.args[0], f"{_OTHER_WAY} than the compiled graph: {node.meta['branch_taken']}, and a graph "
                                   f"holds one way. Compile with example inputs that go the way training goes, or "
                                   f"write the branch without Python control flow on tensor values (torch.where, "
                                   f"torch.cond)")
        return True


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
