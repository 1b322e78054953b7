"""Each benchmark runs with --quick (tiny sizes) in a subprocess and prints its table under a machine header.

The whole file takes well under a minute; the numbers are not looked at, only the shape of the output.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

BENCHMARKS = {
    # name: column headers its table must have
    "overhead": ["variant", "chunks", "checkpoint", "s/step", "vs plain", "vs hand loop", "target", "torchgpipe",
                 "dropout", "plain ms (fastest)", "autopipe ms (fastest)", "autopipe / plain"],
    "speedup": ["model", "K", "M", "s/step", "vs K=1 same M", "vs plain", "1w xM / plain", "ideal"],
    "memory": ["checkpoint", "kept fwd->bwd", "vs plain", "never: blocks / params", "always: blocks / params"],
    "compile_time": ["blocks", "trace s", "cost s", "partition s", "codegen s", "total s"],
}


@pytest.mark.parametrize("name", list(BENCHMARKS))
def test_benchmark_quick_prints_its_table(name, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{name}.py"), "--quick", "--results-dir", str(tmp_path)],
                       capture_output=True, text=True, timeout=150, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert out.startswith(f"# autopipe benchmark: {name}"), out[:300]
    for field in ("date:", "machine:", "torch ", "threads"):
        assert field in out.split("\n\n")[0], f"header lacks {field!r}"
    assert re.search(r"^-+(  -+)+$", out, re.M), "no tabulate table in the output"
    for header in BENCHMARKS[name]:
        assert header in out, f"column {header!r} missing"
    written = tmp_path / f"{name}-quick.txt"  # --quick never overwrites the real results
    assert written.read_text().strip() == out.strip()
    assert "wrote" in r.stderr  # progress goes to stderr, the table to stdout


def test_gpu_benchmark_tiny_on_cpu_workers(tmp_path):
    """benchmarks/gpu.py measures on a GPU; ``--device cpu --tiny`` runs the whole script on CPU workers."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    written = tmp_path / "gpu_smoke.txt"
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--tiny", "--out", str(written)],
                       capture_output=True, text=True, timeout=180, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert out.startswith("# autopipe benchmark: gpu"), out[:300]
    head = "\n".join(line for line in out.splitlines() if line.startswith("#"))
    for field in ("date:", "machine:", "torch ", "gpu: none", "overhead at K=1, M=1"):
        assert field in head, f"header lacks {field!r}"
    assert re.search(r"^-+(  -+)+$", out, re.M), "no tabulate table in the output"
    for header in ("model", "K", "M", "ms/step", "vs plain", "vs loop", "bubble meas/pred", "overlap", "peak GiB"):
        assert header in out, f"column {header!r} missing"
    for model in ("transformer", "cnn"):  # the plain row, the loop over M=4, and --tiny's K in {1, 2} x M in {1, 4}
        assert len(re.findall(rf"^{model}  ", out, re.M)) == 6, model
        assert len(re.findall(rf"^{model} +loop +4 ", out, re.M)) == 1, model
        assert len(re.findall(rf"^{model} +2 +4 ", out, re.M)) == 1, model
    assert written.read_text().strip() == out.strip()
    assert "wrote" in r.stderr


def test_cost_model_quick_validates_a_split_schedule_over_gloo_processes(tmp_path):
    """benchmarks/cost_model.py over K gloo processes: every rank's Timeline reaches rank 0's plan.validate, and the
    gradient sums a rank adds inside its tasks are predicted there (no 'accumulate' among the untimed terms), and the
    loss, a task of the last rank's, is compared."""
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    command = [sys.executable, str(ROOT / "benchmarks" / "cost_model.py"), "--quick", "--transport", "gloo",
               "--schedules", "zb-h1", "--results-dir", str(tmp_path)]
    # a process group of its own: on a timeout its spawned ranks are killed with it, not left to gloo's timeout
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env,
                          **group) as child:
        try:
            out, err = child.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            raise
    assert child.returncode == 0, err[-3000:]
    assert out.startswith("# autopipe benchmark: cost_model_gloo") and "2 gloo processes" in out, out[:300]
    rows = [line for line in out.splitlines() if line.startswith("transformer_like  2")]
    assert len(rows) == 1 and "zb-h1 (never)" in rows[0]
    predicted, report = out.split("Predicted / measured per stage")
    measured = re.findall(r"^ +([01]) +[01] +[\d.]+ / ([\d.]+) ", report, re.M)  # each stage's measured forward
    assert [s for s, _ in measured] == ["0", "1"] and all(float(ms) > 0 for _, ms in measured), report
    stage_1 = re.search(r"^ +1 +1 +[\d.]+ / ([\d.]+) +[\d.]+ / ([\d.]+) +[\d.]+ / ([\d.]+) ", report, re.M)
    assert "weight (ms)" in report and all(float(ms) > 0 for ms in stage_1.groups())  # F, B and W timed on rank 1
    columns = next(line for line in predicted.splitlines() if re.match(r"^ +stage +device ", line)).split()
    rows = [line.split() for line in predicted.splitlines() if re.match(r"^ +[01] +[01] ", line)]
    assert len(rows) == 2 and all(float(r[columns.index("accumulate")]) > 0 for r in rows)  # the sums, priced
    assert "accumulate" not in report  # inside the rank's tasks: compared in their terms, not listed apart
    assert "loss (ms)" in report and "loss" not in report.split("not in the Timeline's tasks")[-1]  # compared
    assert (tmp_path / "cost_model_gloo-quick.txt").read_text().strip() == out.strip()
