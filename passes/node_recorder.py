"""The graph run under fx's Interpreter with each call node's forward timed and its backward stamped, for
passes/node_times.py and passes/split_times.py; and the gradients a timed backward starts from."""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves, tree_map_only

from .fake_shapes import MutableArguments

_CALLS = ("call_function", "call_method", "call_module")


# Note [backward time per node]: the CPU autograd engine runs one node at a time on the calling thread, so a pre-hook
# on each graph node's grad_fn stamps when its backward begins, and the next stamp ends it; the time in between is
# that node's autograd functions (a Linear's addmm, transpose and bias sum). Timed with autograd.grad, so no .grad is
# left on the model and no AccumulateGrad runs; the B run freezes the parameters and makes each value computed from
# the inputs alone require a gradient.
class NodeRecorder(MutableArguments):
    """Runs the graph, timing each call node's forward and stamping its backward (Note [backward time per node])."""

    def __init__(self, gm: fx.GraphModule, forward: dict[str, list[float]], inputs_only: bool, cut: bool = False):
        super().__init__(gm)
        self.forward, self.inputs_only, self.cut = forward, inputs_only, cut
        self.past_cut: set[fx.Node] = set()  # cut: nodes reading a leaf made from the inputs
        self.stamps: list[tuple[float, str]] = []
        self.hooked: set[int] = set()
        self.leaves: list[torch.Tensor] = []
        self.from_inputs: set[fx.Node] = set()
        self.made: list[tuple[str, Any]] = []  # (call node, a grad_fn it made)

    def run_node(self, n: fx.Node):
        start = time.perf_counter()
        result = super().run_node(n)
        if n.op not in _CALLS:
            if n.op == "placeholder":
                self.from_inputs.add(n)
            return result
        self.forward[n.name].append(time.perf_counter() - start)
        batched = any(a in self.from_inputs for a in n.all_input_nodes)
        if batched:
            self.from_inputs.add(n)
        if self.cut and batched:  # the first floating values computed from the inputs: a later stage's inputs
            if any(a in self.past_cut for a in n.all_input_nodes):
                self.past_cut.add(n)
            elif any(isinstance(t, torch.Tensor) and t.is_floating_point() for t in tree_leaves(result)):
                self.past_cut.add(n)
                result = tree_map_only(torch.Tensor, self._leaf, result)
        for t in tree_leaves(result):
            if not isinstance(t, torch.Tensor):
                continue
            if self.inputs_only and batched and t.grad_fn is None and t.is_floating_point() and not t.requires_grad:
                t.requires_grad_()  # a leaf computed from the inputs alone: B's gradients start here
                self.leaves.append(t)
            if t.grad_fn is not None and id(t.grad_fn) not in self.hooked:
                self.hooked.add(id(t.grad_fn))
                self.made.append((n.name, t.grad_fn))
                t.grad_fn.register_prehook(lambda *_, name=n.name: self.stamps.append((time.perf_counter(), name)))
        return result

    def _leaf(self, t: torch.Tensor) -> torch.Tensor:
        if not t.is_floating_point():
            return t
        leaf = t.detach().requires_grad_()
        self.leaves.append(leaf)
        return leaf


def backward_starts(flat: list, outputs: list, output_grads: Callable[[list], Sequence] | None) -> list:
    """The gradients a backward starts from at ``outputs`` (the flat outputs requiring one)."""
    given = output_grads(flat) if output_grads is not None else [None] * len(outputs)
    return [torch.ones_like(t) if output_grads is None else torch.zeros_like(t) if g is None else g
            for t, g in zip(outputs, given, strict=True)]
