"""The benchmarks of stages on streams and SM slices run here as smoke tests: ``gpu.py --slices`` on CPU workers (``--device cpu --tiny``) and
``host_cost.py --quick``. The numbers are not looked at, only what the output must hold: the summary lines in their
exact form, the columns, the probe."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def run(*argv: str) -> str:
    r = subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=180, cwd=ROOT, env=ENV)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


def test_gpu_slices_tiny_on_cpu_workers(tmp_path):
    written = tmp_path / "gpu_slices_smoke.txt"
    out = run(str(ROOT / "benchmarks" / "gpu.py"), "--device", "cpu", "--tiny", "--slices", "2", "--slice-models",
              "gpt-135M,resnet50", "--slice-schedules", "gpipe,interleaved", "--out", str(written))
    assert written.read_text().strip() == out.strip()
    assert out.startswith("# autopipe benchmark: gpu --slices") and "gpu: none" in out
    assert re.search(r"^# probe K=2 \(gpt-135M: 2 blocks each.*: U = \d+\.\d\dx", out, re.M), out[:2000]
    summaries = re.findall(r"^# slices: (\S+) K=2 M=4 (\S+): speedup \d+\.\d\dx, \d+\.\d\d of ideal$", out, re.M)
    assert summaries == [(m, s) for m in ("gpt-135M", "resnet50") for s in ("gpipe", "interleaved")], summaries
    for column in ("ms/step", "speedup", "ideal", "ideal x U/K", "of ideal", "bubble meas/pred", "peak GiB"):
        assert column in out, column
    assert len(re.findall(r"^\S+ +2 +- +plain, one slice ", out, re.M)) == 2  # a baseline row per model


def test_host_cost_quick_reports_us_per_task_for_each_schedule():
    out = run(str(ROOT / "benchmarks" / "host_cost.py"), "--quick")
    found = re.findall(r"^# host cost: (\S+) K=(\d) M=8: -?\d+\.\d us per task, -?\d+ us per step$", out, re.M)
    assert found == [("gpipe", "1")] + [(s, "2") for s in ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")], found
    for column in ("tasks", "host ms/step", "autopipe us/step", "us/task", "us/stage/step"):
        assert column in out, column
