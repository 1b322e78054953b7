"""The facts the micro-batch rules read: trace's facts on each node (``node.meta``: "rows_per_sample", "batch_dim",
"pairs_samples", "batch_number", "batch_free", "batch_literal", "data_dependent", "selected_rows"; docs/architecture.md,
"Contracts between passes"), the nodes computed from the batch, which values share a storage, and the op tables the
rules share."""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
from torch.multiprocessing.reductions import StorageWeakRef

from autopipe.random_ops import op_name

# a new shape over the same row-major order: a sample's rows stay together
RESHAPES = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "view_as", "reshape_as", "squeeze",
                      "unsqueeze", "contiguous", "clone", "detach", "alias", "to", "_to_copy", "type", "type_as",
                      "float", "double", "half", "bfloat16"})
# row-wise unless along dim 0 (``dim``), or over every dim (``normalized_shape``)
ALONG_DIMS = frozenset({"softmax", "log_softmax", "_softmax", "_log_softmax", "sum", "mean", "amax", "amin", "max",
                        "min", "argmax", "argmin", "topk", "sort", "argsort", "norm", "logsumexp", "cumsum", "var",
                        "std", "normalize", "split", "chunk", "unbind", "select", "slice", "narrow", "index_select",
                        "gather", "dropout", "native_dropout", "layer_norm", "native_layer_norm", "rms_norm",
                        "_fused_rms_norm"})
ON_ROWS = frozenset({"linear", "mm", "addmm", "matmul", "bmm", "baddbmm", "embedding", "conv1d", "conv2d", "conv3d",
                     "convolution"})
ROW_MODULES = (torch.nn.Linear, torch.nn.Embedding, torch.nn.LayerNorm, torch.nn.RMSNorm,
               torch.nn.modules.dropout._DropoutNd, torch.nn.Identity, torch.nn.ReLU, torch.nn.GELU, torch.nn.SiLU,
               torch.nn.Tanh, torch.nn.Sigmoid)
# ops that read only their input's shape, dtype or device
SHAPE_ONLY = frozenset({"zeros_like", "ones_like", "empty_like", "full_like", "arange", "zeros", "ones", "full",
                        "empty", "scalar_tensor", "size", "sym_size", "dim", "numel", "sym_numel"})
# ops whose result shares its input's storage: a write to one changes the other
VIEWS = RESHAPES | {"slice", "select", "narrow", "getitem", "transpose", "permute", "t", "expand", "expand_as",
                    "as_strided", "unbind", "split", "chunk", "diagonal", "movedim", "unfold", "view_as_real",
                    "view_as_complex", "split_with_sizes"}


def rows_per_sample(n: Any) -> int:
    """k where ``n``'s dim 0 holds k rows of each sample at every batch size (trace's fact), else 0."""
    return n.meta.get("rows_per_sample", 0) if isinstance(n, fx.Node) else 0


def from_batch(gm: fx.GraphModule) -> set[fx.Node]:
    """The nodes computed from the batch inputs."""
    found: set[fx.Node] = set()
    for n in gm.graph.nodes:
        if rows_per_sample(n) and n.op == "placeholder" or any(a in found for a in n.all_input_nodes):
            found.add(n)
    return found


def views(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Each node -> a representative of the values that may share its storage (views of views of one tensor)."""
    root: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        source = n.args[0] if n.args else None
        is_view = n.op in ("call_function", "call_method") and op_name(n.target) in VIEWS \
            or n.target is operator.getitem
        root[n] = root.get(source, source) if is_view and isinstance(source, fx.Node) else n
    return root


def is_inplace(n: fx.Node) -> bool:
    return ((n.op == "call_method" and n.target.endswith("_")) or n.target is operator.setitem
            or (isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable))


def shape_only(n: fx.Node) -> bool:
    """An op that reads only its input's shape, dtype or device (``x.new_zeros(d)``, ``torch.zeros_like``)."""
    name = op_name(n.target)
    return name.startswith("new_") or name in SHAPE_ONLY


# -- recorded by trace, from each node's value at the batch and one row larger ----------------------------------------

def literals(n: fx.Node) -> list[str]:
    """The node's non-node arguments, by repr: a nan compares equal to itself."""
    return [repr(a) for a in pytree.tree_leaves((n.args, n.kwargs)) if not isinstance(a, fx.Node)]


# Note [the batch found by one more row]: which dim holds the batch is read from the graph run a second time on
# fake inputs one row larger: k rows a sample is a dim 0 that grows by k rows with no other dim changing. An int
# comparison with the batch size took a transposed sequence dim equal to the batch, or a stack of two at a batch
# of two, for the batch, and such outputs merged row-permuted. The same fact sizes the wire: a (batch * seq, d)
# tensor needs a receive buffer of its own rows. A graph that does not run one row larger specialises on the batch.
def record_batch_facts(gm: fx.GraphModule, batch: int, grown: dict[fx.Node, Any] | None) -> None:
    """node.meta "rows_per_sample", "batch_dim", "pairs_samples", "batch_free", "batch_number", "data_dependent" and
    "selected_rows" from each node's value at ``batch`` rows and its value one row larger, ``grown``
    (docs/architecture.md, "Contracts between passes"; Note [the batch found by one more row]). Without it (a static
    graph that exports at one size alone) only the batch tensors are known (k = 1), and any literal may be the batch
    size (Note [static graphs one row larger])."""
    known: dict[fx.Node, int] = {}  # k of a concatenation of rows in order, and of values computed from it: see below
    for n in gm.graph.nodes:
        val = n.meta.get("val")
        if grown is None and literals(n):
            n.meta["literals_unknown"] = True  # any may be the batch size
        if sized_by_values(val) or grown is not None and sized_by_values(grown[n]):
            # x[mask]: rows of no fixed number a sample; mask.sum().item(): a count over the micro-batch
            n.meta["data_dependent"] = True
            n.meta["batch_number"] = not isinstance(val,
                                                    (torch.Tensor, tuple, list))  # torch.where's tuple is no number
            if rows := selected_rows(val):
                n.meta["selected_rows"] = rows
        elif isinstance(val, torch.Tensor):
            k = val.shape[0] // batch if val.dim() and batch and val.shape[0] % batch == 0 else 0
            if k > 1 and grown is None or grown is not None and k and tuple(grown[n].shape) != (k * (batch + 1),
                                                                                                *val.shape[1:]):
                # with one size only, what looks like k rows a sample may hold more samples' elements than k rows do
                k = 0
            n.meta["rows_per_sample"] = k
            if (rows := concatenated_rows(n)) is not None and rows[1]:
                known[n] = n.meta["rows_per_sample"] = rows[1]  # Note [rows concatenated in order]
            elif grown is None and not k and (k := next((known[a] for a in n.all_input_nodes if a in known
                                                        and val.dim() and val.shape[0] == known[a] * batch), 0)):
                known[n] = n.meta["rows_per_sample"] = k  # one size only: k is the concatenation's, until it changes
            grows = [i
                     for i, (a, b) in enumerate(zip(val.shape, grown[n].shape)) if a != b] if grown is not None else []
            if len(grows) == 1:
                n.meta["batch_dim"] = grows[0]  # (seq, batch, d): 1
            if len(grows) > 1:
                n.meta["pairs_samples"] = True  # u @ v.T of two batches (contrastive logits): the batch in two dims
            if grown is not None and tuple(val.shape) == tuple(grown[n].shape):
                n.meta["batch_free"] = True  # the same shape at every batch size: no sample's own rows in it
        elif isinstance(val, int) and grown is not None and grown[n] != val:
            n.meta["batch_number"] = True  # x.shape[0], a number that differs between micro-batches


# Note [rows concatenated in order]: torch.cat along dim 0 of views that are the rows of one batch tensor, each once
# and in order (x.unbind(0), x.split(1), [x[i] for i in range(len(x))], list(x), LLaVA's per-image features) is that
# tensor reshaped, row-major: each sample's rows stay together, k of them a sample (k of the tensor, times dim 1 where a
# piece drops the row dim). Read from the views' storage, offsets and strides, which every route's fake values carry,
# so that a graph of one static size (the samples unbound one by one, one node each: its export one row larger has
# other nodes) knows k too, as it does not for other values: there k goes on to values computed from the
# concatenation whose dim 0 keeps its k * batch rows, and samples.py decides, as for any value, whether their rows
# stay together. Pieces that hold all the rows but in another order (reversed, permuted, repeated) give parts that
# no concatenation of micro-batches turns into the plain value: samples.py refuses them.

def concatenated_rows(n: fx.Node) -> tuple[fx.Node, int] | None:
    """For ``torch.cat`` along dim 0 of views of one batch tensor's rows: (that tensor, k) where the pieces are its
    rows, each once, in order (k: rows a sample of the result); (that tensor, 0) where they hold every row but in
    another order, none of them all the rows. None for any other op or pieces (Note [rows concatenated in order])."""
    if n.op != "call_function" or op_name(n.target) not in ("cat", "concat", "concatenate") or not n.args:
        return None
    parts, dim = n.args[0], n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
    if isinstance(parts, (list, tuple)) and parts and all(isinstance(p, fx.Node) for p in parts):
        pieces = [(p, p.meta.get("val")) for p in parts]
    elif isinstance(parts, fx.Node) and isinstance(parts.meta.get("val"), (list, tuple)):  # fx: torch.cat(x.unbind(0))
        pieces = [(parts, v) for v in parts.meta["val"]]
    else:
        return None
    if not pieces or not all(isinstance(v, torch.Tensor) and v.dim() for _, v in pieces) or not isinstance(dim, int) \
            or dim % pieces[0][1].dim():
        return None
    for source in _viewed(pieces[0][0]):
        rows = [_rows_viewed(v, source.meta.get("val")) for _, v in pieces] if rows_per_sample(source) else [None]
        if None in rows or len({kept for _, _, kept in rows}) != 1:
            continue
        total, kept = source.meta["val"].shape[0], rows[0][2]
        if [start for start, _, _ in rows] == [0] + [stop for _, stop, _ in rows[:-1]] and rows[-1][1] == total:
            return source, rows_per_sample(source) * (1 if kept else source.meta["val"].shape[1])
        whole = any(stop - start == total for start, stop, _ in rows) and kept
        return (source, 0) if _covers([(start, stop) for start, stop, _ in rows], total) and not whole else None
    return None


def _covers(spans: list[tuple[int, int]], total: int) -> bool:
    """Do the spans [start, stop) cover 0..total-1?"""
    reach = 0
    for start, stop in sorted(spans):
        if start > reach:
            return False
        reach = max(reach, stop)
    return reach >= total


def _viewed(piece: fx.Node) -> list[fx.Node]:
    """The tensors ``piece`` is a view of, nearest first: its chain of view ops' first arguments."""
    chain = []
    while piece.op in ("call_function", "call_method") and (op_name(piece.target) in VIEWS
                                                            or piece.target is operator.getitem) \
            and piece.args and isinstance(piece.args[0], fx.Node) and len(chain) < 16:
        piece = piece.args[0]
        chain.append(piece)
    return [a for a in chain if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].dim()]


def _rows_viewed(v: torch.Tensor, of: Any) -> tuple[int, int, bool] | None:
    """(first, end, kept) where ``v`` is rows first..end-1 of ``of`` (kept: as ``of[first:end]``; else ``of[first]``,
    one row without its dim), read from storage, offset and strides; None where it is not."""
    numbers = (*v.shape, *v.stride(), v.storage_offset(), *of.shape, *of.stride(), of.storage_offset()) \
        if isinstance(of, torch.Tensor) else (None,)
    if not all(type(x) is int for x in numbers) or v.dtype != of.dtype or of.stride(0) <= 0 \
            or StorageWeakRef(v.untyped_storage()) != StorageWeakRef(of.untyped_storage()):
        return None
    first, offset = divmod(v.storage_offset() - of.storage_offset(), of.stride(0))
    if v.shape == of.shape[1:] and v.stride() == of.stride()[1:]:
        end, kept = first + 1, False
    elif v.dim() == of.dim() and v.shape[1:] == of.shape[1:] and v.stride()[1:] == of.stride()[1:] and \
            (v.shape[0] <= 1 or v.stride(0) == of.stride(0)):
        end, kept = first + v.shape[0], True
    else:
        return None
    return (first, end, kept) if not offset and 0 <= first < end <= of.shape[0] else None


def sized_by_values(val: Any) -> bool:
    """Does the value hold a size or number that depends on values (an unbacked symbol of the shape env: u0)?"""
    return any(free_unbacked_symbols(x)
               for x in pytree.tree_leaves(val) if isinstance(x,
                                                              (torch.Tensor, torch.SymInt, torch.SymFloat,
                                                               torch.SymBool)))


def selected_rows(val: Any) -> tuple[int, str] | None:
    """(the dim of rows, its size) of a tensor whose one dim of a size set by values follows dims of 1: x[mask] (u0, d),
    x[None, idx] (1, u0, d); of the tensors of a tuple (torch.where(mask)) if they agree."""
    found = set()
    for t in pytree.tree_leaves(val):
        dims = [i for i, d in enumerate(t.shape) if free_unbacked_symbols(d)] if isinstance(t, torch.Tensor) else [-1]
        if len(dims) != 1 or dims[0] < 0 or any(d != 1 for d in t.shape[:dims[0]]):
            return None
        found.add((dims[0], str(t.shape[dims[0]])))
    return found.pop() if len(found) == 1 else None
