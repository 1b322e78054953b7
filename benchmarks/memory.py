"""Memory: saved activations per checkpoint mode, and the deepest model that fits (GPipe Table 1 style).

    python benchmarks/memory.py            # real sizes (~1 min on 2 cores)
    python benchmarks/memory.py --quick    # tiny smoke test

Part 1, measured: one training step of a small GPT-style model at M=32 under
autopipe with checkpoint = never / except_last / always on K = 1 and 2 CPU
workers, read from ``pipe.memory`` (bytes autograd saves between forward and
backward, counted with saved-tensor hooks; parameters excluded; measured only with
``autopipe.compile(..., track_memory=True)``), against the
plain model counted the same way (autopipe.runtime.memory.SavedBytes). The
"predicted" column is the analytic model of part 2 applied to this model, so
the measurement checks the model. Per stage, the measured peak is set beside
what the plan predicts for it (``pipe.plan.memory``, passes/memory_model/:
saved activations from a fake-tensor run of the graph); they must agree
within 15%.

Part 2, analytic from one measured layer (GPipe Table 1 in miniature): a
GPT-style model (d, heads, seq, vocab below; fp32; Adam), a fixed per-device
memory budget holding weights + gradients + 2 Adam states (4 x the parameter
bytes) + saved activations. Measured once, on real tensors with batch 1:
saved bytes of one block, of the embeddings and of the head (final norm +
LM head), all linear in the batch. Then per stage s with n blocks, whole
mini-batch N in M micro-batches, stage input in_s (token ids or the hidden
state), block activations a:
    never        4*W + n*a + fixed activations            (every micro-batch's activations kept)
    except_last  4*W + in_s*(M-1)/M + 2*(n*a + fixed)/M   (last micro-batch kept + one re-materialised)
    always       4*W + in_s + (n*a + fixed)/M              (one micro-batch re-materialised at a time)
Each stage takes as many blocks as fit (embeddings on stage 0, head on stage
K-1); the deepest model is the sum. The loss (its saved log-softmax) is outside
the model and not counted; neither is the backward's transient memory.
GPipe (Table 1, Transformer-L, 8 GB accelerators): Naive-1 3 layers / 282.2M
params -> Pipeline-1 13 layers / 785.8M params, ~2.7x from re-materialisation alone.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import autopipe  # noqa: E402
from autopipe.ir.plan import human_bytes  # noqa: E402
from autopipe.runtime.memory import SavedBytes  # noqa: E402
from benchmarks import _common as C  # noqa: E402
from zoo import GPT, TransformerBlock  # noqa: E402

MODES = ("never", "except_last", "always")
TOLERANCE = 0.15  # predicted vs measured peak, per stage


class Saved(SavedBytes):
    """The runtime's counter (distinct storages autograd saves), skipping the parameters' storages as a stage does
    (autograd saves ``weight.t()``, a view of the weight's storage, for a Linear on a 3-D input)."""

    def __init__(self, params):
        super().__init__({p.untyped_storage().data_ptr() for p in params})


def saved(params, fn) -> int:
    """Bytes autograd saves while running ``fn`` (distinct storages, ``params`` excluded), as the runtime counts."""
    with Saved(params) as s:
        out = fn()
    del out
    return s.total


@dataclass
class Layer:
    """Bytes measured on one GPT-style config, per sample (activations) or total (parameters)."""

    block_act: float     # saved activations of one block, per sample
    embed_act: float     # embeddings, per sample
    head_act: float      # final norm + LM head, per sample
    block_params: int    # parameter bytes of one block
    embed_params: int    # wte + wpe
    head_params: int     # ln_f + lm_head
    hidden: float        # the hidden state crossing a cut, per sample
    ids: float           # the token ids entering stage 0, per sample


def measure_layer(d: int, heads: int, seq: int, vocab: int, batch: int = 1) -> Layer:
    """Measure a block, the embeddings and the head on real tensors (batch ``batch``; results per sample)."""
    torch.manual_seed(0)
    small_vocab = min(vocab, 64)  # embedding/head activations do not depend on the vocabulary (logits are not saved)
    model = GPT(small_vocab, d, heads, layers=1, block=seq, dropout=None, tied=False)
    block = model.blocks[0]
    x = torch.randn(batch, seq, d, requires_grad=True)
    idx = torch.zeros(batch, seq, dtype=torch.long)
    block_act = saved(block.parameters(), lambda: block(x))
    embed_act = saved(model.parameters(), lambda: model.wte(idx) + model.wpe(torch.arange(seq)))
    head_act = saved(model.parameters(), lambda: model.lm_head(model.ln_f(x)))
    nbytes = lambda ps: sum(p.numel() * p.element_size() for p in ps)  # noqa: E731
    return Layer(
        block_act=block_act / batch, embed_act=embed_act / batch, head_act=head_act / batch,
        block_params=nbytes(block.parameters()),
        embed_params=(vocab * d + seq * d) * 4,
        head_params=nbytes(model.ln_f.parameters()) + vocab * d * 4,
        hidden=seq * d * 4, ids=seq * 8,
    )


def stage_bytes(layer: Layer, mode: str, n: int, s: int, K: int, N: int, M: int, states: float = 4.0) -> float:
    """Weights (+grads+Adam) and saved activations of stage ``s`` of ``K`` holding ``n`` blocks."""
    weights = n * layer.block_params + (layer.embed_params if s == 0 else 0) + (layer.head_params if s == K - 1 else 0)
    acts = N * (n * layer.block_act + (layer.embed_act if s == 0 else 0) + (layer.head_act if s == K - 1 else 0))
    inp = N * (layer.ids if s == 0 else layer.hidden)
    if mode == "never":
        act_bytes = acts
    elif mode == "except_last":
        act_bytes = inp * (M - 1) / M + 2 * acts / M
    else:
        act_bytes = inp + acts / M
    return states * weights + act_bytes


def deepest(layer: Layer, mode: str, K: int, N: int, M: int, budget: float) -> int | None:
    """The most blocks that fit ``budget`` per device over ``K`` stages (None: not even the embeddings/head fit)."""
    total = 0
    for s in range(K):
        if stage_bytes(layer, mode, 0, s, K, N, M) > budget:
            return None
        lo, hi = 0, 1
        while stage_bytes(layer, mode, hi, s, K, N, M) <= budget:
            lo, hi = hi, hi * 2
        while hi - lo > 1:  # largest n that fits
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if stage_bytes(layer, mode, mid, s, K, N, M) <= budget else (lo, mid)
        total += lo
    return total


def params_of(layer: Layer, blocks: int) -> float:
    return (blocks * layer.block_params + layer.embed_params + layer.head_params) / 4


def measured_part(quick: bool):
    """Part 1: one step per (K, mode) of a small GPT at M=32; returns rows and a description."""
    layers, d, heads, seq, vocab, N = (2, 32, 2, 16, 64, 8) if quick else (4, 256, 4, 128, 1024, 32)
    M = 4 if quick else 32
    torch.manual_seed(0)
    model = GPT(vocab, d, heads, layers, block=seq, dropout=None, tied=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, vocab, (N, seq), generator=g)
    y = torch.randint(0, vocab, (N, seq), generator=g)
    loss_fn = torch.nn.CrossEntropyLoss()
    threads = C.cores()
    torch.set_num_threads(threads)

    C.progress("memory: plain model step")
    with Saved(model.parameters()) as s:
        out = model(x)
    plain = s.total
    loss_fn(out.flatten(0, 1), y.flatten()).backward()
    model.zero_grad(set_to_none=True)
    del out

    layer = measure_layer(d, heads, seq, vocab, batch=N)
    rows = [["plain model", "-", "-", C.mib(plain), C.mib(plain), C.mib(plain), "1.00x",
             C.mib(N * (layers * layer.block_act + layer.embed_act + layer.head_act)), "-"]]
    stage_rows = []
    for K in (1, 2):
        for mode in MODES:
            C.progress(f"memory: K={K} M={M} checkpoint={mode}")
            # TransformerBlock kept whole: cuts fall between blocks (a cut inside attention, between qkv.split and its
            # getitems, sends the tuple undetached and breaks the backward; see the report)
            pipe = autopipe.compile(model, devices=["cpu"] * K, chunks=M, checkpoint=mode,
                                    intra_op_threads=max(1, threads // K), leaf_modules=(TransformerBlock,),
                                    track_memory=True, example_inputs=(x,))
            out = pipe(x)
            loss_fn(out.flatten(0, 1), y.flatten()).backward()
            model.zero_grad(set_to_none=True)
            mem = pipe.memory
            kept = sum(st.kept for st in mem.stages)
            peaks = [st.peak for st in mem.stages]
            acts = N * (layers * layer.block_act + layer.embed_act + layer.head_act)
            inputs = N * (layer.ids + (K - 1) * layer.hidden)
            predicted = {"never": acts, "except_last": inputs * (M - 1) / M + 2 * acts / M,
                         "always": inputs + acts / M}[mode]
            rows.append(["autopipe", K, mode, C.mib(kept), C.mib(sum(peaks)), C.mib(max(peaks)),
                         f"{sum(peaks) / plain:.3f}x", C.mib(predicted), f"{sum(peaks) / predicted:.2f}"])
            # GPipe holds every micro-batch at once, so the plan's in-flight kept is pipe.memory's kept
            for p, m in zip(pipe.plan.memory, mem.stages):
                stage_rows.append([K, mode, p.stage, C.mib(m.kept), C.mib(m.recompute_peak), C.mib(m.peak),
                                   C.mib(p.kept_activations), C.mib(p.recompute_peak), C.mib(p.activations_peak),
                                   f"{m.peak / p.activations_peak:.3f}"])
            pipe.close()
            del out
    desc = (f"part 1 (measured): GPT(layers={layers}, d={d}, heads={heads}, seq={seq}, vocab={vocab}), batch {N}, "
            f"M={M}, one training step (TransformerBlock kept whole: leaf_modules); per-block saved activations {C.mib(layer.block_act)} per sample")
    worst = max(abs(float(r[-1]) - 1) for r in stage_rows)
    desc = [desc,
            f"  per stage, measured vs predicted peak: largest difference {100 * worst:.1f}% "
            f"({'within' if worst <= TOLERANCE else 'OUTSIDE'} the {100 * TOLERANCE:.0f}% bound). Stage 0 measures "
            "more: the embedding saves its token ids, a view of the caller's mini-batch, and pipe.memory counts a "
            f"saved view by its whole storage, once per micro-batch ({human_bytes(x.nbytes)} x {M} instead of "
            f"{human_bytes(x.nbytes)} in all); and the position ids (arange(seq)) are whole in every micro-batch, where "
            "the prediction scales every saved tensor by the micro-batch's rows"]
    return rows, stage_rows, desc


def analytic_part(quick: bool, args):
    d, heads, seq, vocab = (32, 2, 16, 64) if quick else (args.d, args.heads, args.seq, args.vocab)
    N, M, budget = args.batch, args.micro_batches, args.budget_gib * 2**30
    if quick:
        budget = 2**20 * 4
    C.progress(f"memory: measuring one block of d={d}, heads={heads}, seq={seq} (batch 1)")
    layer = measure_layer(d, heads, seq, vocab, batch=1)
    rows = []
    base = {}
    for K in range(1, 5):
        row = [K]
        for mode in MODES:
            n = deepest(layer, mode, K, N, M, budget)
            base[(K, mode)] = n
            row.append("does not fit" if n is None else f"{n} / {params_of(layer, n) / 1e6:.0f}M")
        never = base[(K, "never")]
        for mode in ("except_last", "always"):
            n = base[(K, mode)]
            if never and n is not None:
                row.append(f"{n / never:.1f}x / {params_of(layer, n) / params_of(layer, never):.2f}x")
            else:
                row.append("-")
        rows.append(row)
    n1, r1 = base[(1, "never")], base[(1, "always")]
    headline = ("re-materialisation alone (K=1, never -> always): "
                + (f"{n1} -> {r1} blocks, {params_of(layer, n1) / 1e6:.0f}M -> {params_of(layer, r1) / 1e6:.0f}M params = "
                   f"{params_of(layer, r1) / params_of(layer, n1):.2f}x params ({r1 / n1:.1f}x blocks); GPipe: ~2.7x params "
                   f"(282.2M -> 785.8M), 4.3x layers (3 -> 13)" if n1 and r1 else "the plain model does not fit"))
    desc = [
        f"part 2 (analytic): GPT-style d={d}, heads={heads}, seq={seq}, vocab={vocab}, fp32, untied head, Adam "
        f"(4 x parameter bytes); batch {N} in M={M} micro-batches; budget {C.gib(budget)} per device",
        f"  measured per sample: block {C.mib(layer.block_act)}, embeddings {C.mib(layer.embed_act)}, head "
        f"{C.mib(layer.head_act)}; parameters: block {C.mib(layer.block_params)}, embeddings "
        f"{C.mib(layer.embed_params)}, head {C.mib(layer.head_params)}",
        "  " + headline,
    ]
    return rows, desc, headline


def main(argv=None) -> int:
    p = C.parser(__doc__)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--batch", type=int, default=32, help="mini-batch of part 2")
    p.add_argument("--micro-batches", type=int, default=32, help="M of part 2")
    p.add_argument("--budget-gib", type=float, default=2.0, help="memory per device in part 2")
    args = p.parse_args(argv)
    quick = args.quick

    rows1, stage_rows, desc1 = measured_part(quick)
    rows2, desc2, headline = analytic_part(quick, args)
    head = C.header("memory", [
        *desc1,
        "  kept = saved from the end of forward to backward, all stages; peak = kept + the largest re-materialised "
        "micro-batch, per stage (pipe.memory); vs plain = sum of stage peaks / the plain model's saved bytes;",
        "  predicted = the part-2 formulas summed over stages; meas/pred = measured sum of peaks / predicted",
        *desc2,
    ], quick=quick)
    t1 = C.table(rows1, ["run", "K", "checkpoint", "kept fwd->bwd", "sum of stage peaks", "largest stage peak",
                         "vs plain", "predicted", "meas/pred"])
    t_stages = C.table(stage_rows, ["K", "checkpoint", "stage", "kept (measured)", "recompute (measured)",
                                    "peak (measured)", "kept (predicted)", "recompute (predicted)",
                                    "peak (predicted)", "meas/pred"])
    t2 = C.table(rows2, ["K", "never: blocks / params", "except_last: blocks / params", "always: blocks / params",
                         "except_last vs never (blocks / params)", "always vs never (blocks / params)"])
    text = (head + "\n\nPart 1: saved activations, measured\n" + t1
            + "\n\nPart 1, per stage: measured (pipe.memory) vs predicted by the plan (pipe.plan.memory)\n" + t_stages
            + "\n\nPart 2: deepest GPT-style model within the budget, per device count K (analytic from one measured layer)\n"
            + t2 + "\n" + headline)
    C.write("memory", text, quick=quick, results_dir=args.results_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
