"""Shared helpers for the benchmarks: interleaved timing, machine header, result tables.

Every benchmark compares variants measured side by side in one run: the
variants are interleaved (A B C, B C A, C A B, ...: the order rotates every
round), the first rounds are warm-up, and the numbers reported are medians.
Ratios are medians of the per-round ratios, so a slow spell of the machine
that hits one round hits both sides of the ratio (Note [timing on noisy machines]).

Progress goes to stderr; the table (with a header naming the machine, torch,
threads and date) goes to stdout and to ``benchmarks/results/<name>.txt``
(``<name>-quick.txt`` with ``--quick``, so a smoke run never overwrites real
numbers).

Note [timing on noisy machines]: the same work timed in two sequential blocks can differ by far more than in
alternation, and the two cores of a VM need not run at the same speed. Benchmarks interleave the variants they
compare, take medians or minima of alternating runs, report ratios, and pin the process to one core for an
overhead ratio.

Note [micro-batching's own cost]: small micro-batches are slow on their own (smaller kernels, more launches
from one host thread), on a CPU and on one GPU alike. Benchmarks report the plain model looped over the same
micro-batches beside the plain step, so the pipeline's efficiency and micro-batching's cost are seen apart.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python benchmarks/x.py` puts benchmarks/ on the path, not the root
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from tabulate import tabulate  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


# -- command line -------------------------------------------------------------

def parser(doc: str | None) -> argparse.ArgumentParser:
    """The options every benchmark takes; add its own before ``parse_args``."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0],
                                epilog=None, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny sizes and 1-2 repeats: a smoke test, not a measurement")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds after warm-up (default: per benchmark)")
    p.add_argument("--warmup", type=int, default=None, help="untimed warm-up rounds (default: 1)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds of timing per table: stop adding rounds past it once 3 are timed (default: per benchmark)")
    p.add_argument("--results-dir", type=Path, default=RESULTS, help=f"where to write <name>.txt (default {RESULTS})")
    return p


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def progress(*parts) -> None:
    print(*parts, file=sys.stderr, flush=True)


# -- timing -------------------------------------------------------------------

@dataclass
class Timings:
    """Seconds per call of each variant, one entry per timed round (all variants ran in every round)."""

    seconds: dict[str, list[float]]
    rounds: int
    warmup: int
    elapsed: float
    stopped_by_budget: bool = False
    extra: dict = field(default_factory=dict)

    def median(self, name: str) -> float:
        return statistics.median(self.seconds[name])

    def fastest(self, name: str) -> float:
        """The fastest timed round: for overheads on a pinned core, where noise only adds time."""
        return min(self.seconds[name])

    def ratios(self, num: str, den: str) -> list[float]:
        """Per-round ``num / den`` (seconds), e.g. ``ratios("pipe", "plain")`` is the slowdown."""
        return [a / b for a, b in zip(self.seconds[num], self.seconds[den])]

    def ratio(self, num: str, den: str) -> float:
        """Median over rounds of seconds(num) / seconds(den): paired, so robust to slow spells."""
        return statistics.median(self.ratios(num, den))

    def spread(self, num: str, den: str) -> str:
        """The quartiles of the per-round ratio, as 'lo-hi' (the noise to read the median against)."""
        r = sorted(self.ratios(num, den))
        if len(r) < 3:
            return f"{r[0]:.2f}-{r[-1]:.2f}"
        q = statistics.quantiles(r, n=4, method="inclusive")
        return f"{q[0]:.2f}-{q[2]:.2f}"


def on_thread(fn: Callable[[], object], threads: int) -> Callable[[], object]:
    """``fn`` run on one long-lived thread with ``threads`` intra-op threads, as an autopipe worker
    runs a stage. The plain model gets this too because on these machines the same step ran up to
    ~10% slower on the main thread than on a fresh thread; each table's baseline is the faster."""
    from concurrent.futures import ThreadPoolExecutor
    import torch

    pool = ThreadPoolExecutor(1, thread_name_prefix="plain", initializer=torch.set_num_threads, initargs=(threads,))
    return lambda: pool.submit(fn).result()


def faster(t: "Timings", *names: str) -> str:
    """The variant with the lowest median: the baseline a ratio should be taken against."""
    return min(names, key=t.median)


def interleaved(variants: Mapping[str, Callable[[], object]], *, repeats: int, warmup: int = 1,
                budget: float | None = None, label: str = "", verbose: bool = True) -> Timings:
    """Time each callable once per round, rotating the order every round; ``warmup`` rounds are dropped.

    With ``budget`` (seconds), rounds stop being added once the next one would end past the
    budget and at least 3 (or ``repeats``, if fewer) rounds are timed. ``verbose``: a progress
    line per round on stderr."""
    names = list(variants)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    t_start = time.perf_counter()
    total = warmup + repeats
    stopped = False
    r = 0
    while r < total:
        order = names[r % len(names):] + names[: r % len(names)]
        t_round = time.perf_counter()
        times = {}
        gc.collect()  # once a round (a full collection costs ~0.1 s with torch loaded), never inside a timing
        gc.disable()
        try:
            for name in order:
                t0 = time.perf_counter()
                variants[name]()
                times[name] = time.perf_counter() - t0
        finally:
            gc.enable()
        round_s = time.perf_counter() - t_round
        timed = r >= warmup
        if timed:
            for name in names:
                seconds[name].append(times[name])
        r += 1
        elapsed = time.perf_counter() - t_start
        done = r - warmup
        if verbose:
            progress(f"  {label}round {r}/{total} ({'timed' if timed else 'warm-up'}) {round_s:.1f} s: "
                     + ", ".join(f"{n} {times[n]:.3f}" for n in names))
        if budget is not None and done >= min(3, repeats) and r < total and elapsed + round_s > budget:
            progress(f"  {label}stopping after {done} timed rounds: the {budget:.0f} s budget is spent")
            stopped = True
            break
    return Timings(seconds, max(r - warmup, 0), warmup, time.perf_counter() - t_start, stopped)


# -- header and tables -----------------------------------------------------------

def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return f"{head}{' + uncommitted changes' if dirty else ''}" if head else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def header(name: str, lines: Sequence[str] = (), *, quick: bool = False) -> str:
    """The machine, torch, threads and date, then the benchmark's own lines; '# ' prefixed."""
    try:
        load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        load = "n/a"
    env = {k: os.environ[k] for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OMP_WAIT_POLICY") if k in os.environ}
    rows = [
        f"autopipe benchmark: {name}{'   (--quick: tiny sizes, a smoke test, NOT a measurement)' if quick else ''}",
        f"date: {_dt.datetime.now().astimezone().strftime('%Y-%m-%d %H:%M:%S %Z')}   host: {platform.node()}   git: {_git()}",
        f"machine: {_cpu_model()}, {cores()} usable cores (os.cpu_count()={os.cpu_count()}), "
        f"{platform.system()} {platform.release()}",
        f"torch {torch.__version__} (CUDA {'available' if torch.cuda.is_available() else 'not used'}), "
        f"python {platform.python_version()}, main-thread intra-op threads {torch.get_num_threads()}, "
        f"inter-op {torch.get_num_interop_threads()}" + (f", env {env}" if env else ""),
        f"load average at start (1/5/15 min): {load}",
        *lines,
    ]
    return "\n".join(f"# {r}" if r else "#" for r in rows)


def table(rows: Sequence[Sequence[object]], headers: Sequence[str]) -> str:
    return tabulate(rows, headers=headers, tablefmt="simple", disable_numparse=True)


def write(name: str, text: str, *, quick: bool, results_dir: Path = RESULTS) -> Path:
    """Print ``text`` to stdout and write it to ``<results_dir>/<name>.txt`` (``-quick`` suffix with --quick)."""
    print(text, flush=True)
    results_dir = Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    path = results_dir / f"{name}{'-quick' if quick else ''}.txt"
    path.write_text(text + "\n")
    progress(f"wrote {path}")
    return path


def gpu_name(device: torch.device) -> str:
    """The GPU's name as result files carry it (gpu_<gpu>.txt; .ci/gpu.sh names its files alike): lower case, each
    run of other characters one underscore."""
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(device).lower()).strip("_")


def write_file(path: Path, text: str) -> None:
    """``text`` into ``path``, its folder made, and a line on stderr saying so."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")
    progress(f"wrote {path}")


def timing_line(t: Timings) -> str:
    return (f"timing: variants interleaved in rotating order, {t.warmup} warm-up round(s) dropped, {t.rounds} timed "
            f"round(s) ({t.elapsed:.0f} s{', stopped by the time budget' if t.stopped_by_budget else ''}); "
            f"s/step = median; ratios = median of per-round ratios, [quartiles] beside them")


def fmt_s(x: float) -> str:
    return f"{x:.4f}" if x < 1 else f"{x:.3f}"


def fmt_x(x: float) -> str:
    return f"{x:.2f}x"


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


# -- K gloo processes on this machine -------------------------------------------------------------------------------

def run_ranks(target: Callable, k: int, *args) -> list:
    """Spawns ``k`` processes, each running ``target(rank, k, port, *args, queue)`` with a free 127.0.0.1 port for its
    process group; each puts ``(rank, result)`` on the queue once, or ``(rank, traceback text)`` when it fails.
    Returns the results by rank. Raises on a failure, on a rank that exits before it reports (a signal, the OOM
    killer) and on a non-zero exit after; kills any rank left running."""
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=target, args=(r, k, port, *args, queue)) for r in range(k)]
    for p in procs:
        p.start()
    results: list = [None] * k
    try:
        for _ in range(k):
            while queue.empty():
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    raise RuntimeError(f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} before reporting")
                time.sleep(0.05)
            rank, got = queue.get()
            if isinstance(got, str):
                raise RuntimeError(f"rank {rank} failed:\n{got}")
            results[rank] = got
        for p in procs:
            p.join(timeout=120)
        failed = [r for r, p in enumerate(procs) if p.exitcode != 0]
        if failed:
            raise RuntimeError(f"rank {failed[0]} exited with code {procs[failed[0]].exitcode} after reporting")
        return results
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
