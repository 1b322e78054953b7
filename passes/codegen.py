"""Codegen pass: Plan + graph -> one readable fx.GraphModule per stage, nothing wrapping its ops at run time. The
contract (random ops, devices, in-place writes, module aliases): docs/architecture.md, "codegen"."""
from __future__ import annotations

import contextlib
import copy
import functools
import operator
import os
import re
import sys
import types
from typing import Any

import torch
import torch.fx as fx
from torch._ops import HigherOrderOperator, OpOverload

import autopipe.random_ops as random_ops
from autopipe.ir.plan import Plan, StagePlan

from .custom_gradients import FunctionCall
from .diagnostics import node_where
from .inplace_writes import InPlaceWrites, find_inplace_writes, is_batch_norm


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
        self.running_buffers, self.written_buffers = _running_buffers(self)
        self.module_aliases = dict(graph._codegen.aliases)  # the modules stay registered under their own names
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
                             f"0 does not hold the batch as whole samples (a value over the batch, or several rows a "
                             f"sample that autopipe cannot show stay together: torch.cat of batch tensors along dim 0, "
                             f"a flatten after a transpose), so no concatenation of what {plan.chunks} micro-batches "
                             f"give is the plain model's value; return it per sample, compute it outside the model, or "
                             f"run with chunks=1")
    stages = []
    for sp in plan.stages:
        inputs = [facts.nodes[name] for name in sp.inputs]
        body = sorted((facts.nodes[n] for n in (*sp.replicated, *sp.nodes)), key=facts.order.__getitem__)
        routes = {n: r for n in body if (r := _route(n, graph_module, sp)) is not None}
        writable = _check_writes(facts, plan, sp, inputs, body)
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
            env[node] = _emit(graph, node, routes[node], env, generator, graph_module, attributes) if node in routes \
                else graph.node_copy(node, env.__getitem__)
        graph.output(tuple(env[facts.nodes[name]] for name in sp.outputs))
        _use_stage_device(graph, graph_module, attributes, sp.device)
        graph.lint()
        graph.set_codegen(_CodeGen(graph, graph_module))
        stages.append(Stage(graph_module, graph, sp, _header(plan, sp, routes, writable), attributes,
                            [n.name for n in writable]))
    return stages


# -- random ops -----------------------------------------------------------------------

def _route(node: fx.Node, gm: fx.GraphModule, sp: StagePlan) -> tuple[str, Any, dict] | None:
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
        draws = any(_route(n, sub, sp) for sub in subgraphs if isinstance(sub, fx.GraphModule) for n in sub.graph.nodes)
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
        f"numbers but takes no generator and nothing it runs can be given one, so the pipeline could not replay it "
        f"when it recomputes the stage for backward. Set its dropout probability to 0 or call model.eval(), or use an "
        f"op that takes a generator (torch.rand, ...).")


def _emit(graph: fx.Graph, node: fx.Node, route: tuple[str, Any, dict], env: dict, generator: fx.Node,
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


def _use_stage_device(graph: fx.Graph, root: torch.nn.Module, attributes: dict[str, Any], device: torch.device) -> bool:
    """Device literals traced into calls (``arange(..., device=cpu)``) read the stage's ``stage_device``; a subgraph of
    export's no_grad / autocast regions that names one is copied into ``attributes`` and reads its own, which
    Stage._apply moves with the stage. Returns whether ``graph`` reads the device."""
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


# -- in-place writes --------------------------------------------------------------------

def _check_writes(facts: InPlaceWrites, plan: Plan, sp: StagePlan, inputs: list[fx.Node],
                  body: list[fx.Node]) -> list[fx.Node]:
    """The stage inputs the stage writes in place, to clone first. Raises ValueError for a write another stage (or the
    model's output) would have to see: each stage gets its own copy of what it receives. A safety net: partition keeps
    each write with the reads that must see it (InPlaceWrites.reads), so no plan of its own should meet it."""
    input_set, body_set, own = set(inputs), set(body), {facts.nodes[n] for n in sp.nodes}
    recomputed_elsewhere = {facts.nodes[n] for s in plan.stages if s.index != sp.index for n in s.replicated}

    def local_root(a: fx.Node) -> fx.Node:  # follow views back to a stage input or a tensor made here
        while a not in input_set and facts.alias[a] is not None:
            a = facts.alias[a]
        return a

    for w in body:
        for a in facts.writes[w]:
            root = local_root(a)
            if facts.base[a].op == "get_attr":  # a buffer: every stage holds the same object
                continue
            for m in facts.sharing(a):
                same = (m in body_set or m in input_set) and local_root(m) is root
                if m not in body_set and m not in input_set and any(v in own for v in facts.views_back(m)):
                    continue  # a later stage's view of what this stage sent once it had run, the write included
                for u in m.users:
                    # a reader here sees the write; one elsewhere (a recomputed node's copy too) gets what this stage
                    # sends, which is the write's result only for a tensor made here
                    elsewhere = u not in body_set or u in recomputed_elsewhere
                    if facts.order[u] > facts.order[w] and not (same and (m in own or not elsewhere)):
                        reader = "the model's output" if u.op == "output" else f"{u.name} ({node_where(u)})"
                        raise ValueError(
                            f"stage {sp.index}: {w.name} ({node_where(w)}) writes in place to {a.name}, whose value "
                            f"{reader} reads afterwards through {m.name}; each stage gets its own copy of a tensor it "
                            f"receives, so that read would not see the write. Write out of place there (x = x + y "
                            f"rather than x += y, inplace=False); see docs/faithfulness.md")
    return list(dict.fromkeys(root
                              for root in (local_root(a) for w in body for a in facts.writes[w]) if root in input_set))


def _running_buffers(stage: Stage) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(every buffer the stage writes: training BatchNorms' statistics, also in modules run whole, and buffers written
    by in-place ops; those of them no BatchNorm writes)."""
    norms = [m for m in stage.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.training]
    buffers = [b for m in norms if m.track_running_stats for b in m.buffers(recurse=False)]
    facts, written = find_inplace_writes(stage), []
    # code the graph does not show may write its buffers: spectral_norm's power iteration
    for node in stage.graph.find_nodes(op="call_module"):
        module = stage.get_submodule(node.target)
        if any(m._forward_hooks or m._forward_pre_hooks or torch.nn.utils.parametrize.is_parametrized(m)
               or not random_ops.from_torch(type(m)) for m in module.modules()):
            written += [b for m in module.modules() if not isinstance(m, torch.nn.modules.batchnorm._NormBase)
                        for b in m.buffers(recurse=False)]
    for node, args in facts.writes.items():
        by_norm = is_batch_norm(node)
        for base in (facts.base[a] for a in args):
            value = operator.attrgetter(base.target)(stage) if base.op == "get_attr" else None
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                (buffers if by_norm else written).append(value)
    return list({id(b): b for b in [*buffers, *written]}.values()), list({id(b): b for b in written}.values())


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


# -- counts of targets -------------------------------------------------------------------

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
