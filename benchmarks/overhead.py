"""Overhead of autopipe on ONE worker: a full training step of the pipeline vs the plain model.

    python benchmarks/overhead.py            # real sizes (~2-3 min on 2 cores)
    python benchmarks/overhead.py --quick    # tiny smoke test

One worker (devices=["cpu"]) with as many intra-op threads as the plain run
(all usable cores), so the only differences are autopipe's runtime and the
micro-batching. Model: zoo.transformer_like(512, 2048, 8)
with batch 1024 x threads, where running M=8 micro-batches is nearly free on
CPU (Note [micro-batching's own cost]; docs/decisions/history.md: 1.00x at batch 1024 on one thread; measured here,
2 threads: 1.18x at batch 1024, 1.03x at 2048). A step is zero_grad +
forward + MSE loss + backward (no optimizer step: the same for every variant).

Variants, interleaved round by round:
  plain                 model(x) on the calling thread
  hand loop xM          the plain model over M micro-batches with gradient accumulation
                        (micro-batching cost alone, no autopipe)
  hand loop + ckpt      the same, each micro-batch but the last (except_last) or every one
                        (always) under torch.utils.checkpoint: re-materialisation's own cost
                        on this machine, no autopipe
  chunks=1              autopipe, checkpoint never
  chunks=M              autopipe, checkpoint never / except_last / always
Targets: chunks=1 <= 1.03x; chunks=8 never <= 1.10x (torchgpipe 1.07x);
except_last <= 1.30x and always <= 1.38x (torchgpipe's numbers).

Second table, a model of small ops where per-op costs dominate: the GPT of
zoo/models.py (d=64, 8 layers, 4 heads, vocab 64, tied head), batch 8 x
sequence 32, dropout 0.1 and 0, compiled with devices=1, chunks=1,
checkpoint="never", intra_op_threads=1 (a TorchFunctionMode around the stage
once cost it 1.44x the plain step: Note [random ops bound at codegen]). Measured
in a child process pinned to ONE core (os.sched_setaffinity before torch
starts its threads, torch.set_num_threads(1)): plain and autopipe alternate
for 41 runs (--small-op-runs) of 5 consecutive steps each; the fastest run of
each is compared, per step, for the
training step (zero_grad + forward + cross-entropy + backward) and for the
forward alone under torch.no_grad().
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

SMALL_OP_CHILD = "--small-op-child"
if __name__ == "__main__" and SMALL_OP_CHILD in sys.argv:
    # One core for the whole child, set before torch starts any thread pool.
    _allowed = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {0} if 0 in _allowed else {min(_allowed)})

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import autopipe  # noqa: E402
from autopipe.ir.checkpoint import checkpoints  # noqa: E402
from benchmarks import _common as C  # noqa: E402
from zoo import transformer_like  # noqa: E402

SMALL_OP = dict(vocab=64, d=64, heads=4, layers=8, block=32)  # zoo.GPT
SMALL_OP_BATCH = (8, 32)  # batch x sequence
SMALL_OP_STEPS = 5  # consecutive steps per timed run: a single ~15 ms step jitters by +-5% on this VM

TARGETS = {  # (variant key) -> (target, torchgpipe's measurement)
    ("pipe", 1, "never"): ("<= 1.03x", "-"),
    ("pipe", 8, "never"): ("<= 1.10x", "1.07x"),
    ("pipe", 8, "except_last"): ("<= 1.30x", "1.30x"),
    ("pipe", 8, "always"): ("<= 1.38x", "1.38x"),
}


def main(argv=None) -> int:
    p = C.parser(__doc__)
    p.add_argument("--threads", type=int, default=None, help="intra-op threads, plain and worker alike (default: all usable cores)")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--small-op-runs", type=int, default=None,
                   help="alternating runs of plain vs autopipe per small-op GPT row (default 41; --quick 5)")
    p.add_argument("--no-small-op", dest="small_op", action="store_false", help="skip the small-op GPT table")
    p.add_argument(SMALL_OP_CHILD, dest="small_op_child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.small_op_child:
        return small_op_child(args.small_op_runs or 41, args.quick)
    quick = args.quick
    threads = args.threads or C.cores()
    torch.set_num_threads(threads)
    # batch 1024 rows per thread: 8 micro-batches of 128 rows per thread run at full speed
    # (2 threads: batch 1024 as 8 micro-batches costs 1.18x the whole batch, batch 2048 1.03x)
    d, hidden, blocks, batch = (64, 256, 2, 64) if quick else (512, 2048, 8, 1024 * threads)
    batch = args.batch or batch
    M = args.chunks
    repeats = args.repeats or (2 if quick else 10)
    warmup = args.warmup if args.warmup is not None else 1
    budget = args.budget or (30 if quick else 200)

    torch.manual_seed(0)
    model = transformer_like(d, hidden, blocks)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g)
    loss_fn = nn.MSELoss()

    def step(fn):
        def run():
            model.zero_grad(set_to_none=True)
            loss_fn(fn(x), y).backward()
        return run

    def hand_loop(mode):
        """The plain model over M micro-batches by hand; ``mode`` as autopipe's checkpoint, through
        torch.utils.checkpoint."""
        from torch.utils.checkpoint import checkpoint

        def run():
            model.zero_grad(set_to_none=True)
            for i, (xs, ys) in enumerate(zip(x.tensor_split(M), y.tensor_split(M))):
                out = checkpoint(model, xs, use_reentrant=False) if checkpoints(mode, i, M) else model(xs)
                (loss_fn(out, ys) * (len(xs) / batch)).backward()
        return run

    configs = [(1, "never"), (M, "never"), (M, "except_last"), (M, "always")]
    pipes = {}
    for chunks, ckpt in configs:
        C.progress(f"compiling chunks={chunks} checkpoint={ckpt}")
        pipes[(chunks, ckpt)] = autopipe.compile(model, devices=["cpu"], chunks=chunks, checkpoint=ckpt,
                                                 intra_op_threads=threads, example_inputs=(x,))
    variants = {"plain": step(model), "plain thread": C.on_thread(step(model), threads),
                f"hand x{M}": hand_loop("never"), f"hand x{M} except_last": hand_loop("except_last"),
                f"hand x{M} always": hand_loop("always")}
    names = {}
    for (chunks, ckpt), pipe in pipes.items():
        names[(chunks, ckpt)] = f"c{chunks} {ckpt}"
        variants[names[(chunks, ckpt)]] = step(pipe)

    C.progress(f"overhead: {len(variants)} variants, {warmup} warm-up + {repeats} rounds, budget {budget:.0f} s")
    t = C.interleaved(variants, repeats=repeats, warmup=warmup, budget=budget)
    base = C.faster(t, "plain", "plain thread")

    def row(label, chunks, ckpt, name, key):
        target, tg = TARGETS.get(key, ("-", "-"))
        if chunks == M and M != 8 and key[0] == "pipe":
            target, tg = "-", "-"  # the targets are stated for M=8
        hand = f"hand x{M}" if ckpt in ("never", "-") else f"hand x{M} {ckpt}"
        vs_hand = f"{t.ratio(name, hand):.2f}x" if chunks == M and not name.startswith("hand") else "-"
        return [label, chunks, ckpt, C.fmt_s(t.median(name)), f"{t.ratio(name, base):.2f}x",
                t.spread(name, base), vs_hand, target, tg]

    rows = [row("plain model, main thread", "-", "-", "plain", ("plain",)),
            row("plain model, own thread", "-", "-", "plain thread", ("plain",)),
            row("hand-written loop", M, "-", f"hand x{M}", ("hand", M, "-")),
            row("hand loop + torch ckpt", M, "except_last", f"hand x{M} except_last", ("hand", M, "except_last")),
            row("hand loop + torch ckpt", M, "always", f"hand x{M} always", ("hand", M, "always"))]
    for (chunks, ckpt), name in names.items():
        rows.append(row("autopipe, 1 worker", chunks, ckpt, name, ("pipe", chunks, ckpt)))
    n_params = sum(p.numel() for p in model.parameters())
    head = C.header("overhead", [
        f"model: transformer_like(d={d}, hidden={hidden}, blocks={blocks}) ({n_params / 1e6:.1f} M params), batch {batch}, "
        f"MSE loss; step = zero_grad + forward + backward (no optimizer)",
        f"threads: plain run {threads} intra-op threads on the calling thread; autopipe devices=['cpu'] (one worker) "
        f"with intra_op_threads={threads}",
        C.timing_line(t),
        f"'vs plain' = seconds / the faster plain run's seconds ({'main thread' if base == 'plain' else 'own thread'} "
        f"here; lower is better; torchgpipe = its published overhead);",
        f"'vs hand loop' = seconds / the plain model run as {M} micro-batches by hand, with the same checkpoint mode "
        f"through torch.utils.checkpoint: autopipe's own overhead",
    ], quick=quick)
    text = head + "\n" + C.table(rows, ["variant", "chunks", "checkpoint", "s/step", "vs plain", "[quartiles]",
                                        "vs hand loop", "target", "torchgpipe"])
    for pipe in pipes.values():
        pipe.close()
    if args.small_op:
        text += "\n\n" + small_op_table(args.small_op_runs or (2 if quick else 41), quick)
    C.write("overhead", text, quick=quick, results_dir=args.results_dir)
    return 0


# -- the small-op GPT: plain vs autopipe on one pinned core -----------------------------

def small_op_table(runs: int, quick: bool = False) -> str:
    """Runs the measurement in a child process pinned to one core; returns the ratio table. ``quick``: the model
    at 2 layers (a smoke run of the table)."""
    C.progress(f"overhead: small-op GPT in a child process pinned to one core, {runs} alternating runs per row")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, str(Path(__file__).resolve()), SMALL_OP_CHILD, "--small-op-runs", str(runs),
                        *(["--quick"] if quick else [])],
                       stdout=subprocess.PIPE, text=True, env=env, check=True)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    rows = [[row["step"], row["dropout"], f"{row['plain'] * 1e3:.2f}", f"{row['autopipe'] * 1e3:.2f}",
             f"{row['autopipe'] / row['plain']:.3f}x", f"{row['median_ratio']:.3f}x [{row['quartiles']}]"]
            for row in got["rows"]]
    model = ", ".join(f"{k}={v}" for k, v in _small_op(quick).items())
    lines = [
        f"small-op model: zoo.GPT({model}), batch {SMALL_OP_BATCH[0]} x sequence {SMALL_OP_BATCH[1]}, "
        f"{got['params'] / 1e6:.2f} M params, model.train(); autopipe.compile(devices=1, chunks=1, checkpoint='never', "
        f"intra_op_threads=1)",
        f"one process pinned to core {got['cores']} (os.sched_setaffinity before torch starts threads), "
        f"torch.set_num_threads(1); plain and autopipe alternate for {runs} runs per row, a run being "
        f"{SMALL_OP_STEPS} consecutive steps ({got['warmup']} warm-up runs dropped); fastest run of each, per step; "
        f"train = zero_grad + forward + cross-entropy "
        f"+ backward, forward = under torch.no_grad()",
    ]
    return ("\n".join(f"# {line}" for line in lines) + "\n"
            + C.table(rows, ["step", "dropout", "plain ms (fastest)", "autopipe ms (fastest)", "autopipe / plain",
                             "median of per-run ratios [quartiles]"]))


def _small_op(quick: bool) -> dict:
    return {**SMALL_OP, "layers": 2} if quick else SMALL_OP


def small_op_child(runs: int, quick: bool = False) -> int:
    """In the pinned child: time plain vs autopipe; one JSON line on stdout."""
    from zoo import GPT

    torch.set_num_threads(1)
    warmup = 2 if runs > 5 else 0  # --quick: a smoke run of the table, not a measurement
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, SMALL_OP["vocab"], SMALL_OP_BATCH, generator=g)
    y = torch.randint(0, SMALL_OP["vocab"], SMALL_OP_BATCH, generator=g)
    rows, params = [], 0
    for dropout in (0.1, 0.0):
        torch.manual_seed(0)
        model = GPT(dropout=dropout, **_small_op(quick)).train()
        params = sum(p.numel() for p in model.parameters())
        pipe = autopipe.compile(model, devices=1, chunks=1, checkpoint="never", intra_op_threads=1,
                                example_inputs=(x,))

        def train(fn):
            def run():
                for _ in range(SMALL_OP_STEPS):
                    model.zero_grad(set_to_none=True)
                    nn.functional.cross_entropy(fn(x).flatten(0, 1), y.flatten()).backward()
            return run

        def forward(fn):
            def run():
                with torch.no_grad():
                    for _ in range(SMALL_OP_STEPS):
                        fn(x)
            return run

        for step, wrap in (("train", train), ("forward", forward)):
            t = C.interleaved({"plain": wrap(model), "autopipe": wrap(pipe)}, repeats=runs, warmup=warmup,
                              label=f"small-op {step} dropout={dropout} ", verbose=False)
            rows.append({"step": step, "dropout": dropout, "plain": t.fastest("plain") / SMALL_OP_STEPS,
                         "autopipe": t.fastest("autopipe") / SMALL_OP_STEPS, "median_ratio": t.ratio("autopipe", "plain"),
                         "quartiles": t.spread("autopipe", "plain")})
            C.progress(f"  small-op {step} dropout={dropout}: plain {rows[-1]['plain'] * 1e3:.2f} ms, autopipe "
                       f"{rows[-1]['autopipe'] * 1e3:.2f} ms a step (fastest of {runs} runs)")
        pipe.close()
    print(json.dumps({"rows": rows, "params": params, "warmup": warmup,
                      "cores": sorted(os.sched_getaffinity(0))}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
