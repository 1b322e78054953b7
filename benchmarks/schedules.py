"""Schedules side by side: GPipe, 1F1B, interleaved 1F1B (v=2), the zero-bubble zb-h1 and zbv (Qi et al.,
ICLR 2024) and DualPipeV (DeepSeek-V3's DualPipe in zbv's V), autopipe vs torch.distributed.pipelining.

    python benchmarks/schedules.py                        # K=2, M=8, all six (~6 min on 2 cores)
    python benchmarks/schedules.py --schedules zb-h1 zbv  # some of them
    python benchmarks/schedules.py --quick                # tiny smoke test, not a measurement

One model (zoo.transformer_like), one intra-op thread per
device, checkpoint="never", float32, MSE loss. Rows, per schedule:

- autopipe, in-process: ``autopipe.compile(model, devices=2, schedule=...)``, two CPU worker threads;
- autopipe, 2 procs:   the same call under 2 gloo processes (torchrun's environment), its own split;
- pipelining, 2 procs: torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B /
  ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble (one stage per rank: ZB-H1) /
  ScheduleZBVZeroBubble / ScheduleDualPipeV on a split written by hand (2 pieces, or 4: rank r holds
  pieces r and r+2 for interleaved, r and 3-r in the V of zbv and dualpipev), shapes inferred at a
  warm-up step, as its docs show. Its rows are named by class. autopipe cuts its own stages (2K of
  them in the V).

Step time: median of ``--steps`` steps; within each part the variants run interleaved,
order rotated each round. Memory: the peak of activations autograd saves for backward
(bytes, each storage once, parameters excluded) per device, counted with one
``saved_tensors_hooks`` for every row in an extra untimed step: the memory a schedule
changes. "held" is the most micro-batches the first stage held at once (until its W frees
them where the backward is split), from autopipe's timeline. Minor page faults a step, per
rank (2 procs): getrusage's count across each timed step, its median; pages glibc's malloc had
handed back to the OS and the step wrote again, which cost the 2-process rows time at the
default allocator; a count the machine's load does not move. The gradient column is
max |g - g_plain| / max |g_plain| over the parameters each device holds, against the plain model.
"""
from __future__ import annotations

import os
import resource
import statistics
import sys
import threading
import time
import traceback
from collections import defaultdict
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

import autopipe  # noqa: E402
from benchmarks import _common as C  # noqa: E402
from zoo import transformer_like  # noqa: E402

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 2), ("dualpipev", 2))
PIPELINING = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
              "zb-h1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble",
              "dualpipev": "ScheduleDualPipeV"}
V_LAYOUT = ("zbv", "dualpipev")  # rank r holds pieces r and 2K-1-r
K = 2


class SavedPeak:
    """Peak bytes of tensors saved for backward per device, each storage counted once while autograd holds it."""

    def __init__(self, model: nn.Module, device_of=lambda: 0):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.device_of = device_of
        self.lock = threading.Lock()
        self.live: dict[int, list] = {}     # storage -> [bytes, references, device]
        self.now: dict[int, int] = defaultdict(int)
        self.peak: dict[int, int] = defaultdict(int)
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda held: held.tensor)

    def __enter__(self):
        self.hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self.hooks.__exit__(*exc)

    def _pack(self, t: torch.Tensor):
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self.params and storage.nbytes():
            with self.lock:
                entry = self.live.get(key)
                if entry is None:
                    device = self.device_of()
                    self.live[key] = [storage.nbytes(), 1, device]
                    self.now[device] += storage.nbytes()
                    self.peak[device] = max(self.peak[device], self.now[device])
                else:
                    entry[1] += 1
            return _Held(self, key, t)
        return _Held(None, key, t)

    def release(self, key: int) -> None:
        with self.lock:
            entry = self.live[key]
            entry[1] -= 1
            if entry[1] == 0:
                self.now[entry[2]] -= entry[0]
                del self.live[key]


class _Held:
    __slots__ = ("owner", "key", "tensor")

    def __init__(self, owner, key, tensor):
        self.owner, self.key, self.tensor = owner, key, tensor

    def __del__(self):
        if self.owner is not None:
            self.owner.release(self.key)


def worker_device() -> int:
    name = threading.current_thread().name
    return int(name.removeprefix("autopipe-device")) if name.startswith("autopipe-device") else 0


def grad_error(model: nn.Module, reference: dict[str, torch.Tensor], names=None) -> float:
    mine = [(n, p.grad) for n, p in model.named_parameters() if p.grad is not None and (names is None or n in names)]
    scale = max(reference[n].abs().max().item() for n, _ in mine)
    return max((g - reference[n]).abs().max().item() for n, g in mine) / scale


def plain_grads(args, x, y) -> dict[str, torch.Tensor]:
    model = build(args)
    F.mse_loss(model(x), y).backward()
    return {n: p.grad for n, p in model.named_parameters()}


def build(args) -> nn.Module:
    return transformer_like(args.d, args.hidden, args.blocks, seed=0)


def data(args):
    g = torch.Generator().manual_seed(1)
    return torch.randn(args.batch, args.d, generator=g), torch.randn(args.batch, args.d, generator=g)


# -- in-process --------------------------------------------------------------------------------

def in_process(args) -> dict:
    x, y = data(args)
    plain = build(args)
    pipes, models = {}, {}
    for name, v in args.schedule_list:
        models[name] = build(args)
        pipes[name] = autopipe.compile(models[name], devices=K, chunks=args.chunks, checkpoint="never", schedule=name,
                                       virtual_stages=v, intra_op_threads=1, example_inputs=(x,))
    variants = {"plain": C.on_thread(lambda: F.mse_loss(plain(x), y).backward(), 1)}
    for name, pipe in pipes.items():
        variants[name] = lambda pipe=pipe: pipe.step(x, target=y, loss_fn=F.mse_loss)
    t = C.interleaved(variants, repeats=args.steps, warmup=1, label="in-process: ")
    reference = plain_grads(args, x, y)
    results = {"plain": t.median("plain")}
    for name, pipe in pipes.items():
        models[name].zero_grad()
        with SavedPeak(models[name], worker_device) as peak:
            pipe.step(x, target=y, loss_fn=F.mse_loss)
        results[name] = dict(seconds=t.median(name), peak=[peak.peak[d] for d in range(K)],
                             held=pipe.timeline.held(0), error=grad_error(models[name], reference),
                             stages=[pipe.schedule.stages_on(d) for d in range(K)])
        pipe.close()
    return results


# -- two processes -------------------------------------------------------------------------------

class Piece(nn.Module):
    """Blocks [lo, hi) of a TransformerLike, with the input projection first and the norm and head last."""

    def __init__(self, model: nn.Module, lo: int, hi: int):
        super().__init__()
        self.proj = model.proj if lo == 0 else None
        self.blocks = nn.ModuleList(model.blocks[lo:hi])
        self.norm, self.head = (model.norm, model.head) if hi == len(model.blocks) else (None, None)

    def forward(self, x):
        x = self.proj(x) if self.proj is not None else x
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)) if self.head is not None else x


def pipelining_step(model: nn.Module, rank: int, name: str, v: int, x, y, chunks: int):
    """torch.distributed.pipelining as its docs use it: the hand split, PipelineStage(s), the schedule class (for
    zbv and dualpipev the V by hand: rank r holds pieces r and 2K-1-r)."""
    from torch.distributed import pipelining

    n = K * v
    bounds = [round(len(model.blocks) * k / n) for k in range(n + 1)]
    mine = [rank, n - 1 - rank] if name in V_LAYOUT else list(range(rank, n, K))
    stages = [pipelining.PipelineStage(Piece(model, bounds[s], bounds[s + 1]), s, n, torch.device("cpu")) for s in mine]
    cls = getattr(pipelining, PIPELINING[name])
    multi = name in ("interleaved", "zb-h1", *V_LAYOUT)  # the classes that take a list of stages
    schedule = cls(stages if multi else stages[0], n_microbatches=chunks, loss_fn=F.mse_loss)
    names = {n for s in stages for n, _ in _full_names(model, s.submod)}

    def step():
        inputs = (x,) if 0 in mine else ()
        schedule.step(*inputs, **(dict(target=y, losses=[]) if n - 1 in mine else {}))
    return step, names


def _full_names(model: nn.Module, piece: nn.Module):
    ids = {id(p) for p in piece.parameters()}
    return [(n, p) for n, p in model.named_parameters() if id(p) in ids]


def rank_main(rank: int, k: int, port: int, args, queue) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(k), MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=k, timeout=timedelta(seconds=300))
        x, y = data(args)
        plain = build(args)
        steps, models, names, pipes = {}, {}, {}, {}

        def plain_step():
            if rank == 0:
                F.mse_loss(plain(x), y).backward()
        steps["plain"] = plain_step
        for name, v in args.schedule_list:
            models[("autopipe", name)] = model = build(args)
            pipe = autopipe.compile(model, chunks=args.chunks, checkpoint="never", schedule=name, virtual_stages=v,
                                    example_inputs=(x,))
            pipes[name] = pipe
            steps[("autopipe", name)] = lambda pipe=pipe: pipe.step(x, target=y, loss_fn=F.mse_loss)
            names[("autopipe", name)] = {n for n, _ in pipe.named_parameters()}
            models[("pipelining", name)] = model = build(args)
            steps[("pipelining", name)], names[("pipelining", name)] = pipelining_step(model, rank, name, v, x, y,
                                                                                       args.chunks)
        keys = list(steps)
        times, faults = {k: [] for k in keys}, {k: [] for k in keys}
        for rep in range(1 + args.steps):
            for k in keys[rep % len(keys):] + keys[:rep % len(keys)]:
                for m in models.values():
                    m.zero_grad(set_to_none=True)
                dist.barrier()
                start, faulted = time.perf_counter(), minor_faults()
                steps[k]()
                faulted = minor_faults() - faulted
                dist.barrier()
                if rep:
                    times[k].append(time.perf_counter() - start)
                    faults[k].append(faulted)
        reference = plain_grads(args, x, y)
        results = {"plain": statistics.median(times["plain"])}
        for k in keys[1:]:
            models[k].zero_grad(set_to_none=True)
            dist.barrier()
            with SavedPeak(models[k]) as peak:
                steps[k]()
            dist.barrier()
            results[k] = dict(seconds=statistics.median(times[k]), times=times[k], peak=peak.peak[0],
                              faults=statistics.median(faults[k]),
                              error=grad_error(models[k], reference, names[k]),
                              held=pipes[k[1]].timeline.held(0) if k[0] == "autopipe" and rank == 0 else None)
        queue.put((rank, results))
        for pipe in pipes.values():
            pipe.close()
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, traceback.format_exc()))
        raise


def minor_faults() -> int:
    """This process's minor page faults so far: a page the allocator had handed back to the OS, written again. A count
    the machine's load does not change, unlike the step's time."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def two_processes(args) -> list[dict]:
    return C.run_ranks(rank_main, K, args)


def main() -> None:
    p = C.parser(__doc__)
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 11, --quick 1)")
    p.add_argument("--schedules", nargs="+", choices=[name for name, _ in SCHEDULES],
                   default=[name for name, _ in SCHEDULES], help="which schedules to run (default: all)")
    args = p.parse_args()
    args.schedule_list = [(name, v) for name, v in SCHEDULES if name in args.schedules]
    args.chunks = 4 if args.quick else 8
    args.d, args.hidden, args.blocks, args.batch = (32, 64, 4, 32) if args.quick else (512, 2048, 8, 512)
    args.steps = args.steps or (1 if args.quick else 11)
    C.progress("in-process part")
    local = in_process(args)
    C.progress("2-process part")
    ranks = two_processes(args)
    rows = []
    for name, v in args.schedule_list:
        label = name + (f" v={v}" if name == "interleaved" else "")  # the V: two stages per device, by its name
        ours, theirs = ranks[0][("autopipe", name)], ranks[0][("pipelining", name)]
        mine = local[name]
        rows.append([label, "autopipe, in-process", C.fmt_s(mine["seconds"]), "", C.fmt_x(local["plain"] / mine["seconds"]),
                     " / ".join(C.mib(b) for b in mine["peak"]), "", str(mine["held"]), "", f"{mine['error']:.1e}"])
        for who, res in (("autopipe", ours), ("pipelining", theirs)):
            peaks = [ranks[r][(who, name)]["peak"] for r in range(K)]
            other = [ranks[r][("pipelining", name)]["peak"] for r in range(K)]
            error = max(ranks[r][(who, name)]["error"] for r in range(K))
            rows.append([label if who == "autopipe" else PIPELINING[name], f"{who}, 2 procs", C.fmt_s(res["seconds"]),
                         C.fmt_x(statistics.median(t / o for t, o in zip(theirs["times"], res["times"])))
                         if who == "autopipe" else "1.00x",
                         C.fmt_x(ranks[0]["plain"] / res["seconds"]), " / ".join(C.mib(b) for b in peaks),
                         f"{max(a / b for a, b in zip(peaks, other)):.2f}x" if who == "autopipe" else "1.00x",
                         str(res["held"]) if res["held"] is not None else "",
                         " / ".join(f"{ranks[r][(who, name)]['faults'] / 1000:.1f}k" for r in range(K)), f"{error:.1e}"])
    head = C.header("schedules", [
        f"model: transformer_like(d={args.d}, hidden={args.hidden}, blocks={args.blocks}), batch {args.batch}, "
        f"MSE loss, float32, checkpoint='never'",
        f"K={K} devices (CPU worker threads in-process; gloo processes otherwise) x 1 intra-op thread, "
        f"M={args.chunks} micro-batches; plain = the model on 1 thread",
        f"step time: median of {args.steps} steps after 1 warm-up, variants interleaved within each part",
        "speed vs pipelining: median over rounds of its step time / ours in the same round (>1: faster); memory vs pipelining: the largest per-device ratio of "
        "saved activations (<=1: no more)",
        "minor page faults: per rank, the median over the timed steps of getrusage's ru_minflt across one step (pages "
        "the allocator had returned to the OS, written again; the machine's load does not change them)",
    ], quick=args.quick)
    table = C.table(rows, ["schedule", "runtime", "s/step", "speed vs pipelining", "speedup vs plain",
                           "saved activations per device (peak)", "memory vs pipelining", "held (stage 0)",
                           "minor page faults a step (rank 0 / 1)", "grad error vs plain"])
    C.write("schedules", head + "\n" + table, quick=args.quick, results_dir=args.results_dir)


if __name__ == "__main__":
    main()
