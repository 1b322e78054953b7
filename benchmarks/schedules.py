"""Schedules side by side, in-process on CPU workers: GPipe, 1F1B, interleaved 1F1B (v=2).

    python benchmarks/schedules.py            # K=2 workers, M=8 (~1-2 min on 2 cores)
    python benchmarks/schedules.py --quick    # tiny smoke test

One model (benchmarks/_models.py transformer_like), one intra-op thread per
worker, checkpoint="never", all schedules interleaved round by round with the
plain 1-thread model. Per schedule: the step time (median), the ratio to
GPipe's, the micro-batches the first stage held at once (counted from the
timeline's forward/backward events as they ran), and the peak of saved
activations per device: measured (track_memory, kept counted as the schedule
holds it: in-flight micro-batches x bytes kept per micro-batch) and as the
plan predicts (autopipe.memory_model).

torch.distributed.pipelining's schedules run one process per stage; they are
compared with ours under torchrun in benchmarks/distributed.py.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import autopipe  # noqa: E402
from benchmarks import _common as C  # noqa: E402
from benchmarks._models import transformer_like  # noqa: E402

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2))


def _held(timeline, stage: int) -> int:
    """Most micro-batches whose forward ran and backward did not, on one stage, as it ran."""
    live = peak = 0
    for e in sorted((e for e in timeline.events if e.stage == stage and e.kind in ("forward", "backward")),
                    key=lambda e: e.start):
        live += 1 if e.kind == "forward" else -1
        peak = max(peak, live)
    return peak


def main() -> None:
    p = C.parser(__doc__)
    args = p.parse_args()
    quick = args.quick
    K, M = 2, (4 if quick else 8)
    d, hidden, blocks, batch = (32, 64, 4, 32) if quick else (512, 2048, 8, 512)
    model = transformer_like(d, hidden, blocks)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(batch, d, generator=g), torch.randn(batch, d, generator=g)
    pipes = {name: autopipe.compile(model, devices=K, chunks=M, checkpoint="never", schedule=name, virtual_stages=v,
                                    intra_op_threads=1, track_memory=True, example_inputs=(x,))
             for name, v in SCHEDULES}
    plain_step = C.on_thread(lambda: F.mse_loss(model(x), y).backward(), 1)
    variants = {"plain": plain_step}
    for name, pipe in pipes.items():
        variants[name] = lambda pipe=pipe: pipe.step(x, target=y, loss_fn=F.mse_loss)
    t = C.interleaved(variants, repeats=3 if quick else 9, warmup=1, label="schedules: ")
    rows = []
    for (name, v), pipe in zip(SCHEDULES, pipes.values()):
        model.zero_grad()
        pipe.step(x, target=y, loss_fn=F.mse_loss)
        schedule = pipe.schedule
        measured = []
        for dev in range(K):
            total = 0
            for s in schedule.stages_on(dev):
                per_micro_batch = pipe.memory.stages[s].kept / M
                total += _held(pipe.timeline, s) * per_micro_batch
            measured.append(total)
        predicted = [sum(pipe.plan.memory[s].kept_activations for s in schedule.stages_on(dev)) for dev in range(K)]
        rows.append([name + (f" v={v}" if v > 1 else ""), C.fmt_s(t.median(name)),
                     f"{t.ratio(name, 'gpipe'):.2f}x", f"{t.ratio('plain', name):.2f}x", str(_held(pipe.timeline, 0)),
                     " / ".join(C.mib(m) for m in measured), " / ".join(C.mib(m) for m in predicted),
                     f"{schedule.bubble_fraction:.3f}"])
    for pipe in pipes.values():
        pipe.close()
    head = C.header("schedules", [
        f"model: transformer_like(d={d}, hidden={hidden}, blocks={blocks}), batch {batch}, MSE loss, float32",
        f"K={K} CPU workers x 1 intra-op thread, M={M} micro-batches, checkpoint='never'; plain = the model on 1 thread",
        C.timing_line(t),
        "held = most micro-batches stage 0 held at once (from the timeline); saved activations per device: "
        "measured (in flight x kept per micro-batch) and predicted by the plan (autopipe.memory_model)",
    ], quick=quick)
    table = C.table(rows, ["schedule", "s/step", "vs gpipe (time)", "speedup vs plain", "held (stage 0)",
                           "saved acts per device, measured", "predicted", "bubble (table)"])
    C.write("schedules", head + "\n" + table, quick=quick, results_dir=args.results_dir)


if __name__ == "__main__":
    main()
