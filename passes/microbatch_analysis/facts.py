"""The facts the micro-batch rules read: trace's facts on each node (``node.meta``: "rows_per_sample", "batch_dim",
"pairs_samples", "batch_number", "batch_free", "batch_literal", "data_dependent", "selected_rows"; docs/architecture.md,
"Contracts between passes"), the nodes computed from the batch, which values share a storage, and the op tables the
rules share."""
from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

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
