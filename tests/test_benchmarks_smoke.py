"""Each benchmark runs with --quick (tiny sizes) in a subprocess and prints its table under a machine header.

The whole file takes well under a minute; the numbers are not looked at, only the shape of the output.
"""
from __future__ import annotations

import os
import re
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
    for model in ("transformer", "cnn"):  # the plain row, the loop over M in {4, 8}, and K in {1, 2, 4} x M in {1, 4, 8}
        assert len(re.findall(rf"^{model}  ", out, re.M)) == 12, model
        assert len(re.findall(rf"^{model} +loop +[48] ", out, re.M)) == 2, model
    assert written.read_text().strip() == out.strip()
    assert "wrote" in r.stderr
