"""GPipe over torch.distributed on CPU (gloo): plain vs p2p prototype vs torch.distributed.pipelining.

    python -m benchmarks.distributed                 # the side-by-side table (2 processes)
    python -m benchmarks.distributed --check         # 3-rank correctness: skip edge, several
                                                     # tensors per cut, int tensor, uneven split
    python -m benchmarks.distributed --failures      # failure detection: raise / SIGKILL / hang
    python -m benchmarks.distributed --sleep 1.2     # blocks sleep instead of computing: the
                                                     # schedules and transports alone, CPU-free

One run, 2 processes spawned on 127.0.0.1 with gloo, ``torch.set_num_threads(1)``
in every process, ``transformer_like(blocks=4)`` (benchmarks/_models.py), batch
4096 (128 rows per micro-batch at M=32: the size at which one process runs 32
micro-batches no slower than the whole batch on this CPU; at batch 1024 it runs
them 0.81x as fast, and no pipeline can hide that), no checkpointing, split at
the middle block. Variants, interleaved step by step
(order rotated every repetition), median over ``--steps`` steps after warm-up:

- plain:      one process, one thread, the whole batch at once (rank 1 idles)
- 1p xM:      one process running the batch as M micro-batches (the cost of
              micro-batching alone, no pipeline)
- 2p compute: both processes run their half on M micro-batches at once, with no
              communication and no waiting: what two busy cores can do at best
- p2p:        autopipe/runtime/p2p.py, ProcessGroup.send/recv directly
- p2p-batch:  the same with dist.batch_isend_irecv (P2POp lists)
- pipelining: torch.distributed.pipelining ScheduleGPipe + PipelineStage, the
              split written by hand (shapes inferred at the warm-up step)
- autopipe:   autopipe.compile(model, chunks=M) under the same process group: its own split

Speedups are plain / variant; "ideal" is 2M/(M+1) (GPipe bubble, 2 stages).
The machine is shared: compare rows of one run, never runs with each other.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks._models import transformer_like  # noqa: E402


def _load_p2p():
    """autopipe.runtime.p2p, by file path if the package is not importable
    (the prototype is standalone; the package around it may be mid-edit)."""
    try:
        from autopipe.runtime import p2p  # type: ignore

        return p2p
    except Exception:  # noqa: BLE001
        path = ROOT / "autopipe" / "runtime" / "p2p.py"
        spec = importlib.util.spec_from_file_location("_autopipe_p2p", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["_autopipe_p2p"] = mod
        spec.loader.exec_module(mod)
        return mod


p2p = _load_p2p()


# ---------------------------------------------------------------------------
# the hand-written split (used by both p2p and torch.distributed.pipelining)
# ---------------------------------------------------------------------------
class Front(nn.Module):
    """Stage 0: input projection and blocks[:k] of a TransformerLike."""

    def __init__(self, model: nn.Module, k: int) -> None:
        super().__init__()
        self.proj = model.proj
        self.blocks = nn.ModuleList(model.blocks[:k])

    def forward(self, x):
        x = self.proj(x)
        for b in self.blocks:
            x = b(x)
        return x


class Back(nn.Module):
    """Stage 1: blocks[k:], final norm and head."""

    def __init__(self, model: nn.Module, k: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(model.blocks[k:])
        self.norm = model.norm
        self.head = model.head

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward sleep: CPU-free "compute"."""

    @staticmethod
    def forward(ctx, x, fwd_s, bwd_s):
        ctx.bwd_s = bwd_s
        time.sleep(fwd_s)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        time.sleep(ctx.bwd_s)
        return g, None, None


class SleepBlock(nn.Module):
    """A small Linear plus a sleep proportional to the rows: micro-batching is
    free by construction and the "compute" needs no CPU."""

    def __init__(self, d: int, fwd_s_per_row: float, bwd_s_per_row: float) -> None:
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.f, self.b = fwd_s_per_row, bwd_s_per_row

    def forward(self, x):
        n = x.shape[0]
        return _Sleep.apply(x + self.lin(x), n * self.f, n * self.b)


class SleepModel(nn.Module):
    """Same attribute layout as TransformerLike (proj, blocks, norm, head), so
    the same hand-written split applies; ``--sleep`` times the schedules and
    transports apart from CPU contention on a shared machine."""

    def __init__(self, d: int, blocks: int, batch: int, step_s: float) -> None:
        super().__init__()
        per_block = step_s / blocks / batch  # forward 1/3, backward 2/3 of the step
        self.proj = nn.Linear(d, d)
        self.blocks = nn.ModuleList(SleepBlock(d, per_block / 3, 2 * per_block / 3) for _ in range(blocks))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, d)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p_ in self.parameters():
                p_.copy_(torch.randn(p_.shape, generator=g) * 0.02)

    def forward(self, x):
        x = self.proj(x)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def half(model: nn.Module, rank: int) -> nn.Module:
    k = len(model.blocks) // 2
    return Front(model, k) if rank == 0 else Back(model, k)


def make_autopipe_step(model, x, y, chunks, rank, world):
    """HOOK for the autopipe row: return a zero-argument callable that runs one
    training step (forward + backward, no optimizer step) of ``model`` on this
    rank, or None to leave the row out. ``model`` is this variant's own
    full-size copy, identical to the plain one; ``x`` / ``y`` are the whole
    batch (every rank has them). To be wired by the lead, along the lines of:

        pipe = autopipe.compile(model, devices=world, chunks=chunks,
                                transport="distributed", example_inputs=(x[:1],))
        return lambda: pipe.step(x, target=y, loss_fn=F.mse_loss)

    The gradient check below covers it too: after a step, the parameters of
    ``model`` that this rank owns must hold the same gradients as the plain
    model's (compared by name; parameters whose .grad is None are skipped).
    """
    import autopipe

    pipe = autopipe.compile(model, chunks=chunks, checkpoint="never", example_inputs=(x,))

    def step():
        pipe.zero_grad()  # as the other rows: each step's gradients alone
        return pipe.step(x, target=y, loss_fn=F.mse_loss)
    return step


# ---------------------------------------------------------------------------
# the timing run
# ---------------------------------------------------------------------------
def _init(rank, world, port, timeout_s=120.0):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=timedelta(seconds=timeout_s),
    )


def _p2p_spec(B, M, d):
    mb = B // M
    return p2p.PipeSpec(
        edges=[p2p.Edge("h", 0, (1,), (mb, d))],
        stage_inputs=[("x",), ("h",)],
        stage_outputs=[("h",), ("out",)],
        batch_size=B,
        chunks=M,
    )


def _pingpong(rank, sizes=(512, 64 * 1024, 4 << 20), iters=200):
    """Round-trip latency of one message each way, per posting API."""
    res = {}
    pg = dist.group.WORLD
    for nbytes in sizes:
        t = torch.zeros(nbytes // 4)
        for mode in ("pg", "isend", "batch"):
            times = []
            for it in range(iters + 10):
                dist.barrier()
                t0 = time.perf_counter()
                if mode == "pg":
                    if rank == 0:
                        pg.send([t], 1, 7).wait()
                        pg.recv([t], 1, 8).wait()
                    else:
                        pg.recv([t], 0, 7).wait()
                        pg.send([t], 0, 8).wait()
                elif mode == "isend":
                    if rank == 0:
                        dist.isend(t, 1, tag=7).wait()
                        dist.irecv(t, 1, tag=8).wait()
                    else:
                        dist.irecv(t, 0, tag=7).wait()
                        dist.isend(t, 0, tag=8).wait()
                else:
                    if rank == 0:
                        [w.wait() for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 1, tag=7)])]
                        [w.wait() for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, 1, tag=8)])]
                    else:
                        [w.wait() for w in dist.batch_isend_irecv([dist.P2POp(dist.irecv, t, 0, tag=7)])]
                        [w.wait() for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, t, 0, tag=8)])]
                if it >= 10:
                    times.append(time.perf_counter() - t0)
            res[(nbytes, mode)] = statistics.median(times)
    return res


def _bench_worker(rank, world, port, args, q):
    try:
        _init(rank, world, port)
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        B, d, Ms = args.batch, args.d, args.chunks
        g = torch.Generator().manual_seed(1)
        x = torch.randn(B, d, generator=g)
        y = torch.randn(B, d, generator=g)

        def build():
            if args.sleep:
                return SleepModel(args.d, args.blocks, B, args.sleep)
            return transformer_like(args.d, args.hidden, args.blocks, seed=0)

        plain = build()  # rank 0 times it; rank 1 uses it as the gradient reference
        loss_fn = nn.MSELoss()

        steps: dict[tuple[str, int], object] = {}
        owners: dict[tuple[str, int], nn.Module] = {}

        def plain_step():
            plain.zero_grad(set_to_none=True)
            if rank == 0:
                loss_fn(plain(x), y).backward()

        steps[("plain", 0)] = plain_step
        for M in Ms:
            def mb_step(M=M):
                plain.zero_grad(set_to_none=True)
                if rank == 0:
                    for xs, ys in zip(x.tensor_split(M), y.tensor_split(M)):
                        (loss_fn(plain(xs), ys) * (len(xs) / B)).backward()

            steps[("1p xM", M)] = mb_step

            half_model = half(build(), rank)

            def compute_only(st=half_model, M=M):
                """Each rank runs its half on M micro-batches with no communication and no wait:
                the pipeline's compute alone, both cores busy (memory bandwidth shared)."""
                st.zero_grad(set_to_none=True)
                outs = []
                for xs in x.tensor_split(M):
                    h = xs.detach().requires_grad_(rank > 0)
                    outs.append(st(h))
                for out, ys in zip(reversed(outs), reversed(y.tensor_split(M))):
                    if rank == world - 1:
                        (loss_fn(out, ys) * (len(ys) / B)).backward()
                    else:
                        out.backward(torch.ones_like(out))

            steps[("2p compute", M)] = compute_only

            for ops in ("pg", "batch"):
                full = build()
                st = half(full, rank)
                pipe = p2p.P2PGPipe(st, _p2p_spec(B, M, d), ops=ops, name=f"bench_{ops}_{M}")
                name = "p2p" if ops == "pg" else "p2p-batch"

                def p2p_step(st=st, pipe=pipe):
                    st.zero_grad(set_to_none=True)
                    return pipe.step(
                        {"x": x} if rank == 0 else None,
                        target=y if rank == world - 1 else None,
                        loss_fn=F.mse_loss,
                    )

                steps[(name, M)] = p2p_step
                owners[(name, M)] = full

            full = build()
            st = half(full, rank)
            # As the docs' examples write it: shapes inferred at the first step
            # (a warm-up step), nothing else passed.
            stage = PipelineStage(st, rank, world, torch.device("cpu"))
            sched = ScheduleGPipe(stage, n_microbatches=M, loss_fn=F.mse_loss)

            def pp_step(st=st, sched=sched):
                st.zero_grad(set_to_none=True)
                if rank == 0:
                    sched.step(x)
                else:
                    sched.step(target=y, losses=[])

            steps[("pipelining", M)] = pp_step
            owners[("pipelining", M)] = full

            full = build()
            auto = make_autopipe_step(full, x, y, M, rank, world)
            if auto is not None:
                steps[("autopipe", M)] = auto
                owners[("autopipe", M)] = full

        keys = [k for k in steps if k[0] in ("plain", *args.variants)]
        times: dict[tuple[str, int], list[float]] = {k: [] for k in keys}
        for rep in range(args.warmup + args.steps):
            order = keys[rep % len(keys):] + keys[: rep % len(keys)]  # rotate: no fixed neighbour
            for k in order:
                dist.barrier()
                t0 = time.perf_counter()
                steps[k]()
                dist.barrier()
                dt = time.perf_counter() - t0
                if rep >= args.warmup:
                    times[k].append(dt)
            if rank == 0 and args.verbose:
                print(f"  rep {rep} done", flush=True)

        # Gradient check: every pipelined variant's last step against the plain
        # model's, on this rank's half. Loss is a mean, so p2p weights micro-batch
        # losses by size/B and pipelining divides gradients by M (scale_grads).
        plain.zero_grad(set_to_none=True)
        loss_fn(plain(x), y).backward()
        ref = dict(plain.named_parameters())
        gdiff = {}
        for k, full in owners.items():
            if k not in keys:
                continue
            steps[k]()
            mine = [(n, p) for n, p in full.named_parameters() if p.grad is not None]
            mx = max((p.grad - ref[n].grad).abs().max().item() for n, p in mine)
            scale = max(ref[n].grad.abs().max().item() for n, _ in mine)
            gdiff[k] = (mx, scale, len(mine))
        ping = _pingpong(rank) if args.pingpong else {}
        q.put((rank, {k: statistics.median(v) for k, v in times.items()}, gdiff, ping))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        q.put((rank, "error", traceback.format_exc(), None))
        raise


def bench(args):
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    world = 2
    procs = [ctx.Process(target=_bench_worker, args=(r, world, args.port, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(world):
        rank, t, gdiff, ping = q.get()
        if t == "error":
            print(f"rank {rank} failed:\n{gdiff}")
            for p in procs:
                p.kill()
            sys.exit(1)
        results[rank] = (t, gdiff, ping)
    for p in procs:
        p.join()

    t0, gd0, ping = results[0]
    _, gd1, _ = results[1]
    plain = t0[("plain", 0)]
    variants = [v for v in ("1p xM", "2p compute", "p2p", "p2p-batch", "pipelining", "autopipe")
                if any(k[0] == v for k in t0)]
    model_desc = (
        f"SleepModel(d={args.d}, blocks={args.blocks}, {args.sleep:g} s of sleep per plain step)"
        if args.sleep
        else f"transformer_like(d={args.d}, hidden={args.hidden}, blocks={args.blocks})"
    )
    print(
        f"{model_desc}, batch {args.batch}, "
        f"2 gloo processes x 1 thread, split at block {args.blocks // 2}; median of {args.steps} steps "
        f"after {args.warmup} warm-up, variants interleaved (shared machine: compare within this run)"
    )
    print(f"plain 1-process 1-thread step: {plain:.3f} s")
    head = f"{'M':>3} {'plain s':>8} | " + " | ".join(f"{v:>17}" for v in variants) + f" | {'ideal':>5}"
    print(head)
    print(f"{'':>3} {'':>8} | " + " | ".join(f"{'s/step  speedup':>17}" for _ in variants) + " |")
    for M in args.chunks:
        cells = []
        for v in variants:
            s = t0.get((v, M))
            cells.append(f"{s:7.3f}  {plain / s:6.2f}x" if s else f"{'-':>17}")
        print(f"{M:>3} {plain:8.3f} | " + " | ".join(f"{c:>17}" for c in cells) + f" | {2 * M / (M + 1):5.2f}")
    print("(1p xM: one process running M micro-batches; its 'speedup' < 1 is the micro-batching cost)")
    print("(2p compute: each process runs its half on M micro-batches with no communication and no bubble)")
    print("against the ideal 2M/(M+1): speedup over plain / ideal; the pipeline alone = (t(1p xM) / t) / ideal;")
    print("schedule + transport = t(2p compute) * (M+1)/M / t, i.e. 1.00 when only GPipe's bubble is lost")
    for M in args.chunks:
        ideal = 2 * M / (M + 1)
        cells = []
        for v in ("pipelining", "autopipe"):
            s, one, both = t0.get((v, M)), t0.get(("1p xM", M)), t0.get(("2p compute", M))
            if s:
                alone = f"{one / s / ideal:.2f}" if one else "-"
                transport = f"{both * (M + 1) / M / s:.2f}" if both else "-"
                cells.append(f"{v}: {plain / s / ideal:.2f}, alone {alone}, schedule+transport {transport}")
        print(f"  M={M:<3} " + "   |   ".join(cells))
    print("gradients vs the plain model: max |diff| / max |grad| over the parameters each rank owns")
    for k in sorted(gd0, key=lambda k: (k[0], k[1])):
        a, sa, na = gd0[k]
        b, sb, nb = gd1[k]
        print(f"  {k[0]:<11} M={k[1]:<3} rank 0 ({na} params) {a:.2e} / {sa:.2e} | rank 1 ({nb} params) {b:.2e} / {sb:.2e}")
    if ping:
        print("ping-pong round trip (rank 0 -> 1 -> 0), median, microseconds:")
        for nbytes in sorted({k[0] for k in ping}):
            print(
                f"  {nbytes:>8} B: "
                + "  ".join(f"{m} {ping[(nbytes, m)] * 1e6:8.1f}" for m in ("pg", "isend", "batch"))
            )


# ---------------------------------------------------------------------------
# --check: 3 ranks, skip connection, several tensors per cut, uneven split
# ---------------------------------------------------------------------------
class _SkipModel(nn.Module):
    """x -> a -> (h, skip, idx); h,idx -> b -> h2; (h2, skip, w) -> c,d -> out.
    'skip' goes from rank 0 to rank 2 directly; 'h' goes to ranks 1 and 2."""

    def __init__(self, d=16):
        super().__init__()
        self.a = nn.Linear(d, 2 * d)
        self.b = nn.Linear(2 * d, d)
        self.c = nn.Linear(d, d)
        self.e = nn.Linear(2 * d, d)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)

    def parts(self, x):
        h = torch.tanh(self.a(x))
        skip = h[:, : h.shape[1] // 2] * 2
        idx = (x[:, :1] > 0).long()
        return h, skip, idx

    def forward(self, x, w):
        h, skip, idx = self.parts(x)
        h2 = torch.tanh(self.b(h)) + idx
        return self.c(h2) + skip * w + self.e(h)


class _S0(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.a = m.a

    def forward(self, x):
        return _SkipModel.parts(self, x)


class _S1(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.b = m.b

    def forward(self, h, idx):
        return torch.tanh(self.b(h)) + idx


class _S2(nn.Module):
    def __init__(self, m):
        super().__init__()
        self.c, self.e = m.c, m.e

    def forward(self, h2, skip, w, h):
        return self.c(h2) + skip * w + self.e(h)


def _check_worker(rank, world, port, q):
    try:
        _init(rank, world, port)
        B, M, d = 13, 4, 16  # uneven: 4, 3, 3, 3
        spec = p2p.PipeSpec(
            edges=[
                p2p.Edge("h", 0, (1, 2), (4, 2 * d)),
                p2p.Edge("skip", 0, (2,), (4, d)),
                p2p.Edge("idx", 0, (1,), (4, 1), torch.int64),
                p2p.Edge("h2", 1, (2,), (4, d)),
            ],
            stage_inputs=[("x",), ("h", "idx"), ("h2", "skip", "w", "h")],
            stage_outputs=[("h", "skip", "idx"), ("h2",), ("out",)],
            batch_size=B,
            chunks=M,
        )
        g = torch.Generator().manual_seed(1)
        x, w, y = (torch.randn(B, d, generator=g) for _ in range(3))
        m = _SkipModel(d)
        st = [_S0, _S1, _S2][rank](m)
        out = []
        for ops in ("pg", "isend", "batch"):
            pipe = p2p.P2PGPipe(st, spec, ops=ops, name=f"check_{ops}")
            for _ in range(2):  # twice: buffers are reused across steps
                st.zero_grad(set_to_none=True)
                loss = pipe.step(
                    {"x": x} if rank == 0 else ({"w": w} if rank == 2 else None), target=y, loss_fn=F.mse_loss
                )
            ref = _SkipModel(d)
            lref = F.mse_loss(ref(x, w), y)
            lref.backward()
            rp = dict(ref.named_parameters())
            gd = max((p.grad - rp[n].grad).abs().max().item() for n, p in st.named_parameters())
            ld = None if loss is None else abs(loss.item() - lref.item())
            out.append((ops, gd, ld))
            pipe.close()
        q.put((rank, out))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        q.put((rank, traceback.format_exc()))
        raise


def check(args):
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=_check_worker, args=(r, 3, args.port + 1, q)) for r in range(3)]
    [p.start() for p in procs]
    res = dict(q.get() for _ in range(3))
    [p.join() for p in procs]
    ok = True
    for r in range(3):
        if isinstance(res[r], str):
            print(f"rank {r} failed:\n{res[r]}")
            ok = False
            continue
        for ops, gd, ld in res[r]:
            good = gd < 1e-5 and (ld is None or ld < 1e-5)
            ok &= good
            print(f"rank {r} ops={ops:<6} max|grad - ref| {gd:.1e}" + ("" if ld is None else f"  |loss - ref| {ld:.1e}")
                  + ("" if good else "  MISMATCH"))
    print("check:", "OK" if ok else "FAILED")
    return ok


# ---------------------------------------------------------------------------
# --failures: inject a failure on one rank, time how long each rank takes to error
# ---------------------------------------------------------------------------
SCENARIOS = {
    # name: (failing rank, phase, micro-batch, action)
    "raise-fwd-r1": (1, "fwd", 3, "raise"),
    "raise-loss-r2": (2, "loss", 5, "raise"),
    "raise-bwd-r0": (0, "bwd", 2, "raise"),
    "sigkill-r1": (1, "fwd", 3, "kill"),
    "sigkill-r2-bwd": (2, "bwd", 4, "kill"),
    "sigkill-r0 (store host)": (0, "fwd", 5, "kill"),
    "hang-r1": (1, "fwd", 3, "hang"),
    "no-target-r2": (2, "args", 0, "noarg"),  # a usage error: step() without target=
}


class _Inject(nn.Module):
    """Wraps a stage; fires the scenario's action at the chosen micro-batch."""

    def __init__(self, inner, action, phase, mb, t_inject):
        super().__init__()
        self.inner, self.action, self.phase, self.mb, self.t_inject = inner, action, phase, mb, t_inject
        self.calls = 0
        self.armed = False  # armed after a first good step

    def fire(self):
        self.t_inject.value = time.time()
        if self.action == "raise":
            raise ValueError(f"injected failure ({self.phase}, micro-batch {self.mb})")
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.action == "hang":
            time.sleep(3600)

    def forward(self, *a):
        i = self.calls
        self.calls += 1
        if self.armed and self.phase == "fwd" and i == self.mb:
            self.fire()
        out = self.inner(*a)
        if self.armed and self.phase == "bwd" and i == self.mb:
            out = _BwdHook.apply(out, self)
        return out


class _BwdHook(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, inj):
        ctx.inj = inj
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.inj.fire()
        return g, None


def _failure_worker(rank, world, port, scenario, timeout_s, t_inject, q):
    fr, phase, mb, action = SCENARIOS[scenario]
    _init(rank, world, port, timeout_s=60)
    B, M, d = 512, 8, 256
    m = transformer_like(d, 1024, 6, seed=0)
    k = [0, 2, 4, 6]
    proj_or_none = [m.proj, None, None]

    class St(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre = proj_or_none[rank]
            self.blocks = nn.ModuleList(m.blocks[k[rank]:k[rank + 1]])
            self.post = nn.Sequential(m.norm, m.head) if rank == world - 1 else None

        def forward(self, h):
            if self.pre is not None:
                h = self.pre(h)
            for b in self.blocks:
                h = b(h)
            return self.post(h) if self.post is not None else h

    st = St()
    mb_shape = (B // M, d)
    spec = p2p.PipeSpec(
        edges=[p2p.Edge("h1", 0, (1,), mb_shape), p2p.Edge("h2", 1, (2,), mb_shape)],
        stage_inputs=[("x",), ("h1",), ("h2",)],
        stage_outputs=[("h1",), ("h2",), ("out",)],
        batch_size=B,
        chunks=M,
    )
    loss_fn = F.mse_loss
    if rank == fr and phase in ("fwd", "bwd"):
        st = _Inject(st, action, phase, mb, t_inject)
    armed = [False]
    if rank == fr and phase == "loss":
        calls = [0]

        def loss_fn(o, t):  # noqa: F811
            if armed[0] and calls[0] == mb:
                t_inject.value = time.time()
                raise ValueError(f"injected failure (loss, micro-batch {mb})")
            calls[0] += 1
            return F.mse_loss(o, t)

    pipe = p2p.P2PGPipe(st, spec, timeout=timeout_s)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(B, d, generator=g), torch.randn(B, d, generator=g)
    try:
        pipe.step({"x": x} if rank == 0 else None, target=y, loss_fn=F.mse_loss)  # a good step first
        if isinstance(st, _Inject):
            st.calls, st.armed = 0, True
        armed[0] = True
        dist.barrier()
        tgt = y
        if rank == fr and action == "noarg":
            tgt = None
            t_inject.value = time.time()
        pipe.step({"x": x} if rank == 0 else None, target=tgt, loss_fn=loss_fn)
        q.put((rank, "no error", "", time.time(), 0.0))
    except Exception as e:  # noqa: BLE001
        t_err = time.time()
        t0 = time.time()
        try:  # can the process group be torn down after the failure?
            dist.destroy_process_group()
            td = time.time() - t0
        except Exception:  # noqa: BLE001
            td = -1.0
        q.put((rank, type(e).__name__, str(e), t_err, td))
    time.sleep(1.0)  # like a real rank printing its traceback; rank 0 hosts the store
    os._exit(0)


def failures(args):
    ctx = mp.get_context("spawn")
    print(
        "3 ranks, transformer_like(256, 1024, 6) 2 blocks/rank, batch 512, M=8 (~0.1 s/step/rank); "
        f"P2PGPipe(timeout={args.fail_timeout:g} s). Detection = time from the injected failure "
        "to the PipelineError on each rank; teardown = dist.destroy_process_group() after it."
    )
    for i, scen in enumerate(SCENARIOS):
        q = ctx.SimpleQueue()
        t_inject = ctx.Value("d", 0.0)
        procs = [
            ctx.Process(target=_failure_worker, args=(r, 3, args.port + 10 + i, scen, args.fail_timeout, t_inject, q))
            for r in range(3)
        ]
        [p.start() for p in procs]
        fr, _, _, action = SCENARIOS[scen]
        expect = 3 - (1 if action in ("kill", "hang") else 0)
        got = {}
        deadline = time.time() + 60 + args.fail_timeout
        while len(got) < expect and time.time() < deadline:
            if not q.empty():
                r, kind, msg, t_err, td = q.get()
                got[r] = (kind, msg, t_err, td)
            else:
                time.sleep(0.01)
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        print(f"\n[{scen}] failing rank {fr}")
        for r in range(3):
            if r not in got:
                print(f"  rank {r}: no report ({'expected: it was killed/hung' if r == fr else 'HUNG'})")
                continue
            kind, msg, t_err, td = got[r]
            det = t_err - t_inject.value if t_inject.value else float("nan")
            print(f"  rank {r}: {kind} after {det * 1e3:8.1f} ms, teardown {td * 1e3:6.1f} ms: {msg[:300]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="3-rank correctness check only")
    ap.add_argument("--failures", action="store_true", help="failure-detection scenarios only")
    ap.add_argument("--fail-timeout", type=float, default=5.0, help="P2PGPipe timeout for --failures")
    ap.add_argument(
        "--sleep",
        type=float,
        default=0.0,
        metavar="S",
        help="replace the blocks' compute by sleeping S s per plain step (1/3 forward, 2/3 "
        "backward): measures schedule + transport overhead without CPU contention",
    )
    ap.add_argument("--batch", type=int, default=4096)
    ap.add_argument("--d", type=int, default=512)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--chunks", type=int, nargs="+", default=[4, 8, 32])
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["1p xM", "2p compute", "p2p", "p2p-batch", "pipelining", "autopipe"],
        help="rows to time besides plain (names as in the table)",
    )
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-pingpong", dest="pingpong", action="store_false")
    ap.add_argument("--port", type=int, default=29700)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args()
    if args.check:
        sys.exit(0 if check(args) else 1)
    if args.failures:
        failures(args)
        return
    bench(args)


if __name__ == "__main__":
    main()
