"""The torch.export route of the trace pass.

``export_flat_graph(model, bound, batch_size)`` captures ``model`` with
non-strict ``torch.export`` (one dynamic batch dimension), unlifts it back to
a module whose parameters are ``get_attr`` nodes, and flattens its calling
convention, so that the graph is what the later passes expect:

* one placeholder per TENSOR leaf of ``tree_flatten(bound)``, in that order,
  named after the argument (``input_ids``, ``attention_mask``,
  ``past_key_values_0_1`` ...); non-tensor leaves (bools, ints, strings) are
  baked in as constants;
* the output node returns a flat tuple of the tensor leaves of
  ``tree_flatten(model(**bound))``; ``output_spec`` and ``output_constants``
  rebuild the model's own output type (``ModelOutput``, tuple, dict, plain
  dataclass) with ``ExportedGraph.unflatten_output``;
* ``get_attr`` targets are the model's qualified parameter / buffer names and
  resolve to the model's OWN Parameter / buffer objects (no copies):
  gradients land on the user's parameters, in-place buffer updates (BatchNorm
  running statistics, ``num_batches_tracked``) land on the user's buffers,
  and tied weights stay one object (export keeps ONE target for them, e.g.
  GPT-2's embedding reads ``lm_head.weight``);
* ``node.meta["val"]`` (fake tensors; the batch dimension is a symbol, see
  ``ExportedGraph.batch_symbol``) and ``node.meta["nn_module_stack"]``
  (paths relative to the model) are kept; call nodes are named after the
  innermost module and the op (``transformer_h_0_attn_c_attn_addmm``);
  each ``get_attr`` sits just before its first user.

No node bakes in the batch size (it is a ``torch.export.Dim``), so every
piece of the graph runs on micro-batches of any size >= 1 (unless asked for
a static graph, ``dynamic_batch=False``: then every size is a constant). The batch size
reaches later nodes as ``aten.sym_size.int(<input>, 0)`` nodes (SymInt
values): a piece of the graph that uses one needs it as an input (an int)
or must recompute it from a tensor it has.

Decisions:

* How: the model is called through a small wrapper module whose
  ``forward(*tensor_leaves)`` rebuilds ``bound``, calls the model and
  returns the flat tensor leaves of its output; the wrapper's prefix is
  stripped from every name afterwards. (Exporting the model with its own
  signature breaks on ``**kwargs`` in torch 2.13: export's dynamic-shape
  matcher puts the var-keyword entries at top level.)
* The graph is captured in the model's CURRENT mode (``model.training``):
  dropout / BatchNorm behaviour is frozen into the graph (``ExportedGraph.
  training`` records which); export again after ``model.train()/eval()``.
* If ``model.forward`` has a ``use_cache`` parameter that the caller did not
  bind, it is called with ``use_cache=False`` (a KV cache is an opaque
  object, useless for training, and would otherwise be part of the output).
  It is recorded in ``ExportedGraph.forced_kwargs``; it is not an input.
* Example tensors are copied (same strides) before export: export ties
  inputs that are the same tensor object (``input_ids`` passed again as
  ``labels``), and the graph would then read one placeholder for both.
* With ``batch_size == 1`` the batch tensors are repeated to two rows for the
  export only (a size-1 example is specialised to 1 by the 0/1 rule).
* Assertion nodes (``_assert_tensor_metadata``, ``_assert_scalar``,
  ``sym_constrain_range*``, export's ``_guards_fn`` call) are dropped: they
  only re-check facts about the example and would pin tensors across cuts.
* Plain (unregistered) dataclasses in the output are registered as pytree
  nodes with ``torch.utils._pytree.register_dataclass`` (process-wide).
"""

from __future__ import annotations

import dataclasses
import inspect
import keyword
import linecache
import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

__all__ = ["ExportedGraph", "ExportRouteError", "export_flat_graph"]

_ROOT = "_autopipe_model"  # the model's attribute name inside the wrapper


class ExportRouteError(RuntimeError):
    """torch.export could not capture the model (the cause is chained)."""


@dataclass
class ExportedGraph:
    graph_module: fx.GraphModule
    # inputs: the leaves of tree_flatten(bound); tensor leaves are the placeholders
    input_names: list[str]  # placeholder names, in order
    input_spec: pytree.TreeSpec  # tree_flatten(bound)[1]
    input_constants: dict[int, Any]  # leaf index -> baked-in non-tensor value
    # outputs: the tensor leaves of tree_flatten(output) are the graph outputs
    output_spec: pytree.TreeSpec
    output_constants: dict[int, Any]  # leaf index -> non-tensor output value
    training: bool  # the mode the graph was captured in
    batch_symbol: Any = None  # sympy symbol of the batch dim in node.meta["val"]
    forced_kwargs: dict[str, Any] = field(default_factory=dict)
    exported_program: Any = None  # the torch.export.ExportedProgram (debugging)

    # the same facts in trace.TracedModel's terms
    @property
    def output_positions(self) -> list[int]:
        """Output leaf index of each flat graph output."""
        n = self.output_spec.num_leaves
        return [i for i in range(n) if i not in self.output_constants]

    @property
    def output_leaves(self) -> list[Any]:
        """Non-tensor output leaves; None where a graph output goes."""
        return [self.output_constants.get(i) for i in range(self.output_spec.num_leaves)]

    def flatten_inputs(self, bound: dict[str, Any]) -> list[torch.Tensor]:
        """The graph's positional inputs for a bound-arguments dict."""
        leaves, spec = pytree.tree_flatten(dict(bound))
        if spec != self.input_spec:
            raise ValueError(
                "inputs do not have the structure the graph was exported with:\n"
                f"{spec}\nexpected\n{self.input_spec}"
            )
        return [x for i, x in enumerate(leaves) if i not in self.input_constants]

    def unflatten_output(self, flat: tuple | list) -> Any:
        """Rebuild the model's output (same type) from the graph's flat outputs."""
        it = iter(flat)
        leaves = [
            self.output_constants[i] if i in self.output_constants else next(it)
            for i in range(self.output_spec.num_leaves)
        ]
        return pytree.tree_unflatten(leaves, self.output_spec)


# --------------------------------------------------------------------------


class _FlatCall(nn.Module):
    """forward(*tensor leaves of bound) -> tuple(tensor leaves of the output)."""

    def __init__(self, model, leaves, is_tensor, in_spec, forced, record):
        super().__init__()
        setattr(self, _ROOT, model)
        self.train(model.training)
        self._leaves = list(leaves)
        self._tensor_pos = [i for i, t in enumerate(is_tensor) if t]
        self._in_spec = in_spec
        self._forced = forced
        self._sig = inspect.signature(model.forward)
        # filled by forward (a plain dict held from outside: export restores
        # module attributes assigned while tracing)
        self._record = record

    def forward(self, *tensors):
        leaves = list(self._leaves)
        for pos, t in zip(self._tensor_pos, tensors):
            leaves[pos] = t
        bound = pytree.tree_unflatten(leaves, self._in_spec)
        arguments = {
            name: bound[name] if name in bound else self._forced[name]
            for name in self._sig.parameters
            if name in bound or name in self._forced
        }
        ba = inspect.BoundArguments(self._sig, arguments)
        out = getattr(self, _ROOT)(*ba.args, **ba.kwargs)
        _register_dataclasses(out)
        flat, spec = pytree.tree_flatten(out)
        constants: dict[int, Any] = {}
        result = []
        for i, x in enumerate(flat):
            if isinstance(x, torch.Tensor):
                result.append(x)
            elif isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
                raise ExportRouteError(
                    f"output leaf {i} of {type(getattr(self, _ROOT)).__name__} is a "
                    f"symbolic {type(x).__name__} ({x}), e.g. a size depending on the "
                    "batch: only tensors and constants can be outputs"
                )
            else:
                constants[i] = x
        self._record.update(out_spec=spec, out_constants=constants)
        return tuple(result)


def _register_dataclasses(output: Any) -> None:
    """Make plain dataclasses found in ``output`` pytree nodes."""
    for _ in range(32):  # nested dataclasses appear once their parent is a node
        new = {
            type(x)
            for x in pytree.tree_leaves(output)
            if dataclasses.is_dataclass(x)
            and not isinstance(x, type)
            and type(x) not in pytree.SUPPORTED_NODES
        }
        if not new:
            return
        for cls in new:
            pytree.register_dataclass(cls)


_ASSERT_OPS = {
    "_assert_tensor_metadata",
    "_assert_scalar",
    "_assert_async",
    "sym_constrain_range",
    "sym_constrain_range_for_size",
    "_functional_sym_constrain_range",
    "_functional_sym_constrain_range_for_size",
    "_functional_assert_async",
    "_functional_assert_scalar",
}


def _is_assert(node: fx.Node) -> bool:
    if node.op == "call_module":
        return str(node.target).startswith("_guards_fn")
    if node.op != "call_function":
        return False
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t.namespace == "aten" and t._schema.name.split("::")[-1] in _ASSERT_OPS
    return t is torch._assert


def _op_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name.split("::")[-1]
    if isinstance(t, torch._ops.HigherOrderOperator):
        return t.name()
    return getattr(t, "__name__", str(t)).strip("_") or "op"


def _strip(path: str) -> str | None:
    """Wrapper path -> model path ('' for the model itself, None if outside)."""
    if path == _ROOT:
        return ""
    if path.startswith(_ROOT + "."):
        return path[len(_ROOT) + 1 :]
    return None


def _fix_module_stack(meta: dict) -> None:
    """Rewrite nn_module_stack as a plain export of the model records it."""
    stack = meta.get("nn_module_stack")
    if not stack:
        return
    fixed = {}
    for path, typ in stack.values():
        p = _strip(path) if isinstance(path, str) else None
        if p is not None:  # the wrapper itself is dropped
            fixed["L__self__" + p] = (p, typ)
    meta["nn_module_stack"] = fixed


def _leaf_names(bound: dict[str, Any]) -> list[str]:
    """Readable, unique identifiers for the leaves of tree_flatten(bound)."""
    names, seen = [], set()
    for path, _ in pytree.tree_flatten_with_path(bound)[0]:
        parts = []
        for k in path:
            if isinstance(k, pytree.MappingKey):
                parts.append(str(k.key))
            elif isinstance(k, pytree.SequenceKey):
                parts.append(str(k.idx))
            elif isinstance(k, pytree.GetAttrKey):
                parts.append(k.name)
            else:
                parts.append(str(k))
        name = re.sub(r"\W", "_", "_".join(parts)) or "input"
        if name[0].isdigit() or keyword.iskeyword(name):
            name = "arg_" + name
        base, n = name, 1
        while name in seen:
            name, n = f"{base}_{n}", n + 1
        seen.add(name)
        names.append(name)
    return names


def export_flat_graph(
    model: nn.Module, bound: dict[str, Any], batch_size: int, *, dynamic_batch: bool = True
) -> ExportedGraph:
    """Capture ``model`` called with ``bound`` as a flat fx graph (see module doc).

    ``bound`` is ``inspect.signature(model.forward).bind(*args, **kwargs).arguments``.
    ``batch_size`` is the size of dim 0 of the batch tensors in ``bound``: dim 0
    of every tensor leaf of that size becomes one dynamic dimension, ``batch``.
    With ``dynamic_batch=False`` no dimension is dynamic: the graph is exported
    for exactly these shapes (``batch_symbol`` is None), for models that make
    the batch size a constant (trace.py's ``static_batch``).
    Raises ``ExportRouteError`` (with torch's error chained) if export fails.
    """
    bound = dict(bound)
    sig = inspect.signature(model.forward)
    leaves, in_spec = pytree.tree_flatten(bound)
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    is_batch = [
        t and x.dim() > 0 and x.shape[0] == batch_size for x, t in zip(leaves, is_tensor)
    ]
    if not any(is_batch):
        shapes = {n: tuple(x.shape) for n, x, t in zip(_leaf_names(bound), leaves, is_tensor) if t}
        raise ValueError(
            f"no tensor input of {type(model).__name__} has batch_size={batch_size} "
            f"rows in dim 0 (tensor inputs: {shapes})"
        )

    forced: dict[str, Any] = {}
    p = sig.parameters.get("use_cache")
    if p is not None and p.kind is not inspect.Parameter.VAR_KEYWORD and "use_cache" not in bound:
        forced["use_cache"] = False

    # Example tensors: fresh copies with the same strides (export would tie
    # aliased inputs), two rows where the batch is 1 (a size-1 example is
    # specialised to 1).
    examples = []
    for x, b in zip(leaves, is_batch):
        if not isinstance(x, torch.Tensor):
            continue
        x0 = x.detach()
        if b and batch_size == 1 and dynamic_batch:
            x0 = torch.cat([x0, x0])
        if 0 in x0.stride() and x0.numel() > 1:  # expanded: memory overlaps
            y = x0.clone()
        else:  # same values and strides (views, channels_last), no aliasing
            y = torch.empty_strided(x0.shape, x0.stride(), dtype=x0.dtype, device=x0.device)
            if y.device.type != "meta":
                y.copy_(x0)
        examples.append(y.requires_grad_(x.requires_grad))
    batch = torch.export.Dim("batch", min=1)
    dynamic = tuple({0: batch} if b and dynamic_batch else None for b, t in zip(is_batch, is_tensor) if t)

    record: dict[str, Any] = {}
    wrapper = _FlatCall(model, leaves, is_tensor, in_spec, forced, record)
    try:
        ep = torch.export.export(
            wrapper, tuple(examples), dynamic_shapes={"tensors": dynamic}, strict=False
        )
    except ExportRouteError:
        raise
    except Exception as e:  # noqa: BLE001 - re-raised with what was tried
        where = _user_frame(e, model)
        hint = ""
        if dynamic_batch and "Constraints violated (batch)" in str(e):
            hint = (
                "\nThe model treats the batch size as a constant (e.g. reshape("
                f"{batch_size}, ...)), so it cannot run on smaller micro-batches; "
                'TORCH_LOGS="+dynamic" shows where it specialised.'
            )
        how = f"dim 0 of size {batch_size} dynamic" if dynamic_batch else f"static shapes, batch {batch_size}"
        raise ExportRouteError(
            f"torch.export (non-strict, {how}) failed on "
            f"{type(model).__name__}{where}: {type(e).__name__}: {e}{hint}"
        ) from e
    out_spec, out_consts = record["out_spec"], record["out_constants"]

    unlifted = ep.module()
    old = unlifted.graph
    old_phs = [n for n in old.nodes if n.op == "placeholder"]
    if len(old_phs) != len(examples):
        raise ExportRouteError(
            f"unexpected export calling convention: {len(old_phs)} inputs for "
            f"{len(examples)} tensors"
        )

    # ---- a fresh flat graph (fresh names): placeholders named after arguments
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    names = _leaf_names(bound)
    input_names = []
    for node, name in zip(old_phs, [n for n, t in zip(names, is_tensor) if t]):
        ph = graph.placeholder(name, type_expr=node.type)
        ph.meta = dict(node.meta)
        env[node] = ph
        input_names.append(ph.name)

    module_paths = {name for name, _ in model.named_modules()}
    for node in old.nodes:
        if node.op == "placeholder" or _is_assert(node):
            continue
        if node.op == "output":
            vals = node.args[0]
            vals = vals if isinstance(vals, (tuple, list)) else (vals,)
            graph.output(tuple(fx.node.map_arg(tuple(vals), env.__getitem__)))
            continue
        target, name = node.target, node.name
        meta = dict(node.meta)
        _fix_module_stack(meta)  # on a copy: the ExportedProgram keeps its own
        if node.op in ("get_attr", "call_module"):
            stripped = _strip(str(target))
            if stripped:
                target = stripped
                name = re.sub(r"\W", "_", stripped)
        elif node.op == "call_function":
            stack = meta.get("nn_module_stack") or {}
            path = list(stack.values())[-1][0] if stack else ""
            op = _op_name(node)
            name = f"{path}_{op}" if path in module_paths and path else op
            name = re.sub(r"\W", "_", name)
        new = graph.create_node(
            node.op,
            target,
            fx.node.map_arg(node.args, env.__getitem__),
            fx.node.map_arg(node.kwargs, env.__getitem__),
            name=name,
            type_expr=node.type,
        )
        new.meta = meta
        env[node] = new

    # ---- the module: the model's own objects behind every get_attr
    own: dict[str, Any] = dict(model.named_parameters(remove_duplicate=False))
    own.update(model.named_buffers(remove_duplicate=False))
    root: dict[str, Any] = {}
    for old_node, node in env.items():
        if node.op not in ("get_attr", "call_module"):
            continue
        target = str(node.target)
        if target in own:
            obj = own[target]
        else:  # lifted constants, submodules of higher-order ops
            obj = _getattr_path(unlifted, str(old_node.target))
            if isinstance(obj, nn.Parameter):
                raise ExportRouteError(
                    f"get_attr {target!r} is a Parameter the model does not have"
                )
        if target in root and root[target] is not obj:
            raise ExportRouteError(f"two objects for get_attr target {target!r}")
        root[target] = obj
    gm = fx.GraphModule(root, graph, class_name=f"{type(model).__name__}Graph")
    gm.graph.eliminate_dead_code()
    # export puts every get_attr first; put each just before its first user,
    # so that a contiguous cut keeps a parameter with (the first of) its users
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in [n for n in gm.graph.nodes if n.op == "get_attr" and n.users]:
        min(node.users, key=order.__getitem__).prepend(node)
    gm.graph.lint()
    gm.recompile()

    batch_symbol = None
    for node in gm.graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and isinstance(val, torch.Tensor) and val.dim() > 0:
            if isinstance(val.shape[0], torch.SymInt):
                batch_symbol = val.shape[0].node.expr
                break

    return ExportedGraph(
        graph_module=gm,
        input_names=input_names,
        input_spec=in_spec,
        input_constants={i: x for i, x in enumerate(leaves) if not is_tensor[i]},
        output_spec=out_spec,
        output_constants=out_consts,
        training=model.training,
        batch_symbol=batch_symbol,
        forced_kwargs=forced,
        exported_program=ep,
    )


def _user_frame(exc: BaseException, model: nn.Module) -> str:
    """' at <module path> (file:line, code)' of the deepest user frame of exc."""
    skip = (os.path.dirname(torch.__file__), os.path.dirname(inspect.__file__), __file__)
    modules = {id(m): name for name, m in model.named_modules()}
    found = None
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if not code.co_filename.startswith(skip):
            found = tb
        tb = tb.tb_next
    if found is None:
        return ""
    frame = found.tb_frame
    code = frame.f_code
    owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
    path = modules.get(id(owner)) if isinstance(owner, nn.Module) else None
    line = (linecache.getline(frame.f_code.co_filename, found.tb_lineno) or "").strip()
    at = f" in module {path or type(model).__name__!r}" if path is not None else ""
    return f"{at} ({frame.f_code.co_filename}:{found.tb_lineno} in {frame.f_code.co_name}: {line})"


def _getattr_path(obj: Any, target: str) -> Any:
    for atom in target.split("."):
        obj = getattr(obj, atom)
    return obj
