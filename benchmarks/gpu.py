"""autopipe on ONE GPU: a training step of the plain model vs the pipeline, K stages x M micro-batches.

    python benchmarks/gpu.py                        # on a GPU (~2-4 min): writes benchmarks/results/gpu_<gpu name>.txt
    python benchmarks/gpu.py --out benchmarks/results/gpu_h100.txt
    python benchmarks/gpu.py --device cpu --tiny    # smoke test without a GPU (CI): tiny sizes, CPU workers
    python benchmarks/gpu.py --slices 2,4           # stages on SM slices (benchmarks/gpu_slices.py): writes
                                                    # benchmarks/results/gpu_slices_<gpu name>.txt

Models (zoo/models.py), under bf16 autocast (fp32 weights), random weights:
  transformer  zoo.GPT(vocab 32768, d 1024, 16 heads, 8 layers, tied LM head, no dropout), batch 16 x 512 tokens
  cnn          zoo.ResNet50 (torchvision's layout), batch 128 x 3x224x224, BatchNorm in training mode
A step is zero_grad + forward and cross-entropy under torch.autocast(bfloat16) + backward (no optimizer);
with --device cpu in float32 (autocast off: bf16 is slow on CPUs without bf16 units).
Variants, interleaved round by round (benchmarks/_common.py): the plain model, the plain model looped over
M micro-batches with gradients accumulated (Note [micro-batching's own cost]), and
autopipe.compile(model, devices=["cuda:0"] * K, chunks=M, checkpoint="never") for K in {1, 2, 4},
M in {1, 4, 8} (--tiny: K in {1, 2}, M in {1, 4}). Every variant ends with torch.cuda.synchronize(), so a
timed call is the whole step on the GPU.

All K stages share one GPU and its default stream: they cannot run at the same time, so nothing here
can be faster than the plain model. The table is autopipe's cost on a GPU: K worker threads, M
micro-batches (smaller kernels), the hand-offs. Goal: K=1, M=1 <= 1.03x the plain step.
The timeline columns come from pipe.timeline of the last step: on a GPU its spans are CUDA events on the
stages' stream, so its bubble and overlap are GPU time (on the CPU smoke test, host time).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import autopipe  # noqa: E402
from benchmarks import _common as C  # noqa: E402
from zoo import GPT, ResNet50  # noqa: E402

KS, MS = (1, 2, 4), (1, 4, 8)
TINY_KS, TINY_MS = (1, 2), (1, 4)  # a smoke run of every code path: the larger K and M run the same code
GOAL = 1.03  # K=1, M=1 vs plain


def build(name: str, tiny: bool, device: torch.device, layers: int, batch: int | None):
    """(description, model, x, y, loss_fn) of the named model, model and data on ``device``."""
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    if name == "transformer":
        vocab, d, heads, seq = (64, 32, 4, 16) if tiny else (32768, 1024, 16, 512)
        layers, batch = (4, batch or 8) if tiny else (layers, batch or 16)
        model = GPT(vocab=vocab, d=d, heads=heads, layers=layers, block=seq, dropout=None, tied=True)
        x, y = (torch.randint(0, vocab, (batch, seq), generator=g) for _ in range(2))
        description = (f"zoo.GPT(vocab={vocab}, d={d}, heads={heads}, layers={layers}, tied head, no dropout), "
                       f"batch {batch} x {seq} tokens, cross-entropy")
        return description, model.to(device), x.to(device), y.to(device), \
            lambda out, y: F.cross_entropy(out.flatten(0, 1).float(), y.flatten())
    if name == "cnn":
        # tiny: one bottleneck per layer on 16x16 images (layer3 and 4 are 1x1: >= 2 images per micro-batch for BatchNorm)
        blocks, classes, size, batch = ((1, 1, 1, 1), 10, 16, batch or 16) if tiny else ((3, 4, 6, 3), 1000, 224, batch or 128)
        model = ResNet50(layers=blocks, num_classes=classes)
        x, y = torch.randn(batch, 3, size, size, generator=g), torch.randint(0, classes, (batch,), generator=g)
        description = (f"zoo.ResNet50(layers={blocks}, classes={classes}), batch {batch} x 3x{size}x{size}, "
                       f"BatchNorm in training mode, cross-entropy")
        return description, model.to(device), x.to(device), y.to(device), lambda out, y: F.cross_entropy(out.float(), y)
    raise ValueError(name)


def gpu_line(device: torch.device) -> str:
    if device.type != "cuda":
        return "gpu: none: --device cpu runs the stages on CPU workers (a smoke test of this script, NOT a GPU measurement)"
    p = torch.cuda.get_device_properties(device)
    return (f"gpu: {torch.cuda.get_device_name(device)} ({p.total_memory / 2**30:.0f} GiB, sm_{p.major}{p.minor}, "
            f"{p.multi_processor_count} SMs), CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}, "
            f"torch {torch.__version__}, {torch.cuda.device_count()} GPU(s) visible, {device} used")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="'cuda' (cuda:0, the default), 'cuda:N', or 'cpu' (a smoke test)")
    p.add_argument("--tiny", action="store_true", help="tiny models, 1 timed round: a smoke test, not a measurement")
    p.add_argument("--out", type=Path, default=None,
                   help="write the table here (default on a GPU: benchmarks/results/gpu_<gpu name>.txt; "
                        "--tiny writes nothing unless given --out)")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 10; --tiny 1)")
    p.add_argument("--warmup", type=int, default=None, help="untimed rounds first (default 2; --tiny 0)")
    p.add_argument("--budget", type=float, default=None, help="seconds of timing per model (default 180)")
    p.add_argument("--layers", type=int, default=8, help="transformer layers (default 8)")
    p.add_argument("--gpt-batch", type=int, default=None, help="transformer sequences per step (default 16)")
    p.add_argument("--cnn-batch", type=int, default=None, help="images per step (default 128)")
    p.add_argument("--checkpoint", default="never", choices=["never", "except_last", "always"])
    p.add_argument("--models", default="transformer,cnn")
    p.add_argument("--slices", default=None,
                   help="K (or 'K1,K2'): instead of the table above, the pipeline on K SM slices of the GPU and the "
                        "probe U (benchmarks/gpu_slices.py)")
    p.add_argument("--slice-models", default="gpt-877M,gpt-135M,resnet50", help="with --slices")
    p.add_argument("--slice-chunks", default="4,8,16", help="with --slices: M values")
    p.add_argument("--slice-schedules", default="gpipe,1f1b,interleaved", help="with --slices")
    p.add_argument("--no-probe", action="store_true", help="with --slices: skip the probe U")
    args = p.parse_args(argv)
    names = args.models.split(",")
    if not names or set(names) - {"transformer", "cnn"}:
        p.error(f"--models: a comma-separated list of 'transformer' and 'cnn', got {args.models!r}")

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            p.error("no CUDA device here: run with --device cpu --tiny for a smoke test")
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # every micro-batch shape is tuned in the warm-up rounds
    elif device.type == "cpu":
        torch.set_num_threads(1)  # and one per worker: a smoke test must not fight the machine's other work
    else:
        p.error(f"--device must be 'cuda' or 'cpu', got {args.device!r}")
    if args.slices:
        return slices_main(args, device)
    repeats = args.repeats or (1 if args.tiny else 10)
    warmup = args.warmup if args.warmup is not None else (0 if args.tiny else 2)
    budget = args.budget or (60 if args.tiny else 180)

    rows, described, notes = [], [], []
    for name in names:
        batch = args.gpt_batch if name == "transformer" else args.cnn_batch
        description, got_rows, got_notes = measure(name, build(name, args.tiny, device, args.layers, batch), device,
                                                   args.checkpoint, repeats=repeats, warmup=warmup, budget=budget,
                                                   grid=(TINY_KS, TINY_MS) if args.tiny else (KS, MS))
        described.append(f"model {name}: {description}")
        rows += got_rows
        notes += got_notes
        if device.type == "cuda":
            torch.cuda.empty_cache()

    head = C.header("gpu", [
        gpu_line(device),
        *([] if not args.tiny else ["--tiny: tiny sizes, a smoke test, NOT a measurement"]),
        *described,
        f"pipeline: autopipe.compile(model, devices=['{device}'] * K, chunks=M, checkpoint='{args.checkpoint}'): "
        f"all K stages on one device; step = zero_grad + forward and loss "
        + ("under torch.autocast('cuda', bfloat16) + backward + torch.cuda.synchronize()" if device.type == "cuda"
           else "in float32 (autocast off: bf16 on this CPU is slow) + backward"),
        *notes,
        "vs plain = t(variant) / t(plain), median of per-round ratios [quartiles] (lower is better; 1.00x = no cost);",
        "loop M = the plain model over the same M micro-batches, gradients accumulated (what micro-batching costs without",
        "autopipe); vs loop = t(K, M) / t(loop M): autopipe's own cost at that micro-batch size;",
        f"timeline ({'CUDA events' if device.type == 'cuda' else 'host time'}, pipe.timeline of the last step): "
        "makespan; bubble = idle share of the K stages measured / GPipe's (K-1)/(M+K-1); overlap = sum of busy time "
        "/ makespan (> 1: stages worked at once);",
        "peak = torch.cuda.max_memory_allocated over one more step of that variant alone (peak statistics reset first)",
    ])
    text = head + "\n" + C.table(rows, ["model", "K", "M", "ms/step", "vs plain", "[quartiles]", "vs loop", "timeline ms",
                                        "bubble meas/pred", "overlap", "peak GiB"])
    print(text, flush=True)
    out = args.out
    if out is None and device.type == "cuda" and not args.tiny:
        out = C.RESULTS / f"gpu_{C.gpu_name(device)}.txt"
    if out is not None:
        C.write_file(out, text)
    return 0


def slices_main(args, device: torch.device) -> int:
    """--slices: benchmarks/gpu_slices.py's probe and table, to gpu_slices_<gpu>.txt."""
    from benchmarks import gpu_slices
    described, rows, lines = gpu_slices.run_slices(args, device, build)
    head = C.header("gpu --slices", [
        gpu_line(device),
        *([] if not args.tiny else ["--tiny: tiny sizes, CPU workers stand in for the slices: a smoke test, NOT a "
                                    "measurement"]),
        *described,
        "pipeline: autopipe.compile(model, devices=autopipe.sm_slices(K), chunks=M, schedule=..., checkpoint='never'), "
        "trained with pipe.step under bf16 autocast; baseline: the plain model on slice 0's stream; speedup = "
        "t(plain, one slice) / t(pipeline); ideal = K x (1 - the schedule's bubble); of ideal = speedup / (ideal x "
        "U/K), or / ideal where no probe ran; bubble from pipe.timeline (CUDA events) vs the schedule's",
        *lines,
    ])
    text = head + "\n" + C.table(rows, gpu_slices.HEADERS)
    print(text, flush=True)
    out = args.out
    if out is None and device.type == "cuda" and not args.tiny:
        out = C.RESULTS / f"gpu_slices_{C.gpu_name(device)}.txt"
    if out is not None:
        C.write_file(out, text)
    return 0


def measure(name: str, built, device: torch.device, checkpoint: str, *, repeats: int, warmup: int,
            budget: float, grid: tuple[tuple[int, ...], tuple[int, ...]]) -> tuple[str, list[list], list[str]]:
    """Time the plain model and every (K, M) pipeline of ``grid`` (Ks, Ms) of one model, interleaved; (description,
    rows, notes)."""
    ks, ms = grid
    description, model, x, y, loss_fn = built
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step(fn):
        def run():
            model.zero_grad(set_to_none=True)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = loss_fn(fn(x), y)
            loss.backward()
            sync()
        return run

    pipes = {}
    for K in ks:
        for M in ms:
            C.progress(f"{name}: compiling K={K} M={M}")
            pipes[(K, M)] = autopipe.compile(model, devices=[str(device)] * K, chunks=M, checkpoint=checkpoint,
                                             example_inputs=(x,), intra_op_threads=torch.get_num_threads())
    def loop(M):  # the plain model over M micro-batches, gradients accumulated: micro-batching's cost without autopipe
        def run():
            model.zero_grad(set_to_none=True)
            for xc, yc in zip(x.tensor_split(M), y.tensor_split(M), strict=True):
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                    loss = loss_fn(model(xc), yc) * (len(xc) / len(x))
                loss.backward()
            sync()
        return run

    variants = {"plain": step(model), **{f"loop M{M}": loop(M) for M in ms if M > 1},
                **{f"K{K} M{M}": step(pipe) for (K, M), pipe in pipes.items()}}
    C.progress(f"{name}: {len(variants)} variants, {warmup} warm-up + {repeats} rounds, budget {budget:.0f} s")
    t = C.interleaved(variants, repeats=repeats, warmup=warmup, budget=budget, label=f"{name} ")
    peaks = peak_memory(variants, device)

    rows = [[name, "plain", "-", f"{1e3 * t.median('plain'):.2f}", "1.00x", "-", "-", "-", "-", "-", peaks["plain"]]]
    rows += [[name, "loop", M, f"{1e3 * t.median(f'loop M{M}'):.2f}", f"{t.ratio(f'loop M{M}', 'plain'):.3f}x",
              t.spread(f"loop M{M}", "plain"), "1.00x", "-", "-", "-", peaks[f"loop M{M}"]] for M in ms if M > 1]
    for (K, M), pipe in pipes.items():
        key, tl = f"K{K} M{M}", pipe.timeline
        busy = sum(tl.busy(d) for d in range(K))
        rows.append([name, K, M, f"{1e3 * t.median(key):.2f}", f"{t.ratio(key, 'plain'):.3f}x", t.spread(key, "plain"),
                     f"{t.ratio(key, f'loop M{M}'):.3f}x" if M > 1 else "-",
                     f"{1e3 * tl.makespan:.2f}", f"{tl.measured_bubble:.2f} / {tl.predicted_bubble:.2f}",
                     f"{busy / tl.makespan:.2f}" if tl.makespan else "-", peaks[key]])
        pipe.close()
    overhead = t.ratio("K1 M1", "plain")
    notes = [f"{name}: " + C.timing_line(t),
             f"{name}: overhead at K=1, M=1: {overhead:.3f}x [{t.spread('K1 M1', 'plain')}] the plain step "
             f"(goal <= {GOAL:.2f}x: {'met' if overhead <= GOAL else 'NOT met'})"]
    params = sum(q.numel() for q in model.parameters())
    return f"{description} ({params / 1e6:.1f} M params)", rows, notes


def peak_memory(variants, device: torch.device) -> dict[str, str]:
    """Each variant's peak allocated memory over one step, run alone after the timing ('-' off CUDA)."""
    if device.type != "cuda":
        return {name: "-" for name in variants}
    peaks = {}
    for name, run in variants.items():
        torch.cuda.reset_peak_memory_stats(device)
        run()
        peaks[name] = f"{torch.cuda.max_memory_allocated(device) / 2**30:.2f}"
    return peaks


if __name__ == "__main__":
    sys.exit(main())
