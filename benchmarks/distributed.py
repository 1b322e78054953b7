"""GPipe and 1F1B over torch.distributed on CPU (gloo): plain vs autopipe vs torch.distributed.pipelining.

    python -m benchmarks.distributed                 # the side-by-side table (2 processes)
    python -m benchmarks.distributed --quick         # tiny sizes, one step: a smoke test, not a measurement
    python -m benchmarks.distributed --sleep 1.2     # blocks sleep instead of computing: the
                                                     # schedules and transports alone, CPU-free
    python -m benchmarks.distributed --mesh          # 2D: pp=2 x dp_shard=2 over FSDP2, 4 processes
    python -m benchmarks.distributed --mesh --quick  # its smoke test

Correctness and failure handling of the torchrun runtime are tests, not
benchmark modes: tests/runtime/test_distributed.py (gradients equal the
in-process pipeline's, data parallel, meta models) and tests/runtime/test_p2p.py
(a rank raising, SIGKILLed or hanging past ``timeout`` ends every rank with a
PipelineError naming it; the wire spec sends a skip straight to its reader).

One run, 2 processes spawned on 127.0.0.1 with gloo, ``torch.set_num_threads(1)``
in every process, ``transformer_like(blocks=4)`` (zoo/models.py), batch
4096 (128 rows per micro-batch at M=32: the size at which one process runs 32
micro-batches no slower than the whole batch on this CPU; at batch 1024 it runs
them 0.81x as fast, and no pipeline can hide that), no checkpointing, split at
the middle block. Variants, interleaved step by step
(order rotated every repetition), median over ``--steps`` steps after warm-up:

- plain:           one process, one thread, the whole batch at once (rank 1 idles)
- 1p xM:           one process running the batch as M micro-batches (the cost of
                   micro-batching alone, no pipeline)
- 2p compute:      both processes run their half on M micro-batches at once, with no
                   communication and no waiting: what two busy cores can do at best
- pipelining:      torch.distributed.pipelining ScheduleGPipe + PipelineStage, the
                   split written by hand (shapes inferred at the warm-up step)
- pipelining 1f1b: the same split under torch.distributed.pipelining's Schedule1F1B
- autopipe:        autopipe.compile(model, chunks=M) under the same process group
                   (autopipe.runtime.distributed.DistributedPipeline): its own split
- autopipe 1f1b:   the same with schedule="1f1b"

``--mesh``: 4 gloo processes as a DeviceMesh pp=2 x dp_shard=2, the same model and hand split, 1F1B, AdamW, each
data-parallel rank its half of the batch. Rows: autopipe.compile(model, chunks=M, mesh=mesh) against
torch.distributed.pipelining's Schedule1F1B over PipelineStage with FSDP2's fully_shard(stage, mesh=mesh["dp_shard"],
reshard_after_forward=False) (pipelining drives FSDP2 itself): the median step time (forward, backward, optimizer),
the bytes each rank holds between steps of parameters, gradients and AdamW state (its FSDP2 shards), the peak
anonymous memory a step adds (parameters gathered, gradients, activations), and the bytes a rank hands to
point-to-point sends and to collectives per step.

Speedups are plain / variant; "ideal" is 2M/(M+1) (GPipe's bubble, 2 stages; 1F1B
has the same bubble and keeps fewer micro-batches in flight).
The machine is shared: compare rows of one run, never runs with each other.
"""

from __future__ import annotations

import argparse
import os
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

from zoo import transformer_like  # noqa: E402

VARIANTS = ("1p xM", "2p compute", "pipelining", "pipelining 1f1b", "autopipe", "autopipe 1f1b")


# ---------------------------------------------------------------------------
# the hand-written split (torch.distributed.pipelining's rows)
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



def make_autopipe_step(model, x, y, chunks, schedule):
    """One training step (forward + backward, no optimizer step) of ``model`` through autopipe
    on this rank: ``autopipe.compile`` under torch.distributed builds a DistributedPipeline
    (one stage per rank, its own split). ``model`` is this variant's own full-size copy."""
    import autopipe

    # a SleepBlock sleeps for a time computed from its batch size, which no tracer can capture: keep it whole
    leaf = (SleepBlock,) if isinstance(model, SleepModel) else ()
    pipe = autopipe.compile(model, chunks=chunks, checkpoint="never", schedule=schedule, leaf_modules=leaf,
                            example_inputs=(x,))
    if getattr(pipe, "schedule_name", schedule) != schedule:
        # autopipe.compile did not hand schedule= to the torchrun runtime: set it on the pipeline,
        # which reads it at every step (and say so, so the table is not silently mislabelled)
        if dist.get_rank() == 0:
            print(f"note: autopipe.compile(schedule={schedule!r}) under torchrun gave schedule "
                  f"{pipe.schedule_name!r}; set pipe.schedule_name = {schedule!r}", file=sys.stderr, flush=True)
        pipe.schedule_name = schedule

    def step():
        pipe.zero_grad()  # as the other rows: each step's gradients alone
        return pipe.step(x, target=y, loss_fn=F.mse_loss)
    return step, pipe


# ---------------------------------------------------------------------------
# the timing run
# ---------------------------------------------------------------------------
def _init(rank, world, port, timeout_s=120.0):
    """torchrun's environment contract (autopipe.compile reads WORLD_SIZE to plan one stage per rank)."""
    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


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
    pipes = []
    try:
        _init(rank, world, port)
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        B, d, Ms = args.batch, args.d, args.chunks
        g = torch.Generator().manual_seed(1)
        x = torch.randn(B, d, generator=g)
        y = torch.randn(B, d, generator=g)
        wanted = set(args.variants)

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

            for name, schedule_cls in (("pipelining", ScheduleGPipe), ("pipelining 1f1b", Schedule1F1B)):
                if name not in wanted:
                    continue
                full = build()
                st = half(full, rank)
                # As the docs' examples write it: shapes inferred at the first step
                # (a warm-up step), nothing else passed.
                stage = PipelineStage(st, rank, world, torch.device("cpu"))
                sched = schedule_cls(stage, n_microbatches=M, loss_fn=F.mse_loss)

                def pp_step(st=st, sched=sched):
                    st.zero_grad(set_to_none=True)
                    if rank == 0:
                        sched.step(x)
                    else:
                        sched.step(target=y, losses=[])

                steps[(name, M)] = pp_step
                owners[(name, M)] = full

            for name, schedule in (("autopipe", "gpipe"), ("autopipe 1f1b", "1f1b")):
                if name not in wanted:
                    continue
                full = build()
                steps[(name, M)], pipe = make_autopipe_step(full, x, y, M, schedule)
                owners[(name, M)] = full
                pipes.append(pipe)

        keys = [k for k in steps if k[0] == "plain" or k[0] in wanted]
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

        # Gradient check: every pipelined variant's last step against the plain model's, on
        # this rank's half. The loss is a mean, so autopipe weights micro-batch losses by
        # size/B and pipelining divides gradients by M (scale_grads).
        plain.zero_grad(set_to_none=True)
        loss_fn(plain(x), y).backward()
        ref = dict(plain.named_parameters())
        gdiff = {}
        for k, full in owners.items():
            steps[k]()
            mine = [(n, p) for n, p in full.named_parameters() if p.grad is not None]
            mx = max((p.grad - ref[n].grad).abs().max().item() for n, p in mine)
            scale = max(ref[n].grad.abs().max().item() for n, _ in mine)
            gdiff[k] = (mx, scale, len(mine))
        ping = _pingpong(rank) if args.pingpong else {}
        q.put((rank, {k: statistics.median(v) for k, v in times.items()}, gdiff, ping))
        for pipe in pipes:
            pipe.close()
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        q.put((rank, "error", traceback.format_exc(), None))
        raise


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench(args):
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    world = 2
    port = args.port or _free_port()
    procs = [ctx.Process(target=_bench_worker, args=(r, world, port, args, q)) for r in range(world)]
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
    variants = [v for v in VARIANTS if any(k[0] == v for k in t0)]
    model_desc = (
        f"SleepModel(d={args.d}, blocks={args.blocks}, {args.sleep:g} s of sleep per plain step)"
        if args.sleep
        else f"transformer_like(d={args.d}, hidden={args.hidden}, blocks={args.blocks})"
    )
    if args.quick:
        print("--quick: tiny sizes, a smoke test, NOT a measurement")
    print(
        f"{model_desc}, batch {args.batch}, "
        f"2 gloo processes x 1 thread, hand split at block {args.blocks // 2}; median of {args.steps} steps "
        f"after {args.warmup} warm-up, variants interleaved (shared machine: compare within this run)"
    )
    print(f"plain 1-process 1-thread step: {plain:.3f} s")
    w = 17
    head = f"{'M':>3} {'plain s':>8} | " + " | ".join(f"{v:>{w}}" for v in variants) + f" | {'ideal':>5}"
    print(head)
    print(f"{'':>3} {'':>8} | " + " | ".join(f"{'s/step  speedup':>{w}}" for _ in variants) + " |")
    for M in args.chunks:
        cells = []
        for v in variants:
            s = t0.get((v, M))
            cells.append(f"{s:7.3f}  {plain / s:6.2f}x" if s else f"{'-':>{w}}")
        print(f"{M:>3} {plain:8.3f} | " + " | ".join(f"{c:>{w}}" for c in cells) + f" | {2 * M / (M + 1):5.2f}")
    print("(1p xM: one process running M micro-batches; its 'speedup' < 1 is the micro-batching cost)")
    print("(2p compute: each process runs its half on M micro-batches with no communication and no bubble)")
    print("against the ideal 2M/(M+1): speedup over plain / ideal; the pipeline alone = (t(1p xM) / t) / ideal;")
    print("schedule + transport = t(2p compute) * (M+1)/M / t, i.e. 1.00 when only the bubble is lost")
    pipelined = [v for v in variants if v.startswith(("pipelining", "autopipe"))]
    for M in args.chunks:
        ideal = 2 * M / (M + 1)
        one, both = t0.get(("1p xM", M)), t0.get(("2p compute", M))
        for v in pipelined:
            s = t0.get((v, M))
            if not s:
                continue
            alone = f"{one / s / ideal:.2f}" if one else "-"
            transport = f"{both * (M + 1) / M / s:.2f}" if both else "-"
            print(f"  M={M:<3} {v:<16} {plain / s / ideal:.2f} of ideal, alone {alone}, schedule+transport {transport}")
    print("gradients vs the plain model: max |diff| / max |grad| over the parameters each rank owns")
    for k in sorted(gd0, key=lambda k: (k[0], k[1])):
        a, sa, na = gd0[k]
        b, sb, nb = gd1[k]
        print(f"  {k[0]:<16} M={k[1]:<3} rank 0 ({na} params) {a:.2e} / {sa:.2e} | rank 1 ({nb} params) {b:.2e} / {sb:.2e}")
    if ping:
        print("ping-pong round trip (rank 0 -> 1 -> 0), median, microseconds:")
        for nbytes in sorted({k[0] for k in ping}):
            print(
                f"  {nbytes:>8} B: "
                + "  ".join(f"{m} {ping[(nbytes, m)] * 1e6:8.1f}" for m in ("pg", "isend", "batch"))
            )


# ---------------------------------------------------------------------------
# --mesh: pp=2 x dp_shard=2 (FSDP2), 4 processes
# ---------------------------------------------------------------------------
MESH_VARIANTS = ("autopipe 2D", "pipelining 2D")


class _Counted:
    """Bytes this rank hands to point-to-point sends and to collectives, while ``on``."""

    def __init__(self):
        self.on, self.p2p, self.collective = False, 0, 0
        from autopipe.runtime.p2p import P2PTransport
        post = P2PTransport._post

        def counted_post(transport, send, tensor, peer, tag, what):
            if self.on and send:
                self.p2p += tensor.numel() * tensor.element_size()
            return post(transport, send, tensor, peer, tag, what)
        P2PTransport._post = counted_post
        import torch.distributed.pipelining.schedules as schedules
        batch = schedules._batch_p2p  # every send of pipelining's schedules goes through it

        def counted_batch(ops, *args, **kwargs):
            if self.on:
                self.p2p += sum(op.tensor.numel() * op.tensor.element_size() for op in ops if op.op is dist.isend)
            return batch(ops, *args, **kwargs)
        schedules._batch_p2p = counted_batch
        for name in ("all_gather_single", "reduce_scatter_single", "all_reduce"):
            original = getattr(dist, name)

            def collective(*a, _original=original, **k):
                if self.on and a:
                    t = a[1] if len(a) > 1 and isinstance(a[1], torch.Tensor) else a[0]  # (output, input) or tensor
                    self.collective += t.numel() * t.element_size()
                return _original(*a, **k)
            setattr(dist, name, collective)


def _held_bytes(params, opt) -> tuple[int, int, int]:
    """This rank's bytes of parameters, gradients and optimizer state (local FSDP2 shards)."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    size = lambda ts: sum(local(t).numel() * local(t).element_size() for t in ts)  # noqa: E731
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    return size(params), size(p.grad for p in params if p.grad is not None), size(state)


def _anonymous_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def _sample_peak(peak: list, done) -> None:
    while not done.is_set():
        peak[0] = max(peak[0], _anonymous_bytes())
        time.sleep(0.001)


def _mesh_worker(rank, world, port, args, q):
    import threading

    try:
        _init(rank, world, port)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        import autopipe

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp_shard"))
        pp, dp = mesh["pp"].get_local_rank(), mesh["dp_shard"].get_local_rank()
        B, M = args.batch, args.chunks[0]
        g = torch.Generator().manual_seed(1)
        x, y = torch.randn(B, args.d, generator=g), torch.randn(B, args.d, generator=g)
        x, y = x.chunk(2)[dp], y.chunk(2)[dp]  # this data-parallel rank's half
        counted, rows = _Counted(), {}
        for name in [v for v in MESH_VARIANTS if v in args.mesh_variants]:
            model = transformer_like(args.d, args.hidden, args.blocks, seed=0)
            if name == "autopipe 2D":
                pipe = autopipe.compile(model, chunks=M, mesh=mesh, schedule="1f1b", checkpoint="never",
                                        example_inputs=(x,))
                params = list(pipe.parameters())

                def run(pipe=pipe):
                    return pipe.step(x, target=y, loss_fn=F.mse_loss)
            else:
                st = half(model, pp)
                fully_shard(st, mesh=mesh["dp_shard"], reshard_after_forward=False)
                stage = PipelineStage(st, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
                sched = Schedule1F1B(stage, n_microbatches=M, loss_fn=F.mse_loss)
                params = list(st.parameters())

                def run(sched=sched):
                    losses = []
                    sched.step(x) if pp == 0 else sched.step(target=y, losses=losses)
                    return sum(losses) / len(losses) if losses else None
            opt = torch.optim.AdamW(params, lr=1e-3)
            times, peaks, sent = [], [], (0, 0)
            for rep in range(args.warmup + args.steps):
                dist.barrier()
                counted.on, counted.p2p, counted.collective = rep >= args.warmup, 0, 0
                base, peak, done = _anonymous_bytes(), [0], threading.Event()
                sampler = threading.Thread(target=_sample_peak, args=(peak, done))
                sampler.start()
                t0 = time.perf_counter()
                loss = run()
                opt.step()
                dist.barrier()
                dt = time.perf_counter() - t0
                done.set()
                sampler.join()
                counted.on = False
                if rep >= args.warmup:
                    times.append(dt)
                    peaks.append(max(peak[0] - base, 0))
                    sent = (counted.p2p, counted.collective)
                held = _held_bytes(params, opt)
                opt.zero_grad()
            rows[name] = {"s": statistics.median(times), "held": held, "peak": max(peaks), "sent": sent,
                          "loss": None if loss is None else float(loss.detach())}
            if name == "autopipe 2D":
                pipe.close()
        q.put((rank, rows, (pp, dp), None))
        dist.barrier()
        dist.destroy_process_group()
    except Exception:
        q.put((rank, "error", traceback.format_exc(), None))
        raise


def bench_mesh(args):
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    world, port = 4, args.port or _free_port()
    procs = [ctx.Process(target=_mesh_worker, args=(r, world, port, args, q)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    for _ in range(world):
        rank, rows, where, _ = q.get()
        if rows == "error":
            print(f"rank {rank} failed:\n{where}")
            for p in procs:
                p.kill()
            sys.exit(1)
        results[rank] = (rows, where)
    for p in procs:
        p.join()
    if args.quick:
        print("--quick: tiny sizes, a smoke test, NOT a measurement")
    print(f"transformer_like(d={args.d}, hidden={args.hidden}, blocks={args.blocks}) float32, batch {args.batch} "
          f"(each dp rank half), M={args.chunks[0]}, 1F1B, AdamW; 4 gloo processes x 1 thread as pp=2 x dp_shard=2; "
          f"hand split at block {args.blocks // 2} for pipelining; median of {args.steps} steps after {args.warmup} "
          f"warm-up (shared machine: compare within this run)")
    mib = lambda b: f"{b / 2**20:7.2f}"  # noqa: E731
    print(f"{'variant':<14} {'rank':>4} {'(pp,dp)':>7} {'s/step':>7} | held between steps, MiB: {'params':>7} "
          f"{'grads':>7} {'adam':>7} | {'step peak':>9} | sent per step, MiB: {'p2p':>7} {'collect.':>8} | loss")
    for name in MESH_VARIANTS:
        for rank in range(world):
            rows, where = results[rank]
            if name not in rows:
                continue
            r = rows[name]
            loss = "-" if r["loss"] is None else f"{r['loss']:.6f}"
            print(f"{name:<14} {rank:>4} {str(where):>7} {r['s']:7.3f} | {'':>25}{mib(r['held'][0])} "
                  f"{mib(r['held'][1])} {mib(r['held'][2])} | {mib(r['peak']):>9} | {'':>19}{mib(r['sent'][0])} "
                  f"{mib(r['sent'][1]):>8} | {loss}")
    print("(held: each rank's FSDP2 shards after a step, before zero_grad; step peak: anonymous memory a step adds "
          "over its start, sampled every 1 ms; sent: bytes handed to p2p sends and to all-gather / reduce-scatter / "
          "all-reduce inputs)")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="tiny sizes (d=64, hidden=128, batch 256, M=4), one step, no ping-pong: a smoke test")
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
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS, metavar="VARIANT",
                    help=f"rows to time besides plain (default: all of {', '.join(VARIANTS)})")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--no-pingpong", dest="pingpong", action="store_false")
    ap.add_argument("--port", type=int, default=None, help="rendezvous port on 127.0.0.1 (default: a free one)")
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--mesh", action="store_true", help="the 2D rows: pp=2 x dp_shard=2 over FSDP2, 4 processes")
    ap.add_argument("--mesh-variants", nargs="+", default=list(MESH_VARIANTS), choices=MESH_VARIANTS)
    args = ap.parse_args(argv)
    if args.quick:
        args.d, args.hidden, args.batch, args.chunks = 64, 128, 256, [4]
        args.steps, args.warmup, args.pingpong = 1, 1, False
    if args.mesh:
        bench_mesh(args)
    else:
        bench(args)


if __name__ == "__main__":
    main()
