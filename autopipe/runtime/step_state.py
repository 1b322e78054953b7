"""What every task of one step shares (``StepState``): the caller's thread-local state each task re-enters
(``Ambient``), the step's seed and each task's (``task_seed``), its timeline and memory report."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from autopipe.ir.checkpoint import checkpoints
from autopipe.ir.schedule import Schedule

from .batchnorm import DeferredStatistics
from .memory import MemoryReport, StageMemory
from .timeline import Timeline


# Note [one generator per task]: the default CPU generator is one per process, so worker threads drawing from it
# interleave by timing. Each stage has its own generator, seeded per (step seed, stage, micro-batch) by
# SplitMix64's finaliser, so forward and recompute draw the same numbers and a seeded run is reproducible.
def task_seed(step_seed: int, stage: int, micro_batch: int) -> int:
    """A seed per (step, stage, micro-batch): SplitMix64's finaliser (Steele et al. 2014) over a Weyl sequence, a few
    integer ops rather than a digest (Note [one generator per task]; benchmarks/overhead.py measures a step's fixed
    cost)."""
    z = (step_seed + 0x9E3779B97F4A7C15 * ((stage << 32) + micro_batch + 1)) & _U64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _U64
    return (z ^ (z >> 31)) >> 1  # 63 bits: a non-negative manual_seed


_U64 = (1 << 64) - 1


# Note [inline under a profiler or a mode]: the profiler records only threads it was started on (unless
# profile_all_threads), and a user's TorchFunctionMode or TorchDispatchMode sees only its own thread. With one
# active, the step runs inline on the calling thread in schedule order. So does one CPU worker whose thread count
# is the caller's: nothing to overlap, no hand-off.
@dataclass
class Ambient:
    """The caller's thread-local state (autocast, inference mode, saved-tensor hooks), re-entered in every task.
    ``inline_reason``: why the step runs inline (Note [inline under a profiler or a mode])."""

    autocast: dict[str, tuple[bool, torch.dtype]]
    autocast_cache: bool
    inference: bool
    saved_tensors_hooks: tuple[Callable, Callable] | None
    inline_reason: str | None
    streams: dict  # the caller's current stream of each of the pipeline's GPUs: the stages compute on them

    @classmethod
    def capture(cls, devices=()) -> "Ambient":
        """Each query is a C call: a step reads them all, with its caches cold from the last step's kernels (Note [a
        step's fixed cost is its lines])."""
        reason = None
        if torch._C._autograd._profiler_enabled():
            reason = "a profiler is active"
        elif torch._C._len_torch_function_stack() or torch._C._len_torch_dispatch_stack():
            reason = "a TorchFunctionMode/TorchDispatchMode is active"
        autocast = {d: (True, torch.get_autocast_dtype(d)) for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)} \
            if torch._C._is_any_autocast_enabled() else {}
        return cls(autocast=autocast, autocast_cache=torch.is_autocast_cache_enabled(),
                   inference=torch.is_inference_mode_enabled(),
                   saved_tensors_hooks=torch._C._autograd._top_saved_tensors_default_hooks(False),
                   inline_reason=reason, streams={d: torch.cuda.current_stream(d) for d in devices if d.type == "cuda"})

    @property
    def plain(self) -> bool:
        """Nothing to re-enter around a task."""
        return not (self.autocast or self.saved_tensors_hooks)

    def entered(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The caller's state re-entered around what a task runs on ``device`` (its forward, its backward, the loss of
        ``pipe.step`` on the last stage: the plain model's loss runs in the caller's autocast too)."""
        if self.plain:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        self.enter(stack, device)
        return stack

    def enter(self, stack: contextlib.ExitStack, device: torch.device) -> None:
        enabled, dtype = self.autocast.get(device.type, (False, None))
        if enabled:
            stack.enter_context(torch.autocast(device.type, dtype=dtype, cache_enabled=self.autocast_cache))
        if self.saved_tensors_hooks is not None:
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(*self.saved_tensors_hooks))


@dataclass
class StepState:
    """What every task of one step shares."""

    training: bool                  # a backward follows: build autograd graphs
    random: bool                    # the model is in train mode: random ops draw from task generators
    checkpoint: str
    chunks: int
    seed: int
    ambient: Ambient
    timeline: Timeline
    memory: MemoryReport | None = None        # saved-bytes accounting, only when asked (it hooks every save)
    deferred: DeferredStatistics | None = None
    stages: dict[int, Any] = field(default_factory=dict)  # id of a StageRunner -> its StageStep (task.py)
    split_backward: bool = False    # B computes input gradients and W the parameters' (the zero-bubble schedules)
    full_backwards: frozenset = frozenset()  # (stage, micro-batch) whose B does its W's work too (Schedule's)

    @classmethod
    def start(cls, *, training: bool, random: bool, checkpoint: str, schedule: Schedule,
              deferred_model: torch.nn.Module | None, track_memory: bool, devices=()) -> "StepState":
        seed = int(torch.randint(0, 2**62, ()).item()) if random else 0  # one draw from the global RNG per step
        return cls(training=training, random=random, checkpoint=checkpoint if training else "never",
                   chunks=schedule.chunks, seed=seed, ambient=Ambient.capture(devices), timeline=Timeline(schedule),
                   memory=MemoryReport([StageMemory() for _ in range(schedule.n_stages)],
                                       checkpoint) if track_memory else None,
                   deferred=DeferredStatistics(deferred_model) if deferred_model is not None and training else None,
                   split_backward=schedule.splits_backward, full_backwards=schedule.full_backwards)

    def recomputes(self, micro_batch: int) -> bool:
        return self.training and checkpoints(self.checkpoint, micro_batch, self.chunks)
