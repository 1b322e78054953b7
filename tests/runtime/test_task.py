"""autopipe/runtime/task.py: a StageRunner's tasks on stages built by autopipe.compile(...).stages, driven one by one
as a transport would, against the plain model run micro-batch by micro-batch in float64: forward, backward and the
parameter gradients summed in task order; a recompute bit for bit its first forward (Note [recompute under grad mode]);
each task's own generator (Note [one generator per task]); a written buffer each task's own (Note [buffers written in
place per task])."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

import autopipe
from autopipe.ir.schedule import Schedule
from autopipe.runtime.step_state import StepState, task_seed
from autopipe.runtime.task import StageRunner

ROWS = [slice(0, 3), slice(3, 5)]  # 5 rows as 2 micro-batches


class MLP(nn.Module):
    def __init__(self, p: float = 0.0):
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(4, 6), nn.Dropout(p), nn.Linear(6, 2)

    def forward(self, x):
        return self.b(self.drop(self.a(x).tanh()))


class Counting(nn.Module):
    """Writes a buffer in place and reads it: each micro-batch sees the count after its own write."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 2)
        self.register_buffer("steps", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        self.steps.add_(1)
        return self.b(self.a(x).tanh() * self.steps)


def runners(model: nn.Module, x: torch.Tensor, devices: int) -> tuple[list[StageRunner], list[str]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = autopipe.compile(model, devices=devices, chunks=2, example_inputs=(x,), checkpoint="never")
    return [StageRunner(stage) for stage in pipe.stages], list(pipe.plan.graph_inputs)


def started(stages: list[StageRunner], *, training: bool = True, random: bool = False, checkpoint: str = "never",
            seed: int = 0) -> StepState:
    torch.manual_seed(seed)  # the step's seed is one draw of the global generator
    step = StepState.start(training=training, random=random, checkpoint=checkpoint,
                           schedule=Schedule.build("gpipe", len(stages), 2), deferred_model=None, track_memory=False)
    for runner in stages:
        runner.start_step(step)
    return step


def forward(stages: list[StageRunner], graph_inputs: list[str], step: StepState, i: int, x: torch.Tensor) -> list:
    """Micro-batch ``i`` through every stage, each value handed to the stage that reads it by name."""
    values = {graph_inputs[0]: x}
    for runner in stages:
        names = runner.stage.input_names
        outputs = runner.forward(step, i, [values[n] for n in names], [n not in graph_inputs for n in names])
        values.update(zip(runner.stage.output_names, outputs))
    return [values[n] for n in stages[-1].stage.output_names]


def backward(stages: list[StageRunner], step: StepState, i: int, output_grads: list) -> None:
    grads = dict(zip(stages[-1].stage.output_names, output_grads))
    for runner in reversed(stages):
        got = runner.backward(step, i, [grads.get(n) for n in runner.stage.output_names])
        grads.update((n, g) for n, g in zip(runner.stage.input_names, got) if g is not None)


def summed_grads(stages: list[StageRunner], step: StepState) -> dict[int, torch.Tensor]:
    return {id(p): g for runner in stages for p, g in runner.take_grads(step)}


def by_hand(model: nn.Module, x: torch.Tensor, weight: torch.Tensor) -> list[torch.Tensor]:
    """The plain model micro-batch by micro-batch, gradients accumulated; its outputs."""
    outputs = []
    for rows in ROWS:
        outputs.append(model(x[rows]))
        (outputs[-1] * weight[rows]).sum().backward()
    return outputs


def test_forward_and_backward_of_two_stages_are_the_plain_models_per_micro_batch():
    torch.manual_seed(0)
    model, x = MLP().double(), torch.randn(5, 4, dtype=torch.float64)
    weight = torch.randn(5, 2, dtype=torch.float64)
    stages, graph_inputs = runners(model, x, devices=2)
    reference = copy.deepcopy(model)
    step = started(stages)
    outputs = [forward(stages, graph_inputs, step, i, x[rows]) for i, rows in enumerate(ROWS)]
    for i in reversed(range(2)):  # GPipe's order: every forward, then the backwards last first
        backward(stages, step, i, [weight[ROWS[i]]])
    want = by_hand(reference, x, weight)
    for (out,), expected in zip(outputs, want):
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-15)
        assert not out.requires_grad  # a task hands on detached values
    grads = summed_grads(stages, step)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(grads[id(p)], q.grad, rtol=0, atol=1e-14, msg=name)
        assert p.grad is None  # a stage never adds into .grad itself (Note [gradients through the engine])


def test_without_training_a_task_keeps_nothing_for_a_backward():
    model, x = MLP().double(), torch.randn(5, 4, dtype=torch.float64)
    stages, graph_inputs = runners(model, x, devices=2)
    step = started(stages, training=False)
    (out,) = forward(stages, graph_inputs, step, 0, x[ROWS[0]])
    torch.testing.assert_close(out, model(x[ROWS[0]]).detach(), rtol=0, atol=1e-15)
    assert all(step.stages[id(r)].saved == {} for r in stages)


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_recomputed_micro_batch_is_bit_for_bit_its_first_forward_and_its_gradients_too(checkpoint):
    """Dropout in train mode: the recompute draws the same mask from the task's generator. The gradients equal, bit
    for bit, those of a step that keeps every micro-batch's graph."""
    torch.manual_seed(0)
    model, x = MLP(p=0.5).double(), torch.randn(5, 4, dtype=torch.float64)
    weight = torch.randn(5, 2, dtype=torch.float64)
    stages, graph_inputs = runners(model, x, devices=1)
    grads = {}
    for mode in (checkpoint, "never"):
        step = started(stages, random=True, checkpoint=mode, seed=7)
        outputs = [forward(stages, graph_inputs, step, i, x[rows]) for i, rows in enumerate(ROWS)]
        saved = step.stages[id(stages[0])].saved
        assert [saved[i].outputs is None for i in range(2)] == [step.recomputes(i) for i in range(2)]
        for i in range(2):
            stages[0].rematerialise(step, i)
            assert torch.equal(saved[i].outputs[0], outputs[i][0])
        for i in reversed(range(2)):
            backward(stages, step, i, [weight[ROWS[i]]])
        grads[mode] = summed_grads(stages, step)
    for p in model.parameters():
        assert torch.equal(grads[checkpoint][id(p)], grads["never"][id(p)])


def test_each_task_draws_from_its_own_generator_seeded_by_step_stage_and_micro_batch():
    """Two micro-batches of the same rows draw different masks; the same task in another step with the same seed draws
    the same one; the caller's global generator is not touched by the tasks."""
    torch.manual_seed(0)
    model = MLP(p=0.5).double()
    rows = torch.randn(2, 4, dtype=torch.float64)
    x = torch.cat([rows, rows])
    stages, graph_inputs = runners(model, x, devices=1)
    (runner,) = stages
    step = started(stages, random=True, training=False, seed=3)
    state = torch.get_rng_state()
    first, second = (forward(stages, graph_inputs, step, i, rows)[0] for i in range(2))
    assert torch.equal(torch.get_rng_state(), state)
    for i, out in enumerate((first, second)):
        generator = torch.Generator().manual_seed(task_seed(step.seed, runner.stage.index, i))
        with torch.no_grad():
            (expected,) = runner.stage(rows, generator=generator)
        assert torch.equal(out, expected)
    assert not torch.equal(first, second)
    again = started(stages, random=True, training=False, seed=3)
    assert again.seed == step.seed and torch.equal(forward(stages, graph_inputs, again, 0, rows)[0], first)
    assert len({task_seed(step.seed, s, i) for s in range(3) for i in range(3)}) == 9


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_buffer_written_in_place_is_each_tasks_own(checkpoint):
    """Every forward first, then the backwards (GPipe): each micro-batch's graph keeps the count it saw, as the plain
    model run micro-batch by micro-batch does, where one shared buffer would have been written under the first
    micro-batch's graph. A recompute starts from the value its forward started from."""
    torch.manual_seed(0)
    model, x = Counting().double(), torch.randn(5, 4, dtype=torch.float64)
    weight = torch.randn(5, 2, dtype=torch.float64)
    stages, graph_inputs = runners(model, x, devices=1)
    (runner,) = stages
    assert [b is model.steps for b in runner.stage.written_buffers] == [True]
    reference = copy.deepcopy(model)
    with torch.no_grad():
        model.steps.zero_()
    step = started(stages, checkpoint=checkpoint)
    outputs = [forward(stages, graph_inputs, step, i, x[rows])[0] for i, rows in enumerate(ROWS)]
    assert model.steps.item() == 2.0
    for i in reversed(range(2)):
        backward(stages, step, i, [weight[ROWS[i]]])
    assert model.steps.item() == 2.0  # a recompute writes a copy, not the buffer
    want = by_hand(reference, x, weight)
    for out, expected in zip(outputs, want):
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-15)
    grads = summed_grads(stages, step)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(grads[id(p)], q.grad, rtol=0, atol=1e-14, msg=name)
