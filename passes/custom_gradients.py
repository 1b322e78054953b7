"""Gradients a model defines in Python, which a traced graph would drop: the trace pass keeps them or refuses them.

- A custom autograd.Function is kept whole, its own backward run: fx records a call of the Function; torch.export
  records an opaque custom op (``autopipe::autograd_function``), which export_route swaps for the same call (Note
  [Function.apply traced into], Note [a Function that writes its input]).
- A reentrant ``torch.utils.checkpoint`` runs its function inline; the pipeline re-materialises stages itself (Note
  [reentrant checkpoints inline]).
- A module's backward hook runs where the module is called whole (Note [module backward hooks]); a tensor hook
  registered in the forward (``h.register_hook(f)``) is refused (Note [tensor hooks in the forward])."""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import traceback
from typing import Any, Iterator

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
import torch.utils.checkpoint

_TORCH_HOOKS = tuple(os.path.join(os.path.dirname(torch.__file__), *p)
                     for p in (("utils", "hooks.py"), ("nn", "modules", "module.py")))
_PATCH = threading.Lock()
# what the first trace on any thread replaced (torch's own, or a user's patch), put back by the last
_replaced: dict[str,
                Any] = {}
# thread ident -> the reentrant checkpoints its trace ran inline, and whether with grad
_tracing: dict[int,
               list[tuple[str,
                          bool]]] = {}
_exporting = threading.local()       # .calls: export_route's calls of the custom op, by number, while it exports
_TENSOR = object()                   # where a tensor goes among an output's leaves


class FunctionCall:
    """``function.apply`` with the call's other arguments baked in, called with the traced values (tensors; on fx also
    sizes) in order. With ``flat``, it returns the tensors of the Function's output as a list, as the custom op does on
    the export route."""

    def __init__(self, function: type, spec: pytree.TreeSpec, leaves: list[Any], slots: list[int], flat: bool = False):
        self.function, self.spec, self.slots, self.flat = function, spec, slots, flat
        self.leaves = [None if i in slots else leaf
                       for i, leaf in enumerate(leaves)]  # the call's other arguments; the values fill the slots
        self.__name__ = self.__qualname__ = f"{function.__name__}_apply"  # the name fx writes into the stage code
        self.__module__ = ""  # so that fx makes it a global of the code, never an attribute path into torch
        self.output: tuple[pytree.TreeSpec,
                           list[Any]] | None = None  # the export route's: the output's structure and non-tensor leaves

    # Note [a Function that writes its input]: a kept Function that writes its input in place (ctx.mark_dirty) is a
    # call the in-place analysis cannot see into, so a recompute would write the caller's input again. run compares
    # its inputs' versions and refuses during the trace's shape runs, on both routes (the custom op of the export
    # route says it mutates nothing). A SymInt argument is refused too: a size set by the batch would be baked in.
    def run(self, *values: Any) -> Any:
        filled = dict(zip(self.slots, values))
        args, kwargs = pytree.tree_unflatten([filled.get(i, leaf) for i, leaf in enumerate(self.leaves)], self.spec)
        tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        versions = [t._version for t in tensors]
        output = _apply_unpatched(self.function, *args, **kwargs)
        if [t._version for t in tensors] != versions:  # seen by the shape runs of the trace, before anything else runs
            raise TypeError(f"{self!r} writes its input in place (ctx.mark_dirty): autopipe keeps a custom "
                            f"autograd.Function whole, and its analysis of in-place writes (which stage must see one, "
                            f"what a recompute must not redo) cannot see into it; return a new tensor")
        return output

    def __call__(self, *values: Any) -> Any:
        output = self.run(*values)
        return [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)] if self.flat else output

    def __repr__(self) -> str:
        return f"{self.function.__module__}.{self.function.__qualname__}.apply"


def _recorded_call(tensors: list[torch.Tensor], call: int) -> list[torch.Tensor]:
    """Export's record of one Function call: the forward on (fake or real) values; its structure is kept for the traced
    Python."""
    calls = getattr(_exporting, "calls", None)
    if calls is None:
        raise RuntimeError("autopipe::autograd_function runs only while autopipe exports a model: a graph still calls "
                           "it (a bug in autopipe)")
    function = calls[call]
    with torch.no_grad():
        output = function.run(*tensors)
    leaves, spec = pytree.tree_flatten(output)
    function.output = (spec, [_TENSOR if isinstance(t, torch.Tensor) else t for t in leaves])
    return [t.clone() for t in leaves if isinstance(t, torch.Tensor)]  # a custom op's outputs alias nothing


torch.library.custom_op("autopipe::autograd_function", mutates_args=())(_recorded_call).register_fake(_recorded_call)


# Note [Function.apply traced into]: fx and non-strict export both trace into Function.apply: the graph holds the
# forward's ops and the backward is gone, so a pipeline would differentiate the forward instead (a gradient
# reversal layer's sign lost, silently). While a trace runs on a thread, apply is patched for that thread: on fx
# a call_function node calling FunctionCall; on export a custom op whose fake kernel runs the forward, swapped
# back for FunctionCall in every GraphModule of the export (higher-order ops' subgraphs too). The patches put back
# what they found (a user's own patch), not what torch had at import.
def _apply(cls, *args, **kwargs):
    """Function.apply while a trace runs on this thread: the call kept whole (Note [Function.apply traced into]);
    elsewhere torch's own."""
    ran_inline = _tracing.get(threading.get_ident())
    if ran_inline is None:
        return _apply_unpatched(cls, *args, **kwargs)
    leaves, spec = pytree.tree_flatten((args, kwargs))
    proxies = [i for i, leaf in enumerate(leaves) if isinstance(leaf, fx.Proxy)]
    # Note [reentrant checkpoints inline]: a reentrant torch.utils.checkpoint is CheckpointFunction.apply, whose
    # forward runs under no_grad: export recorded the region without grad and no gradient reached the layers. It runs
    # inline, under no_grad only where none of its inputs requires grad, as the plain model gives such a function's
    # parameters no gradient. That is right only for the requires_grad flags it was traced with: they are kept
    # (grad_flags) and a call whose flags differ is refused. fx refuses it (its grad-mode switch).
    if cls is torch.utils.checkpoint.CheckpointFunction:  # (run_function, preserve_rng_state, *args)
        if proxies:  # fx: torch's own, whose no_grad region fx refuses
            return _apply_unpatched(cls, *args, **kwargs)
        # as in the plain model, no gradient reaches the function's parameters where none of its inputs requires grad
        needs_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in pytree.tree_leaves(args[2:]))
        ran_inline.append((_named(args[0]), needs_grad))
        with contextlib.nullcontext() if needs_grad else torch.no_grad():
            return args[0](*args[2:])
    if proxies:  # fx: one node calling the Function
        call = FunctionCall(cls, spec, leaves, proxies)
        return leaves[proxies[0]].tracer.create_proxy("call_function", call, tuple(leaves[i] for i in proxies), {})
    calls = getattr(_exporting, "calls", None)
    if calls is None:  # not inside an export (FakeTensorProp runs the graph's calls through FunctionCall.run)
        return _apply_unpatched(cls, *args, **kwargs)
    if sizes := [leaf for leaf in leaves if isinstance(leaf, (torch.SymInt, torch.SymFloat, torch.SymBool))]:
        raise TypeError(f"{cls.__qualname__}.apply is given {sizes[0]}, a number set by the batch size: autopipe keeps "
                        f"a custom autograd.Function whole and bakes its non-tensor arguments in; pass such a number "
                        f"as a tensor")
    slots = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)]
    call = FunctionCall(cls, spec, leaves, slots, flat=True)
    calls.append(call)
    tensors = iter(torch.ops.autopipe.autograd_function([leaves[i] for i in slots], len(calls) - 1))
    out_spec, out_leaves = call.output
    return pytree.tree_unflatten([next(tensors) if leaf is _TENSOR else leaf for leaf in out_leaves], out_spec)


def _named(function: Any) -> str:
    """A checkpointed function by its module's class (Hugging Face checkpoints ``partial(layer.__call__, ...)``), else
    its own name."""
    while isinstance(function, functools.partial):
        function = function.func
    owner = function if isinstance(function, torch.nn.Module) else getattr(function, "__self__", None)
    return type(owner).__name__ if isinstance(owner, torch.nn.Module) else getattr(function, "__qualname__",
                                                                                   type(function).__name__)


def _apply_unpatched(cls, *args, **kwargs):
    """Function.apply as it is outside a trace: torch's, or a user's patch of it."""
    apply = _replaced.get("apply") or torch.autograd.Function.__dict__["apply"]
    return apply.__get__(None, cls)(*args, **kwargs)


# Note [tensor hooks in the forward]: a hook registered in the forward (h.register_hook(f)) is set on a fake
# tensor while export traces and held by no graph: it would never run through the pipeline. While a trace runs,
# Tensor.register_hook called from outside torch's own code raises, naming the line; register_multi_grad_hook,
# which calls it from torch's code, is refused too. A hook on a grad_fn is a C method no patch reaches.
def _register_hook(tensor: torch.Tensor, hook: Any):
    """Tensor.register_hook while a trace runs on this thread: refused where the forward calls it, also through torch's
    register_multi_grad_hook (nn.Module's own hook machinery runs as it does; Note [tensor hooks in the forward])."""
    frames = traceback.extract_stack(limit=2)
    if threading.get_ident() in _tracing and not frames[0].filename.startswith(_TORCH_HOOKS):
        torch_dir = os.path.dirname(torch.__file__)
        user = next((f for f in reversed(traceback.extract_stack()[:-1]) if not f.filename.startswith(torch_dir)),
                    frames[0])
        raise TypeError(f"the forward registers a gradient hook on a tensor ({user.filename}:{user.lineno}: "
                        f"{user.line}): a traced graph holds no hook, so the pipeline would never run it. Write it as "
                        f"a custom torch.autograd.Function, or a module's full backward hook; see docs/faithfulness.md")
    return (_replaced.get("register_hook") or torch.Tensor.register_hook)(tensor, hook)


# Note [module backward hooks]: a module's full backward hook (and pre-hook) is set up by its __call__ on the
# autograd graph of that call, which a graph tracing into the module does not keep. fx keeps a module with a
# backward hook whole, so the stage calls it and the hook runs per micro-batch; export refuses one, naming it;
# a global module backward hook is refused on both routes. fx calls the model through nn.Module._call_impl, so
# its own forward (pre-)hooks run as they do in the plain model.
def backward_hooked(model: torch.nn.Module) -> list[str]:
    """The modules with a backward hook (register_full_backward_hook, ..._pre_hook): a graph that traces into a module
    holds no hook of its, so the hook runs only where the module is called as a whole ("" is the model itself)."""
    return [name for name, m in model.named_modules() if m._backward_hooks or m._backward_pre_hooks]


@contextlib.contextmanager
def kept_whole() -> Iterator[list[tuple[str, bool]]]:
    """Around a trace on this thread: custom Functions kept whole, reentrant checkpoints inline (yields each function
    run inline, and whether with grad), tensor hooks refused."""
    module_hooks = torch.nn.modules.module
    if module_hooks._global_backward_hooks or module_hooks._global_backward_pre_hooks:
        raise TypeError("a global module backward hook is set "
                        "(torch.nn.modules.module.register_module_full_backward_hook): a traced graph holds no "
                        "module's backward hook, so it would not run where it runs on the plain model; remove it while "
                        "compiling and training, or register it on the modules themselves")
    ran_inline: list[tuple[str, bool]] = []
    with _PATCH:
        if not _tracing:
            _replaced.update(apply=torch.autograd.Function.__dict__["apply"],
                             register_hook=torch.Tensor.__dict__["register_hook"])
            torch.autograd.Function.apply = classmethod(_apply)
            torch.Tensor.register_hook = _register_hook
        _tracing[threading.get_ident()] = ran_inline
    try:
        yield ran_inline
    finally:
        with _PATCH:
            del _tracing[threading.get_ident()]
            if not _tracing:
                torch.autograd.Function.apply = _replaced.pop("apply")
                torch.Tensor.register_hook = _replaced.pop("register_hook")


@contextlib.contextmanager
def exporting() -> Iterator[list[FunctionCall]]:
    """Around torch.export: each Function call becomes a custom op numbering it in the list yielded (``calls_restored``
    reads it back)."""
    _exporting.calls = calls = []
    try:
        yield calls
    finally:
        del _exporting.calls


def calls_restored(root: fx.GraphModule, calls: list[FunctionCall]) -> None:
    """The exported graph calls each Function again where export recorded the custom op (its getitems stay: the call
    returns a list), also in the subgraphs of its no_grad and autocast regions (Note [Function.apply traced into])."""
    for module in root.modules():
        found = module.graph.find_nodes(op="call_function", target=torch.ops.autopipe.autograd_function.default) \
            if isinstance(module, fx.GraphModule) else []
        for node in found:
            tensors, number = node.args
            node.target, node.args = calls[number], tuple(tensors)
        if found and module is not root:
            module.recompile()
