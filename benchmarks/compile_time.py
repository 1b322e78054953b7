"""Compile time: seconds of each compiler pass for GPT-style models of 12, 48 and 96 blocks on meta.

    python benchmarks/compile_time.py            # real sizes (~1 min on 2 cores)
    python benchmarks/compile_time.py --quick    # tiny smoke test

The models (zoo.GPT, untied, no dropout: d=1024, 16 heads, sequence 1024, vocab
32768, batch 8) are built under torch.device("meta"), so nothing is allocated
and nothing runs. Each pass is called directly, as autopipe/compile.py chains
them, for devices=8 and chunks=32: trace (fx + fake-tensor shapes), cost
(FLOPs per node), partition (exact balanced cuts), codegen (one GraphModule
per stage). The models are interleaved round by round; medians.
Target: the 48-block model in under 2 s in total.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from autopipe.passes.codegen import codegen  # noqa: E402
from autopipe.passes.cost import cost  # noqa: E402
from autopipe.passes.partition import partition  # noqa: E402  (the partition autopipe/compile.py calls)
from autopipe.passes.trace import trace  # noqa: E402
from benchmarks import _common as C  # noqa: E402
from zoo import GPT  # noqa: E402

PASSES = ("trace", "cost", "partition", "codegen")


def run_passes(model, x, devices: list[torch.device], chunks: int):
    """Seconds of each pass, plus what the run produced (for the table's descriptive columns)."""
    seconds = {}
    t = time.perf_counter()
    traced = trace(model, (x,), {})
    seconds["trace"] = time.perf_counter() - t
    t = time.perf_counter()
    costed = cost(traced)
    seconds["cost"] = time.perf_counter() - t
    t = time.perf_counter()
    plan = partition(costed, len(devices), devices=devices, chunks=chunks, balance="flops")
    seconds["partition"] = time.perf_counter() - t
    t = time.perf_counter()
    stages = codegen(traced.graph_module, plan)
    seconds["codegen"] = time.perf_counter() - t
    nodes = sum(1 for _ in traced.graph_module.graph.nodes)
    return seconds, {"nodes": nodes, "route": traced.route, "imbalance": plan.imbalance, "stages": len(stages)}


def main(argv=None) -> int:
    p = C.parser(__doc__)
    p.add_argument("--blocks", type=str, default=None, help="comma-separated block counts (default 12,48,96)")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--chunks", type=int, default=32)
    args = p.parse_args(argv)
    quick = args.quick
    if quick:
        blocks, d, heads, seq, vocab, batch = [2, 4], 64, 4, 32, 256, 8
    else:
        blocks, d, heads, seq, vocab, batch = [12, 48, 96], 1024, 16, 1024, 32768, 8
    if args.blocks:
        blocks = [int(b) for b in args.blocks.split(",")]
    K = args.devices if not quick else min(args.devices, 4)
    repeats = args.repeats or (1 if quick else 3)
    warmup = args.warmup if args.warmup is not None else 1
    devices = [torch.device("cpu")] * K

    models = {}
    for n in blocks:
        with torch.device("meta"):
            models[n] = GPT(vocab, d, heads, n, block=seq, dropout=None, tied=False)
    x = torch.zeros(batch, seq, dtype=torch.long, device="meta")

    seconds: dict[int, dict[str, list[float]]] = {n: {k: [] for k in PASSES} for n in blocks}
    info = {}
    t0 = time.perf_counter()
    for r in range(warmup + repeats):
        for n in blocks:
            s, info[n] = run_passes(models[n], x, devices, args.chunks)
            C.progress(f"  round {r + 1}/{warmup + repeats} ({'timed' if r >= warmup else 'warm-up'}) {n} blocks: "
                       + ", ".join(f"{k} {v:.3f} s" for k, v in s.items()))
            if r >= warmup:
                for k, v in s.items():
                    seconds[n][k].append(v)
    elapsed = time.perf_counter() - t0

    rows = []
    for n in blocks:
        med = {k: statistics.median(v) for k, v in seconds[n].items()}
        totals = [sum(seconds[n][k][i] for k in PASSES) for i in range(repeats)]
        params = sum(p.numel() for p in models[n].parameters())
        rows.append([n, f"{params / 1e9:.2f} B" if params >= 1e9 else f"{params / 1e6:.{0 if params >= 1e7 else 2}f} M", info[n]["nodes"],
                     info[n]["route"], *(f"{med[k]:.3f}" for k in PASSES), f"{statistics.median(totals):.3f}",
                     f"{info[n]['imbalance']:.3f}"])
    head = C.header("compile_time", [
        f"models: GPT-style (zoo.GPT, untied, no dropout), d={d}, {heads} heads, sequence {seq}, vocab {vocab}, batch {batch}, "
        f"token ids on meta; built under torch.device('meta')",
        f"passes called directly (autopipe.passes.trace.trace, cost.cost, partition.partition, codegen.codegen), "
        f"devices={K}, chunks={args.chunks}, balance='flops'",
        f"timing: models interleaved, {warmup} warm-up round(s) dropped, {repeats} timed round(s) ({elapsed:.0f} s); "
        f"seconds = median per pass; total = median of the per-round sums",
        "target: 48 blocks under 2 s in total",
    ], quick=quick)
    text = head + "\n" + C.table(rows, ["blocks", "params", "graph nodes", "traced by", "trace s", "cost s",
                                        "partition s", "codegen s", "total s", "plan imbalance"])
    C.write("compile_time", text, quick=quick, results_dir=args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
