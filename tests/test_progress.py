"""Compile progress: each pass reported as it finishes, on stderr with verbose=True, always to the logger."""
import logging

import torch

import autopipe
from models import build, random_inputs

PASSES = ["trace", "cost", "partition", "codegen"]


def test_verbose_compile_reports_every_pass_on_stderr(capsys):
    model = build("gpt").eval()
    args, _ = random_inputs("gpt", 8, torch.Generator().manual_seed(0))
    pipe = autopipe.compile(model, devices=2, chunks=4, example_inputs=args, verbose=True)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("autopipe: ")]
    assert lines[0].startswith("autopipe: planning GPT") and "2 stages x 4 micro-batches" in lines[0]
    assert [line.split()[1] for line in lines[1:]] == PASSES
    assert "graph nodes" in lines[1] and "2 stages" in lines[3]
    assert list(pipe.plan.pass_seconds) == PASSES
    assert all(seconds >= 0 for seconds in pipe.plan.pass_seconds.values())
    assert "compiled in" in str(pipe.plan)


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
