"""Each node's B and W timed as a split schedule runs them (runtime/split_backward.py): B an engine call towards the
stage's inputs that keeps the gradient arriving where parameters' subgraphs leave the input path, W one engine call
per such node from it (Note [B and W timed apart]). ``measure_node_times(split_backward=True)`` (passes/node_times.py)
calls ``time_split``."""
from __future__ import annotations

import collections
import time
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.autograd.graph import GradientEdge
from torch.utils._pytree import tree_leaves

from .node_recorder import NodeRecorder, backward_starts


# Note [B and W timed apart]: a split schedule's B (runtime/split_backward.py) first walks the stage's autograd
# graph for the nodes where parameters' subgraphs leave the input path (a Linear's AddmmBackward), hooks them to keep
# the gradient arriving there, and runs the engine towards the inputs with the graph kept; its W is an engine call per
# group of parameters from those gradients, each node run again for its parameters' outputs alone. Both cost more
# than their shares of a fused backward (the walk, the hooks, each call's own start), so each node is timed that way:
# the first floating values computed from the graph's inputs become leaves (a later stage's inputs), the graph is
# walked, B runs towards them stamping each node, and W runs once per node reading parameters, from the kept
# gradient to the edges into its parameters' subgraph (a transpose or cast on that side is not timed). The walk is
# shared out per autograd node; a node whose output becomes a leaf (an embedding, the first Linear on a float input)
# keeps its fused-backward figures.
def time_split(gm: fx.GraphModule, inputs: Sequence, params: list, output_grads: Callable[[list], Sequence] | None,
                input_apart: dict, weight_apart: dict) -> None:
    """One forward of ``gm`` on ``inputs``, then B and W as a split schedule runs them (Note [B and W timed
    apart]): each node's seconds appended to ``input_apart`` and, for a node reading parameters, ``weight_apart``."""
    recorder = NodeRecorder(gm, collections.defaultdict(list), False, cut=True)
    flat = tree_leaves(recorder.run(*inputs))
    outputs = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
    if not outputs or not recorder.leaves:
        return
    ids, made = {id(p) for p in params}, {id(fn) for _, fn in recorder.made}
    owned = {id(fn): (name, fn) for name, out in reversed(recorder.made) for fn in _own_nodes(out, made)}
    sources = [(name, fn, reached) for name, fn in owned.values() if (reached := _parameter_edges(fn, ids))]
    start = time.perf_counter()
    walked = _walk([t.grad_fn for t in outputs if t.grad_fn is not None])  # as B finds its sources
    per_node = (time.perf_counter() - start) / max(walked, 1)
    kept: dict[int, tuple] = {}
    handles = [fn.register_prehook(lambda grads, fn=fn: kept.__setitem__(id(fn), grads)) for _, fn, _ in sources]
    try:
        starts = backward_starts(flat, outputs, output_grads)
        recorder.stamps.clear()
        _engine(outputs, starts, recorder.leaves)
        stamps = recorder.stamps + [(time.perf_counter(), "")]
    finally:
        for h in handles:
            h.remove()
    seen: dict[str, float] = collections.defaultdict(float)
    for (at, name), (after, _) in zip(stamps, stamps[1:]):
        seen[name] += after - at
    for name, fn in owned.values():
        seen[name] += per_node
    for name, seconds in seen.items():
        input_apart[name].append(seconds)
    seen.clear()
    for name, fn, reached in sources:
        edges = [(GradientEdge(fn, k), g) for k, g in enumerate(kept.get(id(fn), ())) if g is not None]
        if edges:
            start = time.perf_counter()
            _engine([e for e, _ in edges], [g for _, g in edges], reached)
            seen[name] += time.perf_counter() - start
    for name, seconds in seen.items():
        weight_apart[name].append(seconds)


def _engine(roots: list, grads: list, wrt: list) -> tuple:
    """The engine call a split backward makes (split_backward.engine_grad: torch.autograd.grad without its Python
    checks), the graph kept."""
    return torch.autograd.Variable._execution_engine.run_backward(tuple(roots), tuple(grads), True, False, tuple(wrt),
                                                                 True, False)


def _walk(roots: list) -> int:
    """A post-order walk of the autograd graph below ``roots``, as B's search for its sources makes; the nodes seen."""
    seen, order, stack = set(), [], [(fn, False) for fn in roots]
    while stack:
        fn, expanded = stack.pop()
        if expanded:
            order.append(fn)
        elif id(fn) not in seen:
            seen.add(id(fn))
            stack.append((fn, True))
            stack.extend((child, False) for child, _ in fn.next_functions if child is not None)
    return len(order)


def _own_nodes(out: Any, made: set[int]) -> list:
    """The autograd nodes one call node made: from its output's down to another call node's outputs or leaves (a 3-d
    Linear's view, addmm and view)."""
    found, stack, seen = [], [out], {id(out)}
    while stack:
        fn = stack.pop()
        found.append(fn)
        for child, _ in fn.next_functions:
            if child is not None and id(child) not in seen and id(child) not in made and not hasattr(child, "variable"):
                seen.add(id(child))
                stack.append(child)
    return found


def _parameter_edges(fn: Any, ids: set[int]) -> list:
    """The edges out of an autograd node on a path to something else that lead to parameters (of ``ids``) alone:
    directly, or by a chain of one-input nodes (a Linear's weight through its transpose). None for a node whose edges
    all lead to parameters (that transpose itself): W starts where such a subgraph leaves the path. Edges, not the
    parameters: a tied weight's other use is not W's here."""
    found, elsewhere = [], False
    for edge in fn.next_functions:
        child = edge[0]
        while child is not None and not hasattr(child, "variable") and len(child.next_functions) == 1:
            child = child.next_functions[0][0]
        if getattr(child, "variable", None) is not None and id(child.variable) in ids:
            found.append(GradientEdge(*edge))
        elif child is not None:
            elsewhere = True
    return found if elsewhere else []
