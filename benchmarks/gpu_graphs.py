"""compile(..., cuda_graphs=True) on ONE GPU: the graphed pipeline against the eager one and the plain eager loop.

    python benchmarks/gpu_graphs.py                      # on a GPU: writes benchmarks/results/gpu_graphs_<gpu>.txt
    python benchmarks/gpu_graphs.py --models gpt-135M --budget 20 --out results/gpu_graphs.txt
    python benchmarks/gpu_graphs.py --device cpu --tiny  # smoke test without a GPU: arguments and the refusal only

Models (benchmarks/gpu.py's and gpu_slices.py's), bf16 autocast, fp32 weights, no dropout:
  gpt-135M  zoo.GPT(vocab 32768, d 1024, 16 heads, 8 layers), batch 16 x 512 tokens (host-bound at M=8)
  gpt-877M  zoo.GPT(vocab 32768, d 2048, 16 heads, 16 layers), batch 8 x 2048 tokens
A step is pipe.step(x, target=y, loss_fn=cross-entropy) (the loop: forward, loss and backward per micro-batch,
gradients accumulated), then torch.cuda.synchronize(). Pipelines: schedule="1f1b", checkpoint="never", M=8: at K=1
that is the loop's order (F0 B0 F1 B1 ...), and a graphed stage needs one slot. K=4: four stages on the GPU's SM
slices (autopipe.sm_slices) where available, else four stages on the caller's stream, eager and graphed.
Summary lines, for each model: ``graphs: <model> K=1 M=8: <R>x the eager loop`` (the goal: R <= 0.50 for the
135M GPT) and ``graphs: <model> K=4 M=8: graphed <R>x eager``. NOT YET RUN ON A GPU.
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
from zoo import GPT  # noqa: E402

MODELS = {"gpt-135M": (1024, 8, 16, 512), "gpt-877M": (2048, 16, 8, 2048)}  # d, layers, batch, seq
GOAL = 0.50  # graphed K=1, M=8 vs the eager loop over the same micro-batches
M = 8


def build(name: str, device: torch.device, tiny: bool):
    d, layers, batch, seq = (32, 2, 8, 16) if tiny else MODELS[name]
    vocab = 64 if tiny else 32768
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(0)
    model = GPT(vocab=vocab, d=d, heads=4 if tiny else 16, layers=layers, block=seq, dropout=None, tied=True)
    x, y = (torch.randint(0, vocab, (batch, seq), generator=g).to(device) for _ in range(2))
    return model.to(device), x, y


def loss_fn(out, y):
    return F.cross_entropy(out.flatten(0, 1).float(), y.flatten())


def measure(name: str, device: torch.device, tiny: bool, budget: float) -> tuple[list[list], list[str]]:
    model, x, y = build(name, device, tiny)
    params = sum(p.numel() for p in model.parameters())

    def loop():
        model.zero_grad(set_to_none=True)
        for xc, yc in zip(x.tensor_split(M), y.tensor_split(M), strict=True):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = loss_fn(model(xc), yc) * (len(xc) / len(x))
            loss.backward()
        torch.cuda.synchronize()

    slices = getattr(autopipe, "sm_slices", None)
    pipes, placement = {}, {1: [str(device)], 4: [str(device)] * 4}
    if slices is not None:
        try:
            placement[4] = slices(4)
        except Exception as e:  # no green contexts here: four stages on one stream
            C.progress(f"{name}: sm_slices(4) unavailable ({e}); K=4 on the caller's stream")
    for K in (1, 4):
        for graphs in (False, True):
            C.progress(f"{name}: compiling K={K} M={M} cuda_graphs={graphs}")
            pipes[(K, graphs)] = autopipe.compile(model, devices=placement[K], chunks=M, schedule="1f1b",
                                                  checkpoint="never", cuda_graphs=graphs, example_inputs=(x,))

    def step(pipe):
        def run():
            model.zero_grad(set_to_none=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pipe.step(x, target=y, loss_fn=loss_fn)
            torch.cuda.synchronize()
        return run

    variants = {"loop": loop, **{f"K{K} {'graphed' if g else 'eager'}": step(p) for (K, g), p in pipes.items()}}
    t = C.interleaved(variants, repeats=20, warmup=3, budget=budget, label=f"{name} ")  # warm-up: the captures
    rows = [[name, "loop", "-", f"{1e3 * t.median('loop'):.2f}", "1.00x", "-"]]
    for (K, graphs), pipe in pipes.items():
        key = f"K{K} {'graphed' if graphs else 'eager'}"
        eager_key = f"K{K} eager"
        rows.append([name, key, K, f"{1e3 * t.median(key):.2f}", f"{t.ratio(key, 'loop'):.3f}x",
                     f"{t.ratio(key, eager_key):.3f}x" if graphs else "-"])
    captured = pipes[(1, True)].plan.cuda_graphs
    ratio = t.ratio("K1 graphed", "loop")
    notes = [f"{name}: {params / 1e6:.0f} M params; " + C.timing_line(t),
             f"graphs: {name} K=1 M={M}: {ratio:.2f}x the eager loop"
             + (f" (goal <= {GOAL:.2f}x: {'met' if ratio <= GOAL else 'NOT met'})" if name == "gpt-135M" else ""),
             f"graphs: {name} K=4 M={M}: graphed {t.ratio('K4 graphed', 'K4 eager'):.2f}x eager "
             f"({'SM slices' if placement[4] and not isinstance(placement[4][0], str) else 'one stream'})",
             f"{name}: {str(captured).splitlines()[0]}"]
    for pipe in pipes.values():
        pipe.close()
    return rows, notes


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (with --device cpu: the argument check only)")
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--budget", type=float, default=40.0, help="seconds of timing per model")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        p.error(f"unknown model(s) {unknown}: choose from {', '.join(MODELS)}")
    device = torch.device(args.device)
    if device.type != "cuda":  # CUDA graphs need CUDA: the smoke path checks that compile refuses, and stops
        model, x, _ = build(names[0], device, tiny=True)
        try:
            autopipe.compile(model, devices=[str(device)], chunks=M, cuda_graphs=True, example_inputs=(x,))
        except ValueError as e:
            print(f"graphs: needs CUDA; compile refuses {device}: {e}")
            return 0
        print("graphs: compile accepted cuda_graphs=True on a CPU device", file=sys.stderr)
        return 1
    rows, notes = [], []
    for name in names:
        r, n = measure(name, device, args.tiny, args.budget)
        rows += r
        notes += n
        for line in n:
            print(line, flush=True)
    head = C.header("gpu_graphs", [f"gpu: {torch.cuda.get_device_name(device)}, torch {torch.__version__}",
                                   "t = median step (ms); vs loop = t / t(eager loop over the same 8 micro-batches); "
                                   "vs eager = t(graphed) / t(eager pipeline of the same K)", *notes])
    text = head + "\n" + C.table(rows, ["model", "variant", "K", "t (ms)", "vs loop", "vs eager"])
    print(text, flush=True)
    out = args.out
    if out is None and not args.tiny:
        out = C.RESULTS / f"gpu_graphs_{C.gpu_name(device)}.txt"
    if out is not None:
        C.write_file(out, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
