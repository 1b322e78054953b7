"""The cut, measured end to end: tokens/s of autopipe's own cut against the splits people write by hand, on one
GPT-style LM with a modern vocabulary-to-width ratio (a heavy output head), under K gloo processes.

    python benchmarks/cut.py                 # K=2, 1F1B, GPipe and zbv (~7 min on 2 cores)
    python benchmarks/cut.py --world 4       # K=4: only meaningful with at least 4 free cores
    python benchmarks/cut.py --quick         # tiny smoke test, not a measurement

Rows, per schedule, all measured in one interleaved run (the order rotates every round):

- autopipe: ``autopipe.compile(model, chunks=M, schedule=..., checkpoint="never")`` under torchrun's environment, its
  own cut (``checkpoint="never"``: every activation kept, as pipelining keeps them; autopipe's default recomputes);
- autopipe, train_time: its cut balanced on each node's measured seconds of a training step (``balance="train_time"``),
  planned once on rank 0 and given to every rank as ``balance=plan``;
- autopipe, even split: the same runtime given the even split's shares of the work (``balance=``): separates the cut
  from the runtime;
- autopipe, best layer split: the same runtime given the best layer split's shares (K=2): autopipe's cut against
  the best hand split with the runtime held fixed;
- pipelining, even split: torch.distributed.pipelining on torchtitan's default split (layers split evenly, the
  embedding and the output head counted as one layer each);
- pipelining, best layer split: the same on the layer split that measured fastest among every layer split (K=2:
  each of the L+1 boundaries, timed first under the same schedule).

zbv (2K stages in a V, rank r holding r and 2K-1-r) has its own rows: autopipe's V cut, balanced per device; autopipe,
stages balanced alone: the same runtime on the cut balanced per stage (2K stages planned under 1F1B, given as
``balance=plan``); autopipe and pipelining's ScheduleZBVZeroBubble on the even split of 2K pieces. Its summary line
is ``cut: <model> K=<k> zbv: auto/even <R>x, auto/stages balanced alone <T>x``; its predicted max/mean is per device.

Printed: tokens/s, each row's speed over the even split (median of per-round ratios against pipelining's even
split), the measured bubble (autopipe rows: 1 - mean busy / longest step, from each rank's Timeline), the
predicted max/mean stage cost (FLOPs of forward and backward per stage, from torch's FlopCounterMode on one
micro-batch; autopipe's rows from its plan), and one summary line per schedule:
``cut: <model> K=<k> <schedule>: auto/even <R>x, auto/best-layer <S>x`` (and, the runtime held fixed, autopipe's
cut over its runtime on the best layer split).
"""
from __future__ import annotations

import os
import statistics
import sys
import time
import traceback
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.flop_counter import FlopCounterMode  # noqa: E402

import autopipe  # noqa: E402
from benchmarks import _common as C  # noqa: E402
from zoo import GPT  # noqa: E402

PIPELINING = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "zbv": "ScheduleZBVZeroBubble"}
V_LAYOUT = ("zbv",)  # 2K pieces, rank r holding pieces r and 2K-1-r


def build(args) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab=args.vocab, d=args.d, heads=args.heads, layers=args.blocks, block=args.seq, dropout=None,
               tied=False)


def data(args):
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, args.vocab, (args.batch, args.seq), generator=g),
            torch.randint(0, args.vocab, (args.batch, args.seq), generator=g))


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


class Piece(nn.Module):
    """Layers [lo, hi) of a GPT counted as torchtitan counts them: layer 0 the embeddings, 1..L the blocks, L+1 the
    final norm and the output head."""

    def __init__(self, model: GPT, lo: int, hi: int):
        super().__init__()
        n = len(model.blocks)
        self.wte, self.wpe = (model.wte, model.wpe) if lo == 0 else (None, None)
        self.blocks = nn.ModuleList(model.blocks[max(lo - 1, 0):min(hi - 1, n)])
        self.ln_f, self.lm_head = (model.ln_f, model.lm_head) if hi == n + 2 else (None, None)

    def forward(self, x):
        if self.wte is not None:
            x = self.wte(x) + self.wpe(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.lm_head is not None else x


def even_split(n_layers: int, k: int) -> list[int]:
    """torchtitan's default: the L blocks plus the embedding and the head as a layer each, split evenly (the bounds
    of k pieces over L + 2 layers)."""
    return [round((n_layers + 2) * s / k) for s in range(k + 1)]


def piece_costs(args, bounds: list[int]) -> list[float]:
    """Forward and backward FLOPs of each piece on one micro-batch (the loss on the last)."""
    model = build(args)
    ids, target = data(args)
    rows = args.batch // args.chunks
    x, costs = ids[:rows], []
    for s in range(len(bounds) - 1):
        piece = Piece(model, bounds[s], bounds[s + 1])
        x = x.detach().requires_grad_(x.is_floating_point())
        with FlopCounterMode(display=False) as counter:
            y = piece(x)
            out = lm_loss(y, target[:rows]) if s == len(bounds) - 2 else y.sum()
            out.backward()
        costs.append(counter.get_total_flops())
        x = y
    return costs


def imbalance(costs, v_layout: bool = False) -> float:
    """max/mean over the pieces, or over the devices (each its two pieces' sum) in a V."""
    if v_layout:
        n = len(costs)
        costs = [costs[d] + costs[n - 1 - d] for d in range(n // 2)]
    return max(costs) / (sum(costs) / len(costs))


def shares(costs) -> list[float]:
    """Each piece's share of the work, at least a millionth (``balance=`` takes positive shares: an embedding alone
    counts no FLOPs)."""
    return [max(c / sum(costs), 1e-6) for c in costs]


def pipelining_step(model: GPT, rank: int, k: int, schedule: str, bounds: list[int], ids, target, chunks: int):
    from torch.distributed import pipelining
    cls = getattr(pipelining, PIPELINING[schedule])
    if schedule in V_LAYOUT:  # the V by hand, as the docs build it: rank r holds pieces r and 2K-1-r
        n = 2 * k
        runner = cls([pipelining.PipelineStage(Piece(model, bounds[s], bounds[s + 1]), s, n, torch.device("cpu"))
                      for s in (rank, n - 1 - rank)], n_microbatches=chunks, loss_fn=lm_loss)
        return lambda: runner.step(ids, target=target, losses=[]) if rank == 0 else runner.step()
    stage = pipelining.PipelineStage(Piece(model, bounds[rank], bounds[rank + 1]), rank, k, torch.device("cpu"))
    runner = cls(stage, n_microbatches=chunks, loss_fn=lm_loss)

    def step():
        if rank == 0:
            runner.step(ids)
        else:
            runner.step(target=target, losses=[]) if rank == k - 1 else runner.step()
    return step


def timed(steps: dict, models: list, repeats: int) -> dict[str, list[float]]:
    """Each step of ``steps`` once per round, the order rotated every round, the first round untimed."""
    keys, times = list(steps), {k: [] for k in steps}
    for rep in range(1 + repeats):
        for key in keys[rep % len(keys):] + keys[:rep % len(keys)]:
            for m in models:
                m.zero_grad(set_to_none=True)
            dist.barrier()
            start = time.perf_counter()
            steps[key]()
            dist.barrier()
            if rep:
                times[key].append(time.perf_counter() - start)
    return times


def best_layer_split(args, rank: int, k: int, schedule: str, ids, target) -> tuple[list[int], dict]:
    """K=2: every boundary 1..L+1 between the L+2 layers, timed under pipelining (median of ``args.search`` steps)."""
    model = build(args)
    candidates = [[0, b, args.blocks + 2] for b in range(1, args.blocks + 2)]
    steps = {tuple(c): pipelining_step(model, rank, k, schedule, c, ids, target, args.chunks) for c in candidates}
    times = timed(steps, [model], args.search)
    medians = {c: statistics.median(t) for c, t in times.items()}
    return list(min(medians, key=medians.get)), medians


def rank_main(rank: int, k: int, port: int, args, queue) -> None:
    try:
        torch.set_num_threads(1)
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(k), LOCAL_WORLD_SIZE=str(k),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=k, timeout=timedelta(seconds=600))
        ids, target = data(args)
        even = even_split(args.blocks, k)
        even_costs = piece_costs(args, even)
        results, v_even = {}, {}
        for schedule in args.schedules:
            v = schedule in V_LAYOUT
            if v:  # 2K pieces; no layer-split search (L^3 splits), the stage-balanced cut beside the V's own
                even_v = even_split(args.blocks, 2 * k)
                v_even = dict(even=even_v, costs=piece_costs(args, even_v))
                best, searched = None, {}  # no layer-split rows
                alone = autopipe.plan(build(args), (ids,), devices=2 * k, chunks=args.chunks, schedule="1f1b",
                                      checkpoint="never")  # Note [stages balanced as their device's sum]
                rows = (("autopipe", "flops"), ("autopipe, stages balanced alone", alone),
                        ("autopipe, even split", shares(v_even["costs"])))
            else:
                best, searched = best_layer_split(args, rank, k, schedule, ids, target) if k == 2 else (even, {})
                measured = [autopipe.plan(build(args), (ids,), devices=k, chunks=args.chunks, schedule=schedule,
                                          checkpoint="never", balance="train_time") if rank == 0 else None]
                dist.broadcast_object_list(measured, src=0)  # one measured cut for every rank
                given = [("autopipe, best layer split", shares(piece_costs(args, best)))] if k == 2 else []
                rows = (("autopipe", "flops"), ("autopipe, train_time", measured[0]),
                        ("autopipe, even split", shares(even_costs)), *given)
            models, steps, pipes = {}, {}, {}
            for key, balance in rows:
                models[key] = model = build(args)
                pipes[key] = autopipe.compile(model, chunks=args.chunks, schedule=schedule, balance=balance,
                                              checkpoint="never", example_inputs=(ids,), timeout=600)
                steps[key] = lambda pipe=pipes[key]: pipe.step(ids, target=target, loss_fn=lm_loss)
            hand = (("pipelining, even split", even_v),) if v else (("pipelining, even split", even),
                                                                     ("pipelining, best layer split", best))
            for key, bounds in hand:
                models[key] = model = build(args)
                steps[key] = pipelining_step(model, rank, k, schedule, bounds, ids, target, args.chunks)
            times = timed(steps, list(models.values()), args.steps)
            bubbles = {}
            for key, pipe in pipes.items():
                pipe.step(ids, target=target, loss_fn=lm_loss)  # one more step, its timeline read
                line = pipe.timeline
                bubbles[key] = (line.busy(rank), line.makespan)
            results[schedule] = dict(times=times, bubbles=bubbles, best=best, searched=searched,
                                     planned={key: [s.cost for s in pipe.plan.stages] for key, pipe in pipes.items()},
                                     cuts={key: str(pipe.plan).splitlines()[0] for key, pipe in pipes.items()})
            for pipe in pipes.values():
                pipe.close()
        queue.put((rank, dict(results=results, even=even, even_costs=even_costs, v_even=v_even)))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:
        queue.put((rank, traceback.format_exc()))
        raise


def run_ranks(args, k: int) -> list[dict]:
    return C.run_ranks(rank_main, k, args)


def main() -> None:
    p = C.parser(__doc__)
    p.add_argument("--world", type=int, default=2, help="gloo processes, one stage each (default 2)")
    p.add_argument("--steps", type=int, default=None, help="timed rounds (default 7, --quick 1)")
    p.add_argument("--schedules", nargs="+", choices=list(PIPELINING), default=["1f1b", "gpipe", "zbv"])
    args = p.parse_args()
    k = args.world
    if args.quick:
        args.vocab, args.d, args.heads, args.blocks, args.seq, args.batch, args.chunks = 512, 32, 4, 2, 16, 4, 2
    else:
        args.vocab, args.d, args.heads, args.blocks, args.seq, args.batch, args.chunks = 32000, 256, 4, 8, 128, 8, 8
    args.steps = args.steps or (1 if args.quick else 7)
    args.search = 1 if args.quick else 3
    C.progress(f"{k} processes: search of the best layer split, then the rows")
    ranks = run_ranks(args, k)
    model_name = f"gpt-{args.vocab // 1000}k" if args.vocab >= 1000 else f"gpt-{args.vocab}"
    tokens = args.batch * args.seq
    rows, summaries = [], []
    even_costs = ranks[0]["even_costs"]
    for schedule in args.schedules:
        got = [r["results"][schedule] for r in ranks]
        times = got[0]["times"]  # rank 0's clock: every round ends at a barrier, so all ranks agree
        even_times = times["pipelining, even split"]
        best, v = got[0]["best"], schedule in V_LAYOUT
        predicted = {"pipelining, even split": imbalance(ranks[0]["v_even"]["costs"], True) if v else
                     imbalance(even_costs)}
        if not v:
            predicted["pipelining, best layer split"] = imbalance(piece_costs(args, best))
        predicted.update({key: imbalance(costs, v) for key, costs in got[0]["planned"].items()})
        ratio = {key: statistics.median(e / t for e, t in zip(even_times, ts)) for key, ts in times.items()}
        for key, ts in times.items():
            bubble = ""
            if key in got[0]["bubbles"]:
                busy = [g["bubbles"][key][0] for g in got]
                span = max(g["bubbles"][key][1] for g in got)
                bubble = f"{1 - statistics.mean(busy) / span:.3f}"
            split = {"pipelining, even split": ranks[0]["v_even"]["even"] if v else ranks[0]["even"],
                     "pipelining, best layer split": best,
                     "autopipe, best layer split": best}.get(key)
            rows.append([schedule, key + (f" {split}" if split else ""), f"{tokens / statistics.median(ts):,.0f}",
                         C.fmt_x(ratio[key]), bubble, f"{predicted[key]:.3f}"])
        if v:
            alone = statistics.median(b / a for a, b in zip(times["autopipe"], times["autopipe, stages balanced alone"]))
            summaries.append(f"cut: {model_name} K={k} {schedule}: auto/even {ratio['autopipe']:.2f}x, auto/stages "
                             f"balanced alone {alone:.2f}x (the V's cut balanced per device, the runtime held fixed)")
            continue
        best_times = times["pipelining, best layer split"]
        for key, label in (("autopipe", ""), ("autopipe, train_time", ' balance="train_time"')):
            s = statistics.median(b / a for a, b in zip(times[key], best_times))
            own = times.get("autopipe, best layer split")
            held = f" (the runtime held fixed: {statistics.median(b / a for a, b in zip(times[key], own)):.2f}x)" \
                if own else ""
            summaries.append(f"cut: {model_name} K={k} {schedule}{label}: auto/even {ratio[key]:.2f}x, "
                             f"auto/best-layer {s:.2f}x{held}")
    head = C.header("cut", [
        f"model: GPT(vocab={args.vocab}, d={args.d}, heads={args.heads}, blocks={args.blocks}, untied head), "
        f"batch {args.batch} x seq {args.seq} ({tokens} tokens a step), M={args.chunks}, float32, cross-entropy",
        f"K={k} gloo processes x 1 intra-op thread, no activation checkpointing in any row; even split: torchtitan's default (embedding and head a layer "
        f"each): layer bounds {ranks[0]['even']}; best layer split: the fastest of every boundary, searched first "
        f"(median of {args.search} steps each)",
        f"tokens/s: median of {args.steps} rounds after 1 warm-up, rows interleaved; vs even: median of per-round "
        f"ratios against pipelining on the even split (>1: faster)",
        "bubble: autopipe's Timeline (1 - mean busy / longest step over ranks); predicted max/mean: FLOPs of "
        "forward+backward per stage (pipelining's pieces: FlopCounterMode; autopipe: its plan's stage costs)",
    ], quick=args.quick)
    table = C.table(rows, ["schedule", "run", "tokens/s", "vs even split", "bubble (measured)",
                           "predicted max/mean"])
    C.write("cut", head + "\n" + table + "\n\n" + "\n".join(summaries), quick=args.quick,
            results_dir=args.results_dir)


if __name__ == "__main__":
    main()
