"""The partition pass: a costed graph -> a CutProblem for passes/cut_solver.py -> a Plan. Replicated cheap nodes,
getitems kept with their producers, tied weights: docs/architecture.md, "Contracts between passes"."""
from __future__ import annotations

import math
import operator
from typing import Any, Sequence

import numpy as np
import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopipe.plan import Plan, StagePlan, TargetCount, TensorInfo
from autopipe.random_ops import aten_overloads, bind, is_random_target, op_name, signature_of
from .cost import CostedGraph
from .custom_gradients import FunctionCall
from .cut_solver import CutProblem, CutSolution, NoFeasiblePlan, solve_cuts
from .trace import node_where

__all__ = ["partition", "NoFeasiblePlan", "CutProblem", "CutSolution", "solve_cuts"]


def partition(costed: CostedGraph, n_stages: int, *, devices: Sequence[torch.device] | None = None, chunks: int = 1,
              balance: str | Sequence[float] = "flops", tolerance: float = 0.03, memory_cap: float | None = None, notes: Sequence[str] = ()) -> Plan:
    gm = costed.traced.graph_module
    every = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    outputs = [a for a in next(n for n in gm.graph.nodes if n.op == "output").args[0] if isinstance(a, fx.Node)]
    weight_of = dict(zip(every, _weights(costed, every, balance)))
    free = _replicable(gm, weight_of, set(outputs), n_stages)
    # a getitem of a tuple (qkv.split(...)[0]) joins its producer's group: no tuple carrying its autograd graph crosses a cut
    group_of: dict[fx.Node, fx.Node] = {}
    groups: dict[fx.Node, list[fx.Node]] = {}
    for n in (n for n in every if n not in free):
        source = n.args[0] if n.args else None
        part = (n.op == "call_function" and n.target is operator.getitem and isinstance(source, fx.Node)
                and source in group_of and not isinstance(source.meta.get("val"), torch.Tensor))
        group_of[n] = group_of[source] if part else n
        groups.setdefault(group_of[n], []).append(n)
    order = _varying_sizes_kept_whole(list(groups), groups)
    if n_stages > len(order):
        raise ValueError(f"{n_stages} stages asked for, but the traced graph has only {len(order)} operations to "
                         f"spread over them; use at most {max(len(order), 1)} devices")
    index = {m: i for i, n in enumerate(order) for m in groups[n]}
    consumers, out_bytes = [], []
    for i, n in enumerate(order):
        # only tensors count: sizes and other Python values travel for free in-process
        crossing = [m for m in groups[n] if _is_tensor_valued(m) and (isinstance(m.meta.get("val"), torch.Tensor) or len(groups[n]) == 1)]
        users = {index[u] for m in crossing for u in m.users if u in index}
        if any(m in outputs for m in crossing):
            users.add(len(order) - 1)  # model outputs travel to the last stage
        consumers.append(sorted(users - {i}))
        out_bytes.append(sum(costed.costs[m.name].out_bytes for m in crossing))
    shared = None
    if memory_cap is not None:  # a parameter once per stage that reads it, with its gradient and Adam's two states
        readers: dict[str, set[int]] = {}
        for m, i in index.items():
            for p in costed.costs[m.name].params:
                readers.setdefault(p, set()).add(i)
        shared = [(costed.tensor_bytes[p] * (4.0 if _is_param(gm, p) else 1.0), sorted(r)) for p, r in readers.items()]
    weights = [sum(weight_of[m] for m in groups[n]) for n in order]
    if isinstance(balance, str):
        solution = solve_cuts(CutProblem(weights=weights, out_bytes=out_bytes, consumers=consumers, n_stages=n_stages, tolerance=tolerance,
                                         shared_memory=shared, memory_cap=memory_cap, activation_multiplier=float(chunks)))
        starts, optimum = list(solution.starts), solution.optimum
    else:
        starts, optimum = _split_by_shares(weights, list(balance), n_stages), float("nan")
    ends = starts[1:] + [len(order)]
    stage_of = {m: s for s in range(n_stages) for n in order[starts[s]:ends[s]] for m in groups[n]}
    plan = _build_plan(costed, stage_of, free, weight_of, n_stages, devices, chunks, balance, tolerance, optimum, outputs)
    plan.notes.extend(notes)
    plan.notes.extend(f"output {name}: a number from the whole micro-batch that autopipe cannot read as a mean or a sum over its samples (a mean over the "
                      f"targets a loss does not ignore, a load-balancing loss): merged as the size-weighted mean of the micro-batches' values, as gradient "
                      f"accumulation by hand does: the plain model's value only for a mean over samples that weigh the same in every micro-batch (no ignored "
                      f"targets), not for a product of batch means (a load-balancing loss); a loss summed and divided by the whole batch's count (Hugging "
                      f"Face's num_items_in_batch) merges exactly"
                      for name, info in plan.tensors.items() if chunks > 1 and info.is_output and info.scalar_merge == "unknown")
    plan.notes.extend(f"output {name}: a mean over the targets {info.count.target} not equal to {info.count.ignore_index}"
                      f"{' weighed by ' + info.count.weight if info.count.weight else ''}: merged exactly, each micro-batch's mean "
                      f"weighted by its count of them over the batch's (counted from the inputs before the step)"
                      for name, info in plan.tensors.items() if chunks > 1 and info.is_output and info.count)
    return plan


def _varying_sizes_kept_whole(order: list[fx.Node], groups: dict[fx.Node, list[fx.Node]]) -> list[fx.Node]:
    """The groups from a value whose size depends on values (trace's "data_dependent": x[mask]) to its last reader become one: no cut carries
    it, as no receiver could size it ahead (its size differs between micro-batches and steps). ``groups`` is updated."""
    index = {m: i for i, n in enumerate(order) for m in groups[n]}
    kept: list[fx.Node] = []
    end = -1
    for i, n in enumerate(order):
        members = groups[n]
        if i > end:
            kept.append(n)
        else:
            groups[kept[-1]] += groups.pop(n)
        end = max([end, *(index.get(u, i) for m in members if m.meta.get("data_dependent") for u in m.users)])
    return kept


def _weights(costed: CostedGraph, nodes: list, balance) -> list[float]:
    if balance == "params":  # each parameter weighs at its first reader
        seen: set[str] = set()
        weights = []
        for n in nodes:
            fresh = set(costed.costs[n.name].params) - seen
            seen |= fresh
            weights.append(float(sum(costed.tensor_bytes[p] for p in fresh)))
        return weights
    if balance == "time":  # measured by compile, which refuses a meta model first
        return [costed.costs[n.name].seconds for n in nodes]
    return [float(costed.costs[n.name].flops) for n in nodes]


def _split_by_shares(weights: list[float], shares: list[float], n_stages: int) -> list[int]:
    """A user-given share of the work per stage: cut where the running cost crosses each share."""
    if len(shares) != n_stages or any(s <= 0 for s in shares):
        raise ValueError(f"balance as a list needs {n_stages} positive per-stage weights, got {shares}")
    targets = np.cumsum(np.array(shares) / sum(shares))[:-1] * (sum(weights) or 1.0)
    starts = [0] + [int(i) + 1 for i in np.searchsorted(np.cumsum(weights), targets)]
    for s in range(1, n_stages):  # every stage non-empty
        starts[s] = min(max(starts[s], starts[s - 1] + 1), len(weights) - n_stages + s)
    return starts


def _replicable(gm: fx.GraphModule, weight_of: dict[fx.Node, float], outputs: set, n_stages: int) -> set[fx.Node]:
    """Cheap nodes of graph inputs and buffers only (masks, position ids): each reading stage recomputes them."""
    budget = 0.01 * sum(weight_of.values()) / n_stages
    free: set[fx.Node] = set()

    def constant(a: fx.Node) -> bool:
        return a.op == "placeholder" or a in free or (a.op == "get_attr" and not _is_param(gm, a.target))

    for n, weight in weight_of.items():
        if (weight <= budget and n not in outputs and n.op != "call_module" and not is_random_target(n.target) and not _is_inplace(n)
                and op_name(n.target) != "_assert_scalar" and all(map(constant, n.all_input_nodes))):  # a check is read by no stage
            free.add(n)
    return free


def _is_inplace(n: fx.Node) -> bool:
    return ((n.op == "call_method" and n.target.endswith("_")) or n.target is operator.setitem
            or (isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable))


def _is_param(gm: fx.GraphModule, name: str) -> bool:
    module, _, leaf = name.rpartition(".")
    return isinstance(getattr(gm.get_submodule(module), leaf, None), torch.nn.Parameter)


def _is_tensor_valued(n: fx.Node) -> bool:
    val = n.meta.get("val")
    return any(isinstance(v, torch.Tensor) for v in (val if isinstance(val, (list, tuple)) else [val]))


def _build_plan(costed, stage_of, free, weight_of, n_stages, devices, chunks, balance, tolerance, optimum, output_args) -> Plan:
    gm = costed.traced.graph_module
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    nodes = [n for n in gm.graph.nodes if n in stage_of or n in free]
    devices = list(devices) if devices is not None else [torch.device("cpu")] * n_stages
    from_batch = _from_batch(gm)
    merges, counted = _scalar_merges(gm, from_batch)
    together = _samples_together(gm, from_batch)
    interleaved = _interleaved_rows(gm)
    misread, selected = _selections_misread(gm, from_batch, interleaved, set(counted))
    mixed = _samples_mixed(gm, from_batch, interleaved, misread)
    readers: dict[fx.Node, set[int]] = {}  # the stages that read each value; a replicated node's are its readers'
    for n in reversed(placeholders + nodes):
        readers[n] = set().union(*(readers[u] if u in free else {stage_of[u]} for u in n.users if u in free or u in stage_of))
    tensors: dict[str, TensorInfo] = {}
    inputs, sent, replicated = ([[] for _ in range(n_stages)] for _ in range(3))
    for n in placeholders + nodes:
        if n in free:
            for s in sorted(readers[n]):
                replicated[s].append(n.name)
            continue
        s = stage_of.get(n, -1)
        later = sorted(readers[n] - {s})
        assert not later or later[0] > s, f"node {n.name} feeds an earlier stage: the order is not topological"
        if later or n in output_args or s < 0:
            tensors[n.name] = _info(n, s, later, n in output_args, merges.get(n, "mean"), n in together, mixed.get(n, ()),
                                    counted.get(n), n in selected)
            if s >= 0:
                sent[s].append(n.name)
            for c in later:
                inputs[c].append(n.name)
    param_stages: dict[str, set[int]] = {}
    for n in nodes:
        for p in costed.costs[n.name].params:
            param_stages.setdefault(p, set()).update(readers[n] if n in free else {stage_of[n]})
    stages = []
    for s in range(n_stages):
        own = [n for n in nodes if stage_of.get(n) == s]
        params = sorted(p for p, st in param_stages.items() if s in st)
        stages.append(StagePlan(
            index=s, device=torch.device(devices[s]), nodes=tuple(n.name for n in own), replicated=tuple(replicated[s]),
            inputs=tuple(inputs[s]), outputs=tuple(sent[s]), params=tuple(params), param_bytes=sum(costed.tensor_bytes[p] for p in params),
            flops=sum(costed.costs[n.name].flops for n in own), cost=sum(weight_of[n] for n in own)))
    weights = [weight_of[n] for n in stage_of]  # every owned node (a group: its node and its getitems)
    return Plan(
        stages=stages, tensors=tensors, graph_inputs=[p.name for p in placeholders], graph_outputs=[a.name for a in output_args],
        chunks=chunks, balance=balance if isinstance(balance, str) else f"shares {list(balance)}", route=costed.traced.route,
        lower_bound=max(sum(weights) / n_stages, max(weights, default=0.0)), optimum=optimum, tolerance=tolerance,
        shared_params={p: tuple(sorted(st)) for p, st in param_stages.items() if len(st) > 1 and _is_param(gm, p)},
        across_micro_batches=_across_micro_batches(gm) if chunks > 1 else [])


_LOSSES = frozenset({"mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss", "binary_cross_entropy", "kl_div",
                     "binary_cross_entropy_with_logits", "soft_margin_loss", "multilabel_soft_margin_loss",
                     "poisson_nll_loss", "gaussian_nll_loss", "cosine_embedding_loss", "margin_ranking_loss"})
# their mean is over the targets not ignored (ignore_index) or weighed by class weights: no merge of micro-batch means
_TARGET_MEANS = frozenset({"cross_entropy", "cross_entropy_loss", "nll_loss", "nll_loss_forward", "nll_loss2d_forward",
                           "nll_loss_nd", "CrossEntropyLoss", "NLLLoss"})
_PASS_THROUGH = frozenset({"to", "type", "float", "double", "half", "bfloat16", "clone", "contiguous", "view",
                           "reshape", "squeeze", "neg", "getitem", "_to_copy", "alias"})
# in-place ops read as their out-of-place op; torch.nn's loss modules (fx keeps them whole) as their functions
_READ_AS = {"itruediv": "truediv", "imul": "mul", "iadd": "add", "isub": "sub", "add_": "add", "sub_": "sub", "mul_": "mul",
            "div_": "div", "MSELoss": "mse_loss", "L1Loss": "l1_loss", "SmoothL1Loss": "smooth_l1_loss", "HuberLoss": "huber_loss",
            "BCELoss": "binary_cross_entropy", "BCEWithLogitsLoss": "binary_cross_entropy_with_logits", "KLDivLoss": "kl_div"}


def _scalar_merges(gm: fx.GraphModule, from_batch: set[fx.Node]) -> tuple[dict[fx.Node, str], dict[fx.Node, TargetCount]]:
    """How each 0-dim float output merges over micro-batches: "mean" (a mean over samples, or no batch in it: the size-weighted mean), "sum" (a sum
    over samples, or one divided by a number the batch does not set, as Hugging Face's ``num_items_in_batch``), "count" (a cross-entropy's mean
    over the targets it does not ignore, whose targets come from the inputs alone: weighted by each micro-batch's count of them, the second
    result), or "unknown"."""
    counted: dict[fx.Node, TargetCount] = {}  # a "count" node -> how a micro-batch counts its targets

    def reduction(n: fx.Node) -> str:
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

    def kind(n, reader: fx.Node | None = None) -> str:
        if not isinstance(n, fx.Node) or n not in from_batch:
            return "mean"
        if any(u is not reader and u.args[:1] == (n,) and _is_inplace(u) for u in n.users):
            return "unknown"  # written in place after it was read here
        if n.op == "call_module":
            name = type(gm.get_submodule(n.target)).__name__
        else:
            name = n.target if n.op == "call_method" else op_name(n.target) if n.op == "call_function" else ""
        name = _READ_AS.get(name, name)
        first = n.args[0] if n.args else None
        if name in ("mean", "sum") and rows_per_sample(first) == 1 and not n.meta["val"].dim():
            return name
        if name in _TARGET_MEANS and reduction(n) == "mean" and (count := _target_count(gm, n)) is not None:
            counted[n] = count
            return "count"
        if (name in _LOSSES or name in _TARGET_MEANS) and rows_per_sample(first) == 1:
            how = reduction(n)
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
            sizes = b.op == "call_function" and op_name(b.target) == "sym_size" or b.op == "call_method" and b.target == "size"
            if name != "mul" and sizes and b.args[1:2] in ((0,), [0]) and rows_per_sample(b.args[0]) == 1 and kind(a, n) == "sum":
                return "mean"  # a sum over samples over the batch size (x.size(0)): their mean
        if name in ("add", "sub") and len(n.args) == 2:
            kinds = {kind(a, n) for a in n.args if a in from_batch}
            constant = any(a not in from_batch for a in n.args)
            if kinds == {"mean"} or kinds == {"sum"} and not constant:
                return kinds.pop()
        return "unknown"

    def carry(n: fx.Node, how: str, source: Any) -> str:  # a view, cast or constant factor of a counted mean is counted the same
        if how == "count":
            counted[n] = counted[source]
        return how

    def last_write(n: fx.Node) -> fx.Node:  # loss.div_(n) without "loss =": the output node is the one before
        while writes := [u for u in n.users if u.args[:1] == (n,) and _is_inplace(u)]:
            n = writes[-1]
        return n

    output = next(n for n in gm.graph.nodes if n.op == "output")
    merges = {n: kind(last_write(n)) for n in output.all_input_nodes
              if isinstance(v := n.meta.get("val"), torch.Tensor) and v.dim() == 0 and v.is_floating_point()}
    return merges, counted


def _target_count(gm: fx.GraphModule, n: fx.Node) -> TargetCount | None:
    """How a micro-batch counts the targets of a mean-reduced cross-entropy or NLL node ``n``: possible where its targets are class
    indices computed from the model's inputs alone (``labels[:, 1:]``, ``labels[labels != -100]``), so that every micro-batch's
    count is known before its loss runs, and its class weights are a tensor the model holds."""
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
    if weight is False or not isinstance(target, fx.Node) or not isinstance(ignore_index, int) or not _from_inputs_alone(gm, target):
        return None
    val = target.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.is_floating_point() or val.dtype == torch.bool:
        return None  # class probabilities: a mean over rows
    return TargetCount(target=target.name, ignore_index=ignore_index, weight=weight)


def _from_inputs_alone(gm: fx.GraphModule, n: fx.Node) -> bool:
    """``n`` is computed from the graph's inputs and constants by functions alone: no parameter, module or random op, so
    it can be computed before the step (passes/codegen.py's ``count_program``)."""
    seen, todo = set(), [n]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        if m.op in ("call_module", "output") or m.op == "get_attr" and isinstance(_attr(gm, m.target), torch.nn.Parameter) \
                or m.op in ("call_function", "call_method") and is_random_target(m.target):
            return False
        todo.extend(m.all_input_nodes)
    return True


def _attr(gm: fx.GraphModule, qualified: str) -> Any:
    owner, _, attr = qualified.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, attr, None)


# a new shape over the same row-major order: a sample's rows stay together
_RESHAPES = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "view_as", "reshape_as", "squeeze", "unsqueeze",
                       "contiguous", "clone", "detach", "alias", "to", "_to_copy", "type", "type_as", "float", "double", "half", "bfloat16"})
# row-wise unless along dim 0 (``dim``), or over every dim (``normalized_shape``)
_ALONG_DIMS = frozenset({"softmax", "log_softmax", "_softmax", "_log_softmax", "sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "topk",
                         "sort", "argsort", "norm", "logsumexp", "cumsum", "var", "std", "normalize", "split", "chunk", "unbind", "select", "slice", "narrow",
                         "index_select", "gather", "dropout", "native_dropout", "layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm"})
_ON_ROWS = frozenset({"linear", "mm", "addmm", "matmul", "bmm", "baddbmm", "embedding", "conv1d", "conv2d", "conv3d", "convolution"})
_ROW_MODULES = (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm, torch.nn.RMSNorm, torch.nn.modules.dropout._DropoutNd,
                torch.nn.Identity, torch.nn.ReLU, torch.nn.GELU, torch.nn.SiLU, torch.nn.Tanh, torch.nn.Sigmoid)


def _samples_together(gm: fx.GraphModule, from_batch: set[fx.Node]) -> set[fx.Node]:
    """Values whose dim 0 holds k rows a sample (k > 1) with each sample's rows together, so that micro-batch parts concatenate to the plain model's
    value: MoE router logits, ``logits.view(-1, V)`` (the rules, and what is not shown: docs/architecture.md, "Pitfalls measured")."""
    together: set[fx.Node] = set()
    poisoned: set[fx.Node] = set()

    def rows_of(n: Any) -> int | None:
        val = n.meta.get("val") if isinstance(n, fx.Node) else None
        return int(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() else None

    def keeps_rows(n: fx.Node, k: int) -> bool:  # n's tensor operands give a result of k rows a sample, row by row
        operands = [a for a in n.all_input_nodes if a.op != "get_attr" and isinstance(a.meta.get("val"), torch.Tensor)]
        if not operands or n.op not in ("call_function", "call_method", "call_module"):
            return False
        first, others = operands[0], operands[1:]
        if n.op == "call_module":
            module = gm.get_submodule(n.target)
            name = "module" if isinstance(module, _ROW_MODULES) else type(module).__name__
        else:
            name = op_name(n.target)
        if name in _RESHAPES:
            return first in together or rows_per_sample(first) == 1
        if first not in together or rows_per_sample(first) != k or n.meta.get("batch_literal") or \
                any(a.meta.get("batch_number") for a in n.all_input_nodes):
            return False  # y * y.shape[0]: a number that differs between micro-batches
        if name in _ON_ROWS:  # a 2-D operand with these rows would be summed over them
            return all(a not in from_batch or (a.meta["val"].dim() > 2 and a in together and rows_per_sample(a) == k) for a in others)
        if name in _ALONG_DIMS:
            bound, ndim = bind(n.target, n.args, n.kwargs) or {}, first.meta["val"].dim()
            dims = bound.get("dim")
            if name == "slice" and bound.get("start") in (0, None) and (bound.get("end") or rows_of(first)) >= rows_of(first) and bound.get("step", 1) == 1:
                dims = None  # export's x[:, ...]: all of dim 0
            if dims is None and name in ("softmax", "log_softmax"):
                dims = 0 if ndim in (0, 1, 3) else 1  # F.softmax's implicit dim (torch/nn/functional.py, _get_softmax_dim)
            if any(d % ndim == 0 for d in (dims if isinstance(dims, (list, tuple)) else [dims]) if isinstance(d, int)) or \
                    len(bound.get("normalized_shape") or ()) >= ndim:
                return False
        elif name != "module" and not any(torch.Tag.pointwise in o.tags for o in aten_overloads(n.target if n.op == "call_method" else name)):
            return False
        return all(a not in from_batch or (rows_per_sample(a) == k and a in together) for a in others)

    def together_by_getitem(n: fx.Node, k: int) -> bool:
        source, index = n.args
        if isinstance(source.meta.get("val"), (tuple, list)):  # one result of topk, split, ... along another dim
            return keeps_rows(source, k)
        index = index if isinstance(index, tuple) else (index,)  # x[:, ...], x[..., i]: an index that leaves dim 0 whole
        return source in together and rows_per_sample(source) == k and bool(index) and (
            isinstance(index[0], slice) and index[0] == slice(None)
            or index[0] is Ellipsis and sum(i is not None for i in index[1:]) < source.meta["val"].dim())

    views = _views(gm)
    while True:
        together.clear()
        for n in gm.graph.nodes:  # k == 1 is the batch itself, as GPipe takes it
            k = rows_per_sample(n)
            by_getitem = n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node)
            if k > 1 and n not in poisoned and (together_by_getitem(n, k) if by_getitem else keeps_rows(n, k)):
                together.add(n)
        # a write in place to a view of a together value (x[:2] = 0, y.copy_(a sequence-major z)) that is not row by row changes every view of its storage
        written = {views[n.args[0]] for n in gm.graph.nodes if _is_inplace(n) and n.args and isinstance(n.args[0], fx.Node)
                   and rows_per_sample(n.args[0]) != 1 and not (n.args[0] in together and keeps_rows(n, rows_per_sample(n.args[0])))}
        spoilt = {n for n in together if views[n] in written} - poisoned
        if not spoilt:
            return together
        poisoned |= spoilt


# ops whose result shares its input's storage: a write to one changes the other
_VIEWS = _RESHAPES | {"slice", "select", "narrow", "getitem", "transpose", "permute", "t", "expand", "expand_as", "as_strided",
                      "unbind", "split", "chunk", "diagonal", "movedim", "unfold", "view_as_real", "view_as_complex", "split_with_sizes"}


def _views(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Each node -> a representative of the values that may share its storage (views of views of one tensor)."""
    root: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        source = n.args[0] if n.args else None
        is_view = n.op in ("call_function", "call_method") and op_name(n.target) in _VIEWS or n.target is operator.getitem
        root[n] = root.get(source, source) if is_view and isinstance(source, fx.Node) else n
    return root


def _samples_mixed(gm: fx.GraphModule, from_batch: set[fx.Node], interleaved: dict[fx.Node, fx.Node],
                   misread: dict[fx.Node, str]) -> dict[fx.Node, tuple[str, str]]:
    """Each value computed from one that mixes samples -> (that node, how): one holding the batch in two dims (trace's "pairs_samples"), or a
    reshape into rows of samples (one row a sample) of rows that are not in sample order: of a value whose dim 0 is not the batch (row-major order
    puts parts of several samples in a row), or of a flatten of one whose batch is in a later dim (``h.transpose(0, 1).reshape(-1, d)``: rows in
    sequence order, which row-wise ops keep, until a reshape gives a dim 0 that is not the batch again, as attention's (seq, batch, d) round trip)."""
    mixed: dict[fx.Node, tuple[str, str]] = {}
    written: dict[fx.Node, tuple[str, str]] = {}  # a storage (view root) written in place with a value that mixes samples -> how
    views = _views(gm)
    for n in gm.graph.nodes:
        source = n.all_input_nodes[0] if n.op in ("call_function", "call_method") and n.all_input_nodes else None
        reshape, v = op_name(n.target) in _RESHAPES, source.meta.get("val") if source is not None else None
        if mixed_input := next((a for a in n.all_input_nodes if a in mixed or views[a] in written), None):  # named by the first that mixes
            mixed[n] = mixed.get(mixed_input) or written[views[mixed_input]]
        elif n.meta.get("pairs_samples"):
            mixed[n] = (n.name, "holds the batch in two dims: it pairs the samples (contrastive logits u @ v.T, in-batch negatives)")
        elif n in misread:
            mixed[n] = (n.name, misread[n])
        elif (reshape and rows_per_sample(n) == 1 and source in from_batch and not rows_per_sample(source)
              and isinstance(v, torch.Tensor) and v.dim() and v.shape[0] > 1):
            mixed[n] = (n.name, f"reshapes {source.name} {tuple(v.shape)}, whose dim 0 is not the batch, into rows of samples: each row holds "
                                f"parts of several samples (a view with the batch size written in, a flatten of a sequence-first tensor)")
        elif reshape and rows_per_sample(n) == 1 and source in interleaved:
            mixed[n] = (n.name, f"reshapes rows that {interleaved[source].name} made by flattening a tensor whose batch is not in dim 0 (a "
                                f"sequence-first one: rows in sequence order), or by stacking batches along dim 0 (torch.cat(x.unbind(1)), repeat), into "
                                f"rows of samples: each row holds parts of several samples")
        if n in mixed and _is_inplace(n) and isinstance(n.args[0], fx.Node):
            written[views[n.args[0]]] = mixed[n]  # buf[0, :k] = rows: what reads buf after reads them
    return mixed


def _interleaved_rows(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Rows of several samples in turn (k rows a sample in sequence order: a flatten of a tensor whose batch is in a later dim, and row-wise
    ops on them) -> the flatten that made them."""
    interleaved: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        source = n.all_input_nodes[0] if n.op in ("call_function", "call_method") and n.all_input_nodes else None
        v = source.meta.get("val") if source is not None else None
        if rows_per_sample(n) > 1 and op_name(n.target) in _RESHAPES and isinstance(v, torch.Tensor) and (d := source.meta.get("batch_dim", 0)) > 0 \
                and math.prod(v.shape[:d]) > 1 or rows_per_sample(n) > 1 and _stacks_batches(n):
            interleaved[n] = n
        elif rows_per_sample(n) > 1 and (origin := next((interleaved[a] for a in n.all_input_nodes if a in interleaved), None)):
            interleaved[n] = origin
    return interleaved


def _stacks_batches(n: fx.Node) -> bool:
    """Batch rows stacked along dim 0 one batch after another: ``torch.cat(x.unbind(1))``, ``x.repeat(t, 1)``, ``torch.tile``."""
    name, number = op_name(n.target), lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a
    if name in ("cat", "concat", "concatenate", "vstack", "row_stack") and n.args:
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
        parts = n.args[0] if isinstance(n.args[0], (list, tuple)) else n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else ()
        batches = [a for a in parts if rows_per_sample(a)] if isinstance(n.args[0], (list, tuple)) else list(parts or ())  # fx: cat(x.unbind(1))
        return dim == 0 and len(batches) > 1
    if name in ("repeat", "tile") and len(n.args) > 1 and rows_per_sample(n.args[0]):
        times = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else n.args[1:]
        lead = len(times) - n.args[0].meta["val"].dim()  # repeat's extra leading dims count first
        return lead >= 0 and isinstance(number(times[lead]), int) and number(times[lead]) > 1
    return False


# rows selected by value: positions made from a mask, the rows they select, counts of them (passes/trace.py's "data_dependent", "selected_rows")
_POSITIONS = frozenset({"nonzero", "argwhere", "where", "nonzero_numpy"})
_SELECTS = frozenset({"index", "getitem", "index_select", "gather"})
_PUTS_BACK = frozenset({"index_put", "index_put_", "setitem", "index_add", "index_add_", "index_copy", "index_copy_", "index_reduce", "index_reduce_",
                        "scatter", "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_"})
_SIZES_OF_VIEWS = frozenset({"view", "reshape", "_unsafe_view", "expand"})  # ops that may take a count as a size
_POINTWISE_OPERATORS = frozenset({"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_",
                                  "invert", "iadd", "isub", "imul", "itruediv"})  # fx's Python operators on tensors


_SAME_ORDER = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze", "contiguous", "alias", "clone", "detach",
                         "expand", "expand_as", "slice", "getitem"})
_ALONG_DIM_MODULES = (torch.nn.LayerNorm, torch.nn.RMSNorm, torch.nn.Softmax, torch.nn.LogSoftmax)


def _selections_misread(gm: fx.GraphModule, from_batch: set[fx.Node], interleaved: dict[fx.Node, fx.Node],
                        counted: set[fx.Node] = frozenset()) -> tuple[dict[fx.Node, str], set[fx.Node]]:
    """Each node computed from rows selected by value (x[mask], nonzero, torch.where) other than as the plain model computes it, under
    micro-batches -> why; and the values whose dim 0 is rows selected from the batch's rows in their order, which concatenate.
    Proven: positions of a mask over batch rows (each micro-batch numbers its own rows from 0), used only as indices of the
    dims they came from, of batch rows or of selected rows of the same number; the rows they select, computed row by row with their number
    kept, or averaged over by a cross-entropy merged by count (``counted``); their counts only as the sizes of views; and the rows put back
    into batch rows where they were taken. Anything else (arithmetic on the positions, a parameter indexed by them, a mean, sort or slice
    over the rows, a count in arithmetic) would differ between micro-batches."""
    positions: dict[fx.Node, tuple[fx.Node, int | None]] = {}  # -> (its nonzero / where, the dim of the mask it holds; None: all, as (n, ndim))
    rows: dict[fx.Node, fx.Node] = {}  # -> the mask, or nonzero / where, that selected them: row i is its i-th true entry
    counts: set[fx.Node] = set()
    found: dict[fx.Node, str] = {}
    origin_of: dict[fx.Node, fx.Node] = {}  # a selection or put-back -> the mask, or nonzero / where, of its index

    def size(t: fx.Node, d: int) -> tuple[bool, str]:  # (a dim of rows?, its size): the symbol's name where set by values (u0)
        if (sel := t.meta.get("selected_rows")) and sel[0] == d:
            return True, sel[1]
        v = t.meta["val"]  # rows in sequence order (interleaved) are no sample's rows in turn
        return bool((d == 0 and rows_per_sample(t) or t.meta.get("batch_dim") == d) and t not in interleaved), str(int(v.shape[d]))

    def indexed(n: fx.Node, name: str) -> tuple[Any, list[tuple[int, Any]]] | None:  # (the tensor indexed, [(its dim, the index)])
        bound = bind(n.target, n.args, n.kwargs) or {}
        if name in ("index_select", "gather") or name.startswith(("index_add", "index_copy", "index_reduce", "scatter")):
            return n.args[0], [(bound.get("dim", 0), bound.get("index"))]
        if name in ("index", "index_put", "index_put_"):
            return (n.args[0], [(p, i) for p, i in enumerate(n.args[1]) if i is not None]) if isinstance(n.args[1], (list, tuple)) else None
        index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)  # getitem / setitem: x[mask, 2:], x[:, j]
        pairs, d = [], 0
        for i in index:
            if i is Ellipsis:
                return None
            if isinstance(i, fx.Node):
                pairs.append((d, i))
            d += i is not None
        return n.args[0], pairs

    def mask_of(m: Any) -> Any:  # a view of a mask in the same row-major order (m.view(b, t), m[:, None]) selects in the same order
        while isinstance(m, fx.Node) and m.args and isinstance(m.args[0], fx.Node) and op_name(m.target) in _SAME_ORDER and not (
                op_name(m.target) == "getitem" and any(isinstance(getattr(a, "meta", {}).get("val"), torch.Tensor) for a in pytree.tree_leaves(m.args[1:]))):
            m = m.args[0]
        return m

    def by_mask(a: fx.Node) -> bool:  # a bool mask of batch rows (x[mask])
        return a in from_batch and getattr(a.meta.get("val"), "dtype", None) == torch.bool

    def misreads_index(n: fx.Node, name: str) -> str:  # n indexes by value: some index is positions or a mask
        got = indexed(n, name)
        if got is None or not isinstance(got[0], fx.Node):
            return "indexes them in a way autopipe cannot follow"
        target, pairs = got
        if target in positions:
            return "indexes the positions themselves"
        origins, by_rows = set(), False
        for d, i in pairs:
            if not isinstance(i, fx.Node) or not isinstance(i.meta.get("val"), torch.Tensor):
                return "indexes them in a way autopipe cannot follow"
            if i in positions:
                origin, j = positions[i]
                if j is None:
                    return f"indexes with {i.name}, all positions of a mask at once"
                origins.add(mask_of(origin.args[0]))  # the mask: nonzero(m) and m select the same rows in the same order
                mask_dim, target_dim = size(origin.args[0], j), size(target, d)
            elif by_mask(i):
                origins.add(mask_of(i))
                mask_dim, target_dim = size(i, 0), size(target, d)
            else:
                continue  # an index of no rows by value: a constant, or row-wise (gather(x, -1, idx))
            if mask_dim != target_dim:
                return (f"indexes dim {d} of {target.name} with positions in a mask's dim of {mask_dim[1]} (not the same rows: a micro-batch numbers "
                        f"its own from 0)")
            by_rows |= mask_dim[0]
        if not origins:
            return ""
        if len(origins) > 1:
            return "indexes with positions of different masks"
        if not by_rows:
            return f"indexes {target.name} by value along other dims than its rows (each row would take other samples' elements)"
        origin_of[n] = origins.pop()
        return ""

    for n in gm.graph.nodes:
        if n not in from_batch or n.op not in ("call_function", "call_method", "call_module"):
            continue
        name = op_name(n.target) if n.op != "call_module" else ""
        val, dd = n.meta.get("val"), n.meta.get("data_dependent")
        ins = n.all_input_nodes
        first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        if name in _POSITIONS and first is not None and dd and len(n.args) == 1:  # not torch.where(cond, a, b)
            if not any(size(first, j)[0] for j in range(first.meta["val"].dim())):
                found[n] = f"takes positions of {first.name}, which has no dim of rows of samples"
            else:
                one_dim = isinstance(val, torch.Tensor) and first.meta["val"].dim() == 1  # nonzero of a 1-D mask: (u0, 1)
                positions[n] = (n, 0 if one_dim else None)
            continue
        if first in positions and name in ("getitem", "select") + tuple(_RESHAPES) + ("squeeze", "unsqueeze", "expand", "expand_as") \
                and not any(a in positions for a in ins[1:]):
            origin, j = positions[first]
            if name == "getitem" and isinstance(first.meta.get("val"), (tuple, list)):
                j = n.args[1]  # one tensor of torch.where's tuple
            elif name in ("getitem", "select"):  # a column of nonzero's (u0, ndim): export's select(1, j), fx's [:, j]
                index = n.args[1:] if name == "select" else n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
                if name == "select" and tuple(index) and index[0] == 1:
                    j = index[1]
                elif name == "getitem" and len(index) == 2 and index[0] == slice(None) and isinstance(index[1], int):
                    j = index[1]
                elif not (name == "getitem" and all(i == slice(None) or i is None for i in index)):
                    found[n] = f"takes some of the positions {first.name} (each micro-batch has its own)"
                    continue
            positions[n] = (origin, j)
            continue
        if first in rows and name == "getitem" and isinstance(first.meta.get("val"), (tuple, list)):
            if isinstance(val, torch.Tensor):
                rows[n] = rows[first]  # one tensor of a tuple of rows (split along another dim)
            else:
                found[n] = f"takes a part of the tuple {first.name} of selected rows, which autopipe cannot follow"
            continue
        by_value = any(a in positions or by_mask(a) for a in ins[1:])  # not x[..., None], gather(x, -1, idx)
        if (name in _SELECTS or name in _PUTS_BACK) and by_value and not (name == "getitem" and isinstance(first.meta.get("val"), (tuple, list))):
            how = misreads_index(n, name)
            if name in _PUTS_BACK:  # what is put: rows the same positions selected, or a value of no sample (out[mask] = 0)
                bound = bind(n.target, n.args, n.kwargs) or {}
                values = n.args[2] if name == "setitem" else next((bound[k] for k in ("values", "source", "src", "value") if k in bound), None)
                if isinstance(values, fx.Node) and values in from_batch and rows.get(values) is not origin_of.get(n, values):
                    how = how or f"puts {values.name} back, which is not rows the same positions selected (it would give other rows' values)"
            if how:
                found[n] = how
            elif name in _SELECTS and n.meta.get("selected_rows"):
                rows[n] = origin_of[n]
            elif name in _SELECTS:
                found[n] = "selects rows by value into a layout autopipe cannot follow (their rows not in the leading dim)"
            continue
        if any(a in positions for a in ins) and (name in _SHAPE_ONLY or name == "getattr") and not isinstance(val, torch.Tensor):
            counts.add(n)  # positions.shape[0]: a count
            continue
        if any(a in positions for a in ins):
            found[n] = (f"computes with the positions {next(a for a in ins if a in positions).name} (row numbers each micro-batch counts from 0) "
                        f"other than as indices of the rows they came from")
            continue
        if dd and not isinstance(val, torch.Tensor) and not (isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val)):
            counts.add(n)  # x.shape[0] of selected rows, mask.sum().item(): used as sizes only, checked where read
            continue
        if used := next((a for a in ins if a in counts), None):
            if name not in _SIZES_OF_VIEWS and not (not isinstance(val, torch.Tensor) and dd):
                found[n] = f"computes with {used.name}, a count of rows selected by value (each micro-batch counts its own)"
                continue
            if not isinstance(val, torch.Tensor):
                counts.add(n)
                continue
        if name in ("masked_scatter", "masked_scatter_") and len(n.args) > 2:
            source, mask = n.args[2], n.args[1]  # a source of the destination's own shape gives its first elements, whichever rows the mask selects
            if source in rows and rows[source] is not mask_of(mask):  # mask[:, None].expand_as(out): the mask
                found[n] = f"puts {source.name} back, which is not rows the same mask selected (it would give other rows' values)"
            elif source not in rows and source in from_batch and source.meta["val"].numel() >= n.meta["val"].numel():
                found[n] = ("takes its source's first elements, of all the samples' rows, in the order of the mask's true entries (a source of rows "
                            "the same mask selected, or of as many rows as it selects, a vision tower's, stays apart)")
            continue
        selected = [a for a in ins if a in rows]
        if not selected and not dd:
            continue
        if not dd:
            if n in counted and len({rows[a] for a in selected}) == 1:
                continue  # a cross-entropy's mean over rows one mask selected: merged by each micro-batch's count of them
            if name not in _SHAPE_ONLY:
                found[n] = f"reads rows selected by value ({selected[0].name}) other than row by row or put back where they were taken"
            continue
        sel = n.meta.get("selected_rows")
        others = [a for a in ins if a in from_batch and a not in rows and isinstance(a.meta.get("val"), torch.Tensor)]  # h[mask] * h.mean(0)
        if name in ("cat", "concat", "concatenate") and n.args and isinstance(n.args[0], (list, tuple)) and n.args[0]:
            first = n.args[0][0]  # torch.cat([rows, f(rows)], -1)
        elif first not in rows and selected and n.op != "call_module":
            first = selected[0]  # 2.0 * rows
        if sel is None or not selected or first not in rows or others or any(a.meta.get("selected_rows", (0, ""))[1] != sel[1] for a in selected) \
                or not isinstance(first.meta.get("val"), torch.Tensor):
            found[n] = f"has a size set by values ({name or n.target}) that autopipe cannot follow" + (f" from rows {selected[0].name}" if selected else "")
            continue
        module = _module_of(n)
        ndim, along = first.meta["val"].dim(), first.meta["selected_rows"][0]
        bound = bind(n.target, n.args, n.kwargs) or {} if n.op != "call_module" else {}
        if name in _ALONG_DIMS or name in ("cat", "concat", "concatenate") or isinstance(module, _ALONG_DIM_MODULES) or hasattr(module, "dim"):
            shape, dims = bound.get("normalized_shape", getattr(module, "normalized_shape", None)), bound.get("dim", getattr(module, "dim", None))
            dims = dims if isinstance(dims, (list, tuple)) else [dims]
            keeps = (name in ("dropout", "native_dropout") or shape is not None and len(shape) < ndim - along or
                     dims != [None] and all(isinstance(d, int) and d % ndim != along for d in dims))
        elif name in _ON_ROWS:  # the rows as the operand whose rows stay rows: linear(x, w), x @ w; not a convolution's channels or an image's height
            operand = n.args[1] if name in ("addmm", "baddbmm") else first
            keeps = name not in ("embedding",) and not name.startswith("conv") and all(a is operand for a in selected) and along == 0 and ndim >= 2
        else:
            pointwise = name in _POINTWISE_OPERATORS or any(torch.Tag.pointwise in o.tags for o in aten_overloads(n.target if n.op == "call_method" else name))
            activation = type(module).__module__ == "torch.nn.modules.activation" and not isinstance(module, (torch.nn.MultiheadAttention, torch.nn.Softmax2d))
            index = n.args[1] if name == "getitem" and len(n.args) > 1 else None  # rows[:, 0]: every row
            kept_rows = isinstance(index, tuple) and index[:1] == (slice(None),) and along == 0
            keeps = name in _RESHAPES or name in _SHAPE_ONLY or pointwise or isinstance(module, _ROW_MODULES) or activation or kept_rows
        if keeps and len({rows[a] for a in selected}) > 1:
            found[n] = f"combines rows that different masks selected ({', '.join(a.name for a in selected)}): row i of one is not row i of the other"
        elif keeps:
            rows[n] = rows[selected[0]]
        else:
            found[n] = f"computes from rows selected by value ({selected[0].name}) other than row by row"
    return found, {n for n in rows if (n.meta.get("selected_rows") or (None,))[0] == 0}


def _module_of(n: fx.Node) -> torch.nn.Module | None:
    return n.graph.owning_module.get_submodule(n.target) if n.op == "call_module" else None


def _across_micro_batches(gm: fx.GraphModule) -> list[str]:
    """Batch rows that depend on other samples, which a micro-batch does not hold: rows moved along the batch (flip, roll), computed with the batch
    size, or combined with a statistic over the batch (a floating value from batch rows whose shape is the same at every batch size: trace's
    ``batch_free``), which each micro-batch computes over its own samples, as BatchNorm does (GPipe sec. 2.2). Reported, not refused: routing
    code reads such numbers without mixing (docs/architecture.md, "Pitfalls measured")."""

    statistic: dict[fx.Node, fx.Node] = {}  # a value without the batch -> the statistic it is computed from
    readers: dict[fx.Node, fx.Node] = {}    # a statistic -> the first batch rows combined with it
    notes = []
    for n in gm.graph.nodes:
        if n.op not in ("call_function", "call_method", "call_module"):
            continue
        function = n.op != "call_module"  # fx's leaf modules (Linear): a module's name is not an op's
        if function and _reorders_batch(n):
            notes.append(f"{node_where(n)} moves rows along the batch dim: each micro-batch moves only its own rows, so values "
                         f"and gradients are not the plain model's; compute it outside the model, or run with chunks=1")
        if function and _along_batch(n, ("softmax", "log_softmax", "_softmax", "_log_softmax", "softmin", "sort", "argsort")):
            notes.append(f"{node_where(n)} normalises or sorts along the batch dim (softmax(x, dim=0)): each micro-batch does it over only its "
                         f"own rows, so values and gradients are not the plain model's; compute it outside the model, or run with chunks=1")
        if function and _along_batch(n, ("cumsum", "cumprod", "cummax", "cummin", "logcumsumexp")):
            notes.append(f"{node_where(n)} scans along the batch dim (a running count over several samples' rows, as capacity-limited routing "
                         f"keeps the first rows an expert gets): each micro-batch scans only its own rows, so values and gradients are not the "
                         f"plain model's; compute it outside the model, or run with chunks=1")
        size = next((a.name for a in n.args if isinstance(a, fx.Node) and a.meta.get("batch_number")),
                    "a literal" if n.meta.get("batch_literal") else None)  # trace's facts
        if function and rows_per_sample(n) and (op_name(n.target) in _ARITHMETIC or isinstance(n.target, FunctionCall)) and size is not None:
            notes.append(f"{node_where(n)} computes batch rows with {size}, a number set by the batch size (x.shape[0]): each micro-batch uses "
                         f"its own, so values and gradients are not the plain model's; pass it in, or run with chunks=1")
        inputs = _value_inputs(n) if function else n.all_input_nodes
        source = next((statistic[a] for a in inputs if a in statistic), None)
        if rows_per_sample(n) and source is not None:
            readers.setdefault(source, n)
        elif not _floating(n):  # counts and offsets (a grouped expert dispatch's histc, cumsum) only order the work
            continue
        elif not rows_per_sample(n) and source is not None:
            statistic[n] = source
        elif n.meta.get("batch_free") and any(rows_per_sample(a) for a in inputs) and not (function and _shape_only(n)):
            statistic[n] = n
    return notes + [f"batch rows ({node_where(user)}) combined with a value over the whole batch ({node_where(s)}): each micro-batch computes it "
                    f"over its own samples, as BatchNorm in training mode does (GPipe sec. 2.2), so values and gradients are not the plain model's; "
                    f"compute it outside the model, or run with chunks=1" for s, user in readers.items()]


def _reorders_batch(n: fx.Node) -> bool:
    """``torch.flip`` or ``torch.roll`` of batch rows along dim 0 (a roll without dims rolls the flattened tensor)."""
    name, source = op_name(n.target), n.args[0] if n.args else None
    if name not in ("flip", "roll") or not rows_per_sample(source):
        return False
    if name == "flip":  # torch.flip(x, (0,)), x.flip(0, 1), aten.flip(x, [0])
        rest = n.kwargs.get("dims", n.args[1:])
        dims = rest[0] if isinstance(rest, tuple) and len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
    else:
        dims = n.kwargs.get("dims", n.args[2] if len(n.args) > 2 else None)
        if dims is None or dims == []:
            return True
    ndim = source.meta["val"].dim()
    return any(isinstance(d, int) and d % ndim == 0 for d in ([dims] if isinstance(dims, int) else dims))


def _along_batch(n: fx.Node, ops: tuple[str, ...]) -> bool:
    """One of ``ops`` (cumsum, softmax, ...) along dim 0 of batch rows."""
    source = n.args[0] if n.args else None
    if op_name(n.target) not in ops or not rows_per_sample(source):
        return False
    dim = (bind(n.target, n.args, n.kwargs) or {}).get("dim")
    return isinstance(dim, int) and dim % max(source.meta["val"].dim(), 1) == 0


_ARITHMETIC = frozenset({"add", "sub", "mul", "truediv", "div", "floordiv", "pow", "rsub", "iadd", "isub", "imul", "itruediv",
                         "add_", "sub_", "mul_", "div_", "addcmul", "addcdiv", "lerp", "clamp", "where"})


def _floating(n: fx.Node) -> bool:
    return isinstance(v := n.meta.get("val"), torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _value_inputs(n: fx.Node) -> list[fx.Node]:
    """The inputs whose values an op reads: ``x.type_as(y)`` and ``x.to(y)`` read only y's dtype and device."""
    first = n.args[0] if n.args else None
    return [first] if op_name(n.target) in ("type_as", "to") and isinstance(first, fx.Node) else n.all_input_nodes


def _shape_only(n: fx.Node) -> bool:
    """An op that reads only its input's shape, dtype or device (``x.new_zeros(d)``, ``torch.zeros_like``)."""
    name = op_name(n.target)
    return name.startswith("new_") or name in _SHAPE_ONLY


_SHAPE_ONLY = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "arange", "zeros", "ones", "full", "empty",
                         "scalar_tensor", "size", "sym_size", "dim", "numel", "sym_numel"})


def _from_batch(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes computed from the batch inputs."""
    found: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if rows_per_sample(n) and n.op == "placeholder" or any(a in found for a in n.all_input_nodes):
            found.add(n)
    return found


def rows_per_sample(n: Any) -> int:
    """k where ``n``'s dim 0 holds k rows of each sample at every batch size (trace's fact), else 0."""
    return n.meta.get("rows_per_sample", 0) if isinstance(n, fx.Node) else 0


def _info(n: fx.Node, producer: int, consumers, is_output: bool, scalar_merge: str, together: bool, mixed: tuple[str, ...],
          count: TargetCount | None = None, selected: bool = False) -> TensorInfo:
    """What crosses a cut, as the wire needs it: shapes at the whole batch, Python values by kind. An output of k rows a sample (k > 1) whose rows
    ``_samples_together`` cannot show stay together, or one computed from a value that mixes samples, does not merge: refused."""
    val = n.meta.get("val")
    kind, shape, dtype, nbytes, rows = "other", (), torch.int64, 0, 0
    if isinstance(val, torch.Tensor):
        kind, shape, dtype, nbytes, rows = "tensor", tuple(int(d) for d in val.shape), val.dtype, val.nbytes, rows_per_sample(n)
    elif isinstance(val, (int, torch.SymInt)):
        kind = "int"
    elif isinstance(val, (tuple, list, torch.Size)) and all(isinstance(v, (int, torch.SymInt)) for v in val):
        kind, shape = "size", (len(val),)
    return TensorInfo(name=n.name, shape=shape, dtype=dtype, nbytes=nbytes, producer=producer, consumers=tuple(consumers),
                      is_output=is_output, kind=kind, rows_per_sample=rows,
                      merges=(not shape or rows == 1 or rows > 1 and together or selected) and not mixed, mixes_samples=mixed,
                      scalar_merge=scalar_merge, count=count if scalar_merge == "count" else None, selected_rows=selected)
