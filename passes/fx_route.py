"""The torch.fx route of the trace pass: ``torch.fx.symbolic_trace`` of the model's forward through ``flat_root``, with
the user's leaf modules kept whole; refused where an fx graph would lose what the forward does (grad-mode and autocast
switches, writes and draws with no traced argument), which the export route can hold."""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
import traceback
from typing import Callable, Iterable

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode

from .custom_gradients import backward_hooked
from .diagnostics import TraceError, listed, model_frame
from .model_state import module_state_kept
from .traced_model import TracedModel, flat_root


def trace_fx(model: torch.nn.Module, traced: TracedModel, leaf_modules: Iterable[type | str]) -> TracedModel:
    """``traced`` with the graph torch.fx.symbolic_trace records of the model's forward (``leaf_modules`` and modules
    with backward hooks kept whole), its nodes with their stack traces; TraceError where the graph would lose
    something the forward does."""
    leaves, hooked = tuple(leaf_modules), backward_hooked(model)
    if "" in hooked:
        raise TraceError(f"{type(model).__name__} itself has a backward hook (register_full_backward_hook): the "
                         f"pipeline runs its stages, never the model as a whole, so the hook would not run; register "
                         f"it on a submodule, or on a tensor (tensor.register_hook)")

    # keeps the user's chosen modules (types or qualified names) whole, and those whose backward hooks must run
    # (Note [module backward hooks])
    class LeafTracer(fx.Tracer):
        def create_node(self, *args, **kwargs) -> fx.Node:  # the model's line in every pass's messages (node_where)
            node = super().create_node(*args, **kwargs)
            node.stack_trace = node.stack_trace or model_frame()
            return node

        def is_leaf_module(self, m: torch.nn.Module, name: str) -> bool:
            return any(name == leaf if isinstance(leaf, str) else isinstance(m, leaf)
                       for leaf in leaves) or name in hooked or \
                super().is_leaf_module(m, name)

    # fx cannot call the model itself (it is no submodule of root): its forward, with its own forward hooks as its
    # __call__ runs them
    root = flat_root(model, traced, functools.partial(torch.nn.Module._call_impl, model))
    with module_state_kept(model), _what_fx_cannot_record(model) as lost, sizes_given_whole():
        traced.graph_module = fx.GraphModule(root, LeafTracer().trace(root), class_name=type(model).__name__)
    if traced.assigned:
        lost.append(f"the forward assigns {', '.join(traced.assigned)}, which fx runs once while tracing")
    if lost:
        raise TraceError("; ".join(lost) + ": an fx graph cannot hold it (the export route can)")
    if hooked:
        traced.notes.append(f"kept whole for their backward hooks, which run on each micro-batch's gradients: "
                            f"{listed(hooked)}")
    return traced


_FX_TRACING = threading.Lock()


# Note [what an fx graph loses]: fx records only ops on proxies. A torch.no_grad() region or an autocast switch
# vanishes (its ops would be differentiated, or run in float32); an in-place op whose arguments are all real
# (self.running.mul_(0.9)) runs once, at trace time, and is not in the graph; a random op with no traced argument
# (x + torch.randn(3)) is drawn once and frozen into a constant. We watch grad-mode and autocast switches, the
# version counters of parameters and buffers, and random kernels that really run; any of them fails the fx route,
# and torch.export, which keeps all three, traces the model instead.
@contextlib.contextmanager
def _what_fx_cannot_record(model: torch.nn.Module):
    """What vanishes from an fx graph (Note [what an fx graph loses]): grad-mode and autocast switches, in-place
    writes of parameters and buffers, and random draws (``torch.rand(n)``), all with no traced argument. Yields the
    list of what was lost, filled on exit."""
    tracer_thread, switches, autocasts, draws, lost = threading.get_ident(), [], [], [], []
    skip = (os.path.dirname(torch.__file__), os.path.dirname(__file__), os.path.dirname(contextlib.__file__))

    def where() -> str:
        frames = [f for f in traceback.extract_stack() if not f.filename.startswith(skip)]
        return f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else ""

    def recording(found: list[str],
                  switch: Callable) -> Callable:  # the switch, noting where the tracer thread calls it
        def record(*args) -> None:
            if threading.get_ident() == tracer_thread:
                found.append(where())
            switch(*args)
        return record

    class RealDraws(TorchDispatchMode):  # ops on proxies never reach the dispatcher: these run for real
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if torch.Tag.nondeterministic_seeded in func.tags and not draws:
                draws.append(f"{func} at {where()}")
            return func(*args, **(kwargs or {}))

    tensors = {name: t for name, t in itertools.chain(model.named_parameters(), model.named_buffers())
               if not t.is_inference()}  # an inference tensor has no version counter
    versions = {name: t._version for name, t in tensors.items()}
    # one patch of torch._C._set_grad_enabled (and torch.set_autocast_enabled: torch.autocast's switch) at a time
    with _FX_TRACING:
        set_grad_enabled, set_autocast_enabled = torch._C._set_grad_enabled, torch.set_autocast_enabled
        torch._C._set_grad_enabled = recording(switches, set_grad_enabled)
        torch.set_autocast_enabled = recording(autocasts, set_autocast_enabled)
        try:
            with RealDraws():
                yield lost
        finally:
            torch._C._set_grad_enabled, torch.set_autocast_enabled = set_grad_enabled, set_autocast_enabled
    written = [name for name, t in tensors.items() if t._version != versions[name]]
    if switches:
        lost.append(f"the forward switches grad mode (torch.no_grad(), set_grad_enabled) at {switches[0]}")
    if autocasts:
        lost.append(f"the forward switches autocast (torch.autocast) at {autocasts[0]}")
    if draws:
        lost.append(f"the forward draws random numbers from no traced argument ({draws[0]}), which fx would draw once "
                    f"while tracing and keep as a constant")
    if written:
        lost.append(f"the forward writes {', '.join(written)} in place with no traced argument, which fx runs once "
                    f"while tracing")


# Note [sizes given one by one]: torch's factories that take ``*size`` (their docs: ``torch.ones(*size)``), for
# ``torch.ones(batch_size, seq)`` with ``batch_size, seq = x.shape`` (transformers' default attention masks). Under fx
# those sizes are Proxies, which torch's argument parser takes for no int and matches no overload ("ones() takes 1
# positional argument but 2 were given"); given as one tuple, the Proxy's __torch_function__ records the call, whose
# graph computes the sizes from the input's shape at each micro-batch.
_SIZE_ONE_BY_ONE = ("empty", "ones", "rand", "randn", "zeros")


@contextlib.contextmanager
def sizes_given_whole():
    """While fx traces: torch's ``*size`` factories called with a traced size among several (Note [sizes given one by
    one]) are called with the sizes as one tuple, which fx records as the same function of the same sizes; any other
    call goes through unchanged."""
    def whole(factory: Callable) -> Callable:
        @functools.wraps(factory)
        def call(*size, **kwargs):
            if len(size) > 1 and any(isinstance(s, fx.Proxy) for s in size):
                return factory(size, **kwargs)
            return factory(*size, **kwargs)
        return call

    factories = {name: getattr(torch, name) for name in _SIZE_ONE_BY_ONE}
    for name, factory in factories.items():
        setattr(torch, name, whole(factory))
    try:
        yield
    finally:
        for name, factory in factories.items():
            setattr(torch, name, factory)
