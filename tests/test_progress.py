"""Compile progress: each pass reported as it finishes, on stderr with verbose=True, always to the logger."""
import logging
import time

import torch

import autopipe
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
