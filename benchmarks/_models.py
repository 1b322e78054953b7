"""Benchmark model builders shared by the benchmarks.

Both builders return plain ``nn.Module`` trees (not ``nn.Sequential``), the kind
of model a user hands to ``autopipe.compile`` unchanged, and both are
deterministic given ``seed``: every module draws from its own generator
seeded from ``seed`` and its qualified name (the global RNG is neither read
nor advanced), so one rank can materialise just its stage of a meta-device
model with the same values (see ``init_weights``).

Sizes, measured with one intra-op thread on the 2-core AMD EPYC (Zen 5) VM,
torch 2.13 CPU, while the machine was shared (``python -m benchmarks._models``):

    transformer_like()              17.3 M params, batch 1024: ~1.2-1.4 s/step;
                                    as M micro-batches: 0.9x (M=4), 0.94-1.02x (M=8),
                                    1.2-1.4x (M=32) the whole-batch step
    transformer_like(256, 1024, 8)  batch 1024: ~0.34 s/step; 1.02x (M=8), 1.33x (M=32)

No size reaches both targets (~0.1-0.3 s/step and free micro-batching at
M=32): a 32-row micro-batch re-reads each weight matrix once per micro-batch
(4 MiB per 512x2048 Linear, more than the 1 MiB L2), and per-op overhead
(~10-20 us per op, ~20 ops per block forward+backward) grows with M. The
defaults keep the D=512, H=2048 shape of the reference numbers in docs/architecture.md (pitfalls).
"""

from __future__ import annotations

import zlib

import torch
from torch import nn
from torch.nn import functional as F

__all__ = ["transformer_like", "cnn_like", "TransformerLike", "CNNLike", "init_weights"]


def _module_seed(seed: int, qualname: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(qualname.encode())) % (2**63)


def init_weights(model: nn.Module, seed: int = 0, only: nn.Module | None = None) -> nn.Module:
    """Draw the parameters of ``model`` deterministically from ``seed``.

    Each leaf module draws from its own generator, seeded from ``seed`` and the
    module's qualified name in ``model``, with torch's default distributions
    (kaiming-uniform weights and uniform biases for Linear/Conv, ones/zeros for
    norms). So the values depend neither on the global RNG nor on which other
    modules exist or were initialised: a rank can materialise only its stage
    of a model built on the meta device and get exactly the values of a full
    build::

        with torch.device("meta"):
            model = TransformerLike()            # no memory
        stage = Back(model, 4)                   # shares model's submodules
        stage.to_empty(device="cpu")             # this rank's storage only
        init_weights(model, seed=0, only=stage)  # == transformer_like(seed=0)'s values

    ``only``: initialise just the modules that are also inside ``only``.
    Modules whose parameters are still on the meta device are skipped.
    Returns ``model``.
    """
    wanted = None if only is None else {id(m) for m in only.modules()}
    for name, m in model.named_modules():
        if wanted is not None and id(m) not in wanted:
            continue
        if not isinstance(m, (nn.Linear, nn.Conv2d, nn.LayerNorm, nn.BatchNorm2d)):
            continue
        w = getattr(m, "weight", None)
        if w is None or w.is_meta:
            continue
        g = torch.Generator().manual_seed(_module_seed(seed, name))
        with torch.no_grad():
            if isinstance(m, (nn.Linear, nn.Conv2d)):
                # kaiming_uniform_(a=sqrt(5)) == U(-1/sqrt(fan_in), 1/sqrt(fan_in))
                bound = 1.0 / m.weight[0].numel() ** 0.5
                m.weight.copy_(torch.empty(m.weight.shape).uniform_(-bound, bound, generator=g))
                if m.bias is not None:
                    m.bias.copy_(torch.empty(m.bias.shape).uniform_(-bound, bound, generator=g))
            else:
                m.weight.fill_(1.0)
                m.bias.zero_()
                if isinstance(m, nn.BatchNorm2d):
                    m.reset_running_stats()
    return model


class Block(nn.Module):
    """Pre-norm residual MLP block: ``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TransformerLike(nn.Module):
    """Input projection, ``blocks`` pre-norm MLP blocks, final norm and head.

    Attention-free on purpose: the per-sample cost is independent of the
    other samples, so micro-batching changes only GEMM shapes. Input
    ``(batch, d)``, output ``(batch, d)``.
    """

    def __init__(self, d: int = 512, hidden: int = 2048, blocks: int = 8) -> None:
        super().__init__()
        self.d, self.hidden, self.n_blocks = d, hidden, blocks
        self.proj = nn.Linear(d, d)
        self.blocks = nn.ModuleList(Block(d, hidden) for _ in range(blocks))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def transformer_like(
    d: int = 512, hidden: int = 2048, blocks: int = 8, seed: int = 0
) -> TransformerLike:
    """A pre-norm, attention-free residual MLP "transformer" for pipeline benchmarks.

    ``TransformerLike(d, hidden, blocks)`` with parameters drawn from ``seed``.
    Input shape ``(batch, d)``; pair it with ``nn.MSELoss()`` and a
    ``(batch, d)`` target.
    """
    return init_weights(TransformerLike(d, hidden, blocks), seed)


class ResBlock(nn.Module):
    """conv-bn-relu-conv-bn plus identity, then relu."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class CNNLike(nn.Module):
    """Small ResNet-ish CNN: stem, ``stages`` x ``blocks_per_stage`` residual
    blocks (channels doubling, stride-2 downsampling between stages), global
    average pool and a linear classifier. Input ``(batch, in_ch, size, size)``.

    BatchNorm makes each micro-batch's statistics differ from the whole
    batch's: pipelined results equal the plain model's only per micro-batch,
    which is exactly what benchmarks of micro-batching must expose.
    """

    def __init__(
        self,
        in_ch: int = 3,
        width: int = 32,
        stages: int = 3,
        blocks_per_stage: int = 2,
        num_classes: int = 10,
    ) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_ch, width, 3, padding=1, bias=False),
            nn.BatchNorm2d(width),
            nn.ReLU(),
        )
        layers: list[nn.Module] = []
        c = width
        for s in range(stages):
            if s > 0:
                layers += [
                    nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, bias=False),
                    nn.BatchNorm2d(2 * c),
                    nn.ReLU(),
                ]
                c *= 2
            layers += [ResBlock(c) for _ in range(blocks_per_stage)]
        self.layers = nn.ModuleList(layers)
        self.fc = nn.Linear(c, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def cnn_like(
    in_ch: int = 3,
    width: int = 32,
    stages: int = 3,
    blocks_per_stage: int = 2,
    num_classes: int = 10,
    seed: int = 0,
) -> CNNLike:
    """A small residual CNN (conv/bn/relu blocks) for pipeline benchmarks.

    Input ``(batch, in_ch, H, W)`` (32x32 in the benchmarks), output
    ``(batch, num_classes)`` logits; pair it with ``nn.CrossEntropyLoss()``.
    """
    return init_weights(CNNLike(in_ch, width, stages, blocks_per_stage, num_classes), seed)


def _time_microbatching(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunks, reps: int = 5):
    """Median seconds of one training step with the batch run as M micro-batches
    (gradients accumulated), interleaving the M values across repetitions."""
    import statistics
    import time

    loss_fn = nn.MSELoss() if y.dtype.is_floating_point else nn.CrossEntropyLoss()
    times: dict[int, list[float]] = {m: [] for m in chunks}
    for rep in range(reps + 1):
        for m in chunks:
            model.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            for xs, ys in zip(x.tensor_split(m), y.tensor_split(m)):
                (loss_fn(model(xs), ys) * (len(xs) / len(x))).backward()
            if rep:  # rep 0 is warm-up
                times[m].append(time.perf_counter() - t0)
    return {m: statistics.median(t) for m, t in times.items()}


if __name__ == "__main__":  # python -m benchmarks._models: sizes and micro-batching cost
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    for name, model, x, y in [
        (
            "transformer_like()",
            transformer_like(),
            torch.randn(1024, 512, generator=g),
            torch.randn(1024, 512, generator=g),
        ),
        (
            "cnn_like()",
            cnn_like(),
            torch.randn(256, 3, 32, 32, generator=g),
            torch.randint(0, 10, (256,), generator=g),
        ),
    ]:
        n = sum(p.numel() for p in model.parameters())
        t = _time_microbatching(model, x, y, (1, 4, 8, 32))
        print(f"{name}: {n / 1e6:.2f} M params, batch {len(x)}, 1 thread")
        for m, s in t.items():
            print(f"  M={m:<3d} {s:.3f} s/step  {s / t[1]:.2f}x the whole batch")
