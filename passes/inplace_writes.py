"""The in-place write analysis: ``find_inplace_writes(graph_module) -> InPlaceWrites``. Which nodes' results may share
storage with an argument (views, and conversions that may return ``self``), which nodes write an argument in place, and
which later reads must see each write. Partition keeps each such read in one stage with its write; codegen clones a
stage input a stage writes, and checks, as a safety net, that no read is cut off from its write. The contract:
docs/architecture.md, "Contracts between passes"."""
from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.fx as fx
from torch._ops import HigherOrderOperator, OpOverload

import autopipe.random_ops as random_ops

__all__ = ["InPlaceWrites", "ReadAfterWrite", "find_inplace_writes", "is_batch_norm"]

_INPLACE_OPERATORS = frozenset({operator.setitem} | {getattr(operator, f"i{name}") for name in (
    "add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift", "matmul")})
_INPLACE_DUNDERS = frozenset(f"__{op.__name__}__" for op in _INPLACE_OPERATORS)
# results that may share storage with their first argument: views, and conversions that may return ``self``
_VIEW_NAMES = frozenset({"view", "view_as", "reshape", "reshape_as", "transpose", "t", "T", "mT", "H", "mH", "adjoint",
                         "permute", "unsqueeze", "squeeze", "expand", "expand_as", "narrow", "select", "split",
                         "split_with_sizes", "tensor_split", "hsplit", "vsplit", "dsplit", "chunk", "unbind",
                         "flatten", "unflatten", "ravel", "diagonal", "detach", "contiguous", "as_strided", "movedim",
                         "moveaxis", "swapaxes", "swapdims", "unfold", "real", "imag", "view_as_real",
                         "view_as_complex", "conj", "resolve_conj", "resolve_neg", "alias", "to", "type", "type_as",
                         "float", "double", "half", "bfloat16", "int", "long", "short", "bool", "char", "byte", "cpu",
                         "cuda", "data", "__getitem__", "align_to", "rename", "refine_names", "indices", "values"})
_BATCH_NORMS = frozenset({"batch_norm", "native_batch_norm", "instance_norm", "_batch_norm_impl_index"})


@dataclass(frozen=True)
class ReadAfterWrite:
    """``reader`` reads, after ``write``, the storage ``write`` changed, through ``through`` (a tensor sharing it with
    ``written``, the argument written). Each stage gets its own copy of what it receives, so the read sees the write
    only where one stage holds all the nodes of one of ``ways``: the writing stage makes ``through``, or a tensor it is
    a view of, and sends it on once it has run, the write included; or the reader runs in the writing stage, on its
    copy. Each way also holds the views between ``written`` and ``through``. No way at all where the model returns an
    input it wrote (no stage makes the input, none reads the output)."""
    write: fx.Node
    written: fx.Node
    reader: fx.Node
    through: fx.Node
    ways: tuple[frozenset[fx.Node], ...]


@dataclass(frozen=True)
class InPlaceWrites:
    """Per node of a graph: its position (``order``), the argument whose storage its result may share (``alias``), that
    storage's first owner (``base``), the arguments it writes in place (``writes``); ``nodes``: each by name, as a plan
    names it. ``reads``: every read after a write of what the write changed that a cut between stages could hide from
    it. A read of the write's result, or of a view of it (``y = x.add_(1)``, ``relu(x, inplace=True)``, then ``y``), is
    not among them: whichever stage reads it gets it from the writing stage, after the write; nor is a write to a
    buffer, which every stage holds."""
    nodes: dict[str, fx.Node]
    order: dict[fx.Node, int]
    alias: dict[fx.Node, fx.Node | None]
    base: dict[fx.Node, fx.Node]
    writes: dict[fx.Node, list[fx.Node]]
    reads: tuple[ReadAfterWrite, ...]

    def views_back(self, node: fx.Node | None) -> Iterator[fx.Node]:
        """``node``, the tensor it is a view of, that one's, ... back to a tensor no view made."""
        while node is not None:
            yield node
            node = self.alias[node]

    def sharing(self, node: fx.Node) -> list[fx.Node]:
        """Every node whose result may share ``node``'s storage, in graph order."""
        return [m for m, base in self.base.items() if base is self.base[node]]


def find_inplace_writes(gm: fx.GraphModule) -> InPlaceWrites:
    """The in-place writes of ``gm``'s graph, the views between its values, and the reads a cut could hide."""
    nodes, order = {n.name: n for n in gm.graph.nodes}, {n: i for i, n in enumerate(gm.graph.nodes)}
    alias: dict[fx.Node, fx.Node | None] = {}
    base: dict[fx.Node, fx.Node] = {}
    writes: dict[fx.Node, list[fx.Node]] = {}
    for n in gm.graph.nodes:
        alias[n], writes[n] = _effects(n, gm.get_submodule)
        base[n] = n if alias[n] is None else base[alias[n]]
    facts, sharing = InPlaceWrites(nodes, order, alias, base, writes, ()), {}
    for n, b in base.items():
        sharing.setdefault(b, []).append(n)
    reads = tuple(r for w, written in writes.items() for a in written for r in _reads_after(facts, w, a, sharing))
    return dataclasses.replace(facts, reads=reads)


def is_batch_norm(node: fx.Node) -> bool:
    """A batch or instance norm op, which writes its running statistics in place (its schema does not say so)."""
    return node.op != "call_module" and random_ops.op_name(
        random_ops.resolve(node.target, node.args, node.kwargs)) in _BATCH_NORMS


def _reads_after(facts: InPlaceWrites, w: fx.Node, a: fx.Node,
                 sharing: dict[fx.Node, list[fx.Node]]) -> Iterator[ReadAfterWrite]:
    """The reads after ``w`` of what it writes in ``a`` that a cut could hide from it (``sharing``: per base, the nodes
    sharing its storage)."""
    if facts.base[a].op == "get_attr":  # a buffer: every stage holds the same object
        return
    chain_of_a = list(facts.views_back(a))
    for m in sharing[facts.base[a]]:
        chain = list(facts.views_back(m))
        if w in chain and facts.alias[w] is a:  # the write's own result, or a view of it
            continue
        # the views below the two chains' first common tensor: one stage must make them all for m to be a's storage
        # there (the common tensor itself may be a stage input, one copy for both)
        common = set(chain) & set(chain_of_a)
        below = {n for n in (*chain, *chain_of_a) if n not in common}
        above = chain[:len(chain) - len(common) + 1]  # m, the tensor it is a view of, ... up to the common one
        sent = [frozenset({v, w, *below} - set(chain[:i])) for i, v in enumerate(above)
                if v.op not in ("placeholder", "get_attr")]
        for u in m.users:
            if facts.order[u] > facts.order[w]:
                read = [] if u.op == "output" else [frozenset({w, u, *below})]
                yield ReadAfterWrite(w, a, u, m, tuple(sent + read))


def _effects(node: fx.Node, module_of: Callable[[str], Any]) -> tuple[fx.Node | None, list[fx.Node]]:
    """(the argument whose storage ``node``'s result may share, the arguments it writes in place)."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return None, []
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    target = random_ops.resolve(node.target, node.args, node.kwargs)
    aliased, written = [], []
    if node.op == "call_module":
        if getattr(module_of(target), "inplace", False) is True:
            aliased, written = [first], [first if first is not None else node.kwargs.get("input")]
    elif isinstance(target, HigherOrderOperator):  # export's no_grad / autocast region: what its subgraph writes
        written = _written_by_subgraph(node, module_of)
    elif isinstance(target, OpOverload):
        returned = set().union(*(r.alias_info.before_set for r in target._schema.returns if r.alias_info is not None))
        for i, a in enumerate(target._schema.arguments):
            value = node.args[i] if i < len(node.args) and not a.kwarg_only else node.kwargs.get(a.name)
            if a.alias_info is not None and a.alias_info.is_write:
                written += _nodes_in(value)
            if a.alias_info is not None and a.alias_info.before_set & returned and i < len(node.args):
                aliased += _nodes_in(value)
    else:  # in place: x.mul_(2), x += y, x[i] = y, F.relu(x, inplace=True)
        name, signature = random_ops.op_name(target), random_ops.signature_of(target)
        inplace = signature is not None and "inplace" in signature.parameters \
            and (random_ops.bind(target, node.args, node.kwargs) or {}).get("inplace") is True
        if inplace or (name.endswith("_")
                       and not name.startswith("__")) or name in _INPLACE_DUNDERS or target in _INPLACE_OPERATORS:
            written = [first]
        aliased = [first] if _is_view(node, target, first) or written else []
    if node.op != "call_module":
        if is_batch_norm(node):  # their schemas do not mark the running stats written
            bound = random_ops.bind(target, node.args, node.kwargs) or {}
            if bound.get("training") or bound.get("use_input_stats"):
                written += _nodes_in([bound.get("running_mean"), bound.get("running_var")])
        written += _nodes_in(node.kwargs.get("out"))
    alias = aliased[0] if aliased and first is not None and _may_be_tensor(node, containers=True) else None
    return alias, [n for n in dict.fromkeys(written) if isinstance(n, fx.Node) and _may_be_tensor(n)]


def _written_by_subgraph(node: fx.Node, module_of: Callable[[str], Any]) -> list[fx.Node]:
    """The operands of a higher-order op (export's no_grad / autocast region) that its subgraph writes in place."""
    at = next((i for i, a in enumerate(node.args) if isinstance(a, fx.Node) and a.op == "get_attr"
               and isinstance(module_of(a.target), fx.GraphModule)), None)
    if at is None:
        return []
    inner, operands = find_inplace_writes(module_of(node.args[at].target)), node.args[at + 1:]
    places = {p: a for p, a in zip(inner.order, operands) if p.op == "placeholder"}
    return [places[inner.base[w]] for ws in inner.writes.values() for w in ws if inner.base[w] in places]


def _is_view(node: fx.Node, target: Any, first: fx.Node | None) -> bool:
    """Whether a call_function / call_method result may share its first argument's storage."""
    if node.op == "call_method":
        return target in _VIEW_NAMES
    if target is operator.getitem:  # a tensor indexed by tensors or lists is copied; a tuple's item aliases
        index = node.args[1] if isinstance(node.args[1], tuple) else (node.args[1],)
        return first is None or not isinstance(first.meta.get("val"), torch.Tensor) or not any(
            isinstance(p, list) or (isinstance(p, fx.Node) and isinstance(p.meta.get("val"), torch.Tensor))
            for p in index)
    # torch.Tensor.view is a method descriptor: its class names the module
    module = getattr(target, "__module__", None) or getattr(getattr(target, "__objclass__", None), "__module__", "")
    return target is getattr or (str(module).startswith("torch") and random_ops.op_name(target) in _VIEW_NAMES)


def _nodes_in(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return found


def _may_be_tensor(node: fx.Node, containers: bool = False) -> bool:
    val = node.meta.get("val", node.meta.get("example_value"))
    values = val if containers and isinstance(val, (tuple, list)) else [val]
    return val is None or any(isinstance(v, torch.Tensor) for v in values)
