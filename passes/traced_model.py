"""The trace pass's typed result, ``TracedModel``: a flat graph of the model and how to call it like the model (one
graph input per tensor leaf of the bound arguments, other leaves baked in; one graph output per tensor leaf of the
output; pytree specs rebuild the user's structures at the edges), and ``flat_root``, the module both routes trace
(docs/architecture.md, "Contracts between passes")."""
from __future__ import annotations

import dataclasses
import inspect
import itertools
import keyword
import re
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import torch
import torch.fx as fx
import torch.utils._pytree as pytree

from autopipe.ir.batch import InputMismatch

from .model_state import assigned_since, module_state


@dataclass
class TracedModel:
    """A flat graph of the model and how to call it like the model: one graph input per tensor leaf of the bound
    arguments (other leaves are baked in), one graph output per tensor leaf of the model's output."""

    signature: inspect.Signature       # of model.forward, to bind a call's arguments
    input_names: list[str]             # placeholder names, one per tensor leaf
    input_spec: pytree.TreeSpec        # of the bound-arguments dict
    input_leaves: list[Any]            # non-tensor leaves as traced; None where a tensor goes
    tensor_positions: list[int]        # leaf index of each placeholder
    example_arguments: dict[str, Any]  # argument name -> its kind when traced
    route: str = "fx"                  # "fx", "export" or "export-static"
    batch_size: int = 0                # dim 0 of the batch tensors it was traced with
    graph_module: fx.GraphModule | None = None
    output_spec: pytree.TreeSpec | None = None  # of the model's output
    output_leaves: list[Any] = field(default_factory=list)     # non-tensor output leaves; None where a tensor goes
    output_positions: list[int] = field(default_factory=list)  # leaf index of each flat graph output
    forced_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to forward though the call did not
    notes: list[str] = field(default_factory=list)
    static_batch: int | None = None    # rows every micro-batch must have; None: any number (dynamic)
    # module attributes the forward assigns tensors to and the graph does not
    assigned: list[str] = field(default_factory=list)
    # per placeholder: cut into micro-batches (dim 0 the batch), else given whole; [] unknown
    batch_inputs: list[bool] = field(default_factory=list)
    # cut, with the batch size in another dim too, in a graph of one static size
    ambiguous_inputs: list[str] = field(default_factory=list)
    # the inputs' and parameters' requires_grad, where the graph holds only what they gave (grad_flags)
    grad_flags: tuple | None = None

    @classmethod
    def for_call(cls, signature: inspect.Signature, arguments: dict[str, Any], **fields) -> TracedModel:
        """The calling convention of a call with these bound arguments; the graph is still to be traced."""
        with_paths, spec = pytree.tree_flatten_with_path(dict(arguments))
        tensors = [i for i, (_, leaf) in enumerate(with_paths) if isinstance(leaf, torch.Tensor)]
        return cls(signature=signature, input_names=_leaf_names([with_paths[i][0] for i in tensors]), input_spec=spec,
                   tensor_positions=tensors,
                   input_leaves=[None if i in tensors else leaf for i, (_, leaf) in enumerate(with_paths)],
                   example_arguments={k: torch.empty(0) if isinstance(v, torch.Tensor) else None
                                      for k, v in arguments.items()}, **fields)

    def flat_inputs(self, args: Sequence[Any], kwargs: dict[str, Any]) -> list[torch.Tensor]:
        return self.flatten_inputs(self.signature.bind(*args, **kwargs).arguments)

    def flatten_inputs(self, arguments: dict[str, Any]) -> list[torch.Tensor]:
        """The graph's inputs for a call's bound arguments."""
        leaves, spec = pytree.tree_flatten(dict(arguments))
        if spec != self.input_spec:
            raise InputMismatch(f"this call's arguments have structure {spec} but the pipeline was compiled for "
                                f"{self.input_spec}; call it with the same arguments as the first call")
        names = dict(zip(self.tensor_positions, self.input_names))
        for i, (now, then) in enumerate(zip(leaves, self.input_leaves)):
            if i in names and not isinstance(now, torch.Tensor):
                raise InputMismatch(f"argument {names[i]!r} was a tensor when the pipeline was compiled but is "
                                    f"{type(now).__name__} now")
            if i not in names and not _same_constant(now, then):
                raise InputMismatch(f"non-tensor argument #{i} was {then!r} when the pipeline was compiled and is "
                                    f"{now!r} now; it is baked into the graph")
        return [leaves[i] for i in self.tensor_positions]

    def check_grad_flags(self, model: torch.nn.Module, flat_inputs: Sequence[torch.Tensor]) -> None:
        """A graph that holds a reentrant checkpoint run without grad (none of its inputs required grad) is the plain
        model's only while no input or parameter changes requires_grad (Note [reentrant checkpoints inline])."""
        if self.grad_flags is not None and grad_flags(model, flat_inputs) != self.grad_flags:
            raise InputMismatch("an input or parameter changed requires_grad since the pipeline was compiled, and the "
                                "model's reentrant torch.utils.checkpoint, whose inputs then needed no gradient, was "
                                "traced to give its parameters none, as the plain model did; compile the pipeline "
                                "again (autopipe.compile) for these settings")

    def rebuild_output(self, flat: Sequence[Any]) -> Any:
        return pytree.tree_unflatten(_fill(self.output_leaves, self.output_positions, flat), self.output_spec)

    def _call_flat(self, fn, tensors: Sequence[Any]) -> tuple:
        """``fn`` called as the traced call with ``tensors`` (proxies while tracing), its output's structure kept."""
        arguments = pytree.tree_unflatten(_fill(self.input_leaves, self.tensor_positions, tensors), self.input_spec)
        bound = inspect.BoundArguments(self.signature, {**arguments, **self.forced_kwargs})
        output = per_sample_lists(register_dataclasses(fn(*bound.args, **bound.kwargs)), self.batch_size)
        if any(isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool)) for leaf in pytree.tree_leaves(output)):
            raise TypeError("the output holds a number that depends on the batch size: only tensors and constants can "
                            "be outputs")
        return self.keep_output_structure(output, (torch.Tensor, fx.Proxy))

    def keep_output_structure(self, output: Any, value_types: tuple[type, ...]) -> tuple:
        """``output``'s leaves of ``value_types`` (the graph's flat outputs); its structure and other leaves are kept
        for rebuild_output."""
        leaves, self.output_spec = pytree.tree_flatten(output)
        self.output_positions = [i for i, leaf in enumerate(leaves) if isinstance(leaf, value_types)]
        self.output_leaves = [None if i in self.output_positions else leaf for i, leaf in enumerate(leaves)]
        return tuple(leaves[i] for i in self.output_positions)


@dataclasses.dataclass
class PerSampleList:
    """An output list of one tensor a sample, the rows of a tensor whose dim 0 is the batch (``list(features)``: LLaVA's
    image features): the graph returns them stacked, which micro-batches concatenate, and the rebuilt output is a list
    again, as long as the batch. Kept a list, the graph would have one output a sample, a number no micro-batch has."""

    tensor: Any


pytree.register_pytree_node(
    PerSampleList, lambda p: ([p.tensor], None),
    lambda leaves, _: list(leaves[0].unbind(0)) if isinstance(leaves[0], torch.Tensor) else PerSampleList(leaves[0]),
    flatten_with_keys_fn=lambda p: ([(pytree.GetAttrKey("stacked"), p.tensor)], None))


def per_sample_lists(output: Any, batch: int) -> Any:
    """``output`` with each list of ``batch`` tensors that are the rows of one tensor, in order (views of one storage,
    each after the last), as a PerSampleList of them stacked."""
    def rows_of_one(node: list) -> bool:
        first = node[0]
        return first._base is not None and all(
            x._base is first._base and x.shape == first.shape and x.dtype == first.dtype and x.is_contiguous()
            and x.storage_offset() == first.storage_offset() + i * first.numel() for i, x in enumerate(node))

    def per_sample(node: Any) -> bool:
        return isinstance(node, list) and len(node) == batch > 0 and all(isinstance(x, torch.Tensor) for x in node) \
            and all(type(d) is int for d in node[0].shape) and rows_of_one(node)

    return pytree.tree_map(lambda node: PerSampleList(torch.stack(node)) if per_sample(node) else node, output,
                           is_leaf=per_sample)


def grad_flags(model: torch.nn.Module, flat_inputs: Sequence[torch.Tensor]) -> tuple:
    return tuple(t.requires_grad for t in flat_inputs), tuple(p.requires_grad for p in model.parameters())


def _fill(template: list[Any], positions: list[int], values: Sequence[Any]) -> list[Any]:
    filled = dict(zip(positions, values))
    return [filled.get(i, leaf) for i, leaf in enumerate(template)]


def _same_constant(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return a is b


def register_dataclasses(tree: Any) -> Any:
    """Plain dataclasses become pytree nodes (process-wide), as torch.export needs; nested ones once their parent is."""
    while new := {type(x) for x in pytree.tree_leaves(tree) if dataclasses.is_dataclass(x)
                  and not isinstance(x, type) and type(x) not in pytree.SUPPORTED_NODES}:
        for cls in new:
            pytree.register_dataclass(cls)
    return tree


def flat_root(model: torch.nn.Module, traced: TracedModel, fn) -> torch.nn.Module:
    """A module sharing the model's children, parameters and buffers, so a graph of it names them as the model
    does, whose forward takes one argument per tensor leaf of the call and calls ``fn`` (the model) as the call."""
    params = ", ".join(traced.input_names)

    def call(tensors):  # assignments are seen here (Note [state the forward assigns])
        state = module_state(model)
        try:
            return traced._call_flat(fn, tensors)
        finally:
            traced.assigned = sorted(set(traced.assigned) | assigned_since(state))

    namespace: dict[str, Any] = {"_autopipe_call": call}
    exec(f"def forward(self, {params}):\n    return _autopipe_call(({params},))\n", namespace)
    root = type(f"{type(model).__name__}Flat", (torch.nn.Module,), {"forward": namespace["forward"]})()
    root._modules, root._parameters, root._buffers = model._modules, model._parameters, model._buffers
    root.training = model.training
    return root


def named_leaves(output: Any) -> list[tuple[str, Any]]:
    """("output['logits']", leaf) for each leaf of a model's output, in the order the pipeline flattens it; by position
    for a pytree node registered without keys (diffusers' outputs)."""
    tree = register_dataclasses(output)
    try:
        return [("output" + pytree.keystr(path), t) for path, t in pytree.tree_flatten_with_path(tree)[0]]
    except ValueError:
        return [(f"output[{i}]", t) for i, t in enumerate(pytree.tree_leaves(tree))]


def _leaf_names(paths: Iterable[tuple]) -> list[str]:
    """Unique identifiers for pytree leaf paths: ``past_key_values_0_1`` for ["past_key_values"][0][1]."""
    names: list[str] = []
    for path in paths:
        name = re.sub(r"\W+", "_", pytree.keystr(path)).strip("_") or "input"
        if name[0].isdigit() or keyword.iskeyword(name):
            name = f"input_{name}"
        if name in names:
            name = next(f"{name}_{n}" for n in itertools.count(1) if f"{name}_{n}" not in names)
        names.append(name)
    return names
