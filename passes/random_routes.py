"""Codegen's random ops: how each node that draws gets the task's generator (``route``: a ``generator=`` keyword,
random_ops' generator-taking function, or the call wrapped to draw from it), and the node that does so (``emit``).
An op nothing can hand a generator raises UnroutedRandomOp.

Note [random ops bound at codegen]: the generated code passes the task's generator to each random op, so a
stage runs as plain code. A TorchFunctionMode around a stage that routed the draws instead costs every op a
Python call: a small GPT with dropout ran far slower than the plain step at one device, one micro-batch."""
from __future__ import annotations

import operator
import types
from typing import Any

import torch
import torch.fx as fx
from torch._ops import HigherOrderOperator, OpOverload

import autopipe.random_ops as random_ops
from autopipe.ir.plan import StagePlan

from .custom_gradients import FunctionCall
from .diagnostics import node_where


def route(node: fx.Node, gm: fx.GraphModule, sp: StagePlan) -> tuple[str, Any, dict] | None:
    """(how, target, constants) for a random node: how is "kwarg", "function" (random_ops') or "wrap"."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if type(module) in random_ops.MODULES:  # nn.Dropout & co: their function, their constants baked in
            fn, constants_of = random_ops.MODULES[type(module)]
            return ("function", fn, constants) if random_ops.draws(constants := constants_of(module)) else None
        return ("wrap", node.target, {}) if random_ops.module_draws(module) else None
    if node.op not in ("call_function", "call_method"):
        return None
    if isinstance(node.target, FunctionCall):  # a custom autograd.Function: its forward's draws, where it makes any
        values = fx.node.map_arg((node.args, node.kwargs), lambda a: a.meta.get("val"))
        return ("wrap", node.target, {}) if random_ops.draws_when_called(node.target, *values) else None
    target = random_ops.resolve(node.target, node.args, node.kwargs)
    if isinstance(target,
                  types.FunctionType) and not random_ops.from_torch(target) and not (target.__module__
                                                                                     or "").startswith("autopipe"):
        return "wrap", target, {}  # a function fx did not look into (fx.wrap: torchvision's stochastic_depth, a user's)
    if isinstance(target, HigherOrderOperator):  # export's no_grad / autocast regions: subgraphs
        subgraphs = [operator.attrgetter(a.target)(gm) for a in node.all_input_nodes if a.op == "get_attr"]
        draws = any(route(n, sub, sp) for sub in subgraphs if isinstance(sub, fx.GraphModule) for n in sub.graph.nodes)
        return ("wrap", target, {}) if draws else None
    if not random_ops.is_random_target(target) or not random_ops.draws(random_ops.bind(target, node.args, node.kwargs)
                                                                       or {}):
        return None
    if target in random_ops.FUNCTIONS:
        return "function", *random_ops.FUNCTIONS[target]
    if isinstance(target, OpOverload):
        how, routed = random_ops.aten_route(target)
        if how != "unrouted":
            return how, routed, {}
        if torch.device(sp.device).type == "cuda":  # a fused kernel: on the task's generator's state
            return "wrap", target, {}
    elif random_ops.takes_generator(target):
        return "kwarg", target, {}
    elif node.op == "call_function":  # a torch Python function that draws inside (F.gumbel_softmax)
        return "wrap", target, {}
    raise random_ops.UnroutedRandomOp(  # a Tensor method or an aten op: Python functions were wrapped
        f"stage {sp.index}: {'Tensor.' if node.op == 'call_method' else ''}{target} at {node_where(node)} draws random "
        f"numbers and takes no generator, so a recompute could not replay it. Set its dropout probability to 0, call "
        f"model.eval(), or use an op that takes a generator; see docs/faithfulness.md")


def emit(graph: fx.Graph, node: fx.Node, route: tuple[str, Any, dict], env: dict, generator: fx.Node,
          gm: fx.GraphModule, attributes: dict[str, Any]) -> fx.Node:
    """``node`` in the stage's graph, drawing from ``generator``."""
    how, target, constants = route
    args = tuple(fx.node.map_arg(node.args, env.__getitem__))
    kwargs = dict(fx.node.map_arg(node.kwargs, env.__getitem__))
    if how == "kwarg":  # the op takes generator=; where a call passes its own, the task's replaces it
        args, kwargs = random_ops.with_generator(target, generator, args, kwargs)
    elif how == "wrap":
        if node.op == "call_module":
            callee = graph.create_node("get_attr", node.target, name=f"{node.name}_module")
        elif isinstance(target, (OpOverload, HigherOrderOperator)):
            callee = target
        else:  # a Python function: a stage attribute, so the code can name it
            name = f"{node.name}_fn"
            while hasattr(gm, name):
                name += "_"
            attributes[name] = target
            callee = graph.get_attr(name)
        args, target = (callee, generator, *args), random_ops.call_with_generator
    else:
        if node.op == "call_module":  # the module's input is the function's only argument
            args, kwargs = (args[0] if args else kwargs["input"],), {}
        parameters = getattr(random_ops.signature_of(target), "parameters", {})  # aten's train, F's training
        kwargs = {("training" if k == "train" and "training" in parameters else k): v for k, v in kwargs.items()}
        kwargs.update(constants, generator=generator)
    new = graph.create_node(node.op if how == "kwarg" else "call_function", target, args, kwargs, name=node.name)
    new.meta = {k: v for k, v in node.meta.items() if k != "is_wrapped"}  # fx.wrap's mark is for the old target
    return new
