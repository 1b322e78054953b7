"""Each node's measured seconds at one micro-batch: its forward, its whole backward, and its backward towards its inputs
alone (B, with the parameters frozen); W is the difference. passes/step_time.py adds them up per stage;
``train_seconds`` gives the partitioner a step's seconds per node (balance="train_time")."""
from __future__ import annotations

import collections
import contextlib
import ctypes
import os
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_leaves, tree_map_only

from .cost import CostedGraph
from .model_state import scalar_buffers_kept
from .node_recorder import NodeRecorder, backward_starts
from .split_times import time_split

_CALLS = ("call_function", "call_method", "call_module")


@dataclass(frozen=True)
class NodeTimes:
    """Median seconds per call node over ``repeats`` runs at ``rows`` batch rows. ``backward``: the node's share of a
    backward to every input and parameter; ``input_grad``: of a backward to the inputs only (what B runs)."""

    forward: dict[str, float]
    backward: dict[str, float]
    input_grad: dict[str, float]
    rows: int
    repeats: int
    threads: int = 1
    forward_scale: float = 1.0  # the graph's own forward over its nodes' sum under the Interpreter
    peers: int = 0  # threads that ran the graph meanwhile
    # per trainable parameter (every qualified name it has): seconds to add one micro-batch's gradient to the step's
    # sum in place (Note [a micro-batch's gradients added to the step's])
    accumulate: dict[str, float] = field(default_factory=dict)
    # per trainable parameter (every name): seconds to copy the step's first gradient into a new tensor, the sum a
    # torchrun rank makes (Note [a step's first gradient copied to fresh pages])
    first_sum: dict[str, float] = field(default_factory=dict)
    # B and W as a split schedule runs them (passes/split_times.py): per node, and per node reading parameters
    input_grad_apart: dict[str, float] = field(default_factory=dict)
    weight_apart: dict[str, float] = field(default_factory=dict)

    def weight(self, name: str) -> float:
        """W: the parameter gradients' share of the node's backward, between 0 and all of it (two runs' noise)."""
        whole = self.backward.get(name, 0.0)
        return min(max(whole - self.input_grad.get(name, 0.0), 0.0), whole)

    def input_grad_split(self, name: str) -> float:
        """B as a split schedule runs it: timed so where measured (Note [B and W timed apart]), else
        ``input_grad``."""
        return self.input_grad_apart.get(name, self.input_grad.get(name, 0.0))

    def weight_split(self, name: str) -> float:
        """W as a split schedule runs it, apart from B: timed so where measured (Note [B and W timed apart]); 0 for
        a node timed apart that reads no parameter (W never runs it); else ``weight``."""
        if name in self.weight_apart:
            return self.weight_apart[name]
        return 0.0 if name in self.input_grad_apart else self.weight(name)


def measure_node_times(gm: fx.GraphModule, inputs: Sequence, repeats: int = 3, threads: int | None = None,
                       peers: int = 0, output_grads: Callable[[list], Sequence] | None = None,
                       split_backward: bool = False, sums: bool = True) -> NodeTimes:
    """Time every call node of ``gm`` on ``inputs`` (one micro-batch): forward, backward, and backward to the inputs
    only, on ``threads`` intra-op threads (a CPU worker's: cores // workers; None: torch's), while ``peers`` threads
    run the graph's forward meanwhile (Note [workers sharing cores]). The backward starts from ``output_grads`` of
    the graph's outputs (``loss_gradients``: the loss's, Note [a backward's speed depends on its values]; None:
    ones). ``split_backward``: also time each node's B and W as a split schedule runs them (Note [B and W timed
    apart]). ``sums``: also time the parameters' gradient sums (Note [a micro-batch's gradients added to the step's]).
    Buffers, RNG, the thread count and the parameters' ``requires_grad`` and ``.grad`` are left as they were."""
    forward: dict[str, list[float]] = collections.defaultdict(list)
    backward: dict[str, list[float]] = collections.defaultdict(list)
    input_grad: dict[str, list[float]] = collections.defaultdict(list)
    apart = (collections.defaultdict(list), collections.defaultdict(list)) if split_backward else None
    params = [p for p in gm.parameters() if p.requires_grad]
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    stop = threading.Event()
    load = [threading.Thread(target=_busy, args=(gm, inputs, threads or before, stop), daemon=True)
            for _ in range(peers)]
    try:
        with scalar_buffers_kept(gm, every_buffer=True):  # the peers' writes too, once they have stopped
            for t in load:
                t.start()
            try:
                whole = _time_all(gm, inputs, repeats, forward, backward, input_grad, params, output_grads, apart)
                added, firsts = _time_sums(gm, repeats) if sums else ({}, {})
            finally:
                stop.set()
                for t in load:
                    t.join()
    finally:
        torch.set_num_threads(before)
    rows = next((int(t.shape[0]) for t in inputs if isinstance(t, torch.Tensor) and t.dim()), 1)
    median = lambda d: {k: statistics.median(v) for k, v in d.items()}
    forward_s = median(forward)
    scale = whole / sum(forward_s.values()) if sum(forward_s.values()) else 1.0  # Note [the interpreter's share]
    return NodeTimes(forward={k: v * scale for k, v in forward_s.items()}, backward=median(backward),
                     input_grad=median(input_grad), rows=rows, repeats=repeats, threads=threads or before,
                     forward_scale=scale, peers=peers, accumulate=added, first_sum=firsts,
                     input_grad_apart=median(apart[0]) if apart else {}, weight_apart=median(apart[1]) if apart else {})


# Note [a micro-batch's gradients added to the step's]: a step sums each parameter's gradient over its micro-batches,
# each one after the first added in place (runtime/gradients.py); a torchrun rank, summing as the engine makes them,
# also copies the first into the sum's own tensor (Note [a step's first gradient copied to fresh pages]). On a CPU
# that add reads two parameter-sized tensors and writes one: on a small micro-batch it rivals the gradient's own
# matmul, which a node's backward does not count. Timed here on the worker's threads as a step meets it: in a pass
# over every parameter, so each sum comes back from as far down the caches as the step's other work left it (timed
# on one parameter at a time, hot in cache, it measured half that on transformer_like).
def _time_sums(gm: fx.GraphModule, repeats: int) -> tuple[dict[str, float], dict[str, float]]:
    """Per trainable parameter of ``gm``, under each of its names, the median seconds over ``repeats`` passes of
    ``total.add_(grad)`` and of the first gradient's copy into a new tensor."""
    params = [p for p in {id(p): p for p in gm.parameters() if p.requires_grad}.values() if p.device.type != "meta"]
    adds: dict[int, list[float]] = collections.defaultdict(list)
    copies: dict[int, list[float]] = collections.defaultdict(list)
    with torch.no_grad():
        grads = [torch.ones_like(p, memory_format=torch.contiguous_format) for p in params]
        for _ in range(repeats + 1):  # the first pass warms up
            totals = []
            _heap_returned()
            for p, grad in zip(params, grads):
                start = time.perf_counter()
                totals.append(torch.empty_like(grad).copy_(grad))
                copies[id(p)].append(time.perf_counter() - start)
            for p, grad, total in zip(params, grads, totals):
                start = time.perf_counter()
                total.add_(grad)
                adds[id(p)].append(time.perf_counter() - start)
            del totals
    named = [(name, id(p)) for name, p in gm.named_parameters(remove_duplicate=False) if id(p) in adds]
    median = lambda runs: statistics.median(runs[1:] or runs)
    return {name: median(adds[i]) for name, i in named}, {name: median(copies[i]) for name, i in named}


# Note [a step's first gradient copied to fresh pages]: a training loop frees the step's gradient sums before the
# next step (``zero_grad(set_to_none=True)``, torch's default), and glibc returns that memory to the OS at its heap's
# top; the next step's first gradient copies then write fresh pages, a page fault per 4 KiB. On a torchrun rank
# (transformer_like, K=2) the first copies took 180-200 us each, the later adds 14 us. The copy is timed after
# ``malloc_trim`` hands glibc's free memory back, as the freed sums were; elsewhere than glibc nothing is trimmed.
def _heap_returned() -> None:
    """glibc's free heap memory returned to the OS (``malloc_trim(0)``); nothing where the C library is not glibc."""
    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = ctypes.CDLL("libc.so.6").malloc_trim if sys.platform.startswith("linux") else False
        except (OSError, AttributeError):
            _TRIM = False
    if _TRIM:
        _TRIM(0)


_TRIM: Any = None  # glibc's malloc_trim, once looked up; False where there is none


# Note [a step's seconds per node]: balance="train_time" weighs each node by what a stage spends on it in a training
# step, measured at one micro-batch: its forward, its backward, and its forward again where the checkpoint mode
# recomputes (every stage is counted as recomputing under "except_last": the cut is not known yet, so the last
# stage's saving is not). CPU workers share the cores: each node is timed on cores / K intra-op threads while K - 1
# peers run the graph, as the stages' workers do. The loss, which ``pipe.step`` runs on the last stage, is not
# counted: compile does not know it.
def train_seconds(gm: fx.GraphModule, inputs: Sequence, workers: int, on_cpu: bool,
                  recompute: bool) -> dict[str, float]:
    """Per call node of ``gm``, the measured seconds of one micro-batch's training step on one of ``workers`` stage
    workers (Note [a step's seconds per node])."""
    threads = max(1, (os.cpu_count() or 1) // workers) if on_cpu else None
    times = measure_node_times(gm, inputs, repeats=3, threads=threads, peers=workers - 1 if on_cpu else 0,
                               sums=False)  # the cut weighs nodes; the sums are the parameters'
    again = 1.0 if recompute else 0.0
    return {name: (1.0 + again) * f + times.backward.get(name, 0.0) for name, f in times.forward.items()}


def _busy(gm: fx.GraphModule, inputs: Sequence, threads: int, stop: threading.Event) -> None:
    """A peer worker: the graph's forward, without grad, on copies of the inputs, until ``stop``."""
    torch.set_num_threads(threads)  # per thread, as a worker sets its own
    with torch.no_grad():
        while not stop.is_set():
            gm(*[t.clone() if isinstance(t, torch.Tensor) else t for t in inputs])


# Note [the interpreter's share]: a node timed under fx's Interpreter also pays for fetching its arguments from the
# environment, which a stage's generated code does not; on small ops that is a share of the time. Each node's forward
# is scaled by the graph's own forward (gm(*inputs), the generated code, as a stage runs) over their sum.
def _time_all(gm, inputs, repeats, forward, backward, input_grad, params, output_grads, apart) -> float:
    """Fills the tables (``apart`` where not None); returns the median seconds of the graph's own forward, with
    grad."""
    whole = []
    with scalar_buffers_kept(gm, every_buffer=True), torch.random.fork_rng(devices=[]), torch.enable_grad():
        for _ in range(repeats):
            copies = [t.clone() if isinstance(t, torch.Tensor) else t for t in inputs]  # a write in place stays here
            start = time.perf_counter()
            gm(*copies)
            whole.append(time.perf_counter() - start)
            _time_backward(gm, inputs, forward, backward, params, False, output_grads)
            if apart is not None:
                time_split(gm, inputs, params, output_grads, *apart)
            try:
                for p in params:
                    p.requires_grad_(False)
                _time_backward(gm, inputs, collections.defaultdict(list), input_grad, [], True, output_grads)
            finally:
                for p in params:
                    p.requires_grad_(True)
    return statistics.median(whole)


def _time_backward(gm: fx.GraphModule, inputs: Sequence, forward: dict, backward: dict, params: list,
                   inputs_only: bool, output_grads: Callable[[list], Sequence] | None) -> None:
    recorder = NodeRecorder(gm, forward, inputs_only)
    flat = tree_leaves(recorder.run(*inputs))
    outputs = [t for t in flat if isinstance(t, torch.Tensor) and t.requires_grad]
    wrt = params + recorder.leaves
    seen = {n: 0.0 for n in forward}
    if outputs and wrt:
        starts = backward_starts(flat, outputs, output_grads)
        if params and not any(p._backward_hooks or p._post_accumulate_grad_hooks for p in params):
            with _dropped_as_made(params):
                torch.autograd.backward(outputs, starts, inputs=wrt)
        else:  # the B run, or hooks of the user's that AccumulateGrad would run: kept to the end
            torch.autograd.grad(outputs, wrt, starts, allow_unused=True)
        end = time.perf_counter()
        stamps = recorder.stamps + [(end, "")]
        for (at, name), (after, _) in zip(stamps, stamps[1:]):
            seen[name] = seen.get(name, 0.0) + after - at
    for name, seconds in seen.items():
        backward[name].append(seconds)


# Note [gradients dropped as made]: on a torchrun rank a step's backward hands each parameter's gradient on as the
# engine makes it (Note [gradients summed as the engine makes them], runtime/gradients.py), so glibc's heap holds one
# gradient at a time. Kept to the end, as torch.autograd.grad keeps them, a stage's gradients are freed together,
# glibc trimmed the heap top they grew, and the next backward page-faulted every page again: a Linear's weight
# gradient measured several times its forward that way, and about its forward's time dropped as made. A tensor hook
# handing the engine a zero tensor in their place (the runtime's way) measured little faster than keeping them, so the
# backward runs into ``.grad`` and a post-accumulate hook drops each at once, ``.grad`` restored after; where the
# user's own parameter hooks would run (AccumulateGrad runs them, an optimizer in the backward among them) the
# gradients are kept to the end instead. (The in-process runtime keeps them to the end: these are a rank's figures.)
@contextlib.contextmanager
def _dropped_as_made(params: list):
    """Around a backward into ``params``' ``.grad``: each gradient dropped as soon as it is accumulated, and every
    ``.grad`` as it was afterwards (Note [gradients dropped as made])."""
    before = [p.grad for p in params]
    handles = []
    try:
        for p in params:
            p.grad = None
            handles.append(p.register_post_accumulate_grad_hook(lambda q: setattr(q, "grad", None)))
        yield
    finally:
        for h in handles:
            h.remove()
        for p, g in zip(params, before):
            p.grad = g


# Note [a backward's speed depends on its values]: a matmul over subnormal floats runs many times slower on a CPU. A
# GPT whose tied head's logits are wide (an embedding's N(0, 1) init) gets a softmax gradient a third of it subnormal:
# its head's backward measured several times the untied one's, in the plain model too. Ones as the outputs' gradient
# never show it, so the backward is timed from the loss's own gradient where a loss is given.
def loss_gradients(loss_fn: Callable, target: Any, rebuild: Callable[[list], Any]) -> Callable[[list], Sequence]:
    """``output_grads`` for measure_node_times: given the graph's flat outputs, the gradient ``loss_fn(rebuild(flat),
    target)`` gives each output that requires one (None where the loss does not read it), computed on detached
    copies. ``rebuild``: the model's output from the flat outputs (TracedModel.rebuild_output)."""
    def gradients(flat: list) -> Sequence:
        values = [t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.requires_grad else t for t in flat]
        wrt = [v for v in values if isinstance(v, torch.Tensor) and v.requires_grad]
        with torch.enable_grad():
            loss = loss_fn(rebuild(values), target)
        return torch.autograd.grad(loss, wrt, allow_unused=True)
    return gradients


def times_from_flops(costed: CostedGraph, flops_per_second: float) -> NodeTimes:
    """Node times of a device that runs every op at ``flops_per_second``, at the traced batch (a model on meta, a
    device not at hand): forward = FLOPs / rate; B the same; W the same again where the node reads a trainable
    parameter (a matmul's input and weight gradients each cost its forward: CostedGraph.training_flops)."""
    forward = {name: c.flops / flops_per_second for name, c in costed.costs.items()}
    step = {name: flops / flops_per_second for name, flops in costed.training_flops().items()}
    return NodeTimes(forward=forward, backward={n: step[n] - forward[n] for n in forward}, input_grad=forward,
                     rows=costed.traced.batch_size or 1, repeats=0, threads=0)


def measure_loss(loss_fn, outputs, target=None, repeats: int = 3, threads: int | None = None) -> float:
    """Median seconds of ``loss_fn(outputs, target)`` and its backward on one micro-batch's model outputs (the loss
    ``pipe.step`` runs after the last stage's forward), after two untimed runs; ``outputs`` are detached first, so
    nothing else is touched. (A 32k-token vocabulary's loss measured 28-140 ms on a process's first call, which writes
    fresh pages, and 5-10 ms after; a step's losses ran 9 ms each.)"""
    before, seconds = torch.get_num_threads(), []
    torch.set_num_threads(threads or before)
    try:
        for _ in range(repeats + 2):
            value = tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_(t.is_floating_point()), outputs)
            grads = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.requires_grad]
            start = time.perf_counter()
            with torch.enable_grad():
                loss = loss_fn(value, target)
                if loss.requires_grad and grads:
                    torch.autograd.grad(loss, grads, allow_unused=True)
            seconds.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(before)
    return statistics.median(seconds[2:])
