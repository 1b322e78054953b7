"""The executor: runs one device's schedule tasks over a transport; one loop for every transport.

A transport only moves values (runtime/threads.py in-process, runtime/p2p.py between ranks); the order of the work comes
from the Schedule, so a new schedule needs no new runtime."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import torch

from autopipe.ir.schedule import Task

from .step_state import StepState
from .task import StageRunner

if TYPE_CHECKING:
    from .loss import Loss


class Transport(Protocol):
    """How tensors reach a stage. Values are listed in the stage's input/output name order; the receiving calls wait for
    them."""

    # and whether each input gets a gradient
    def inputs(self, stage: int, micro_batch: int) -> tuple[list, list[bool]]: ...
    def send_outputs(self, stage: int, micro_batch: int, outputs: list) -> None: ...
    # each stage output's gradient, None where there is none
    def output_grads(self, stage: int, micro_batch: int) -> list: ...
    def send_input_grads(self, stage: int, micro_batch: int, grads: list) -> None: ...
    def finals(self, micro_batch: int) -> list: ...  # the model's flat outputs of one micro-batch, for the loss
    def send_final_grads(self, micro_batch: int, grads: list) -> None: ...


def run_tasks(tasks: Sequence[Task], runners: Callable[[Task], StageRunner], transport: Transport, step: StepState,
              loss: Loss | None = None, stopped: Callable[[], bool] = lambda: False) -> None:
    """Run ``tasks`` in order: one device's share of a step (or all of it, inline). A stage on a stream of its own
    waits for the caller's stream before its first task here, and the caller's stream waits for it after the last
    (streams.py), so one phase of a step is ordered as if it ran on the caller's stream."""
    joined: dict = {}  # a stage's own stream -> the caller's stream on its GPU
    try:
        _run_in_order(tasks, runners, transport, step, loss, stopped, joined)
    finally:
        for stream, caller in joined.items():
            caller.wait_stream(stream)


def _run_in_order(tasks, runners, transport: Transport, step: StepState, loss, stopped, joined: dict) -> None:
    for task in tasks:
        if stopped():
            return
        runner, i = runners(task), task.micro_batch
        if runner.stream is not None and runner.stream not in joined:
            joined[runner.stream] = caller = step.ambient.streams[runner.stage.device]
            runner.stream.wait_stream(caller)
        try:
            with runner.on_device(step):  # the transport's waits and sends too, on the stage's stream
                if task.kind == "F":
                    transport.send_outputs(task.stage, i, runner.forward(step, i, *transport.inputs(task.stage, i)))
                    if loss is not None and task.stage == loss.last_stage:
                        begun = step.timeline.begin(runner.stage.device)
                        with step.ambient.entered(runner.stage.device):
                            loss.run(i, transport)
                        step.timeline.end(begun, task.stage, i, "loss", runner.stage.device)
                elif task.kind == "B":
                    runner.rematerialise(step, i)  # needs only the saved inputs: before waiting for gradients
                    grads = transport.output_grads(task.stage, i)
                    transport.send_input_grads(task.stage, i, runner.backward(step, i, grads))
                else:  # W: nothing moves, nothing waits for it
                    runner.backward_weight(step, i)
        except BaseException as e:
            note_failure(e, task, runner.stage.device)
            raise


def note_failure(error: BaseException, task: Task, device: torch.device) -> None:
    """Name the stage, device and micro-batch on the original exception, once."""
    if hasattr(error, "_autopipe_where") or isinstance(error, StageFailure):
        return
    kind = {"F": "forward", "B": "backward", "W": "parameter gradients"}[task.kind]
    # type: ignore[attr-defined]
    error._autopipe_where = f"{kind} of micro-batch {task.micro_batch} (stage {task.stage})"
    if hasattr(error, "add_note"):  # Python >= 3.11
        error.add_note(f"autopipe: raised in stage {task.stage} ({device}) on micro-batch {task.micro_batch} during "
                       f"{kind}; see pipe.stages[{task.stage}].code")


class StageFailure(RuntimeError):
    """A task stopped because another task of the same step failed (that one's error is raised)."""
