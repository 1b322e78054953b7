"""Shapes on every node of a graph, on fake (or meta) tensors: no memory, no compute (``propagate_fake_shapes``), and
the interpreter every autopipe graph run uses (``MutableArguments``)."""
from __future__ import annotations

import contextlib
import logging
from typing import Any, Iterator, Sequence

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

from autopipe.ir.batch import carries_batch

from .diagnostics import failed_at
from .model_state import scalar_buffers_kept


# Note [immutable list arguments]: an fx Interpreter hands each node its list arguments as immutable_list, and a
# function fx keeps whole may write to one (torchvision's swin3d _get_window_and_shift_size). The generated code
# passes a fresh list, so the shape runs, the cost pass's counting and its timing must too: plain copies.
def mutable(value: Any) -> Any:
    """``value`` with fx's immutable_list and immutable_dict as plain ones (Note [immutable list arguments])."""
    if isinstance(value, list):
        return [mutable(v) for v in value]
    if isinstance(value, dict):
        return {k: mutable(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return type(value)(*map(mutable, value)) if hasattr(value, "_fields") else tuple(map(mutable, value))
    return value


class MutableArguments(fx.Interpreter):
    """autopipe's graph runs: a node's arguments ``mutable`` (Note [immutable list arguments]), and a node that raises
    kept on its error (Note [the node an error was raised at])."""

    def fetch_args_kwargs_from_env(self, n: fx.Node):
        return mutable(super().fetch_args_kwargs_from_env(n))

    def run_node(self, n: fx.Node):
        try:
            return super().run_node(n)
        except Exception as e:
            failed_at(e, n)
            raise


class _FakeProp(MutableArguments, FakeTensorProp):
    pass


class _MetaProp(MutableArguments):
    """Meta kernels directly, for a model and inputs all on meta: faster than FakeTensorMode, for the same shapes
    (benchmarks/compile_time.py measures compiling on meta)."""

    def run_node(self, n: fx.Node):
        n.meta["val"] = super().run_node(n)
        return n.meta["val"]


def propagate_fake_shapes(gm: fx.GraphModule, flat_inputs: Sequence[torch.Tensor],
                           grow_batch: int | None = None) -> None:
    """node.meta["val"] for every node, on fake (or meta) tensors: no memory, no compute. ``grow_batch``: the batch,
    whose tensors get one row more."""
    meta_params = next((p.device.type == "meta" for p in gm.parameters()), False)
    # a shape env gives a size that depends on values (x[mask], nonzero) a symbol, u0, where a plain fake mode raises
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=ShapeEnv(), static_shapes=True)
    inputs = [t.to("meta") if meta_params else t for t in flat_inputs]  # propagate makes them fake
    if grow_batch is not None:  # empty on meta, or fake under the mode: no memory either way
        with mode if not meta_params else contextlib.nullcontext():
            inputs = [torch.empty((grow_batch + 1, *t.shape[1:]), dtype=t.dtype, device=t.device)
                      if carries_batch(t, grow_batch) else t for t in inputs]
    if all(t.device.type == "meta" for t in [*gm.parameters(), *gm.buffers(), *inputs]):
        with contextlib.suppress(Exception):  # an op with a fake kernel but no meta kernel falls back
            _MetaProp(gm).run(*inputs)
            return
    for n in gm.graph.nodes:
        n.meta.pop("unbacked_bindings", None)  # export's symbols (u0): this mode names its own
    with scalar_buffers_kept(gm):
        _FakeProp(gm, mode).propagate(*inputs)


@contextlib.contextmanager
def fake_errors_unlogged() -> Iterator[None]:
    """FakeTensorMode logs each kernel that raises (torch/_subclasses/fake_tensor.py, "failed while attempting to run
    meta") before the error reaches autopipe, which names it or, where nothing is learnt, drops it: the log would only
    alarm."""
    logger, quiet = logging.getLogger("torch._subclasses.fake_tensor"), lambda record: record.levelno < logging.ERROR
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
