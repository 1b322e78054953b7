"""Compile progress: each pass reported as it finishes, on stderr with verbose=True, always to the logger; an exception
that escapes a pass leaves it as autopipe's, naming the pass and the model's line."""
import logging
import time

import pytest
import torch

import autopipe
from autopipe.passes.trace import trace
from autopipe.progress import Progress
from zoo import build, random_inputs

PASSES = ["trace", "cost", "partition", "codegen"]


def test_verbose_compile_reports_every_pass_on_stderr(capsys):
    model = build("gpt").eval()
    args, _ = random_inputs("gpt", 8, torch.Generator().manual_seed(0))
    start = time.perf_counter()
    pipe = autopipe.compile(model, devices=2, chunks=4, example_inputs=args, verbose=True)
    elapsed = time.perf_counter() - start
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("autopipe: ")]
    assert lines[0].startswith("autopipe: planning GPT") and "2 stages x 4 micro-batches" in lines[0]
    assert [line.split()[1] for line in lines[1:]] == PASSES
    assert "graph nodes" in lines[1] and "2 stages" in lines[3]
    seconds = pipe.plan.pass_seconds
    assert list(seconds) == PASSES
    # each pass did work, and the passes ran inside the compile call
    assert all(s > 0 for s in seconds.values()) and sum(seconds.values()) <= elapsed, (seconds, elapsed)
    assert f"compiled in {sum(seconds.values()):.2f} s: trace {seconds['trace']:.2f} s" in str(pipe.plan)


def test_quiet_compile_prints_nothing_but_logs(capsys, caplog):
    model = build("mlp")
    args, _ = random_inputs("mlp", 8, torch.Generator().manual_seed(0))
    with caplog.at_level(logging.INFO, logger="autopipe"):
        autopipe.compile(model, devices=2, chunks=2, example_inputs=args)
    assert capsys.readouterr().err == ""
    logged = [r.getMessage().split()[0] for r in caplog.records if r.name == "autopipe"]
    assert logged == ["planning", *PASSES]


def test_plan_reports_its_passes_without_codegen(capsys):
    model = build("mlp")
    args, _ = random_inputs("mlp", 8, torch.Generator().manual_seed(0))
    plan = autopipe.plan(model, args, devices=2, chunks=2, verbose=True)
    err = capsys.readouterr().err
    assert "autopipe: trace" in err and "autopipe: partition" in err and "codegen" not in err
    assert list(plan.pass_seconds) == PASSES[:3]


# -- an exception that escapes a pass leaves it as autopipe's ---------------------------------------------------------

@torch.library.custom_op("autopipe_test_progress::scaled_rows", mutates_args=())
def scaled_rows(x: torch.Tensor) -> torch.Tensor:
    """A user's custom op registered without a fake kernel: it runs, but no fake tensor can."""
    return x * 2.0


class ScalesByCustomOp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.b(scaled_rows(self.a(x)))


class GatedByAMax(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.a(x)
        if x[:, 0].max() > 1.0:  # the whole batch's way, not the first micro-batch's
            h = h * 2
        return self.b(h)


def test_a_raw_torch_error_in_the_trace_pass_is_autopipes_naming_the_pass_and_the_models_line():
    """torch's "There was no fake impl registered" escaped compile as it was, naming no line of the model."""
    with pytest.raises(autopipe.errors.TraceError) as failed:
        autopipe.compile(ScalesByCustomOp(), devices=2, chunks=2, example_inputs=(torch.randn(4, 4),))
    message = str(failed.value)
    assert message.startswith("autopipe's trace pass failed: RuntimeError: There was no fake impl registered")
    assert "test_progress.py:" in message and "return self.b(scaled_rows(self.a(x)))" in message
    assert "chunks=1" in message and "route='export'" in message and "docs/faithfulness.md" in message
    assert failed.value.pass_name == "trace" and "no fake impl" in str(failed.value.__cause__)  # torch's, chained


def test_a_raw_torch_error_in_the_cost_pass_is_autopipes_naming_the_pass_and_the_models_line():
    """balance='time' times the graph on the first micro-batch, which goes the other way at a branch the whole batch
    took: the graph's check raised torch's RuntimeError from the cost pass."""
    x = torch.zeros(4, 4)
    x[3, 0] = 2.0  # only the last row crosses the bound
    with pytest.raises(autopipe.errors.CompileError) as failed:
        autopipe.compile(GatedByAMax(), devices=2, chunks=2, example_inputs=(x,), balance="time")
    message = str(failed.value)
    assert message.startswith("autopipe's cost pass failed: RuntimeError: autopipe: a micro-batch goes the other way")
    assert "test_progress.py:" in message and "if x[:, 0].max() > 1.0:" in message and "chunks=1" in message
    assert failed.value.pass_name == "cost" and isinstance(failed.value.__cause__, RuntimeError)
    assert not isinstance(failed.value, autopipe.errors.TraceError)


def test_autopipes_own_errors_and_those_a_user_must_see_leave_a_pass_as_they_are():
    progress = Progress()
    for error in (ValueError("route must be 'auto', 'fx' or 'export'"), MemoryError(), KeyboardInterrupt(),
                  torch.OutOfMemoryError("CUDA out of memory"), UserWarning("made an error by -W error")):
        with pytest.raises(type(error)) as raised, progress.run("trace"):
            if isinstance(error, ValueError):
                trace(build("mlp"), (torch.randn(2, 8),), route="neither")  # raised by autopipe's code itself
            raise error
        assert type(raised.value) is type(error)
    with pytest.raises(autopipe.errors.TraceError) as named, progress.run("trace"):
        raise autopipe.errors.TraceError("named by the trace pass")
    assert str(named.value) == "named by the trace pass" and named.value.__cause__ is None
