"""The executor: runs one device's schedule tasks over a transport; one loop for every transport.

A transport only moves values (runtime/threads.py in-process, runtime/p2p.py between ranks); the order
of the work comes from the Schedule, so a new schedule needs no new runtime.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

import torch
import torch.utils._pytree as pytree

from .schedule import Task
from .task import StageRunner, StepState


class Transport(Protocol):
    """How tensors reach a stage. Values are listed in the stage's input/output name order."""

    def inputs(self, stage: int, micro_batch: int) -> tuple[list, list[bool]]:
        """The stage's inputs (waiting for them) and whether each gets a gradient."""

    def send_outputs(self, stage: int, micro_batch: int, outputs: list) -> None: ...

    def output_grads(self, stage: int, micro_batch: int) -> list:
        """The gradient of each stage output (waiting for them; None where there is none)."""

    def send_input_grads(self, stage: int, micro_batch: int, grads: list) -> None: ...

    def finals(self, micro_batch: int) -> list:
        """The model's flat outputs of one micro-batch, for the loss."""

    def send_final_grads(self, micro_batch: int, grads: list) -> None: ...


@dataclass
class Loss:
    """The user's loss, run per micro-batch right after the last stage's forward (``pipe.step``);
    it must be known per micro-batch for 1F1B-style schedules to start backward early."""

    fn: Callable[[Any, Any], torch.Tensor]
    rebuild: Callable[[list], Any]      # flat outputs -> the model's output structure
    targets: Sequence[Any]              # per micro-batch
    weights: Sequence[float]            # micro-batch size / batch size
    last_stage: int

    def __post_init__(self):
        self.values: list[torch.Tensor | None] = [None] * len(self.targets)

    def run(self, i: int, transport: Transport) -> None:
        leaves = [v.detach().requires_grad_(True) if isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())
                  else v for v in transport.finals(i)]
        device = next((v.device for v in leaves if isinstance(v, torch.Tensor)), None)
        target = pytree.tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) and device else t,
                                 self.targets[i])  # on the last stage's device, which the caller need not know
        with torch.enable_grad():
            loss = self.fn(self.rebuild(leaves), target)
            if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
                raise TypeError("pipe.step needs loss_fn to return a scalar tensor "
                                f"(got {type(loss).__name__} {getattr(loss, 'shape', '')})")
            loss = loss * self.weights[i]
            wrt = [k for k, v in enumerate(leaves) if isinstance(v, torch.Tensor) and v.requires_grad]
            got = torch.autograd.grad(loss, [leaves[k] for k in wrt], allow_unused=True) if loss.requires_grad else ()
        grads: list = [None] * len(leaves)
        for k, g in zip(wrt, got):
            grads[k] = g
        self.values[i] = loss.detach()
        transport.send_final_grads(i, grads)

    @property
    def total(self) -> torch.Tensor:
        return sum(v for v in self.values if v is not None)


def run_tasks(tasks: Sequence[Task], runners: Callable[[Task], StageRunner], transport: Transport, step: StepState,
              loss: Loss | None = None, stopped: Callable[[], bool] = lambda: False) -> None:
    """Run ``tasks`` in order: one device's share of a step (or all of it, inline)."""
    for task in tasks:
        if stopped():
            return
        runner, i = runners(task), task.micro_batch
        try:
            if task.kind == "F":
                inputs, needs_grad = transport.inputs(task.stage, i)
                transport.send_outputs(task.stage, i, runner.forward(step, i, inputs, needs_grad))
                if loss is not None and task.stage == loss.last_stage:
                    loss.run(i, transport)
            else:
                runner.rematerialise(step, i)  # needs only the saved inputs: before waiting for gradients
                grads = transport.output_grads(task.stage, i)
                transport.send_input_grads(task.stage, i, runner.backward(step, i, grads))
        except BaseException as e:
            note_failure(e, task, runner.stage.device)
            raise


def note_failure(error: BaseException, task: Task, device: torch.device) -> None:
    """Name the stage, device and micro-batch on the original exception, once."""
    if getattr(error, "_autopipe_noted", False) or isinstance(error, StageFailure):
        return
    error._autopipe_noted = True  # type: ignore[attr-defined]
    kind = "forward" if task.kind == "F" else "backward"
    error._autopipe_where = f"{kind} of micro-batch {task.micro_batch} (stage {task.stage})"  # type: ignore[attr-defined]
    error.add_note(f"autopipe: raised in stage {task.stage} ({device}) on micro-batch {task.micro_batch} "
                   f"during {kind}; see pipe.stages[{task.stage}].code")


class StageFailure(RuntimeError):
    """A task stopped because another task of the same step failed (that one's error is raised)."""
