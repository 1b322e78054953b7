"""Codegen pass: Plan + graph -> one readable GraphModule per stage.

Each stage is an ``fx.GraphModule`` built on the traced model as root, so it
holds the model's own Module and Parameter objects (GraphModule copies
attributes by reference; see torch/fx/graph_module.py ``_copy_attr``): no
copies, and ``stage.state_dict()`` keys are the model's own names. Inputs
and outputs are the named cross-cut tensors; replicated nodes (masks,
position ids) are re-emitted in every stage that needs them.
"""
from __future__ import annotations

import os
from typing import Any

import torch
import torch.fx as fx

from autopipe.plan import Plan, StagePlan


class Stage(fx.GraphModule):
    """One pipeline stage: ``stage(*inputs) -> tuple(outputs)`` named by the plan."""

    def __init__(self, root: torch.nn.Module, graph: fx.Graph, plan: StagePlan, header: str):
        super().__init__(root, graph, class_name=f"Stage{plan.index}")
        self.index = plan.index
        self.input_names = list(plan.inputs)
        self.output_names = list(plan.outputs)
        self.device = plan.device
        self._header = header

    @property
    def code(self) -> str:  # type: ignore[override]
        return self._header + super().code

    def __repr__(self) -> str:
        return f"Stage({self.index}, device={self.device}, inputs={self.input_names}, outputs={self.output_names})"


def codegen(graph_module: fx.GraphModule, plan: Plan) -> list[Stage]:
    """Build every stage of ``plan`` from ``graph_module``."""
    nodes = {n.name: n for n in graph_module.graph.nodes}
    order = {n: i for i, n in enumerate(graph_module.graph.nodes)}
    return [_stage(graph_module, nodes, order, plan, s) for s in plan.stages]


def _stage(gm: fx.GraphModule, nodes: dict[str, fx.Node], order: dict, plan: Plan, sp: StagePlan) -> Stage:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for name in sp.inputs:
        source = nodes[name]
        placeholder = graph.placeholder(name)
        placeholder.meta = dict(source.meta)
        env[source] = placeholder
    body = [nodes[n] for n in sp.replicated] + [nodes[n] for n in sp.nodes]
    for node in sorted(body, key=order.__getitem__):
        for attr in node.all_input_nodes:
            if attr.op == "get_attr" and attr not in env:
                env[attr] = graph.node_copy(attr)
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[nodes[name]] for name in sp.outputs))
    graph.lint()
    return Stage(gm, graph, sp, _header(plan, sp))


def _header(plan: Plan, sp: StagePlan) -> str:
    def source(name: str) -> str:
        producer = plan.tensors[name].producer if name in plan.tensors else -1
        return "model input" if producer < 0 else f"stage {producer}"

    def sink(name: str) -> str:
        info = plan.tensors[name]
        where = [f"stage {c}" for c in info.consumers] + (["model output"] if info.is_output else [])
        return ", ".join(where)

    lines = [f"# autopipe stage {sp.index} of {plan.n_stages} on {sp.device}: {len(sp.nodes)} nodes, "
             f"{100 * sp.cost / (plan.total_cost or 1):.1f}% of the {plan.balance}"]
    lines += [f"#   in  {n:<28} from {source(n)}" for n in sp.inputs]
    lines += [f"#   out {n:<28} to {sink(n)}" for n in sp.outputs]
    if sp.replicated:
        lines.append(f"#   recomputed here instead of received: {', '.join(sp.replicated)}")
    return "\n".join(lines) + "\n"


def save_code(stages: list[Stage], directory: str | os.PathLike[str]) -> list[str]:
    """Write one ``stage_<i>.py`` per stage; returns the paths."""
    os.makedirs(directory, exist_ok=True)
    paths = []
    for stage in stages:
        path = os.path.join(os.fspath(directory), f"stage_{stage.index}.py")
        with open(path, "w") as f:
            f.write("import torch\n" + stage.code)
        paths.append(path)
    return paths
