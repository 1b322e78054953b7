"""Codegen pass: Plan + graph -> one readable GraphModule per stage.

Each stage is an ``fx.GraphModule`` built on the traced model as root, so it
holds the model's own Module and Parameter objects (GraphModule copies
attributes by reference; see torch/fx/graph_module.py ``_copy_attr``): no
copies, and ``stage.state_dict()`` keys are the model's own names. Inputs
and outputs are the named cross-cut tensors; replicated nodes (masks,
position ids) are re-emitted in every stage that needs them.

What a stage needs at run time is decided here, once, so that a stage runs
as plain generated code with nothing intercepting its ops:

* Randomness. A stage whose ops draw random numbers takes a keyword argument
  ``generator``, and every random op in it draws from that generator
  (autopipe/random_ops.py): a recomputed forward then replays the forward's
  masks exactly. An op that cannot be routed is refused here, before anything
  runs (``UnroutedRandomOp``).
* Devices. torch.export writes the traced device into factory and conversion
  calls (``arange(..., device=cpu)``); those read the stage's ``stage_device``
  attribute instead, so a stage runs on whatever device it is given.
* In-place writes to an input. A stage input is a detached leaf (autograd
  refuses in-place ops on a leaf that requires grad) that may share storage
  with the value its producer keeps; the stage clones it first,
  ``<input>_writable = <input>.clone()``. A write whose effect another stage
  would have to see cannot be pipelined and is refused with its source line.
* Running statistics. ``running_buffers`` are the buffers the forward updates
  in place (BatchNorm): recomputation must not update them twice.
"""
from __future__ import annotations

import copy
import operator
import os
import re
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import torch
import torch.fx as fx

import autopipe.random_ops as random_ops
from autopipe.plan import Plan, StagePlan
from autopipe.random_ops import UnroutedRandomOp

OpOverload = torch._ops.OpOverload


class Stage(fx.GraphModule):
    """One pipeline stage: ``stage(*inputs) -> tuple(outputs)`` named by the plan; a stage that
    draws random numbers (``uses_rng``) also takes ``generator=`` (a torch.Generator, or None for
    the default one), and every random op in it draws from that."""

    def __init__(self, root: torch.nn.Module, graph: fx.Graph, plan: StagePlan, header: str,
                 attributes: dict[str, Any] | None = None, cloned_inputs: Iterable[str] = ()):
        own = {"stage_device": plan.device, **(attributes or {})}
        super().__init__(_Root(root, own), graph, class_name=f"Stage{plan.index}")
        self.index = plan.index
        self.input_names = list(plan.inputs)
        self.output_names = list(plan.outputs)
        self.stage_device = plan.device
        self._header = header
        self.uses_rng: bool = any(n.op == "placeholder" and n.target == "generator" for n in graph.nodes)
        self.cloned_inputs: list[str] = list(cloned_inputs)  # inputs the code clones before writing them in place
        self.running_buffers: list[torch.Tensor] = _running_buffers(self)

    def __deepcopy__(self, memo):
        copied = super().__deepcopy__(memo)  # fx's copy keeps the graph, code and tensors, not these
        for name in ("index", "input_names", "output_names", "stage_device", "_header", "uses_rng", "cloned_inputs",
                     "running_buffers"):
            copied.__dict__[name] = copy.deepcopy(self.__dict__[name], memo)
        return copied

    @property
    def device(self) -> torch.device:
        return self.stage_device

    @device.setter
    def device(self, value) -> None:
        self.stage_device = torch.device(value)

    def _apply(self, fn, recurse=True):
        # .to(device) / .cuda() / .cpu(): the stage's device follows its tensors (a probe shows where fn sends one)
        try:
            self.stage_device = fn(torch.empty(0, device=self.stage_device)).device
        except Exception:  # noqa: BLE001 - an fn that cannot take the probe moves nothing we can tell
            pass
        return super()._apply(fn, recurse)

    @property
    def code(self) -> str:  # type: ignore[override]
        return self._header + super().code

    def save(self, directory: str | os.PathLike[str]) -> str:
        """Write ``stage_<i>.py`` (the code and the imports it needs) into ``directory``; returns the path."""
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(os.fspath(directory), f"stage_{self.index}.py")
        code = self.code
        imports = "import torch\n" + ("import autopipe.random_ops\n" if "autopipe.random_ops." in code else "")
        with open(path, "w") as f:
            f.write(imports + code)
        return path

    def __repr__(self) -> str:
        return f"Stage({self.index}, device={self.device}, inputs={self.input_names}, outputs={self.output_names})"


class _Root(torch.nn.Module):
    """GraphModule copies each get_attr / call_module target from its root: the traced model's own
    objects (by reference), plus the stage's own attributes (its device, callables it routes)."""

    def __init__(self, model: torch.nn.Module, own: dict[str, Any]):
        super().__init__()
        self.training = model.training
        self.__dict__["_model"] = model
        self.__dict__.update(own)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_model"], name)


class _CodeGen(fx.graph.CodeGen):
    """fx's code, with the functions of autopipe/random_ops.py called by their module path
    (``autopipe.random_ops.dropout(...)``) rather than fx's mangled global (``autopipe_random_ops_dropout``)."""

    def _gen_python_code(self, *args, **kwargs):
        code = super()._gen_python_code(*args, **kwargs)
        for name, obj in list(code.globals.items()):
            if getattr(random_ops, getattr(obj, "__name__", ""), None) is obj and name != "autopipe" \
                    and getattr(obj, "__module__", None) == random_ops.__name__:
                code.src = re.sub(rf"\b{name}\b", f"autopipe.random_ops.{obj.__name__}", code.src)
                del code.globals[name]
                code.globals["autopipe"] = sys.modules["autopipe"]
        return code


def codegen(graph_module: fx.GraphModule, plan: Plan) -> list[Stage]:
    """Build every stage of ``plan`` from ``graph_module``.

    Raises ``UnroutedRandomOp`` for a random op no generator can reach, and ValueError for an
    in-place write another stage would have to see."""
    facts = _GraphFacts(graph_module)
    for s in plan.stages:
        for name in s.replicated:
            facts.replicated_in.setdefault(facts.nodes[name], set()).add(s.index)
    return [_stage(graph_module, facts, plan, s) for s in plan.stages]


# -- one stage ------------------------------------------------------------------------

@dataclass
class _Route:
    """How a random op draws from the stage's generator (see ``_route``)."""

    how: str                 # "kwarg" | "function" | "module" | "wrap"
    target: Any
    kwargs: dict[str, Any] = field(default_factory=dict)


def _stage(gm: fx.GraphModule, facts: "_GraphFacts", plan: Plan, sp: StagePlan) -> Stage:
    nodes, order = facts.nodes, facts.order
    inputs = [nodes[name] for name in sp.inputs]
    body = sorted([nodes[n] for n in sp.replicated] + [nodes[n] for n in sp.nodes], key=order.__getitem__)
    routes = {n: r for n in body if (r := _route(n, gm, sp)) is not None}
    writable = facts.check_writes(sp, inputs, body)

    graph = fx.Graph()
    graph.set_codegen(_CodeGen())
    env: dict[fx.Node, fx.Node] = {}
    for source in inputs:
        placeholder = graph.placeholder(source.name)
        placeholder.meta = dict(source.meta)
        env[source] = placeholder
    generator = graph.placeholder("generator", default_value=None) if routes else None
    for source in writable:
        clone = graph.create_node("call_method", "clone", (env[source],), name=f"{env[source].name}_writable")
        clone.meta = dict(source.meta)
        env[source] = clone

    attributes: dict[str, Any] = {}
    for node in body:
        for attr in node.all_input_nodes:
            if attr.op == "get_attr" and attr not in env:
                env[attr] = graph.node_copy(attr)
        route = routes.get(node)
        env[node] = graph.node_copy(node, env.__getitem__) if route is None else \
            _emit(graph, node, route, env, generator, gm, attributes)
    graph.output(tuple(env[nodes[name]] for name in sp.outputs))
    _use_stage_device(graph)
    graph.lint()
    return Stage(gm, graph, sp, _header(plan, sp, routes, writable), attributes, [n.name for n in writable])


def _route(node: fx.Node, gm: fx.GraphModule, sp: StagePlan) -> _Route | None:
    """None for a node that draws no random numbers (now: dropout in eval or with p=0 draws none);
    else how it gets the generator. Raises UnroutedRandomOp where nothing can reach it."""
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        if type(module) in random_ops.MODULES:
            fn, constants = random_ops.MODULES[type(module)]
            constants = constants(module)
            return _Route("module", fn, constants) if random_ops.draws(constants) else None
        return _Route("wrap", node.target) if random_ops.module_draws(module) else None
    if node.op not in ("call_function", "call_method"):
        return None
    target = _overload(node)
    if _is_user_function(target):  # code fx did not look into (fx.wrap): it may draw
        return _Route("wrap", target)
    if isinstance(target, torch._ops.HigherOrderOperator):  # export's no_grad / autocast regions: subgraphs
        subgraphs = [_attribute(gm, a.target) for a in node.all_input_nodes if a.op == "get_attr"]
        draws = any(_route(n, sub, sp) is not None for sub in subgraphs if isinstance(sub, fx.GraphModule)
                    for n in sub.graph.nodes)
        return _Route("wrap", target) if draws else None
    if not random_ops.is_random_target(target):
        return None
    bound = random_ops.bind(target, node.args, node.kwargs)
    if bound is not None and not random_ops.draws(bound):
        return None
    if target in random_ops.FUNCTIONS:
        fn, extra = random_ops.FUNCTIONS[target]
        return _Route("function", fn, extra)
    if isinstance(target, OpOverload):
        how, routed = random_ops.aten_route(target)
        if how != "unrouted":
            return _Route(how, routed)
    elif random_ops.takes_generator(target):
        return _Route("kwarg", target)
    elif node.op == "call_function":  # a torch Python function that draws inside (F.gumbel_softmax)
        return _Route("wrap", target)
    raise UnroutedRandomOp(
        f"stage {sp.index}: {_describe(node)} at {_where(node)} draws random numbers but takes no generator and "
        f"nothing it runs can be given one, so the pipeline could not replay it when it recomputes the stage for "
        f"backward. Set its dropout probability to 0 or call model.eval(), or replace the op with one that takes "
        f"a generator (torch.rand/bernoulli/..., generator=...).")


def _emit(graph: fx.Graph, node: fx.Node, route: _Route, env: dict, generator: fx.Node, gm: fx.GraphModule,
          attributes: dict[str, Any]) -> fx.Node:
    """``node`` in the stage's graph, drawing from ``generator``."""
    args = fx.node.map_arg(node.args, env.__getitem__)
    kwargs = dict(fx.node.map_arg(node.kwargs, env.__getitem__))
    if route.how == "kwarg":  # the op takes generator= itself (where a call passes its own, ours replaces it)
        args, kwargs = _give_generator(route.target, tuple(args), kwargs, generator)
        target, op = route.target, node.op
    elif route.how == "function":  # a random_ops function that takes one
        parameters = random_ops.signature_of(route.target).parameters
        kwargs = {("training" if k == "train" and "train" not in parameters else k): v for k, v in kwargs.items()}
        kwargs.update(route.kwargs, generator=generator)
        target, op = route.target, "call_function"
    elif route.how == "module":  # nn.Dropout & co: the module's own forward, its constants baked in
        args = (args[0] if args else kwargs.pop("input"),)
        kwargs = {**route.kwargs, "generator": generator}
        target, op = route.target, "call_function"
    else:  # "wrap": code the graph does not show, run under call_with_generator
        if node.op == "call_module":
            callee = graph.create_node("get_attr", node.target, name=f"{node.name}_module")
        elif isinstance(route.target, (OpOverload, torch._ops.HigherOrderOperator)):
            callee = route.target
        else:  # a Python function: a stage attribute, so the code can name it
            name = re.sub(r"\W", "_", f"{random_ops.op_name(route.target)}_fn")
            while hasattr(gm, name) or (name in attributes and attributes[name] is not route.target):
                name += "_"
            attributes[name] = route.target
            callee = graph.get_attr(name)
        args = (callee, generator, *args)
        target, op = random_ops.call_with_generator, "call_function"
    new = graph.create_node(op, target, tuple(args), kwargs, name=node.name)
    new.meta = {k: v for k, v in node.meta.items() if k != "is_wrapped"}  # fx.wrap's mark is for the old target
    return new


def _give_generator(target: Any, args: tuple, kwargs: dict, generator: fx.Node) -> tuple[tuple, dict]:
    if isinstance(target, OpOverload):
        for i, a in enumerate(target._schema.arguments):
            if a.name == "generator" and not a.kwarg_only and i < len(args):
                return args[:i] + (generator,) + args[i + 1:], kwargs
    return args, {**kwargs, "generator": generator}


def _use_stage_device(graph: fx.Graph) -> None:
    """Every device constant in the code (``device=cpu`` traced into a factory call) becomes a read
    of the stage's ``stage_device`` attribute."""
    device: list[fx.Node] = []

    def stage_device() -> fx.Node:
        if not device:
            last = [n for n in graph.nodes if n.op == "placeholder"][-1]
            with graph.inserting_after(last):
                device.append(graph.create_node("get_attr", "stage_device", name="stage_device"))
        return device[0]

    changed = []

    def swap(value):
        if isinstance(value, torch.device):
            changed.append(value)
            return stage_device()
        return value

    for node in list(graph.nodes):
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        changed.clear()
        args = fx.node.map_aggregate(node.args, swap)
        kwargs = dict(fx.node.map_aggregate(dict(node.kwargs), swap))
        if isinstance(kwargs.get("device"), str):  # device="cuda:0" written in the model's code
            kwargs["device"] = swap(torch.device(kwargs["device"]))
        if changed:
            node.args, node.kwargs = tuple(args), kwargs


# -- in-place writes and views --------------------------------------------------------

_INPLACE_OPERATORS = frozenset({
    operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv, operator.imod,
    operator.ipow, operator.iand, operator.ior, operator.ixor, operator.ilshift, operator.irshift,
    operator.imatmul, operator.setitem,
})
_INPLACE_DUNDERS = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__", "__ipow__", "__iand__",
    "__ior__", "__ixor__", "__ilshift__", "__irshift__", "__imatmul__", "__setitem__",
})
# results that may share storage with their first argument (torch's view ops, and conversions
# that return ``self`` when there is nothing to do)
_VIEW_NAMES = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "t", "T", "mT", "H", "mH", "adjoint", "permute",
    "unsqueeze", "squeeze", "expand", "expand_as", "narrow", "select", "split", "split_with_sizes",
    "tensor_split", "hsplit", "vsplit", "dsplit", "chunk", "unbind", "flatten", "unflatten", "ravel",
    "diagonal", "detach", "contiguous", "as_strided", "movedim", "moveaxis", "swapaxes", "swapdims", "unfold",
    "real", "imag", "view_as_real", "view_as_complex", "conj", "resolve_conj", "resolve_neg", "alias",
    "to", "type", "type_as", "float", "double", "half", "bfloat16", "int", "long", "short", "bool", "char",
    "byte", "cpu", "cuda", "data", "__getitem__", "align_to", "rename", "refine_names", "indices", "values",
})
_BATCH_NORMS = frozenset({"batch_norm", "native_batch_norm", "instance_norm", "_batch_norm_impl_index"})


def _overload(node: fx.Node) -> Any:
    """A node's target, with ``torch.ops.aten.<op>`` (an fx trace of it names no overload) resolved."""
    target = node.target
    if isinstance(target, torch._ops.OpOverloadPacket):
        return random_ops.resolve(target, node.args, node.kwargs) or target
    return target


def _is_inplace_name(name: Any) -> bool:
    name = random_ops.op_name(name)
    return (name.endswith("_") and not name.startswith("__")) or name in _INPLACE_DUNDERS


def _inplace_call(target: Any, node: fx.Node) -> bool:
    """A Python function called with ``inplace=True`` (``F.relu(x, inplace=True)``, ``F.leaky_relu(x, 0.1, True)``)."""
    signature = random_ops.signature_of(target)
    if signature is None or "inplace" not in signature.parameters:
        return False
    return (random_ops.bind(target, node.args, node.kwargs) or {}).get("inplace") is True


def _is_user_function(target: Any) -> bool:
    """A plain Python function that is not torch's (nor autopipe's): code fx kept whole (fx.wrap)."""
    module = getattr(target, "__module__", None) or ""
    return isinstance(target, types.FunctionType) and not module.startswith(("torch", "autopipe"))


def _written(node: fx.Node, module_of: Callable[[str], torch.nn.Module]) -> list[fx.Node]:
    """The arguments ``node`` writes in place."""
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    target, out = _overload(node) if node.op == "call_function" else node.target, []
    if node.op == "call_module":
        if getattr(module_of(target), "inplace", False) is True:
            out.append(first if first is not None else node.kwargs.get("input"))
    elif node.op == "call_method":
        if _is_inplace_name(target):
            out.append(first)
    elif node.op == "call_function":
        if isinstance(target, OpOverload):
            for i, a in enumerate(target._schema.arguments):
                if a.alias_info is not None and a.alias_info.is_write:
                    value = node.args[i] if i < len(node.args) and not a.kwarg_only else node.kwargs.get(a.name)
                    out.extend(_nodes_in(value))
        elif target in _INPLACE_OPERATORS or _is_inplace_name(target) or _inplace_call(target, node):
            out.append(first)
        if random_ops.op_name(target) in _BATCH_NORMS:  # their schemas do not mark the running stats written
            bound = random_ops.bind(target, node.args, node.kwargs) or {}
            if bound.get("training") or bound.get("use_input_stats"):
                out.extend(_nodes_in([bound.get("running_mean"), bound.get("running_var")]))
        out.extend(_nodes_in(node.kwargs.get("out")))
    return [n for n in dict.fromkeys(out) if isinstance(n, fx.Node) and _may_be_tensor(n)]


def _alias_of(node: fx.Node, module_of: Callable[[str], torch.nn.Module]) -> fx.Node | None:
    """The argument whose storage ``node``'s result may share: a view of it, an element of a
    tuple of views, or the tensor an in-place op returns."""
    first = node.args[0] if node.args and isinstance(node.args[0], fx.Node) else None
    if first is None or not _may_be_tensor(node, containers=True):
        return None
    target = _overload(node) if node.op == "call_function" else node.target
    if node.op == "call_module":
        return first if getattr(module_of(target), "inplace", False) is True else None
    if node.op == "call_method":
        return first if target in _VIEW_NAMES or _is_inplace_name(target) else None
    if node.op != "call_function":
        return None
    if isinstance(target, OpOverload):
        sets = set().union(*(r.alias_info.before_set for r in target._schema.returns if r.alias_info is not None))
        for i, a in enumerate(target._schema.arguments):
            if a.alias_info is not None and a.alias_info.before_set & sets and i < len(node.args):
                return next(iter(_nodes_in(node.args[i])), None)
        return None
    if target is operator.getitem:
        return None if _advanced_index(first, node.args[1]) else first
    if target is getattr or target in _INPLACE_OPERATORS or _is_inplace_name(target) or _inplace_call(target, node):
        return first
    module = getattr(target, "__module__", None) or getattr(getattr(target, "__objclass__", None), "__module__", "")
    return first if str(module).startswith("torch") and random_ops.op_name(target) in _VIEW_NAMES else None


def _advanced_index(value: fx.Node, index: Any) -> bool:
    """``x[index]`` copies (tensor or list indices) rather than views; indexing a tuple aliases."""
    if not isinstance(value.meta.get("val"), torch.Tensor):
        return False
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, list) or (isinstance(p, fx.Node) and isinstance(p.meta.get("val"), torch.Tensor))
               for p in parts)


def _nodes_in(value: Any) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return found


def _may_be_tensor(node: fx.Node, containers: bool = False) -> bool:
    val = node.meta.get("val", node.meta.get("example_value"))
    if val is None or isinstance(val, torch.Tensor):
        return True
    return containers and isinstance(val, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in val)


class _GraphFacts:
    """Per node of the whole graph: its order, the node whose storage it may share (``alias``),
    the storage's first owner (``base``), and the arguments it writes in place."""

    def __init__(self, gm: fx.GraphModule):
        self.nodes = {n.name: n for n in gm.graph.nodes}
        self.order = {n: i for i, n in enumerate(gm.graph.nodes)}
        self.alias: dict[fx.Node, fx.Node] = {}
        self.base: dict[fx.Node, fx.Node] = {}
        self.writes: dict[fx.Node, list[fx.Node]] = {}
        self.group: dict[fx.Node, list[fx.Node]] = {}
        self.replicated_in: dict[fx.Node, set[int]] = {}  # filled from the plan: the stages recomputing a node
        for n in gm.graph.nodes:
            a = _alias_of(n, gm.get_submodule)
            if a is not None:
                self.alias[n] = a
            self.base[n] = self.base.get(a, a) if a is not None else n
            self.group.setdefault(self.base[n], []).append(n)
            w = _written(n, gm.get_submodule)
            if w:
                self.writes[n] = w

    def check_writes(self, sp: StagePlan, inputs: list[fx.Node], body: list[fx.Node]) -> list[fx.Node]:
        """The stage inputs the stage writes in place, to clone first. Raises ValueError for a write
        another stage (or the model's output) would have to see: each stage gets its own copy of
        what it receives, so the write cannot reach them."""
        input_set, body_set, own = set(inputs), set(body), {self.nodes[n] for n in sp.nodes}

        def local_root(a: fx.Node) -> fx.Node:  # follow views back to a stage input or a tensor made here
            while a not in input_set and a in self.alias:
                a = self.alias[a]
            return a

        writable: dict[fx.Node, None] = {}
        for w in body:
            for a in self.writes.get(w, ()):
                root = local_root(a)
                if root in input_set:
                    writable[root] = None
                if self.base[a].op == "get_attr":  # a buffer: every stage holds the same object
                    continue
                for m in self.group[self.base[a]]:
                    same = (m in body_set or m in input_set) and local_root(m) is root
                    for u in m.users:
                        if self.order[u] <= self.order[w]:
                            continue
                        # a reader here sees the write; one elsewhere (a copy of a recomputed node included)
                        # sees what the stage sends after it, which is the write's result only for a tensor made here
                        elsewhere = u not in body_set or self.replicated_in.get(u, {sp.index}) != {sp.index}
                        ok = same and (m in own or not elsewhere)
                        if not ok:
                            reader = "the model's output" if u.op == "output" else f"{u.name} ({_where(u)})"
                            raise ValueError(
                                f"stage {sp.index}: {w.name} ({_where(w)}) writes in place to {a.name}, whose value "
                                f"{reader} reads afterwards through {m.name}; in the pipeline each stage gets its own "
                                f"copy of a tensor it receives, so that read would not see the write. Write out of "
                                f"place there (x = x + y rather than x += y, inplace=False), or move the cut.")
        return list(writable)


# -- stage facts ----------------------------------------------------------------------

def _running_buffers(stage: Stage) -> list[torch.Tensor]:
    """Buffers the stage's forward updates in place: running statistics of BatchNorm modules in
    training (also inside modules run whole), and buffers written by in-place ops."""
    buffers: list[torch.Tensor] = []
    alias = {n: a for n in stage.graph.nodes if (a := _alias_of(n, stage.get_submodule)) is not None}
    for node in stage.graph.nodes:
        modules = []
        if node.op == "call_module":
            modules.append(stage.get_submodule(node.target))
        elif node.op == "get_attr" and isinstance(obj := _attribute(stage, node.target), torch.nn.Module):
            modules.append(obj)
        for module in modules:
            for m in module.modules():
                if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.track_running_stats and m.training:
                    buffers.extend(b for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None)
        for a in _written(node, stage.get_submodule):
            while a in alias:
                a = alias[a]
            value = _attribute(stage, a.target) if a.op == "get_attr" else None
            if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                buffers.append(value)
    return list({id(b): b for b in buffers}.values())


def _attribute(module: torch.nn.Module, target: str) -> Any:
    for part in target.split("."):
        module = getattr(module, part)
    return module


# -- messages -------------------------------------------------------------------------

def _describe(node: fx.Node) -> str:
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    if node.op == "call_module":
        return f"module {node.target}"
    target = node.target
    return str(target) if isinstance(target, OpOverload) else getattr(target, "__qualname__", str(target))


def _where(node: fx.Node) -> str:
    """Where a node comes from: its module path and the user's source line, when tracing kept them."""
    parts = []
    stack = node.meta.get("nn_module_stack")
    path = list(stack.values())[-1][0] if stack else (node.target if node.op == "call_module" else "")
    if path:
        parts.append(f"module {path}")
    line = _source_line(node.meta.get("stack_trace"))
    if line:
        parts.append(line)
    return f"node {node.name}" + (f", {', '.join(parts)}" if parts else "")


def _source_line(stack_trace: str | None) -> str | None:
    """The innermost frame of a node's stack trace outside torch: 'file:line: code'."""
    if not stack_trace:
        return None
    lines = stack_trace.strip().splitlines()
    frames = []
    for i, line in enumerate(lines):
        match = re.match(r'\s*File "(.+)", line (\d+), in (.+)', line)
        if match:
            code = lines[i + 1].strip() if i + 1 < len(lines) and not lines[i + 1].lstrip().startswith("File ") else ""
            frames.append((match.group(1), match.group(2), code))
    if not frames:
        return lines[-1].strip()
    torch_dir = os.path.dirname(torch.__file__)
    file, line, code = next((f for f in reversed(frames) if not f[0].startswith(torch_dir)), frames[-1])
    return f"{file}:{line}: {code}" if code else f"{file}:{line}"


def _header(plan: Plan, sp: StagePlan, routes: dict[fx.Node, _Route] | None = None,
            writable: Iterable[fx.Node] = ()) -> str:
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
    if routes:
        lines.append(f"#   random ops draw from the generator argument: {', '.join(n.name for n in routes)}")
    writable = [n.name for n in writable]
    if writable:
        lines.append(f"#   written in place, so cloned first: {', '.join(writable)}")
    return "\n".join(lines) + "\n"
