"""Codegen pass: Plan + graph -> one readable fx.GraphModule per stage, nothing wrapping its ops at run time. The
contract (random ops, devices, in-place writes, module aliases): docs/architecture.md, "Contracts between passes"."""
from __future__ import annotations

import contextlib
import copy
import functools
import os
import re
import sys
from typing import Any

import torch
import torch.fx as fx

from autopipe.ir.plan import Plan, StagePlan

from .diagnostics import node_where
from .inplace_writes import find_inplace_writes
from .random_routes import emit, route
from .stage_writes import inputs_written, running_buffers


class Stage(fx.GraphModule):
    """``stage(*inputs) -> tuple(outputs)`` named by the plan; with ``uses_rng`` also ``generator=``."""

    def __init__(self, root: torch.nn.Module, graph: fx.Graph, plan: StagePlan, header: str,
                 attributes: dict[str, Any], cloned_inputs: list[str]):
        super().__init__(_Root(root, {**attributes, "stage_device": plan.device}), graph, f"Stage{plan.index}")
        self.index = plan.index
        self.input_names, self.output_names = list(plan.inputs), list(plan.outputs)
        self.stage_device = plan.device
        self._header = header
        self.uses_rng = any(n.op == "placeholder" and n.target == "generator" for n in graph.nodes)
        self.cloned_inputs = cloned_inputs
        self.running_buffers, self.written_buffers = running_buffers(self)
        self.module_aliases = dict(graph._codegen.aliases)  # Note [module aliases]
        self.__dict__.update({alias: self.get_submodule(target) for target, alias in self.module_aliases.items()})

    def __deepcopy__(self, memo):
        copied = super().__deepcopy__(memo)  # fx's copy keeps only what the graph names: copy the rest
        for name in self.__dict__.keys() - copied.__dict__.keys():
            copied.__dict__[name] = copy.deepcopy(self.__dict__[name], memo)
        return copied

    device = property(lambda self: self.stage_device, doc="The device the stage runs on.")

    def _apply(self, fn, recurse=True):
        # .to() / .cuda() / .cpu(): the stage's device follows its tensors (a probe shows where fn sends one)
        with contextlib.suppress(Exception):  # an fn that cannot take the probe moves nothing we can tell
            device = fn(torch.empty(0, device=self.stage_device)).device
            for module in self.modules():  # with the subgraphs that read their own (_use_stage_device)
                if "stage_device" in module.__dict__:
                    module.stage_device = device
        return super()._apply(fn, recurse)

    @property
    def code(self) -> str:  # type: ignore[override]
        return self._header + super().code

    def save(self, directory: str | os.PathLike[str]) -> str:
        """Write ``stage_<i>.py`` (the code and the imports it needs) into ``directory``; returns the path."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(os.fspath(directory), f"stage_{self.index}.py")
        imports = "import torch\n" + ("import autopipe.random_ops\n" if "autopipe.random_ops." in self.code else "")
        with open(path, "w") as f:
            f.write(imports + self.code)
        return path

    def __repr__(self) -> str:
        return f"Stage({self.index}, device={self.device}, inputs={self.input_names}, outputs={self.output_names})"


class _Root(torch.nn.Module):
    """The root fx copies a stage's attributes from (by reference): the model's own, then the stage's."""

    def __init__(self, model: torch.nn.Module, own: dict[str, Any]):
        super().__init__()
        self.training = model.training
        self.__dict__.update(own, _model=model)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_model"], name)


# Note [module aliases]: the stage code calls a nested submodule through a flat alias (self.blocks_0_attn_qkv):
# one attribute lookup instead of a chain of nn.Module.__getattr__, which a model of small ops feels every step.
# The modules stay registered under the model's names, so state_dict() is unchanged.
class _CodeGen(fx.graph.CodeGen):
    """fx's code, calling ``autopipe.random_ops.dropout`` where fx names a global ``autopipe_random_ops_dropout``,
    and a nested submodule by its flat alias (``self.blocks_0_fc``, Stage.module_aliases) unless that shadows a name."""

    def __init__(self, graph: fx.Graph, model: torch.nn.Module):
        super().__init__()
        nested = {n.target: re.sub(r"\W", "_", n.target) for n in graph.nodes if n.op == "call_module"
                  and "." in n.target}
        self.aliases = {t: a for t, a in nested.items() if a.isidentifier() and not hasattr(model, a)
                        and not hasattr(Stage, a)}

    def _gen_python_code(self, nodes, *args, **kwargs):
        code = super()._gen_python_code(nodes, *args, **kwargs)
        code.src = re.sub(r"\bautopipe_random_ops_(\w+)", r"autopipe.random_ops.\1", code.src)
        for target, alias in self.aliases.items():
            code.src = code.src.replace(f" = {fx.graph._format_target('self', target)}(", f" = self.{alias}(")
        code.globals["autopipe"] = sys.modules["autopipe"]
        return code


def codegen(graph_module: fx.GraphModule, plan: Plan) -> list[Stage]:
    """Every stage of ``plan``; raises UnroutedRandomOp, or ValueError for a write another stage must see or an output
    the micro-batches cannot give."""
    facts = find_inplace_writes(graph_module)
    for name in plan.graph_outputs if plan.chunks > 1 else ():
        info = plan.tensors.get(name)
        if info is not None and info.mixes_samples:
            source, how = info.mixes_samples
            raise ValueError(f"the model's output {name} ({node_where(facts.nodes[name])}) is computed from "
                             f"{node_where(facts.nodes[source])}, which {how}; a micro-batch holds only its own "
                             f"samples, so no merge of what {plan.chunks} micro-batches give is the plain model's "
                             f"value; compute it outside the model from per-sample outputs, or run with chunks=1")
        if info is not None and info.kind == "tensor" and info.shape and not info.merges:
            raise ValueError(f"the model's output {name} ({node_where(facts.nodes[name])}) has shape {info.shape}: dim "
                             f"0 does not hold the batch as whole samples (torch.cat of batch tensors along dim 0, a "
                             f"flatten after a transpose): no concatenation of micro-batch parts gives it. Return it "
                             f"per sample, or run with chunks=1; see docs/faithfulness.md")
    stages = []
    for sp in plan.stages:
        inputs = [facts.nodes[name] for name in sp.inputs]
        body = sorted((facts.nodes[n] for n in (*sp.replicated, *sp.nodes)), key=facts.order.__getitem__)
        routes = {n: r for n in body if (r := route(n, graph_module, sp)) is not None}
        writable = inputs_written(facts, plan, sp, inputs, body)
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for source in inputs:
            env[source] = graph.placeholder(source.name)
            env[source].meta = dict(source.meta)
        generator = graph.placeholder("generator", default_value=None) if routes else None
        for source in writable:
            env[source] = graph.create_node("call_method", "clone", (env[source],), name=f"{env[source].name}_writable")
            env[source].meta = dict(source.meta)
        attributes: dict[str, Any] = {}
        for node in body:
            env.update({a: graph.node_copy(a) for a in node.all_input_nodes if a.op == "get_attr" and a not in env})
            env[node] = emit(graph, node, routes[node], env, generator, graph_module, attributes) if node in routes \
                else graph.node_copy(node, env.__getitem__)
        graph.output(tuple(env[facts.nodes[name]] for name in sp.outputs))
        _use_stage_device(graph, graph_module, attributes, sp.device)
        graph.lint()
        graph.set_codegen(_CodeGen(graph, graph_module))
        stages.append(Stage(graph_module, graph, sp, _header(plan, sp, routes, writable), attributes,
                            [n.name for n in writable]))
    return stages



# Note [device arguments read the stage's device]: export writes the tracing device into factory ops (arange,
# to.dtype_layout, _assert_tensor_metadata), also inside the subgraphs of its no_grad and autocast regions
# (Llama's rotary embedding). Codegen points every device argument at the stage's own stage_device, copying such
# a subgraph into the stage, so Stage._apply moves it with the stage; the traced graph is not touched.
def _use_stage_device(graph: fx.Graph, root: torch.nn.Module, attributes: dict[str, Any], device: torch.device) -> bool:
    """Device literals traced into calls (``arange(..., device=cpu)``) read the stage's ``stage_device``; a subgraph of
    export's no_grad / autocast regions that names one is copied into ``attributes`` and reads its own, which
    Stage._apply moves with the stage (Note [device arguments read the stage's device]). Returns whether ``graph``
    reads the device."""
    with graph.inserting_before(next(n for n in graph.nodes if n.op != "placeholder")):
        read = graph.create_node("get_attr", "stage_device", name="stage_device")
    swap = lambda value: read if isinstance(value, torch.device) else value
    copied = False
    for node in graph.nodes:
        if node.op == "get_attr" and isinstance(sub := _attribute(root, node.target), fx.GraphModule):
            own: dict[str, Any] = {}
            if _use_stage_device(subgraph := copy.deepcopy(sub.graph), sub, own, device):
                node.target = re.sub(r"\W", "_", node.target)
                attributes[node.target] = fx.GraphModule(_Root(sub, {**own, "stage_device": device}), subgraph,
                                                         type(sub).__name__)
                copied = True
            continue
        # also a device="cuda:0" string written in the model's code
        kwargs = {k: read if k == "device" and isinstance(v, str) else v for k, v in node.kwargs.items()}
        node.args, node.kwargs = fx.node.map_aggregate(node.args, swap), fx.node.map_aggregate(kwargs, swap)
    if not read.users:
        graph.erase_node(read)
    return copied or bool(read.users)


def _attribute(root: torch.nn.Module, target: str) -> Any:
    with contextlib.suppress(AttributeError):
        return functools.reduce(getattr, target.split("."), root)
    return None



def _header(plan: Plan, sp: StagePlan, routes: dict[fx.Node, Any], writable: list[fx.Node]) -> str:
    lines = [f"# autopipe stage {sp.index} of {plan.n_stages} on {sp.device}: {len(sp.nodes)} nodes, "
             f"{100 * sp.cost / (plan.total_cost or 1):.1f}% of the {plan.balance}"]
    lines += [f"#   in  {n:<28} from {'model input' if (p := plan.tensors[n].producer) < 0 else f'stage {p}'}"
              for n in sp.inputs]
    for n in sp.outputs:
        sinks = [f"stage {c}"
                 for c in plan.tensors[n].consumers] + (["model output"] if plan.tensors[n].is_output else [])
        lines.append(f"#   out {n:<28} to {', '.join(sinks)}")
    notes = (("recomputed here instead of received", list(sp.replicated)),
             ("random ops draw from the generator argument", [n.name for n in routes]),
             ("written in place, so cloned first", [n.name for n in writable]))
    lines += [f"#   {label}: {', '.join(names)}" for label, names in notes if names]
    return "\n".join(lines) + "\n"


