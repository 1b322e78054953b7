"""Codegen's count program: plain code over a micro-batch's flat inputs that counts the targets each loss output merged
by count averages over (``count_program``). run_passes hands it to the runtime inside the Program, which runs it on
every micro-batch before the step."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from autopipe.ir.plan import Plan


def count_program(graph_module: fx.GraphModule, plan: Plan) -> fx.GraphModule | None:
    """Plain code over a micro-batch's flat inputs that returns, for each output merged by count (``TargetCount``), how
    many targets its loss averages over. It runs on every micro-batch before the step, so that under 1F1B the first
    loss's backward already has its weight: the micro-batch's count over the whole batch's. None where no output needs
    it."""
    counted = [info.count for name in plan.graph_outputs if (info := plan.tensors.get(name)) is not None and info.count]
    if not counted:
        return None
    nodes = {n.name: n for n in graph_module.graph.nodes}
    needed: set[fx.Node] = set()
    todo = [nodes[c.target] for c in counted]
    while todo:
        if (n := todo.pop()) not in needed:
            needed.add(n)
            todo.extend(n.all_input_nodes)
    graph, env = fx.Graph(), {}
    for n in graph_module.graph.nodes:
        if n.op == "placeholder" or n in needed:
            env[n] = graph.node_copy(n, env.__getitem__)
    _on_the_inputs_device(graph, [env[n] for n in graph_module.graph.nodes if n.op == "placeholder" and n in needed])
    counts = []
    for c in counted:
        target = env[nodes[c.target]]
        if c.ignore_index is None:  # a mask: the rows it selects, times the elements the mean takes from each
            counts.append(graph.call_function(operator.mul, (graph.call_method("sum", (target,)), c.per_row)))
            continue
        valid = graph.call_function(operator.ne, (target, c.ignore_index))
        if c.weight is not None:  # torch's total_weight: the class weights of the targets not ignored
            weight = graph.call_method("to",
                                       (graph.get_attr(c.weight), graph.call_function(getattr, (target, "device"))))
            picked = graph.call_function(operator.getitem,
                                         (weight, graph.call_function(torch.where, (valid, target, 0))))
            valid = graph.call_function(operator.mul, (picked, valid))
        counts.append(graph.call_method("sum", (valid,)))
    graph.output(tuple(counts))
    return fx.GraphModule(graph_module, graph, class_name="TargetCounts")


def _on_the_inputs_device(graph: fx.Graph, read: list[fx.Node]) -> None:
    """Note [counts on the inputs' device]: the count program runs on the micro-batch's own inputs, wherever the caller
    put them; a device literal traced into it (``labels.to(device=...)`` of the trace's device, meta for a model built
    on meta under torchrun) reads the device of an input the program counts from instead."""
    if not read:
        return
    with graph.inserting_after(read[-1]):
        device = graph.call_function(getattr, (read[0], "device"))
    swap = lambda value: device if isinstance(value, torch.device) else value
    for node in graph.nodes:
        if node.op == "placeholder" or node is device:
            continue
        kwargs = {k: device if k == "device" and isinstance(v, str) else v for k, v in node.kwargs.items()}
        node.args, node.kwargs = fx.node.map_aggregate(node.args, swap), fx.node.map_aggregate(kwargs, swap)
    if not device.users:
        graph.erase_node(device)
