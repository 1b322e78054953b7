"""The host cost of a task: microseconds of host CPU that autopipe's runtime spends per task, per stage and per step,
for each schedule, on CPU workers or on one GPU.

    python benchmarks/host_cost.py                  # CPU workers, ~1 min: benchmarks/results/host_cost_cpu.txt
    python benchmarks/host_cost.py --device cuda    # stages on one GPU: host_cost_<gpu>.txt (make gpu runs it)
    python benchmarks/host_cost.py --quick          # a smoke test

Model: L Linear(16, 16) + tanh layers, a batch of M x 4 rows, MSE loss: kernels so small that a step's host time is
the ops' own dispatch plus the runtime's work. Measured: the process's CPU time (time.process_time: every thread,
the workers' too) of a step of the pipeline (pipe.step, K stages, M micro-batches, checkpoint never) and of the plain
model looped over the same M micro-batches (the ops' own host cost: dispatch, autograd, no autopipe). The difference
is autopipe's host cost, divided by the schedule's tasks (F, B and W), by its stages, and per step. A thread waiting
on a lock uses no CPU, so the waits between stages do not count; the hand-offs (a lock released, a thread woken) do.
On a GPU, the CPU time while the step is enqueued, before the synchronisation (a spinning sync would count). Variants
are interleaved round by round; medians of the rounds. One worker whose thread count is the caller's runs inline
(K=1 here: torch.set_num_threads(1)), with no thread hand-off.
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import autopipe  # noqa: E402
from benchmarks import _common as C  # noqa: E402

SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 1))


def model_and_batch(layers: int, rows: int, device: torch.device):
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(16, 16), nn.Tanh())]).to(device)
    return model, torch.randn(rows, 16, device=device), torch.randn(rows, 16, device=device)


def host_seconds(run, steps: int, sync) -> tuple[float, float]:
    """(CPU seconds, wall seconds) per step over ``steps`` steps; the synchronisation after them is not counted."""
    cpu = wall = 0.0
    for _ in range(steps):
        c0, w0 = time.process_time(), time.perf_counter()
        run()
        cpu, wall = cpu + time.process_time() - c0, wall + time.perf_counter() - w0
        sync()
    return cpu / steps, wall / steps


def measure(device: torch.device, Ks, M: int, layers: int, steps: int, rounds: int) -> tuple[list, list]:
    model, x, y = model_and_batch(layers, 4 * M, device)
    loss_fn = nn.functional.mse_loss
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def loop():
        model.zero_grad(set_to_none=True)
        for xc, yc in zip(x.tensor_split(M), y.tensor_split(M)):
            (loss_fn(model(xc), yc) / M).backward()

    variants, pipes = {"loop": loop}, {}
    for K in Ks:
        for schedule, v in SCHEDULES if K > 1 else SCHEDULES[:1]:
            if 2 * K * v > layers:
                continue
            pipe = autopipe.compile(model, devices=[str(device)] * K, chunks=M, schedule=schedule, virtual_stages=v,
                                    checkpoint="never", example_inputs=(x,), intra_op_threads=1)
            pipes[(schedule, K)] = pipe

            def step(pipe=pipe):
                model.zero_grad(set_to_none=True)
                pipe.step(x, target=y, loss_fn=loss_fn)
            variants[f"{schedule} K{K}"] = step
    cpu: dict[str, list[float]] = {n: [] for n in variants}
    wall: dict[str, list[float]] = {n: [] for n in variants}
    names = list(variants)
    for r in range(rounds + 1):  # round 0 warms up
        for name in names[r % len(names):] + names[:r % len(names)]:
            c, w = host_seconds(variants[name], steps, sync)
            if r:
                cpu[name].append(c)
                wall[name].append(w)
        C.progress(f"round {r}/{rounds}")
    med = {n: statistics.median(cpu[n]) for n in names}
    rows, lines = [["plain loop", "-", M, M * 2, f"{1e3 * statistics.median(wall['loop']):.2f}",
                    f"{1e3 * med['loop']:.2f}", "-", "-", "-"]], []
    for (schedule, K), pipe in pipes.items():
        name = f"{schedule} K{K}"
        tasks = sum(len(pipe.schedule.device_order(d)) for d in range(K))
        extra = med[name] - med["loop"]
        rows.append([schedule, K, M, tasks, f"{1e3 * statistics.median(wall[name]):.2f}", f"{1e3 * med[name]:.2f}",
                     f"{1e6 * extra:.0f}", f"{1e6 * extra / tasks:.1f}", f"{1e6 * extra / pipe.schedule.n_stages:.0f}"])
        lines.append(f"host cost: {schedule} K={K} M={M}: {1e6 * extra / tasks:.1f} us per task, "
                     f"{1e6 * extra:.0f} us per step")
        pipe.close()
    return rows, lines


def main(argv=None) -> int:
    p = C.parser(__doc__)
    p.add_argument("--device", default="cpu", help="'cpu' (CPU workers, the default) or 'cuda' (cuda:0)")
    p.add_argument("--chunks", type=int, default=8, help="micro-batches M (default 8)")
    p.add_argument("--layers", type=int, default=16, help="Linear+tanh layers (default 16)")
    p.add_argument("--out", type=Path, default=None, help="write the table here (default results/host_cost_<dev>.txt)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            p.error("no CUDA device here: run with --device cpu")
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    torch.set_num_threads(1)  # one intra-op thread per worker and for the loop: the ops stay the same everywhere
    Ks = (1, 2) if args.quick else (1, 2, 4)
    steps, rounds = (2, 1) if args.quick else (20, args.repeats or 5)
    rows, lines = measure(device, Ks, args.chunks, args.layers, steps, rounds)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"CPU workers, {C.cores()} cores"
    head = C.header("host_cost", [
        f"device: {where}; model: {args.layers} x (Linear(16, 16), Tanh), batch {4 * args.chunks} rows, MSE, "
        f"pipe.step, checkpoint never, intra_op_threads=1",
        f"{rounds} rounds of {steps} steps per variant, interleaved; medians of the rounds",
        "host ms = process CPU time per step (all threads); autopipe us/step = pipeline's minus the plain loop's over "
        "the same micro-batches; us/task = that / the schedule's tasks (F, B, W); us/stage = that per stage",
        *lines,
    ], quick=args.quick)
    text = head + "\n" + C.table(rows, ["schedule", "K", "M", "tasks", "wall ms/step", "host ms/step",
                                        "autopipe us/step", "us/task", "us/stage/step"])
    print(text, flush=True)
    out = args.out
    if out is None and not args.quick:
        out = args.results_dir / f"host_cost_{'cpu' if device.type == 'cpu' else C.gpu_name(device)}.txt"
    if out is not None:
        C.write_file(out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
