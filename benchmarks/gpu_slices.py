"""``benchmarks/gpu.py --slices K``: pipelining measured on ONE GPU split into K SM slices.

Each slice is a green context of an equal share of the SMs (``autopipe.sm_slices(K)``); the pipeline's stage s
computes on slice s's stream, so stages run at the same time, each on its own SMs: the emulation of K GPUs.

1. The probe U (the emulation's own ceiling): K independent workloads, each a K-th of the model's blocks, forward and
   backward of R micro-batches of one sequence under bf16 autocast: one after another on one slice, vs each on its own
   slice, issued from one thread (stream by stream, micro-batch by micro-batch) and from K threads. U = the serial
   time / the faster parallel time; K would be perfect. Beside it, raw bf16 matmuls the same way (a U of ~1 there
   means the slices share their SMs: separately created green contexts may, pytorch#195378).
2. The pipeline on K slices (pipe.step, checkpoint never) vs the plain model on one slice, for each model, M and
   schedule: speedup, ideal = K x (1 - the schedule's bubble) (GPipe: K.M/(M+K-1)), ideal scaled by U/K, the speedup
   as a fraction of that, the bubble from the CUDA-event timeline vs the schedule's, peak memory. The plain model on the
   whole GPU is given for scale. One summary line each:
   ``slices: <model> K=<K> M=<M> <schedule>: speedup <S>x, <F> of ideal``.

``--device cpu --tiny``: CPU workers stand in for the slices (a smoke test of this script, NOT a measurement).
"""
from __future__ import annotations

import statistics
import threading
import time

import torch
import torch.nn.functional as F

import autopipe
from benchmarks import _common as C
from zoo import GPT

MODELS = ("gpt-877M", "gpt-135M", "resnet50")
SCHEDULES = {"gpipe": 1, "1f1b": 1, "interleaved": 2}


def build(name: str, tiny: bool, device: torch.device, gpu_build):
    """(description, model, x, y, loss_fn, blocks, block_input) on ``device``: blocks and a block input feed the
    probe (None for ResNet-50, whose probe is skipped: its stages are not alike)."""
    if name == "gpt-877M":
        g = torch.Generator().manual_seed(1)
        torch.manual_seed(0)
        vocab, d, heads, layers, seq, batch = (64, 32, 4, 4, 16, 8) if tiny else (32768, 2048, 16, 16, 2048, 8)
        model = GPT(vocab=vocab, d=d, heads=heads, layers=layers, block=seq, dropout=None, tied=True).to(device)
        x, y = (torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(2))
        description = f"zoo.GPT(vocab={vocab}, d={d}, heads={heads}, layers={layers}), batch {batch} x {seq} tokens"
        loss = lambda out, y: F.cross_entropy(out.flatten(0, 1).float(), y.flatten())
        return description, model, x, y, loss, list(model.blocks), torch.randn(1, seq, d, device=device)
    description, model, x, y, loss = gpu_build("transformer" if name == "gpt-135M" else "cnn", tiny, device, 8, None)
    if name == "gpt-135M":
        seq, d = x.shape[1], model.wte.weight.shape[1]
        return description, model, x, y, loss, list(model.blocks), torch.randn(1, seq, d, device=device)
    return description, model, x, y, loss, None, None


def timed(fn, sync, repeats: int, warmup: int) -> float:
    """Median seconds of ``fn`` (synchronised) over ``repeats`` runs after ``warmup``."""
    times = []
    for r in range(warmup + repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        if r >= warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def in_threads(jobs) -> None:
    """Run each job on its own thread; re-raise the first failure."""
    errors: list[BaseException] = []

    def guarded(job):
        try:
            job()
        except BaseException as e:  # handed to the caller
            errors.append(e)
    threads = [threading.Thread(target=guarded, args=(job,)) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def probe(blocks, block_input, slices, device: torch.device, micro_batches: int, repeats: int) -> dict[str, float]:
    """Seconds of K quarter workloads (fwd+bwd of ``micro_batches`` one-sequence micro-batches each): one after
    another on slice 0 ('serial'), each on its own slice from one thread ('one thread') and from K threads."""
    K = len(slices)
    per = len(blocks) // K
    parts = [torch.nn.Sequential(*blocks[k * per:(k + 1) * per]) for k in range(K)]
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def work(k: int, stream) -> None:  # one micro-batch of workload k on ``stream``
        context = torch.cuda.stream(stream) if cuda else _null()
        with context, torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            x = block_input.detach().requires_grad_()
            parts[k](x).float().square().mean().backward()

    def serial():
        for k in range(K):
            for _ in range(micro_batches):
                work(k, slices[0])

    def one_thread():
        for _ in range(micro_batches):
            for k in range(K):
                work(k, slices[k])

    def k_threads():
        in_threads([lambda k=k: [work(k, slices[k]) for _ in range(micro_batches)] for k in range(K)])

    found = {name: timed(fn, sync, repeats, 1) for name, fn in
             (("serial", serial), ("one thread", one_thread), ("K threads", k_threads))}
    for p in (q for part in parts for q in part.parameters()):
        p.grad = None
    return found


def matmul_probe(slices, device: torch.device, repeats: int, size: int = 8192, count: int = 4) -> dict[str, float]:
    """Raw bf16 matmuls: ``count`` per slice, serial on slice 0 vs one slice each from one thread."""
    if device.type != "cuda":
        return {}
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16)

    def on(stream, n):
        with torch.cuda.stream(stream):
            for _ in range(n):
                a @ a
    serial = lambda: on(slices[0], count * len(slices))
    parallel = lambda: [on(s, count) for s in slices]
    return {name: timed(fn, torch.cuda.synchronize, repeats, 1) for name, fn in (("serial", serial),
                                                                                  ("parallel", parallel))}


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def stand_ins(K: int, device: torch.device, workqueue_scope: str | None = None) -> list:
    """What the stages run on: K SM slices of the GPU, or K CPU workers (--device cpu)."""
    if device.type == "cuda":
        return autopipe.sm_slices(K, device, workqueue_scope=workqueue_scope)
    return [torch.device("cpu")] * K


def step_fn(fn, model, x, y, loss_fn, device, stream=None):
    """A training step of ``fn`` (the model or a pipeline's pipe.step), on ``stream`` if given."""
    cuda = device.type == "cuda"

    def run():
        model.zero_grad(set_to_none=True)
        context = torch.cuda.stream(stream) if stream is not None else _null()
        with context, torch.autocast(device.type, dtype=torch.bfloat16, enabled=cuda):
            if hasattr(fn, "step"):
                fn.step(x, target=y, loss_fn=loss_fn)
            else:
                loss_fn(fn(x), y).backward()
    return run


def peak_of(run, device) -> str:
    if device.type != "cuda":
        return "-"
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    return f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f}"


def measure_model(name, built, device, Ks, Ms, schedules, U: dict, repeats: int, warmup: int):
    """Rows and summary lines of one model: the baselines, then every (K, M, schedule) pipeline."""
    description, model, x, y, loss_fn = built[:5]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    rows, lines = [], []
    whole = timed(step_fn(model, model, x, y, loss_fn, device), sync, repeats, warmup)
    rows.append([name, "whole GPU" if device.type == "cuda" else "caller", "-", "plain", f"{1e3 * whole:.1f}",
                 "-", "-", "-", "-", "-", peak_of(step_fn(model, model, x, y, loss_fn, device), device)])
    for K in Ks:
        slices = stand_ins(K, device)
        one = timed(step_fn(model, model, x, y, loss_fn, device, _stream(slices[0])), sync, repeats, warmup)
        rows.append([name, K, "-", "plain, one slice", f"{1e3 * one:.1f}", "1.00x", "-", "-", "-", "-",
                     peak_of(step_fn(model, model, x, y, loss_fn, device, _stream(slices[0])), device)])
        for M in Ms:
            for schedule in schedules:
                C.progress(f"slices: {name} K={K} M={M} {schedule}")
                pipe = autopipe.compile(model, devices=slices, chunks=M, schedule=schedule,
                                        virtual_stages=SCHEDULES[schedule], checkpoint="never", example_inputs=(x,),
                                        intra_op_threads=1 if device.type == "cpu" else None)
                run = step_fn(pipe, model, x, y, loss_fn, device)
                t = timed(run, sync, repeats, warmup)
                tl = pipe.timeline
                speedup, ideal = one / t, K * (1 - pipe.schedule.bubble_fraction)
                scaled = ideal * U[K] / K if U.get(K) else ideal
                rows.append([name, K, M, schedule, f"{1e3 * t:.1f}", f"{speedup:.2f}x", f"{ideal:.2f}x",
                             f"{scaled:.2f}x" if U.get(K) else "-", f"{speedup / scaled:.2f}",
                             f"{tl.measured_bubble:.2f} / {tl.predicted_bubble:.2f}", peak_of(run, device)])
                lines.append(f"slices: {name} K={K} M={M} {schedule}: speedup {speedup:.2f}x, "
                             f"{speedup / scaled:.2f} of ideal")
                pipe.close()
    return f"model {name}: {description} ({sum(p.numel() for p in model.parameters()) / 1e6:.1f} M params)", rows, lines


def _stream(entry):
    return entry if isinstance(entry, torch.cuda.Stream) else None


def run_slices(args, device: torch.device, gpu_build) -> tuple[list[str], list[list], list[str]]:
    """The probe for each K, then each model's rows: (header lines, rows, summary lines)."""
    tiny, Ks = args.tiny, [int(k) for k in str(args.slices).split(",")]
    Ms = [4] if tiny else [int(m) for m in args.slice_chunks.split(",")]  # tiny ResNet: >= 2 images a micro-batch
    schedules = args.slice_schedules.split(",")
    models = args.slice_models.split(",")
    for what, got, allowed in (("--slice-models", models, MODELS), ("--slice-schedules", schedules, SCHEDULES)):
        if set(got) - set(allowed):
            raise SystemExit(f"gpu.py: {what} takes {', '.join(allowed)}, got {got}")
    repeats, warmup = (1, 0) if tiny else (args.repeats or 3, args.warmup if args.warmup is not None else 2)
    head, rows, lines, U = [], [], [], {}
    built = {name: build(name, tiny, device, gpu_build) for name in models}
    probe_name, probe_model = next(((n, b) for n, b in built.items() if b[5] is not None), (None, None))
    for K in Ks:
        if probe_model is None or args.no_probe:
            break
        slices = stand_ins(K, device)
        found = probe(probe_model[5], probe_model[6], slices, device, 2 if tiny else 8, repeats)
        best = min(found["one thread"], found["K threads"])
        U[K] = found["serial"] / best
        mm = matmul_probe(slices, device, repeats)
        head.append(f"probe K={K} ({probe_name}: {len(probe_model[5]) // K} blocks each, 1 sequence x "
                    f"{2 if tiny else 8} micro-batches, fwd+bwd): serial on one slice {1e3 * found['serial']:.1f} ms, "
                    f"one slice each from one thread {1e3 * found['one thread']:.1f} ms, from {K} threads "
                    f"{1e3 * found['K threads']:.1f} ms: U = {U[K]:.2f}x (goal >= {0.75 * K:.1f}x)"
                    + (f"; bf16 8192^3 matmuls: serial {1e3 * mm['serial']:.1f} ms, parallel "
                       f"{1e3 * mm['parallel']:.1f} ms: {mm['serial'] / mm['parallel']:.2f}x" if mm else ""))
        lines.append(f"probe: K={K} U={U[K]:.2f}x")
    for name, b in built.items():
        described, got_rows, got_lines = measure_model(name, b, device, Ks, Ms, schedules, U, repeats, warmup)
        head.append(described)
        rows += got_rows
        lines += got_lines
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return head, rows, lines


HEADERS = ["model", "K", "M", "schedule", "ms/step", "speedup", "ideal", "ideal x U/K", "of ideal",
           "bubble meas/pred", "peak GiB"]
