"""Whether each sample's rows stay together, so that micro-batch parts concatenate to the plain model's value (an output
of k rows a sample: MoE router logits, ``logits.view(-1, V)``), or values mix samples, which no merge undoes (``u @
v.T``, rows of several samples in turn read back as rows of samples): Note [samples kept together], Note [values that
mix samples]."""
from __future__ import annotations

import math
import operator
from typing import Any

import torch
import torch.fx as fx

from autopipe.random_ops import aten_overloads, bind, op_name

from .facts import ALONG_DIMS, ON_ROWS, RESHAPES, ROW_MODULES, concatenated_rows, is_inplace, rows_per_sample, views

PAIRS_SAMPLES = "holds the batch in two dims: it pairs the samples (contrastive logits u @ v.T, in-batch negatives)"


def _not_batch_rows(source: fx.Node, v: torch.Tensor) -> str:
    return (f"reshapes {source.name} {tuple(v.shape)}, whose dim 0 is not the batch, into rows of samples: each row "
            f"holds parts of several samples (a view with the batch size written in, a flatten of a sequence-first "
            f"tensor)")


def _interleaved(flatten: fx.Node) -> str:
    return (f"reshapes rows that {flatten.name} made by flattening a tensor whose batch is not in dim 0 (a "
            f"sequence-first one: rows in sequence order), or by stacking batches along dim 0 (torch.cat(x.unbind(1)), "
            f"repeat), into rows of samples: each row holds parts of several samples")


def _out_of_order(source: fx.Node) -> str:
    return (f"concatenates the rows of {source.name} along dim 0 in another order than theirs (reversed, permuted or "
            f"repeated pieces of x.unbind(0), x.split(1), x[i]): each micro-batch reorders its own rows alone")


# Note [samples kept together]: an output of k > 1 rows a sample merges by concatenation only where each sample's
# rows stay together: a reshape of a batch tensor (row-major order is kept) or a cat of its rows in order, then
# row-wise ops whose other operands do not come from the batch, no number that differs between micro-batches
# (flat * flat.shape[0]), and no later in-place write to a view of it that is not row by row (flat[:2] = 0).
def samples_together(gm: fx.GraphModule, from_batch: set[fx.Node]) -> set[fx.Node]:
    """Values whose dim 0 holds k rows a sample (k > 1) with each sample's rows together, so that micro-batch parts
    concatenate to the plain model's value: MoE router logits, ``logits.view(-1, V)``: a reshape of a batch tensor
    (row-major order is kept; a torch.cat of its rows in order is one: facts.py, Note [rows concatenated in order]),
    then row-wise ops whose other operands do not come from the batch, with no number that differs between
    micro-batches, and no later write in place to a view of it that is not row by row (Note [samples kept
    together])."""
    together: set[fx.Node] = set()
    poisoned: set[fx.Node] = set()
    storage = views(gm)
    while True:
        together.clear()
        for n in gm.graph.nodes:  # k == 1 is the batch itself, as GPipe takes it
            k = rows_per_sample(n)
            by_getitem = n.op == "call_function" and n.target is operator.getitem and isinstance(n.args[0], fx.Node)
            if k > 1 and n not in poisoned and (_together_by_getitem(gm, n, k, together, from_batch) if by_getitem
                                                else _keeps_rows(gm, n, k, together, from_batch)):
                together.add(n)
        # a write in place to a view of a together value (x[:2] = 0, y.copy_(a sequence-major z)) that is not row by
        # row changes every view of its storage
        written = {storage[n.args[0]] for n in gm.graph.nodes
                   if is_inplace(n) and n.args and isinstance(n.args[0], fx.Node) and rows_per_sample(n.args[0]) != 1
                   and not (n.args[0] in together
                            and _keeps_rows(gm, n, rows_per_sample(n.args[0]), together, from_batch))}
        spoilt = {n for n in together if storage[n] in written} - poisoned
        if not spoilt:
            return together
        poisoned |= spoilt


def _rows_of(n: Any) -> int | None:
    val = n.meta.get("val") if isinstance(n, fx.Node) else None
    return int(val.shape[0]) if isinstance(val, torch.Tensor) and val.dim() else None


def _keeps_rows(gm: fx.GraphModule, n: fx.Node, k: int, together: set[fx.Node], from_batch: set[fx.Node]) -> bool:
    """``n``'s tensor operands give a result of k rows a sample, row by row."""
    if (rows := concatenated_rows(n)) is not None and rows[1]:  # a reshape of rows[0] (facts.py)
        return rows[0] in together or rows_per_sample(rows[0]) == 1
    operands = [a for a in n.all_input_nodes if a.op != "get_attr" and isinstance(a.meta.get("val"), torch.Tensor)]
    if not operands or n.op not in ("call_function", "call_method", "call_module"):
        return False
    first, others = operands[0], operands[1:]
    if n.op == "call_module":
        module = gm.get_submodule(n.target)
        name = "module" if isinstance(module, ROW_MODULES) else type(module).__name__
    else:
        name = op_name(n.target)
    if name in RESHAPES:
        return first in together or rows_per_sample(first) == 1
    if first not in together or rows_per_sample(first) != k or n.meta.get("batch_literal") or \
            any(a.meta.get("batch_number") for a in n.all_input_nodes):
        return False  # y * y.shape[0]: a number that differs between micro-batches
    if name in ON_ROWS:  # a 2-D operand with these rows would be summed over them
        return all(a not in from_batch or (a.meta["val"].dim() > 2 and a in together and rows_per_sample(a) == k)
                   for a in others)
    if name in ALONG_DIMS:
        if _along_dim_0(n, name, first):
            return False
    elif name != "module" and not any(torch.Tag.pointwise in o.tags
                                      for o in aten_overloads(n.target if n.op == "call_method" else name)):
        return False
    return all(a not in from_batch or (rows_per_sample(a) == k and a in together) for a in others)


def _along_dim_0(n: fx.Node, name: str, first: fx.Node) -> bool:
    """An op of ALONG_DIMS along dim 0, or over every dim (``normalized_shape``)."""
    bound, ndim = bind(n.target, n.args, n.kwargs) or {}, first.meta["val"].dim()
    dims = bound.get("dim")
    rows = _rows_of(first)
    if name == "slice" and bound.get("start") in (0, None) and (bound.get("end") or rows) >= rows \
            and bound.get("step", 1) == 1:
        dims = None  # export's x[:, ...]: all of dim 0
    if dims is None and name in ("softmax", "log_softmax"):
        dims = 0 if ndim in (0, 1, 3) else 1  # F.softmax's implicit dim (torch/nn/functional.py, _get_softmax_dim)
    return any(d % ndim == 0 for d in (dims if isinstance(dims, (list, tuple)) else [dims]) if isinstance(d, int)) or \
        len(bound.get("normalized_shape") or ()) >= ndim


def _together_by_getitem(gm: fx.GraphModule, n: fx.Node, k: int, together: set[fx.Node],
                         from_batch: set[fx.Node]) -> bool:
    source, index = n.args
    if isinstance(source.meta.get("val"), (tuple, list)):  # one result of topk, split, ... along another dim
        return _keeps_rows(gm, source, k, together, from_batch)
    index = index if isinstance(index, tuple) else (index,)  # x[:, ...], x[..., i]: an index that leaves dim 0 whole
    return source in together and rows_per_sample(source) == k and bool(index) and (
        isinstance(index[0], slice) and index[0] == slice(None)
        or index[0] is Ellipsis and sum(i is not None for i in index[1:]) < source.meta["val"].dim())


# Note [values that mix samples]: some outputs come back row-permuted from concatenated micro-batches: a cat of two
# batch tensors along dim 0 (classifier-free guidance), a flatten after a transpose (sequence-major), a value
# holding the batch in two dims (u @ v.T), a reshape into rows of samples of a value whose dim 0 is not the batch,
# and every value computed from one of these. They are refused as outputs, naming the node that mixed; a reshape
# that gives dim 0 a non-batch size again (attention's (seq, batch, d) round trip) ends such rows.
def samples_mixed(gm: fx.GraphModule, from_batch: set[fx.Node], interleaved: dict[fx.Node, fx.Node],
                  misread: dict[fx.Node, str]) -> dict[fx.Node, tuple[str, str]]:
    """Each value computed from one that mixes samples -> (that node, how): one holding the batch in two dims (trace's
    "pairs_samples"), rows selected by value misread (``misread``), a batch tensor's rows concatenated out of their
    order (facts.concatenated_rows), or a reshape into rows of samples (one row a sample) of rows that are not in
    sample order: of a value whose dim 0 is not the batch (row-major order puts parts of several samples in a row), or
    of a flatten of one whose batch is in a later dim (``h.transpose(0, 1).reshape(-1, d)``: rows in sequence order,
    which row-wise ops keep, until a reshape gives a dim 0 that is not the batch again, as attention's (seq, batch, d)
    round trip)."""
    mixed: dict[fx.Node, tuple[str, str]] = {}
    written: dict[fx.Node, tuple[str, str]] = {}  # a storage (view root) written in place with a value mixing samples
    storage = views(gm)
    for n in gm.graph.nodes:
        source = n.all_input_nodes[0] if n.op in ("call_function", "call_method") and n.all_input_nodes else None
        reshape, v = op_name(n.target) in RESHAPES, source.meta.get("val") if source is not None else None
        if mixed_input := next((a for a in n.all_input_nodes if a in mixed or storage[a] in written), None):
            mixed[n] = mixed.get(mixed_input) or written[storage[mixed_input]]  # named by the first that mixes
        elif n.meta.get("pairs_samples"):
            mixed[n] = (n.name, PAIRS_SAMPLES)
        elif n in misread:
            mixed[n] = (n.name, misread[n])
        elif (rows := concatenated_rows(n)) is not None and not rows[1]:
            mixed[n] = (n.name, _out_of_order(rows[0]))
        elif (reshape and rows_per_sample(n) == 1 and source in from_batch and not rows_per_sample(source)
              and isinstance(v, torch.Tensor) and v.dim() and v.shape[0] > 1):
            mixed[n] = (n.name, _not_batch_rows(source, v))
        elif reshape and rows_per_sample(n) == 1 and source in interleaved:
            mixed[n] = (n.name, _interleaved(interleaved[source]))
        if n in mixed and is_inplace(n) and isinstance(n.args[0], fx.Node):
            written[storage[n.args[0]]] = mixed[n]  # buf[0, :k] = rows: what reads buf after reads them
    return mixed


def interleaved_rows(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Rows of several samples in turn (k rows a sample in sequence order: a flatten of a tensor whose batch is in a
    later dim, batches stacked along dim 0, and row-wise ops on them) -> the node that made them."""
    interleaved: dict[fx.Node, fx.Node] = {}
    for n in gm.graph.nodes:
        source = n.all_input_nodes[0] if n.op in ("call_function", "call_method") and n.all_input_nodes else None
        v = source.meta.get("val") if source is not None else None
        if rows_per_sample(n) > 1 and op_name(n.target) in RESHAPES and isinstance(v, torch.Tensor) \
                and (d := source.meta.get("batch_dim", 0)) > 0 and math.prod(v.shape[:d]) > 1 \
                or rows_per_sample(n) > 1 and _stacks_batches(n):
            interleaved[n] = n
        elif rows_per_sample(n) > 1 and (origin := next((interleaved[a] for a in n.all_input_nodes if a in interleaved),
                                                        None)):
            interleaved[n] = origin
    return interleaved


def _stacks_batches(n: fx.Node) -> bool:
    """Batch rows stacked along dim 0 one batch after another: ``torch.cat(x.unbind(1))``, ``x.repeat(t, 1)``,
    ``torch.tile``."""
    name, number = op_name(n.target), lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a
    if name in ("cat", "concat", "concatenate", "vstack", "row_stack") and n.args and concatenated_rows(n) is None:
        dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim", 0)
        listed = isinstance(n.args[0], (list, tuple))
        parts = n.args[0] if listed else n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else ()
        batches = [a for a in parts if rows_per_sample(a)] if listed else list(parts or ())  # fx: cat(x.unbind(1))
        return dim == 0 and len(batches) > 1
    if name in ("repeat", "tile") and len(n.args) > 1 and rows_per_sample(n.args[0]):
        times = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (list, tuple)) else n.args[1:]
        lead = len(times) - n.args[0].meta["val"].dim()  # repeat's extra leading dims count first
        return lead >= 0 and isinstance(number(times[lead]), int) and number(times[lead]) > 1
    return False
