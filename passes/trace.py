"""Trace pass: nn.Module -> a flat fx graph with shapes on fake tensors (``trace(...) -> TracedModel``,
traced_model.py). fx first, else torch.export (export_route.py); the routes and ``static_batch``: docs/architecture.md,
"Contracts between passes". The graph runs again one row larger, and the micro-batch analysis's facts are recorded on
its nodes (microbatch_analysis/facts.py)."""
from __future__ import annotations

import functools
import inspect
import operator
import re
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, free_unbacked_symbols
from torch.utils._sympy.numbers import int_oo

from autopipe.global_state import preserved_global_state
from autopipe.ir.batch import carries_batch

from .custom_gradients import FunctionCall, kept_whole
from .diagnostics import (BatchSpecialised, ModuleCastRefused, TraceError, causes, explain_failures, first_line, listed,
                          node_where, raised_at, specialises_batch)
from .export_route import export_flat_graph
from .fake_shapes import fake_errors_unlogged, propagate_fake_shapes
from .fx_route import trace_fx
from .microbatch_analysis.facts import literals, record_batch_facts
from .model_state import buffers_kept, hooks_kept, module_casts_checked
from .traced_model import TracedModel, grad_flags

# the pass's names, importable from here wherever they are defined
__all__ = ["trace", "TracedModel", "TraceError", "BatchSpecialised", "specialises_batch"]


def trace(model: torch.nn.Module, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None, *,
          leaf_modules: Iterable[type | str] = (), route: str = "auto", static_batch: int | None = None) -> TracedModel:
    """Trace ``model(*args, **kwargs)`` into a flat graph with fake-tensor shapes. ``route``: "auto" (fx, then export
    with a dynamic batch), "fx" or "export"; ``static_batch=n`` exports the first n rows with no dynamic dimension
    (route "export-static"). Torch's global state is left as it was found, also when tracing raises."""
    if route not in ("auto", "fx", "export"):
        raise ValueError(f"route must be 'auto', 'fx' or 'export', got {route!r}")
    if static_batch is not None:
        if isinstance(static_batch, bool) or not isinstance(static_batch, int) or static_batch < 1:
            raise ValueError(f"static_batch must be a positive int (rows per micro-batch), got {static_batch!r}")
        if route == "fx":
            raise ValueError("static_batch exports the model at a fixed batch size; it needs route='auto' or "
                             "'export', not 'fx' (an fx graph does not fix the batch size)")
    with preserved_global_state() as guard, buffers_kept(model), fake_errors_unlogged(), kept_whole() as ran_inline, \
            module_casts_checked(model):
        traced = _trace(model, args, dict(kwargs or {}), leaf_modules, route, static_batch)
    if ran_inline:
        traced.notes.append(f"the model's torch.utils.checkpoint (reentrant) of "
                            f"{listed(sorted({name for name, _ in ran_inline}))} runs inline: the pipeline "
                            f"re-materialises its stages itself (compile's checkpoint=)")
    if kept := sorted({repr(n.target) for m in traced.graph_module.modules() if isinstance(m, fx.GraphModule)
                       for n in m.graph.nodes if isinstance(n.target, FunctionCall)}):
        traced.notes.append(f"custom autograd.Functions kept whole, their own backward run: {listed(kept)}; autopipe "
                            f"sees the shapes of their inputs and outputs, not a statistic over the batch computed "
                            f"inside one")
    # the graph holds a checkpoint without grad: right for these requires_grad flags only (Note [reentrant
    # checkpoints inline])
    if not all(with_grad
               for _, with_grad in ran_inline):
        traced.grad_flags = grad_flags(model, traced.flat_inputs(args, kwargs or {}))
    _bound_data_dependent_sizes(traced)
    trace_again = functools.partial(_trace, model, args, dict(kwargs or {}), leaf_modules, route, static_batch)
    if frozen := _drawn_on_every_call(model, guard.restored, trace_again):
        raise TraceError(f"{type(model).__name__}'s forward draws from {' and '.join(frozen)}: the traced graph "
                         f"would keep one draw for every step and micro-batch. Draw with torch (torch.rand, "
                         f"torch.bernoulli), or trace in eval mode if it draws only in training; see "
                         f"docs/faithfulness.md")
    if guard.restored:
        traced.notes.append(f"tracing changed global state, put back: {', '.join(guard.restored)}")
    return traced


# Note [randomness drawn outside torch]: NumPy's and Python's random draws in the forward (wav2vec2's SpecAugment
# masks) happen once, while tracing, and would be baked into the graph: the global-state guard sees the generator
# move and trace refuses. A library that draws once when first imported inside the forward (jax's
# k8s_cluster.py, reached lazily from transformers) moves it too, so trace traces again and refuses only a
# generator that moves again.
def _drawn_on_every_call(model: torch.nn.Module, restored: list[str], trace_again: Callable[[], Any]) -> list[str]:
    """NumPy's and Python's generators that moved while tracing and move again in a second trace: the forward's own
    draws, which the graph would freeze (Note [randomness drawn outside torch]). The second trace runs only where a
    generator moved, under the same guards; both put the generators back."""
    moved = [name for name in restored if name in ("NumPy random", "Python random")]
    if not moved:
        return []
    with preserved_global_state() as guard, buffers_kept(model), fake_errors_unlogged(), kept_whole(), \
            module_casts_checked(model):
        trace_again()
    return [name for name in moved if name in guard.restored]


# Note [batch-specialised models]: a model whose Python specialises on the batch size (a diffusion UNet
# broadcasting its timestep) fails export with a dynamic batch dim ("Constraints violated"), yet exports at a
# static micro-batch shape. So trace raises BatchSpecialised and compile traces the model once per micro-batch
# size it will run at (static_batch), each a program of its own.
def _trace(model, args, kwargs, leaf_modules, route, static_batch) -> TracedModel:
    signature = inspect.signature(model.forward)
    try:
        arguments = signature.bind(*args, **kwargs).arguments
    except TypeError as e:
        raise TypeError(f"{type(model).__name__}.forward{signature} cannot take these arguments: {e}") from None
    traced = TracedModel.for_call(signature, arguments)
    if not traced.tensor_positions:
        raise TypeError(f"{type(model).__name__}.forward was called with no tensor argument; nothing to pipeline")
    flat = traced.flatten_inputs(arguments)
    traced.batch_size = batch = _batch_size(flat, traced.input_names[0])
    if static_batch is None:
        fx_route = ("torch.fx.symbolic_trace", lambda: trace_fx(model, traced, leaf_modules))
        export = ("torch.export (non-strict, dynamic batch)", lambda: export_flat_graph(model, arguments, batch))
        attempts = {"auto": [fx_route, export], "fx": [fx_route], "export": [export]}[route]
    else:
        if static_batch > batch:
            raise ValueError(f"static_batch={static_batch} is more rows than the example inputs have ({batch})")
        whole, arguments = arguments, _batch_rows(arguments, batch, static_batch)
        attempts = [(f"torch.export (non-strict, static shapes, batch {static_batch})",
                     lambda: export_flat_graph(model, arguments, static_batch, dynamic_batch=False))]
    errors: list[tuple[str, BaseException]] = []
    for name, attempt in attempts:
        try:
            with hooks_kept(model):
                traced = attempt()
            break
        except Exception as e:  # fx fails in many exception types
            if (refused := next((c for c in causes(e) if isinstance(c, ModuleCastRefused)), None)) is not None:
                raise refused from None  # every route would meet it
            errors.append((name, e))
    else:
        if static_batch is None and specialises_batch(errors[-1][1]):  # Note [batch-specialised models]
            raise BatchSpecialised(explain_failures(model, errors, batch), errors, batch) from errors[-1][1]
        raise TraceError(explain_failures(model, errors)) from errors[-1][1]
    traced.notes = [f"{name} failed: {type(e).__name__}: {first_line(e)}" for name, e in errors] + traced.notes
    traced.notes += [f"{taken}: each micro-batch checks that it goes that way too, and the step raises where one "
                     f"does not" for taken in dict.fromkeys(getattr(traced, "branches_taken", ()))]
    # at a batch of one, (1, seq) looks cut
    traced.batch_inputs = [carries_batch(t, batch) for t in flat] if batch > 1 else []
    if traced.assigned:
        traced.notes.append(f"the forward assigns {listed(traced.assigned)}: the graph computes with the assigned "
                            f"values but does not store them, so the pipeline leaves them as they were (a cache the "
                            f"forward rebuilds is alike; state it carries across calls is not)")
    if static_batch is not None:
        traced.route, traced.static_batch = "export-static", static_batch
        # a dynamic export would have failed on a (seq, seq) mask cut as batch rows; a static one may run (one-row
        # micro-batches broadcast)
        traced.ambiguous_inputs = [f"{name} {tuple(t.shape)}" for name, t in zip(traced.input_names[1:], flat[1:])
                                   if carries_batch(t, batch) and batch in t.shape[1:]]
        traced.notes.append(f"traced at a static batch of {static_batch} rows (torch.export, no dynamic "
                            f"dimension): the model treats the batch size as a constant")
    inputs = traced.flatten_inputs(arguments)
    try:
        _shaped(traced, inputs)
    except RuntimeError as e:
        if (refusal := _sized_by_values(model, traced.graph_module, e)) is None:
            raise
        raise refusal from e
    if static_batch is not None:
        record_batch_facts(traced.graph_module, static_batch,
                           _static_graph_one_row_larger(model, traced.graph_module, whole, batch, static_batch))
        return traced
    try:
        record_batch_facts(traced.graph_module, batch, _grown(traced.graph_module, inputs, batch))
    except Exception as e:  # the graph runs at the traced batch size alone
        errors.append((f"the {traced.route} graph at a batch of {traced.batch_size + 1}", e))
        message = explain_failures(model, errors, traced.batch_size)
        raise TraceError(message) if route == "fx" else BatchSpecialised(message, errors, traced.batch_size) from e
    return traced


def _sized_by_values(model: torch.nn.Module, gm: fx.GraphModule, error: RuntimeError) -> TraceError | None:
    """The refusal of a graph whose shapes follow from values, where autopipe costs and cuts it by shapes: an op sized
    by numbers read from an input's values (``F.interpolate(x, size=sizes.tolist())``), naming that input, or one whose
    output's shape the values set (x[mask], nonzero); None where ``error`` is another (failures_named names it)."""
    node = raised_at(error) or next((n for n in gm.graph.nodes if "val" not in n.meta and n.op != "output"), None)
    if reads := _numbers_read(node):
        inputs = listed(sorted({repr(p.target) for r in reads for p in _ancestors(r) if p.op == "placeholder"}))
        return TraceError(f"{type(model).__name__}: {node_where(node)} is sized by the values of "
                          f"{inputs or 'a tensor'} (node {reads[0].name}); the trace pass needs sizes from shapes "
                          f"alone. Pass them as Python ints, which the graph holds; see docs/faithfulness.md")
    known = (DynamicOutputShapeException, DataDependentOutputException, GuardOnDataDependentSymNode)
    if not isinstance(error, known) and not re.search(r"\bu\d+\b", str(error)):  # else a size set by values (u0)
        return None
    return TraceError(f"{type(model).__name__}: {node_where(node) if node is not None else 'an op'} "
                      f"({type(error).__name__}: {first_line(error)}) has a shape that depends on the values of its "
                      f"input (boolean-mask indexing x[mask], nonzero, unique), not only on the input shapes, which "
                      f"autopipe needs to cost and cut the graph. Keep the shapes fixed (torch.where(mask, x, 0) with "
                      f"a masked mean) or run it outside the model")


def _ancestors(node: fx.Node) -> Iterator[fx.Node]:
    """``node`` and every node it is computed from."""
    seen, stack = {node}, [node]
    while stack:
        yield (n := stack.pop())
        for a in n.all_input_nodes:
            if a not in seen:
                seen.add(a)
                stack.append(a)


def _numbers_read(node: fx.Node | None) -> list[fx.Node]:
    """The nodes ``node`` depends on that read numbers from a tensor's values (``.tolist()``, ``.item()``): their value
    holds a size known only at run time (u0), their inputs' values none."""
    def values_set(n: fx.Node) -> bool:
        return bool(free_unbacked_symbols(n.meta.get("val")))
    return [] if node is None else [a for a in _ancestors(node) if a is not node and values_set(a)
                                    and not isinstance(a.meta["val"], torch.Tensor)
                                    and not any(map(values_set, a.all_input_nodes))]


def _unpack_sequence_outputs(traced: TracedModel) -> None:
    """An output that is one fx value holding several tensors (``return torch.split(h, [3, 5], -1)``: fx cannot see
    into it while tracing) becomes one getitem node per tensor, so every flat output is a tensor to merge."""
    gm = traced.graph_module
    output = next(n for n in gm.graph.nodes if n.op == "output")
    flat = list(output.args[0])
    if not any(isinstance(n, fx.Node) and isinstance(n.meta.get("val"), (tuple, list)) for n in flat):
        return
    for k, n in enumerate(flat):
        if isinstance(n, fx.Node) and isinstance(values := n.meta.get("val"), (tuple, list)):
            with gm.graph.inserting_before(output):
                items = [gm.graph.call_function(operator.getitem, (n, j)) for j in range(len(values))]
            for item, value in zip(items, values):
                item.meta = {**{key: n.meta[key] for key in ("stack_trace", "nn_module_stack") if key in n.meta},
                             "val": value}
            flat[k] = tuple(items)
    output.args = (traced.keep_output_structure(traced.rebuild_output(flat), (fx.Node,)),)
    gm.recompile()


def _shaped(traced: TracedModel, flat_inputs: Sequence[torch.Tensor]) -> None:
    """Shapes on every node, and a getitem per tensor of an output tuple (which needs the shapes)."""
    propagate_fake_shapes(traced.graph_module, flat_inputs)
    _unpack_sequence_outputs(traced)
    _attribute_outputs_through_an_op(traced.graph_module)


def _attribute_outputs_through_an_op(gm: fx.GraphModule) -> None:
    """A parameter, buffer or constant the model returns as it is (``return logits, self.logit_scale``) is no stage's
    node: no stage sent it, and the step waited for it forever. It is returned through ``aten.alias``, a view autograd
    hands the gradient through, computed by a stage as any node is."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    attributes = [n for n in output.all_input_nodes if n.op == "get_attr"]
    for attribute in attributes:
        with gm.graph.inserting_before(output):
            alias = gm.graph.call_function(torch.ops.aten.alias.default, (attribute,))
        alias.meta = {"val": attribute.meta.get("val")}
        output.replace_input_with(attribute, alias)
    if attributes:
        gm.recompile()


def _batch_rows(arguments: dict[str, Any], batch: int, rows: int) -> dict[str, Any]:
    """The arguments with ``rows`` rows of each batch tensor: its first rows, the last one repeated where it has
    fewer."""
    def take(x: torch.Tensor) -> torch.Tensor:
        if not carries_batch(x, batch):
            return x
        return x[:rows] if rows <= batch else torch.cat([x, x[-1:].expand(rows - batch, *x.shape[1:])])
    return pytree.tree_map_only(torch.Tensor, take, arguments)


def _grown(gm: fx.GraphModule, flat_inputs: Sequence[torch.Tensor], batch: int) -> dict[fx.Node, Any]:
    """Each node's value when the graph runs on fake inputs one row larger."""
    at_batch = {n: n.meta.get("val") for n in gm.graph.nodes}
    try:
        propagate_fake_shapes(gm, flat_inputs, grow_batch=batch)
        return {n: n.meta.get("val") for n in gm.graph.nodes}
    finally:
        for n, val in at_batch.items():
            n.meta["val"] = val


# Note [static graphs one row larger]: a graph traced at one static micro-batch size cannot run at another, so
# it has no run one row larger to read batch facts from. The model is exported again one row larger: where the
# two graphs have the same nodes, the facts come from the pair, and a node whose literals differ has the batch
# size written in ("batch_literal"); where they differ (a loop over the samples) only dim 0 = batch is known and
# any literal may be the batch size ("literals_unknown").
def _static_graph_one_row_larger(model: torch.nn.Module, gm: fx.GraphModule, whole: dict[str, Any], batch: int,
                                 rows: int) -> dict[fx.Node, Any] | None:
    """Each node's value in the model exported again at ``rows + 1`` static rows, or None where that fails or the two
    graphs differ in more than their literals: a graph of one static size cannot run at another, and a second export
    gives it the dynamic graph's batch facts (Note [static graphs one row larger]). Marks node.meta "batch_literal"
    where a literal differs."""
    arguments = _batch_rows(whole, batch, rows + 1)
    try:
        with hooks_kept(model):
            other = export_flat_graph(model, arguments, rows + 1, dynamic_batch=False)
        _shaped(other, other.flatten_inputs(arguments))
    except Exception:  # the model's Python may fix the batch size it runs at
        return None
    pairs = list(zip(gm.graph.nodes, other.graph_module.graph.nodes))
    if len(gm.graph.nodes) != len(other.graph_module.graph.nodes) or \
            any((a.op, a.target, a.name, type(a.meta.get("val"))) != (b.op, b.target, b.name, type(b.meta.get("val")))
                for a, b in pairs):
        return None
    for a, b in pairs:
        if literals(a) != literals(b):
            # reshape(2, -1) at 2 rows, reshape(3, -1) at 3: a number set by the batch size
            a.meta["batch_literal"] = True
    return {a: b.meta.get("val") for a, b in pairs}


# Note [sizes set by values]: the fake mode has a shape env, so a size set by values (x[mask], nonzero, .item())
# is an unbacked symbol rather than an error; its node gets "data_dependent" (and "selected_rows" where the rows
# are one dim). Once the batch facts are read it is made concrete at the symbol's upper bound (x[mask]: every
# row) for cost and partition. Partition keeps such a value and its readers in one stage: a receiver sizes its
# buffer ahead of the message.
def _bound_data_dependent_sizes(traced: TracedModel) -> None:
    """A value whose size depends on the values of its inputs (x[mask], nonzero: u0 rows, known to lie in [0, rows])
    gets its largest size, for the passes that cost and cut it; node.meta "data_dependent" says it has no fixed size,
    and partition keeps it inside one stage (Note [sizes set by values])."""
    found = [n for n in traced.graph_module.graph.nodes if n.meta.get("data_dependent")]
    for n in found:
        n.meta["val"] = pytree.tree_map(_at_largest, n.meta["val"])
    if sized := [n.name
                 for n in found if any(isinstance(x, torch.Tensor)
                                       for x in pytree.tree_leaves(n.meta["val"]))]:  # not a branch's .item()
        traced.notes.append(f"sizes that depend on values (boolean-mask rows, nonzero) at {listed(sized)}: costed at "
                            f"their largest, and kept inside one stage; balance='time' measures them")


def _at_largest(x: Any) -> Any:
    """A number, or a fake tensor's sizes, with each symbol of the shape env at its upper bound (1 where it has none:
    ``.item()``)."""
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        bounds = {u: x.node.shape_env.var_to_range[u].upper for u in free_unbacked_symbols(x)}
        value = x.node.expr.xreplace({u: 1 if b in (int_oo, -int_oo) or not b.is_finite else b
                                      for u, b in bounds.items()})
        return int(value) if isinstance(x, torch.SymInt) else float(value) if isinstance(x, torch.SymFloat) \
            else bool(value)
    if isinstance(x, torch.Tensor) and free_unbacked_symbols(x):
        with x.fake_mode:
            return torch.empty(tuple(_at_largest(d) for d in x.shape), dtype=x.dtype, device=x.device)
    return x


def _batch_size(tensors: list[torch.Tensor], first: str) -> int:
    """The first tensor argument's dim 0; a tensor argument of another dim 0 goes whole to every micro-batch
    (runtime/microbatch.py)."""
    if tensors[0].dim() == 0:
        raise ValueError(f"argument {first!r} is a 0-dim tensor; the first tensor argument must carry the batch "
                         f"in dim 0")
    return tensors[0].shape[0]
