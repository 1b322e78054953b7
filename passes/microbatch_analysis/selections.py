"""Rows selected by value (``x[mask]``, ``nonzero``, ``torch.where``: trace's "data_dependent", "selected_rows"): which
uses of them each micro-batch computes as the plain model does: those the note below allows, and a cross-entropy merged
by count averaging over the rows they select; any other use is misread, naming the node. One method per case, tried in
the order of ``_CASES``.

Note [rows selected by value]: positions (nonzero's, torch.where's) are row numbers each micro-batch counts from
0: they may only index the dim they came from, of batch rows or selected rows of the same size. The rows they
select may be computed row by row with their number kept and put back into batch rows (out[mask] = y,
index_add, scatter, masked_scatter of the same rows); their counts may only size views. Anything else (a mean,
sort, cumsum or slice over them, a capacity buffer written with them and read after, arithmetic on positions or
counts) differs between micro-batches and mixes samples.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopipe.random_ops import aten_overloads, bind, op_name

from .facts import ALONG_DIMS, ON_ROWS, RESHAPES, ROW_MODULES, SHAPE_ONLY, rows_per_sample

_POSITIONS = frozenset({"nonzero", "argwhere", "where", "nonzero_numpy"})
_SELECTS = frozenset({"index", "getitem", "index_select", "gather"})
_PUTS_BACK = frozenset({"index_put", "index_put_", "setitem", "index_add", "index_add_", "index_copy", "index_copy_",
                        "index_reduce", "index_reduce_", "scatter", "scatter_", "scatter_add", "scatter_add_",
                        "scatter_reduce", "scatter_reduce_"})
_SIZES_OF_VIEWS = frozenset({"view", "reshape", "_unsafe_view", "expand"})  # ops that may take a count as a size
# fx's Python operators on tensors
_POINTWISE_OPERATORS = frozenset({"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "neg", "eq", "ne", "lt",
                                  "le", "gt", "ge", "and_", "or_", "invert", "iadd", "isub", "imul", "itruediv"})
_SAME_ORDER = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "squeeze", "unsqueeze",
                         "contiguous", "alias", "clone", "detach", "expand", "expand_as", "slice", "getitem"})
_ALONG_DIM_MODULES = (torch.nn.LayerNorm, torch.nn.RMSNorm, torch.nn.Softmax, torch.nn.LogSoftmax)
_CATS = ("cat", "concat", "concatenate")
_PARTS_OF_POSITIONS = ("getitem", "select") + tuple(RESHAPES) + ("squeeze", "unsqueeze", "expand", "expand_as")

CANNOT_FOLLOW = "indexes them in a way autopipe cannot follow"
MIXED_MASKS = "indexes with positions of different masks"
SELECTS_INTO_LAYOUT = "selects rows by value into a layout autopipe cannot follow (their rows not in the leading dim)"
SCATTERS_FIRST_ELEMENTS = ("takes its source's first elements, of all the samples' rows, in the order of the mask's "
                           "true entries (a source of rows the same mask selected, or of as many rows as it selects, a "
                           "vision tower's, stays apart)")


def _other_rows(d: int, target: fx.Node, mask_dim: tuple[bool, str]) -> str:
    return (f"indexes dim {d} of {target.name} with positions in a mask's dim of {mask_dim[1]} (not the same rows: a "
            f"micro-batch numbers its own from 0)")


def _along_other_dims(target: fx.Node) -> str:
    return (f"indexes {target.name} by value along other dims than its rows (each row would take other samples' "
            f"elements)")


def _puts_back_other(values: fx.Node, what: str) -> str:
    return f"puts {values.name} back, which is not rows the same {what} selected (it would give other rows' values)"


def _computes_with_positions(positions: fx.Node) -> str:
    return (f"computes with the positions {positions.name} (row numbers each micro-batch counts from 0) other than as "
            f"indices of the rows they came from")


def _computes_with_count(count: fx.Node) -> str:
    return f"computes with {count.name}, a count of rows selected by value (each micro-batch counts its own)"


def _size_not_followed(name: str, selected: list[fx.Node]) -> str:
    return f"has a size set by values ({name}) that autopipe cannot follow" + (
        f" from rows {selected[0].name}" if selected else "")


def _different_masks(selected: list[fx.Node]) -> str:
    return (f"combines rows that different masks selected ({', '.join(a.name for a in selected)}): row i of one is not "
            f"row i of the other")


def selections_misread(gm: fx.GraphModule, from_batch: set[fx.Node], interleaved: dict[fx.Node, fx.Node],
                       counted: set[fx.Node] = frozenset()) -> tuple[dict[fx.Node, str], set[fx.Node]]:
    """Each node computed from rows selected by value other than as the plain model computes it, under micro-batches ->
    why; and the values whose dim 0 is rows selected from the batch's rows in their order, which concatenate.
    ``counted``: the cross-entropies merged by count, whose mean over rows one mask selected is exact."""
    walk = _Selections(from_batch, interleaved, counted)
    for n in gm.graph.nodes:
        if n in from_batch and n.op in ("call_function", "call_method", "call_module"):
            op = _Op.of(n)
            next(case for case in _CASES if case(walk, op))
    return walk.found, {n for n in walk.rows if (n.meta.get("selected_rows") or (None,))[0] == 0}


@dataclass
class _Op:
    """A node as the cases read it."""

    n: fx.Node
    name: str             # the op's name; "" for a module
    val: Any
    dd: bool              # trace's "data_dependent": a size or number set by values
    ins: list[fx.Node]
    first: fx.Node | None

    @classmethod
    def of(cls, n: fx.Node) -> _Op:
        first = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        return cls(n, op_name(n.target) if n.op != "call_module" else "", n.meta.get("val"),
                   n.meta.get("data_dependent"), n.all_input_nodes, first)


class _Selections:
    """The walk's state: what each value made from a selection is, and what was found misread."""

    def __init__(self, from_batch: set[fx.Node], interleaved: dict[fx.Node, fx.Node], counted: set[fx.Node]):
        self.from_batch, self.interleaved, self.counted = from_batch, interleaved, counted
        # positions -> (its nonzero / where, the mask's dim it holds; None: all, as (n, ndim))
        self.positions: dict[fx.Node, tuple[fx.Node, int | None]] = {}
        # selected rows -> the mask, or nonzero / where, that selected them: row i is its i-th true entry
        self.rows: dict[fx.Node, fx.Node] = {}
        self.counts: set[fx.Node] = set()  # counts of selected rows, or positions: only sizes of views
        self.found: dict[fx.Node, str] = {}  # misread -> why
        # a selection or put-back -> the mask, or nonzero / where, of its index
        self.origin_of: dict[fx.Node, fx.Node] = {}

    def size(self, t: fx.Node, d: int) -> tuple[bool, str]:
        """(a dim of rows?, its size): the symbol's name where set by values (u0)."""
        if (sel := t.meta.get("selected_rows")) and sel[0] == d:
            return True, sel[1]
        v = t.meta["val"]  # rows in sequence order (interleaved) are no sample's rows in turn
        rows = (d == 0 and rows_per_sample(t) or t.meta.get("batch_dim") == d) and t not in self.interleaved
        return bool(rows), str(int(v.shape[d]))

    def by_mask(self, a: fx.Node) -> bool:
        """A bool mask of batch rows (x[mask])."""
        return a in self.from_batch and getattr(a.meta.get("val"), "dtype", None) == torch.bool

    # -- the cases, in order: each returns True where it decided the node ------------------------------------------

    def takes_positions(self, op: _Op) -> bool:
        """nonzero / argwhere / torch.where(mask) of a mask of rows: positions."""
        if not (op.name in _POSITIONS and op.first is not None and op.dd and len(op.n.args) == 1):
            return False  # not torch.where(cond, a, b)
        if not any(self.size(op.first, j)[0] for j in range(op.first.meta["val"].dim())):
            self.found[op.n] = f"takes positions of {op.first.name}, which has no dim of rows of samples"
        else:
            one_dim = isinstance(op.val, torch.Tensor) and op.first.meta["val"].dim() == 1  # nonzero of a 1-D mask
            self.positions[op.n] = (op.n, 0 if one_dim else None)
        return True

    def part_of_positions(self, op: _Op) -> bool:
        """One tensor of torch.where's tuple, a column of nonzero's (u0, ndim), or a view of positions."""
        n, name, first = op.n, op.name, op.first
        if not (first in self.positions and name in _PARTS_OF_POSITIONS
                and not any(a in self.positions for a in op.ins[1:])):
            return False
        origin, j = self.positions[first]
        if name == "getitem" and isinstance(first.meta.get("val"), (tuple, list)):
            j = n.args[1]  # one tensor of torch.where's tuple
        elif name in ("getitem", "select"):  # a column of nonzero's (u0, ndim): export's select(1, j), fx's [:, j]
            index = n.args[1:] if name == "select" else n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)
            if name == "select" and tuple(index) and index[0] == 1:
                j = index[1]
            elif name == "getitem" and len(index) == 2 and index[0] == slice(None) and isinstance(index[1], int):
                j = index[1]
            elif not (name == "getitem" and all(i == slice(None) or i is None for i in index)):
                self.found[n] = f"takes some of the positions {first.name} (each micro-batch has its own)"
                return True
        self.positions[n] = (origin, j)
        return True

    def part_of_rows_tuple(self, op: _Op) -> bool:
        """One tensor of a tuple of selected rows (split along another dim)."""
        if not (op.first in self.rows and op.name == "getitem" and isinstance(op.first.meta.get("val"), (tuple, list))):
            return False
        if isinstance(op.val, torch.Tensor):
            self.rows[op.n] = self.rows[op.first]
        else:
            self.found[op.n] = (f"takes a part of the tuple {op.first.name} of selected rows, which autopipe cannot "
                                f"follow")
        return True

    def indexes_by_value(self, op: _Op) -> bool:
        """A selection (x[mask], index_select) or put-back (out[mask] = y, index_add, scatter) by positions or a mask.
        """
        n, name = op.n, op.name
        by_value = any(a in self.positions or self.by_mask(a) for a in op.ins[1:])  # not x[..., None], gather(x, -1, i)
        if not ((name in _SELECTS or name in _PUTS_BACK) and by_value
                and not (name == "getitem" and isinstance(op.first.meta.get("val"), (tuple, list)))):
            return False
        how = self.misreads_index(n, name)
        if name in _PUTS_BACK:  # what is put: rows the same positions selected, or a value of no sample (out[mask] = 0)
            bound = bind(n.target, n.args, n.kwargs) or {}
            values = n.args[2] if name == "setitem" else next(
                (bound[k] for k in ("values", "source", "src", "value") if k in bound), None)
            if isinstance(values, fx.Node) and values in self.from_batch \
                    and self.rows.get(values) is not self.origin_of.get(n, values):
                how = how or _puts_back_other(values, "positions")
        if how:
            self.found[n] = how
        elif name in _SELECTS and n.meta.get("selected_rows"):
            self.rows[n] = self.origin_of[n]
        elif name in _SELECTS:
            self.found[n] = SELECTS_INTO_LAYOUT
        return True

    def counts_positions(self, op: _Op) -> bool:
        """positions.shape[0]: a count."""
        if any(a in self.positions for a in op.ins) and (op.name in SHAPE_ONLY or op.name == "getattr") \
                and not isinstance(op.val, torch.Tensor):
            self.counts.add(op.n)
            return True
        return False

    def computes_with_positions(self, op: _Op) -> bool:
        """Anything else read from positions: arithmetic, a parameter indexed by them."""
        if used := next((a for a in op.ins if a in self.positions), None):
            self.found[op.n] = _computes_with_positions(used)
            return True
        return False

    def is_count(self, op: _Op) -> bool:
        """x.shape[0] of selected rows, mask.sum().item(): used as sizes only, checked where read."""
        if op.dd and not isinstance(op.val, torch.Tensor) \
                and not (isinstance(op.val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in op.val)):
            self.counts.add(op.n)
            return True
        return False

    def uses_count(self, op: _Op) -> bool:
        """A count as the size of a view (decided by the later cases), or of another count; not in arithmetic."""
        if not (used := next((a for a in op.ins if a in self.counts), None)):
            return False
        if op.name not in _SIZES_OF_VIEWS and not (not isinstance(op.val, torch.Tensor) and op.dd):
            self.found[op.n] = _computes_with_count(used)
            return True
        if not isinstance(op.val, torch.Tensor):
            self.counts.add(op.n)
            return True
        return False

    def masked_scatter(self, op: _Op) -> bool:
        """A source of the destination's own shape gives its first elements, whichever rows the mask selects."""
        n = op.n
        if not (op.name in ("masked_scatter", "masked_scatter_") and len(n.args) > 2):
            return False
        source, mask = n.args[2], n.args[1]
        if source in self.rows and self.rows[source] is not _mask_of(mask):  # mask[:, None].expand_as(out): the mask
            self.found[n] = _puts_back_other(source, "mask")
        elif source not in self.rows and source in self.from_batch \
                and source.meta["val"].numel() >= n.meta["val"].numel():
            self.found[n] = SCATTERS_FIRST_ELEMENTS
        return True

    def reads_selected_rows(self, op: _Op) -> bool:
        """A value of a fixed size read from selected rows (a loss over them); a node of no selected rows is decided."""
        if op.dd:
            return False
        selected = [a for a in op.ins if a in self.rows]
        if not selected or op.n in self.counted and len({self.rows[a] for a in selected}) == 1:
            return True  # a cross-entropy's mean over rows one mask selected: merged by each micro-batch's count
        if op.name not in SHAPE_ONLY:
            self.found[op.n] = (f"reads rows selected by value ({selected[0].name}) other than row by row or put back "
                                f"where they were taken")
        return True

    def row_by_row(self, op: _Op) -> bool:
        """Selected rows computed into more selected rows: row by row, their number kept, from one mask's rows."""
        n, name = op.n, op.name
        selected = [a for a in op.ins if a in self.rows]
        first = op.first
        if name in _CATS and n.args and isinstance(n.args[0], (list, tuple)) and n.args[0]:
            first = n.args[0][0]  # torch.cat([rows, f(rows)], -1)
        elif first not in self.rows and selected and n.op != "call_module":
            first = selected[0]  # 2.0 * rows
        sel = n.meta.get("selected_rows")
        others = [a for a in op.ins if a in self.from_batch and a not in self.rows
                  and isinstance(a.meta.get("val"), torch.Tensor)]  # h[mask] * h.mean(0)
        if sel is None or not selected or first not in self.rows or others \
                or any(a.meta.get("selected_rows", (0, ""))[1] != sel[1] for a in selected) \
                or not isinstance(first.meta.get("val"), torch.Tensor):
            self.found[n] = _size_not_followed(name or n.target, selected)
        elif not _keeps_rows(op, first, selected):
            self.found[n] = f"computes from rows selected by value ({selected[0].name}) other than row by row"
        elif len({self.rows[a] for a in selected}) > 1:
            self.found[n] = _different_masks(selected)
        else:
            self.rows[n] = self.rows[selected[0]]
        return True

    def misreads_index(self, n: fx.Node, name: str) -> str:
        """Why ``n``, which indexes by value (some index is positions or a mask), is misread; "" where it is not."""
        got = _indexed(n, name)
        if got is None or not isinstance(got[0], fx.Node):
            return CANNOT_FOLLOW
        target, pairs = got
        if target in self.positions:
            return "indexes the positions themselves"
        origins, by_rows = set(), False
        for d, i in pairs:
            if not isinstance(i, fx.Node) or not isinstance(i.meta.get("val"), torch.Tensor):
                return CANNOT_FOLLOW
            if i in self.positions:
                origin, j = self.positions[i]
                if j is None:
                    return f"indexes with {i.name}, all positions of a mask at once"
                origins.add(_mask_of(origin.args[0]))  # the mask: nonzero(m) and m select the same rows, in order
                mask_dim, target_dim = self.size(origin.args[0], j), self.size(target, d)
            elif self.by_mask(i):
                origins.add(_mask_of(i))
                mask_dim, target_dim = self.size(i, 0), self.size(target, d)
            else:
                continue  # an index of no rows by value: a constant, or row-wise (gather(x, -1, idx))
            if mask_dim != target_dim:
                return _other_rows(d, target, mask_dim)
            by_rows |= mask_dim[0]
        if not origins:
            return ""
        if len(origins) > 1:
            return MIXED_MASKS
        if not by_rows:
            return _along_other_dims(target)
        self.origin_of[n] = origins.pop()
        return ""


_CASES = (_Selections.takes_positions, _Selections.part_of_positions, _Selections.part_of_rows_tuple,
          _Selections.indexes_by_value, _Selections.counts_positions, _Selections.computes_with_positions,
          _Selections.is_count, _Selections.uses_count, _Selections.masked_scatter, _Selections.reads_selected_rows,
          _Selections.row_by_row)


def _keeps_rows(op: _Op, first: fx.Node, selected: list[fx.Node]) -> bool:
    """The op computes rows ``first``'s row by row, their number kept: along another dim, the rows as a matmul's rows,
    or pointwise (a row-wise module or activation, a reshape, rows[:, 0])."""
    n, name = op.n, op.name
    module = n.graph.owning_module.get_submodule(n.target) if n.op == "call_module" else None
    ndim, along = first.meta["val"].dim(), first.meta["selected_rows"][0]
    bound = bind(n.target, n.args, n.kwargs) or {} if n.op != "call_module" else {}
    if name in ALONG_DIMS or name in _CATS or isinstance(module, _ALONG_DIM_MODULES) or hasattr(module, "dim"):
        shape = bound.get("normalized_shape", getattr(module, "normalized_shape", None))
        dims = bound.get("dim", getattr(module, "dim", None))
        dims = dims if isinstance(dims, (list, tuple)) else [dims]
        return (name in ("dropout", "native_dropout") or shape is not None and len(shape) < ndim - along or
                dims != [None] and all(isinstance(d, int) and d % ndim != along for d in dims))
    if name in ON_ROWS:  # the rows as the operand whose rows stay rows: linear(x, w), x @ w; not a convolution's
        operand = n.args[1] if name in ("addmm", "baddbmm") else first  # channels or an image's height
        return name not in ("embedding",) and not name.startswith("conv") and all(a is operand for a in selected) \
            and along == 0 and ndim >= 2
    overloads = aten_overloads(n.target if n.op == "call_method" else name)
    pointwise = name in _POINTWISE_OPERATORS or any(torch.Tag.pointwise in o.tags for o in overloads)
    activation = type(module).__module__ == "torch.nn.modules.activation" \
        and not isinstance(module, (torch.nn.MultiheadAttention, torch.nn.Softmax2d))
    index = n.args[1] if name == "getitem" and len(n.args) > 1 else None  # rows[:, 0]: every row
    kept_rows = isinstance(index, tuple) and index[:1] == (slice(None),) and along == 0
    return name in RESHAPES or name in SHAPE_ONLY or pointwise or isinstance(module, ROW_MODULES) or activation \
        or kept_rows


def _indexed(n: fx.Node, name: str) -> tuple[Any, list[tuple[int, Any]]] | None:
    """(the tensor indexed, [(its dim, the index)])."""
    bound = bind(n.target, n.args, n.kwargs) or {}
    if name in ("index_select", "gather") or name.startswith(("index_add", "index_copy", "index_reduce", "scatter")):
        return n.args[0], [(bound.get("dim", 0), bound.get("index"))]
    if name in ("index", "index_put", "index_put_"):
        if not isinstance(n.args[1], (list, tuple)):
            return None
        return n.args[0], [(p, i) for p, i in enumerate(n.args[1]) if i is not None]
    index = n.args[1] if isinstance(n.args[1], tuple) else (n.args[1],)  # getitem / setitem: x[mask, 2:], x[:, j]
    pairs, d = [], 0
    for i in index:
        if i is Ellipsis:
            return None
        if isinstance(i, fx.Node):
            pairs.append((d, i))
        d += i is not None
    return n.args[0], pairs


def _mask_of(m: Any) -> Any:
    """A view of a mask in the same row-major order (m.view(b, t), m[:, None]) selects in the same order: the mask."""
    while isinstance(m, fx.Node) and m.args and isinstance(m.args[0], fx.Node) and op_name(m.target) in _SAME_ORDER \
            and not (op_name(m.target) == "getitem" and any(isinstance(getattr(a, "meta", {}).get("val"), torch.Tensor)
                                                            for a in pytree.tree_leaves(m.args[1:]))):
        m = m.args[0]
    return m
