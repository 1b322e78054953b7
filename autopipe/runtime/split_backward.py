"""A stage's backward in two halves (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, sec. 2): B, the gradients
of the stage's inputs, which the previous stage waits for, and W, the gradients of its parameters, which can wait.

As torch.distributed.pipelining does it (``_backward.py``: ``stage_backward_input`` / ``stage_backward_weight``): B runs
the engine towards the inputs only, and a pre-hook on each *source* (a node of the input path with an edge into a
subgraph that reaches only parameters: a Linear's ``AddmmBackward``) keeps the gradient arriving there; W runs the
engine from those gradients towards the parameters, one call per group of parameters that share sources. Each node
computes each of its outputs once, from the same gradients as in a fused backward, so both halves are bit for bit the
fused backward's (``tests/runtime/test_split_backward.py``). Where this differs from torch's (Note [B and W]):

- a stage output whose graph never reaches an input (``w * 2`` returned) is a source too (torch's loses its gradient);
- groups are closed under shared sources (a union, not torch's first match), so no parameter is summed over two calls;
- a group one of whose sources lies on another's input path (a weight used at two depths of one stage) would re-run
  the input path between them in W (torch clamps the second source's gradient with a hook and re-runs it): its
  parameters are differentiated in B instead, with the inputs, in the one engine call;
- a stage no input of which needs a gradient (the first) has nothing to wait for: B computes everything.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch.autograd.graph import GradientEdge


def engine_grad(roots: Sequence, grads: Sequence, wrt: Sequence, keep_graph: bool) -> tuple:
    """``torch.autograd.grad(roots, wrt, grads, retain_graph=keep_graph, allow_unused=True)`` without its Python checks;
    roots may be GradientEdges (as torch.autograd.grad passes them to ``_engine_run_backward``)."""
    return torch.autograd.Variable._execution_engine.run_backward(tuple(roots), tuple(grads), keep_graph, False,
                                                                 tuple(wrt), True, False)


@dataclass
class _Group:
    """Parameters (by position) that W differentiates in one engine call, and the sources it starts from."""

    params: list[int]
    sources: list[Any]                                     # nodes whose arriving gradient B keeps
    roots: list[int] = field(default_factory=list)         # stage outputs (by position) whose graph is parameters only
    kept: dict[int, tuple] = field(default_factory=dict)   # id(source) -> the gradients that arrived there in B


# Note [memory held from B to W]: under a split schedule a stage's graph lives until its W, so the stage holds
# its activations (recomputed ones included) and the gradients B keeps for W from B until W. The memory model
# counts both; track_memory's report does not count the kept gradients yet. A full backward frees its
# micro-batch at B (the in-flight count, the timeline's held and the memory model alike).
@dataclass
class WeightWork:
    """What B leaves for W: the retained graph's roots, the kept gradients, and the gradients B already computed
    (Note [B and W])."""

    roots: list[torch.Tensor]
    grads: list[torch.Tensor]
    params: list[torch.Tensor]
    groups: list[_Group]
    done: list[torch.Tensor | None]   # per parameter: computed in B (a fused group), else None until W

    def run(self) -> list[torch.Tensor | None]:
        """W: each group's parameter gradients from the gradients kept at its sources. Groups share no node (a node
        reaching two groups' parameters would have joined them), so each call frees what it ran, as torch's does."""
        grads = self.done
        for group in self.groups:
            edges, given = [], []
            for source in group.sources:
                for k, g in enumerate(group.kept.get(id(source), ())):
                    if g is not None:
                        edges.append(GradientEdge(source, k))
                        given.append(g)
            for r in group.roots:
                edges.append(self.roots[r])
                given.append(self.grads[r])
            if edges:
                got = engine_grad(edges, given, [self.params[k] for k in group.params], keep_graph=False)
                for k, g in zip(group.params, got):
                    grads[k] = g
            group.kept.clear()
        self.roots = self.grads = self.groups = []  # type: ignore[assignment]
        return grads


# Note [B and W]: B runs the engine towards the stage inputs only; a pre-hook on each node where a parameter's
# subgraph leaves the input path keeps the gradient arriving there. W runs the engine from those gradients, one
# call per group of parameters sharing such nodes; groups share no node, so each call frees what it ran. Unlike
# torch's stage_backward_weight: an output whose graph never reaches an input is still differentiated, a weight
# used at two depths of one stage is differentiated in B, and a stage whose inputs need no gradient does all in B.
def backward_input(roots: list[torch.Tensor], grads: list[torch.Tensor], inputs: list[torch.Tensor],
                   params: list[torch.Tensor]) -> tuple[tuple, WeightWork]:
    """B: the gradients of ``inputs`` (each requiring grad), and the W still to run for ``params``."""
    graph = _Graph(roots, inputs, params)
    groups = graph.groups()
    deferred = [g for g in groups if inputs and not graph.clamped(g)]  # no input: nothing waits, B does it all
    fused = sorted(k for g in groups if g not in deferred for k in g.params)
    if not inputs and not fused:
        return (), WeightWork(roots, grads, params, [], [None] * len(params))
    handles = []
    for group in deferred:
        for source in group.sources:
            handles.append(source.register_prehook(_keeper(group.kept, source)))
    try:
        got = engine_grad(roots, grads, list(inputs) + [params[k] for k in fused], keep_graph=bool(deferred))
    finally:
        for h in handles:
            h.remove()
    done: list[torch.Tensor | None] = [None] * len(params)
    for k, g in zip(fused, got[len(inputs):]):
        done[k] = g
    return got[:len(inputs)], WeightWork(roots, grads, params, deferred, done)


def _keeper(kept: dict, source: Any):
    def keep(grad_outputs):
        kept[id(source)] = grad_outputs
    return keep


class _Graph:
    """The stage's backward graph from its outputs: which nodes lie on the input path (reach an input), and the
    parameters (a bit set) each node off that path reaches."""

    def __init__(self, roots: list[torch.Tensor], inputs: list[torch.Tensor], params: list[torch.Tensor]):
        self.inputs = {id(x) for x in inputs}
        self.param_bit = {id(p): 1 << k for k, p in enumerate(params)}
        self.n_params = len(params)
        self.root_nodes = [r.grad_fn if r.grad_fn is not None else torch.autograd.graph.get_gradient_edge(r).node
                           for r in roots]
        self.order = self._post_order()
        self.on_path: dict[Any, bool] = {}
        self.reach: dict[Any, int] = {}  # off the input path: the parameters it reaches
        for node in self.order:
            children = self.children[node]
            variable = getattr(node, "variable", None)
            if variable is not None:
                self.on_path[node] = id(variable) in self.inputs
                self.reach[node] = self.param_bit.get(id(variable), 0)
                continue
            self.on_path[node] = any(self.on_path[c] for c in children)
            self.reach[node] = 0
            for c in children:
                if not self.on_path[c]:
                    self.reach[node] |= self.reach[c]

    def _post_order(self) -> list:
        self.children: dict[Any, list] = {}
        order, stack = [], [(n, False) for n in self.root_nodes if n is not None]
        while stack:
            node, expanded = stack.pop()
            if expanded:
                order.append(node)
                continue
            if node in self.children:
                continue
            kids = [fn for fn, _ in node.next_functions if fn is not None]
            self.children[node] = kids
            stack.append((node, True))
            stack.extend((c, False) for c in kids if c not in self.children)
        return order

    def groups(self) -> list[_Group]:
        """Parameters joined by a shared source, each group with its sources and parameters-only stage outputs."""
        found: list[list] = []   # [param bits, sources, root positions]
        def join(bits: int, source: Any = None, root: int | None = None) -> None:
            merged = [bits, [source] if source is not None else [], [root] if root is not None else []]
            for g in [g for g in found if g[0] & bits]:
                found.remove(g)
                merged[0] |= g[0]
                merged[1] += g[1]
                merged[2] += g[2]
            found.append(merged)
        for node in self.order:
            if self.on_path[node]:
                bits = 0
                for c in self.children[node]:
                    if not self.on_path[c]:
                        bits |= self.reach[c]
                if bits:
                    join(bits, source=node)
        for k, node in enumerate(self.root_nodes):
            if not self.on_path[node] and self.reach[node]:
                join(self.reach[node], root=k)
        groups = [_Group([k for k in range(self.n_params) if bits >> k & 1], list(dict.fromkeys(sources)), roots)
                  for bits, sources, roots in found]
        return sorted(groups, key=lambda g: g.params[0])

    def clamped(self, group: _Group) -> bool:
        """Whether one of the group's sources lies below another on the input path: W would run the path between."""
        sources = set(group.sources)
        if len(sources) < 2:
            return False
        below: dict[Any, bool] = {}  # a source of the group lies strictly below, on the input path
        for node in self.order:
            if self.on_path[node]:
                below[node] = any(self.on_path[c] and (c in sources or below[c]) for c in self.children[node])
        return any(below[s] for s in sources)
