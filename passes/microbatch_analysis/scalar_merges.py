"""How each 0-dim float output (a loss) merges over micro-batches: "mean", "sum", "count" (a cross-entropy's mean over
the targets it does not ignore, weighted by each micro-batch's count of them) or "unknown" (Note [scalar merges])."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.fx as fx

from autopipe.ir.plan import TargetCount
from autopipe.random_ops import bind, is_random_target, op_name, signature_of

from .facts import is_inplace, rows_per_sample

_LOSSES = frozenset({"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "kl_div",
                     "binary_cross_entropy_with_logits", "soft_margin_loss", "multilabel_soft_margin_loss",
                     "poisson_nll_loss", "gaussian_nll_loss", "cosine_embedding_loss", "margin_ranking_loss"})
# their mean is over the targets not ignored (ignore_index) or weighed by class weights: no merge of micro-batch means
_TARGET_MEANS = frozenset({"cross_entropy", "cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d_forward",
                           "nll_loss_nd", "CrossEntropyLoss", "NLLLoss"})
_PASS_THROUGH = frozenset({"to", "type", "float", "double", "half", "bfloat16", "clone", "contiguous", "view",
                           "reshape", "squeeze", "neg", "getitem", "_to_copy", "alias"})
# in-place ops read as their out-of-place op; torch.nn's loss modules (fx keeps them whole) as their functions
_READ_AS = {"itruediv": "truediv", "imul": "mul", "iadd": "add", "isub": "sub", "add_": "add", "sub_": "sub",
            "mul_": "mul", "div_": "div", "MSELoss": "mse_loss", "L1Loss": "l1_loss", "SmoothL1Loss": "smooth_l1_loss",
            "HuberLoss": "huber_loss", "BCELoss": "binary_cross_entropy",
            "BCEWithLogitsLoss": "binary_cross_entropy_with_logits", "KLDivLoss": "kl_div"}


# Note [scalar merges]: a 0-dim output merges as the graph reduces it: a mean over samples as the size-weighted
# mean; a sum, or a sum over a number the batch does not set (num_items_in_batch), as the sum (the weighted mean
# gave half the loss at chunks=2); a mean over what the inputs alone select (a cross-entropy mean over class-index
# targets, x[mask].mean()) by each micro-batch's count of it, counted before the step. Anything else is "unknown":
# the weighted mean, with a plan note. verify merges as the plan says, never by a rule of its own.
def scalar_merges(gm: fx.GraphModule,
                  from_batch: set[fx.Node]) -> tuple[dict[fx.Node, str], dict[fx.Node, TargetCount]]:
    """How each 0-dim float output merges over micro-batches: "mean" (a mean over samples, or no batch in it: the
    size-weighted mean), "sum" (a sum over samples, or one divided by a number the batch does not set, as Hugging Face's
    ``num_items_in_batch``), "count" (a cross-entropy's mean over the targets it does not ignore, whose targets come
    from the inputs alone: weighted by each micro-batch's count of them, the second result), or "unknown"."""
    counted: dict[fx.Node, TargetCount] = {}  # a "count" node -> how a micro-batch counts its targets
    carried: dict[fx.Node, list[fx.Node]] = {}  # a counted node -> the counted values it is computed from

    def kind(n, reader: fx.Node | None = None) -> str:
        if not isinstance(n, fx.Node) or n not in from_batch:
            return "mean"
        if any(u is not reader and u.args[:1] == (n,) and is_inplace(u) for u in n.users):
            return "unknown"  # written in place after it was read here
        name = _READ_AS.get(op := _op_of(gm, n), op)
        first = n.args[0] if n.args else None
        if name in ("mean", "sum") and rows_per_sample(first) == 1 and not n.meta["val"].dim():
            return name
        if _over_elements(gm, n, name) and (count := _selected_rows_count(gm, first, name)) is not None:
            counted[n] = count
            return "count"
        if name in _TARGET_MEANS and _reduction(gm, n) == "mean" and (count := _target_count(gm, n)) is not None:
            counted[n] = count
            return "count"
        if (name in _LOSSES or name in _TARGET_MEANS) and rows_per_sample(first) == 1:
            how = _reduction(gm, n)
            return "sum" if how == "sum" else "mean" if how in ("mean", "batchmean") and name in _LOSSES else "unknown"
        if name in _PASS_THROUGH:
            return carry(n, kind(first, n), first)
        if name in ("div", "truediv", "mul") and len(n.args) == 2:
            a, b = n.args
            if name == "mul" and a not in from_batch:
                a, b = b, a
            if b not in from_batch:
                if (n.meta.get("batch_literal") or n.meta.get("literals_unknown")) and not isinstance(b, fx.Node):
                    return "unknown"
                return carry(n, kind(a, n), a)
            if name != "mul" and _batch_size_of(b) and kind(a, n) == "sum":
                return "mean"  # a sum over samples over the batch size (x.size(0)): their mean
        if name in ("add", "sub") and len(n.args) == 2:
            operands = [a for a in n.args if a in from_batch]
            kinds = {kind(a, n) for a in operands}
            constant = any(a not in from_batch for a in n.args)
            if kinds == {"mean"} or kinds == {"sum"} and not constant:
                return kinds.pop()
            if kinds == {"count"} and not constant and len({counted[a] for a in operands}) == 1:
                return carry(n, "count", *operands)  # two means over the same count: their sum is one
        return "unknown"

    def carry(n: fx.Node, how: str, *sources: Any) -> str:  # a view, cast or constant factor of a counted mean
        if how == "count":
            counted[n], carried[n] = counted[sources[0]], list(sources)
        return how

    def last_write(n: fx.Node) -> fx.Node:  # loss.div_(n) without "loss =": the output node is the one before
        while writes := [u for u in n.users if u.args[:1] == (n,) and is_inplace(u)]:
            n = writes[-1]
        return n

    output = next(n for n in gm.graph.nodes if n.op == "output")
    merges = {n: kind(last_write(n)) for n in output.all_input_nodes
              if isinstance(v := n.meta.get("val"), torch.Tensor) and v.dim() == 0 and v.is_floating_point()}
    # only what an output merged by count is computed from: a counted mean that reaches an output otherwise (added to
    # a load-balancing loss) merges by no count, and stays refused where it reads rows a mask selected
    reached, todo = {}, [last_write(n) for n, how in merges.items() if how == "count"]
    while todo:
        if (n := todo.pop()) not in reached:
            reached[n] = counted[n]
            todo.extend(carried.get(n, []))
    return merges, reached


def _op_of(gm: fx.GraphModule, n: fx.Node) -> str:
    """The op's name; a module's class name (fx keeps torch.nn's losses whole)."""
    if n.op == "call_module":
        return type(gm.get_submodule(n.target)).__name__
    return n.target if n.op == "call_method" else op_name(n.target) if n.op == "call_function" else ""


def _reduction(gm: fx.GraphModule, n: fx.Node) -> str:
    """A loss's reduction: "none", "mean", "sum", "batchmean", or "unknown"."""
    if n.op == "call_module":
        return gm.get_submodule(n.target).reduction
    try:
        bound = signature_of(n.target).bind(*n.args, **n.kwargs)
    except (TypeError, AttributeError):
        return "unknown"
    bound.apply_defaults()
    if bound.arguments.get("size_average") is not None or bound.arguments.get("reduce") is not None:
        return "unknown"  # the deprecated way to say the reduction
    how = bound.arguments.get("reduction", "mean")
    return {0: "none", 1: "mean", 2: "sum"}.get(how, how)  # aten's enum, or F's string


def _batch_size_of(b: fx.Node) -> bool:
    """``b`` is the batch size: dim 0 of a tensor of one row a sample (``x.size(0)``)."""
    sizes = b.op == "call_function" and op_name(b.target) == "sym_size" or b.op == "call_method" and b.target == "size"
    return sizes and b.args[1:2] in ((0,), [0]) and rows_per_sample(b.args[0]) == 1


def _target_count(gm: fx.GraphModule, n: fx.Node) -> TargetCount | None:
    """How a micro-batch counts the targets of a mean-reduced cross-entropy or NLL node ``n``: possible where its
    targets are class indices computed from the model's inputs alone (``labels[:, 1:]``, ``labels[labels != -100]``), so
    that every micro-batch's count is known before its loss runs, and its class weights are a tensor the model holds."""
    if n.op == "call_module":
        module = gm.get_submodule(n.target)
        target = n.args[1] if len(n.args) > 1 else n.kwargs.get("target")
        ignore_index = module.ignore_index
        weight = f"{n.target}.weight" if getattr(module, "weight", None) is not None else None
    else:
        bound = bind(n.target, n.args, n.kwargs) or {}
        target, ignore_index, weight = bound.get("target"), bound.get("ignore_index", -100), bound.get("weight")
        if isinstance(weight, fx.Node):
            weight = weight.target if weight.op == "get_attr" else False
    if weight is False or not isinstance(target, fx.Node) or not isinstance(ignore_index, int) \
            or not _from_inputs_alone(gm, target):
        return None
    val = target.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.is_floating_point() or val.dtype == torch.bool:
        return None  # class probabilities: a mean over rows
    return TargetCount(target=target.name, ignore_index=ignore_index, weight=weight)


def _over_elements(gm: fx.GraphModule, n: fx.Node, name: str) -> bool:
    """``n`` averages its first argument into one number: ``x.mean()``, or a loss reducing by "mean" or "batchmean"."""
    if name == "mean":
        return not n.meta["val"].dim()
    return name in _LOSSES and _reduction(gm, n) in ("mean", "batchmean")


def _selected_rows_count(gm: fx.GraphModule, x: Any, name: str) -> TargetCount | None:
    """How a micro-batch counts what a mean over ``x``, rows a boolean mask computed from the inputs alone selected
    (``h[labels != -100]``, row-wise ops after it), divides by: the mask's true entries times a row's elements (one
    for kl_div's "batchmean"). None for anything else: such a mean stays refused (selections.py)."""
    def selected(v: Any) -> bool:
        return isinstance(v, fx.Node) and (v.meta.get("selected_rows") or (None,))[0] == 0

    if not selected(x):
        return None
    node = x
    while (mask := _selecting_mask(node)) is None:
        node = next((a for a in node.all_input_nodes if selected(a)), None)
        if node is None:
            return None
    if not _from_inputs_alone(gm, mask):
        return None
    per_row = math.prod(int(d) for d in x.meta["val"].shape[1:]) if name != "kl_div" else 1
    return TargetCount(target=mask.name, per_row=per_row)


def _selecting_mask(n: fx.Node) -> fx.Node | None:
    """The boolean mask ``n`` selects rows by, as its only index, over its leading dims (``x[mask]``)."""
    if op_name(n.target) not in ("getitem", "index") or len(n.args) < 2:
        return None
    index = n.args[1] if isinstance(n.args[1], (tuple, list)) else (n.args[1],)
    nodes = [i for i in index if isinstance(i, fx.Node)]
    first = index[0] if index else None
    if len(nodes) != 1 or first is not nodes[0] or getattr(first.meta.get("val"), "dtype", None) != torch.bool:
        return None
    return first


def _from_inputs_alone(gm: fx.GraphModule, n: fx.Node) -> bool:
    """``n`` is computed from the graph's inputs and constants by functions alone: no parameter, module or random op,
    so it can be computed before the step (passes/target_counts.py's ``count_program``)."""
    seen, todo = set(), [n]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        parameter = m.op == "get_attr" and isinstance(_attr(gm, m.target), torch.nn.Parameter)
        if m.op in ("call_module", "output") or parameter \
                or m.op in ("call_function", "call_method") and is_random_target(m.target):
            return False
        todo.extend(m.all_input_nodes)
    return True


def _attr(gm: fx.GraphModule, qualified: str) -> Any:
    owner, _, attr = qualified.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, attr, None)
