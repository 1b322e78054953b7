"""Pipeline speedup on CPU workers: GPipe's Table 2 in miniature.

    python benchmarks/speedup.py            # real sizes (~3-4 min on 2 cores)
    python benchmarks/speedup.py --quick    # tiny smoke test

K CPU workers (K = 1, 2, and 4, 8 where there are that many usable cores),
ONE intra-op thread each, M micro-batches in {1, 4, 8, 32}, checkpoint="never"
(plus, at the largest K and M, one row with "except_last" and one with
balance="time" instead of flops), for a transformer-like and a CNN-like
model (zoo/models.py). The plain model runs on one thread too.
All variants of a model are interleaved round by round; numbers are medians.

Columns, per row:
  vs K=1 same M    the pipeline's own speedup: the same M micro-batches on one worker / on K workers
  vs plain         the whole story: the plain 1-thread model / the pipeline
  1w xM / plain    the cost of micro-batching alone: one worker running M micro-batches / the plain model
                   (so vs plain = vs K=1 same M / this; > 1 means micro-batches are slower than the whole batch)
  ideal            GPipe's K*M/(M+K-1): K workers, bubble (K-1)/(M+K-1), perfect balance, free micro-batching
Target: vs K=1 at K=2, M=32 >= 1.85x.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import autopipe  # noqa: E402
from benchmarks import _common as C  # noqa: E402
from zoo import cnn_like, transformer_like  # noqa: E402


def _models(quick: bool, kmax: int):
    """(name, description, model, x, y, loss_fn) for each model."""
    g = torch.Generator().manual_seed(1)
    if quick:
        d, hidden, blocks, batch = 32, 64, max(2, kmax), 64
        width, size, cbatch = 4, 8, 64
    else:
        # batch 4096: a micro-batch of 128 rows at M=32 still runs near full speed on one core
        d, hidden, blocks, batch = 512, 2048, 2 if kmax <= 2 else 4, 4096
        width, size, cbatch = 16, 32, 256
    tf = transformer_like(d, hidden, blocks)
    yield ("transformer", f"transformer_like(d={d}, hidden={hidden}, blocks={blocks}), batch {batch}, MSE loss",
           tf, torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g), nn.MSELoss())
    cnn = cnn_like(width=width)
    yield ("cnn", f"cnn_like(width={width}) (3 stages x 2 res-blocks, BatchNorm), batch {cbatch} x 3x{size}x{size}, "
                  f"cross-entropy",
           cnn, torch.randn(cbatch, 3, size, size, generator=g), torch.randint(0, 10, (cbatch,), generator=g),
           nn.CrossEntropyLoss())


def main(argv=None) -> int:
    p = C.parser(__doc__)
    p.add_argument("--workers", type=str, default=None, help="comma-separated K values (default: 1,2,4,8 up to the usable cores)")
    p.add_argument("--chunks", type=str, default=None, help="comma-separated M values (default 1,4,8,32; --quick 1,8)")
    p.add_argument("--no-extra-rows", action="store_true",
                   help="skip the two extra rows at the largest K and M (checkpoint except_last; balance time)")
    p.add_argument("--models", type=str, default="transformer,cnn")
    args = p.parse_args(argv)
    quick = args.quick
    torch.set_num_threads(1)
    Ks = [int(k) for k in args.workers.split(",")] if args.workers else [k for k in (1, 2, 4, 8) if k <= max(C.cores(), 2)]
    if 1 not in Ks:
        Ks = [1] + Ks
    Ms = [int(m) for m in (args.chunks or ("1,8" if quick else "1,4,8,32")).split(",")]
    kmax, mmax = max(Ks), max(Ms)
    repeats = args.repeats or (1 if quick else 5)
    warmup = args.warmup if args.warmup is not None else 1
    budget = args.budget or (20 if quick else 105)  # per model
    wanted = set(args.models.split(","))

    tables, described, timing = [], [], []
    for name, description, model, x, y, loss_fn in _models(quick, kmax):
        if name not in wanted:
            continue
        described.append(f"{name}: {description}")

        def step(fn, model=model, x=x, y=y, loss_fn=loss_fn):
            def run():
                model.zero_grad(set_to_none=True)
                loss_fn(fn(x), y).backward()
            return run

        configs = [(K, M, "never", "flops") for K in Ks for M in Ms]
        if not args.no_extra_rows and kmax > 1:
            configs.append((kmax, mmax, "except_last", "flops"))
            configs.append((kmax, mmax, "never", "time"))
        pipes = {}
        for K, M, ckpt, balance in configs:
            C.progress(f"{name}: compiling K={K} M={M} checkpoint={ckpt} balance={balance}")
            pipes[(K, M, ckpt, balance)] = autopipe.compile(
                model, devices=["cpu"] * K, chunks=M, checkpoint=ckpt, balance=balance, intra_op_threads=1,
                example_inputs=(x,))
        key = {cfg: f"K{cfg[0]} M{cfg[1]}{'' if cfg[2] == 'never' else ' ' + cfg[2]}"
                    f"{'' if cfg[3] == 'flops' else ' ' + cfg[3]}" for cfg in configs}
        variants = {"plain": step(model), "plain thread": C.on_thread(step(model), 1),
                    **{key[cfg]: step(pipes[cfg]) for cfg in configs}}
        C.progress(f"{name}: {len(variants)} variants, {warmup} warm-up + {repeats} rounds, budget {budget:.0f} s")
        t = C.interleaved(variants, repeats=repeats, warmup=warmup, budget=budget, label=f"{name} ")
        timing.append(f"{name}: " + C.timing_line(t))
        plain = C.faster(t, "plain", "plain thread")
        timing.append(f"{name}: plain baseline = the plain model on {'the main' if plain == 'plain' else 'its own'} thread "
                      f"(the faster of the two: {C.fmt_s(t.median('plain'))} / {C.fmt_s(t.median('plain thread'))} s)")

        rows = [[name, "plain", "-", "-", "-", C.fmt_s(t.median(plain)), "-", "1.00x", "-", "-", "-", "-"]]
        for cfg in configs:
            K, M, ckpt, balance = cfg
            k1 = key[(1, M, "never", "flops")]
            pipe = pipes[cfg]
            tl = pipe.timeline
            rows.append([
                name, K, M, ckpt, balance, C.fmt_s(t.median(key[cfg])),
                f"{t.ratio(k1, key[cfg]):.2f}x [{t.spread(k1, key[cfg])}]" if key[cfg] != k1 else "1.00x",
                f"{t.ratio(plain, key[cfg]):.2f}x [{t.spread(plain, key[cfg])}]",
                f"{t.ratio(k1, plain):.2f}x",
                f"{K * M / (M + K - 1):.2f}x",
                f"{tl.measured_bubble:.2f} / {tl.predicted_bubble:.2f}" if K > 1 else "-",
                f"{pipe.plan.imbalance:.2f} / {tl.measured_imbalance:.2f}" if K > 1 else "-",
            ])
            pipe.close()
        tables.append(rows)

    head = C.header("speedup", [
        *[f"model {d}" for d in described],
        "K CPU workers (devices=['cpu']*K), ONE intra-op thread each (compile(intra_op_threads=1)); the plain "
        "model on one thread; checkpoint='never' and balance='flops' unless the row says otherwise "
        "(balance='time': stages cut on measured node times); step = zero_grad + forward + loss + backward",
        *timing,
        "vs K=1 same M = t(1 worker, M) / t(K, M): pipeline efficiency; vs plain = t(plain) / t(K, M);",
        "1w xM / plain = t(1 worker, M) / t(plain): the micro-batching cost alone (vs plain = vs K=1 / this);",
        "ideal = K*M/(M+K-1); bubble = idle share of the last step (measured) / GPipe's (K-1)/(M+K-1);",
        "imbalance = slowest / mean stage: the plan's flops estimate / the last step's measured busy time.",
        "target: vs K=1 same M >= 1.85x at K=2, M=32",
    ], quick=quick)
    rows = [r for tab in tables for r in tab]
    text = head + "\n" + C.table(rows, ["model", "K", "M", "checkpoint", "balance", "s/step", "vs K=1 same M", "vs plain",
                                        "1w xM / plain", "ideal", "bubble meas/pred", "imbalance plan/meas"])
    C.write("speedup", text, quick=quick, results_dir=args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
