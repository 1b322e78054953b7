"""Our own models, for the tests and the benchmarks: plain ``nn.Module`` trees (no ``nn.Sequential`` at the top),
each exercising a graph shape a user's model has.

Small (the tests'): :class:`MLP`, :class:`ResNet`, :class:`UNet`, :class:`GPT`, :class:`KwargsModel`,
:class:`DataclassModel`, :class:`TwoInputs`; :func:`build` and :func:`random_inputs` make them by name, seeded.
Benchmark-sized: :func:`transformer_like` and :func:`cnn_like` (deterministic per-module weights,
:func:`init_weights`), and, for the partition benchmark on the meta device, ``GPT(layers=24, d=1024, ...)``,
:class:`ResNet50`, :class:`RonnebergerUNet` and :class:`ViT`. The defaults are the tests' sizes: tests rely on them.
"""
from __future__ import annotations

import dataclasses
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F


# -- MLPs ------------------------------------------------------------------------------------------------------

class MLP(nn.Module):
    """``depth`` Linear+ReLU layers and an output Linear."""

    def __init__(self, d_in=8, hidden=32, d_out=4, depth=6):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d_in if i == 0 else hidden, hidden) for i in range(depth)])
        self.out = nn.Linear(hidden, d_out)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.out(x)


class MLPBlock(nn.Module):
    """Pre-norm residual MLP block: ``x + fc2(gelu(fc1(norm(x))))``."""

    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, hidden)
        self.fc2 = nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class TransformerLike(nn.Module):
    """Input projection, ``blocks`` pre-norm residual MLP blocks, final norm and head; input and output ``(batch, d)``.

    Attention-free on purpose: the per-sample cost is independent of the other samples, so micro-batching
    changes only GEMM shapes."""

    def __init__(self, d: int = 512, hidden: int = 2048, blocks: int = 8) -> None:
        super().__init__()
        self.d, self.hidden, self.n_blocks = d, hidden, blocks
        self.proj = nn.Linear(d, d)
        self.blocks = nn.ModuleList(MLPBlock(d, hidden) for _ in range(blocks))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


# -- CNNs ------------------------------------------------------------------------------------------------------

class ResBlock(nn.Module):
    """conv-bn-relu-conv-bn plus identity, then relu."""

    def __init__(self, c):
        super().__init__()
        self.conv1 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ResNet(nn.Module):
    """A residual CNN with BatchNorm: a stem, ``stages`` stages of ``blocks`` ResBlocks (channels doubling, a
    stride-2 conv-bn-relu between stages), global average pool and a linear head. Input ``(batch, in_ch, H, W)``.

    Defaults: the tests' (one stage of 4 blocks at 8 channels, a plain conv stem). :func:`cnn_like`: the
    benchmarks' (3 stages x 2 blocks from 32 channels, a conv-bn-relu stem). BatchNorm makes each micro-batch's
    statistics differ from the whole batch's: pipelined results equal the plain model's only per micro-batch."""

    def __init__(self, c=8, blocks=4, classes=5, stages=1, in_ch=3, stem_bn=False):
        super().__init__()
        if stem_bn:
            self.stem = nn.Sequential(nn.Conv2d(in_ch, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
        else:
            self.stem = nn.Conv2d(in_ch, c, 3, padding=1)
        layers: list[nn.Module] = []
        for s in range(stages):
            if s > 0:
                layers.append(nn.Sequential(nn.Conv2d(c, 2 * c, 3, stride=2, padding=1, bias=False),
                                            nn.BatchNorm2d(2 * c), nn.ReLU()))
                c *= 2
            layers += [ResBlock(c) for _ in range(blocks)]
        self.blocks = nn.ModuleList(layers)
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(dim=(2, 3)))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        out = planes * self.expansion
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, out, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(out)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = None
        if stride != 1 or inplanes != out:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        y = self.relu(self.bn1(self.conv1(x)))
        y = self.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        return self.relu(y + identity)


class ResNet50(nn.Module):
    """torchvision's ResNet-50 layout (v1.5: stride on the 3x3 conv), written out here."""

    def __init__(self, layers=(3, 4, 6, 3), num_classes=1000):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        inplanes, stages = 64, []
        for i, (planes, count) in enumerate(zip((64, 128, 256, 512), layers)):
            blocks = []
            for j in range(count):
                blocks.append(Bottleneck(inplanes, planes, stride=2 if (i > 0 and j == 0) else 1))
                inplanes = planes * Bottleneck.expansion
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, num_classes)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class UNet(nn.Module):
    """Long skips: each encoder level feeds the decoder level at the other end of the graph. Input ``(batch, 1, H, W)``."""

    def __init__(self, c=4, levels=3):
        super().__init__()
        self.inc = nn.Conv2d(1, c, 3, padding=1)
        self.down = nn.ModuleList([nn.Conv2d(c * 2**i, c * 2 ** (i + 1), 3, stride=2, padding=1) for i in range(levels)])
        self.mid = nn.Conv2d(c * 2**levels, c * 2**levels, 3, padding=1)
        self.up = nn.ModuleList([nn.ConvTranspose2d(c * 2 ** (i + 1), c * 2**i, 2, stride=2) for i in reversed(range(levels))])
        self.fuse = nn.ModuleList([nn.Conv2d(c * 2 ** (i + 1), c * 2**i, 3, padding=1) for i in reversed(range(levels))])
        self.outc = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        x = F.relu(self.inc(x))
        skips = []
        for down in self.down:
            skips.append(x)
            x = F.relu(down(x))
        x = F.relu(self.mid(x))
        for up, fuse in zip(self.up, self.fuse):
            x = up(x)
            x = F.relu(fuse(torch.cat([x, skips.pop()], dim=1)))
        return self.outc(x)


class DoubleConv(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(x)))


class RonnebergerUNet(nn.Module):
    """Ronneberger et al.'s U-Net (padded convs, BatchNorm, max-pool down): each encoder level's output skips to the
    decoder level of the same resolution."""

    def __init__(self, in_channels=3, classes=2, base=64, levels=4):
        super().__init__()
        widths = [base * 2**i for i in range(levels + 1)]
        self.downs = nn.ModuleList(DoubleConv(c_in, c_out) for c_in, c_out in zip([in_channels] + widths[:-2], widths[:-1]))
        self.mid = DoubleConv(widths[-2], widths[-1])
        self.ups = nn.ModuleList(nn.ConvTranspose2d(w, w // 2, 2, stride=2) for w in reversed(widths[1:]))
        self.decs = nn.ModuleList(DoubleConv(w, w // 2) for w in reversed(widths[1:]))
        self.out = nn.Conv2d(base, classes, 1)

    def forward(self, x):
        skips = []
        for down in self.downs:
            x = down(x)
            skips.append(x)
            x = F.max_pool2d(x, 2)
        x = self.mid(x)
        for up, dec, skip in zip(self.ups, self.decs, reversed(skips)):
            x = dec(torch.cat([skip, up(x)], dim=1))
        return self.out(x)


# -- transformers ----------------------------------------------------------------------------------------------

def _drop(drop: nn.Module | None, x):
    return x if drop is None else drop(x)


class SelfAttention(nn.Module):
    """Multi-head self-attention through SDPA, one fused qkv projection. ``dropout=None``: no Dropout module at all
    (``0.0`` keeps one, with p=0)."""

    def __init__(self, d, heads, dropout=None, causal=True):
        super().__init__()
        self.heads, self.causal = heads, causal
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = None if dropout is None else nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return _drop(self.drop, self.proj(y.transpose(1, 2).reshape(b, t, d)))


class TransformerBlock(nn.Module):
    """Pre-norm transformer block: attention and a 4x GELU MLP, each residual."""

    def __init__(self, d, heads, dropout=None, causal=True):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = SelfAttention(d, heads, dropout, causal)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.drop = None if dropout is None else nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + _drop(self.drop, self.proj(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """A GPT: token + position embeddings, causal blocks, final norm, LM head (tied to the token embedding unless
    ``tied=False``). Input: token ids ``(batch, seq <= block)``.

    Defaults: the tests' small GPT with dropout 0.1. The benchmarks' GPT-2-sized ones pass ``dropout=None`` (no
    Dropout modules in the graph)."""

    def __init__(self, vocab=64, d=32, heads=4, layers=4, block=16, dropout=0.1, tied=True):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.drop = None if dropout is None else nn.Dropout(dropout)
        self.blocks = nn.ModuleList([TransformerBlock(d, heads, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = _drop(self.drop, self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class ViT(nn.Module):
    """ViT-B/16: patch embedding, class token, learned positions, pre-norm blocks, head."""

    def __init__(self, image=224, patch=16, d=768, n_blocks=12, heads=12, classes=1000):
        super().__init__()
        self.patch_embed = nn.Conv2d(3, d, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, d))
        self.pos_embed = nn.Parameter(torch.zeros(1, (image // patch) ** 2 + 1, d))
        self.blocks = nn.ModuleList(TransformerBlock(d, heads, causal=False) for _ in range(n_blocks))
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x):
        x = self.patch_embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


# -- inputs and outputs of other shapes --------------------------------------------------------------------------

@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class KwargsModel(nn.Module):
    """Keyword arguments, a None/bool argument, a dict output and a loss computed inside."""

    def __init__(self, d=8, classes=3):
        super().__init__()
        self.enc = nn.Linear(d, 16)
        self.mid = nn.Linear(16, 16)
        self.cls = nn.Linear(16, classes)

    def forward(self, x, attention_mask=None, labels=None, return_hidden=False):
        h = torch.tanh(self.enc(x))
        if attention_mask is not None:
            h = h * attention_mask.unsqueeze(-1)
        h = torch.tanh(self.mid(h)).mean(dim=1)
        logits = self.cls(h)
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits, labels)
        if return_hidden:
            out["hidden"] = h
        return out


class DataclassModel(KwargsModel):
    def forward(self, x, labels=None):
        out = super().forward(x, labels=labels)
        return Output(logits=out["logits"], loss=out.get("loss"))


class TwoInputs(nn.Module):
    """Two inputs that meet late, and two outputs."""

    def __init__(self):
        super().__init__()
        self.a = nn.ModuleList([nn.Linear(6, 6) for _ in range(3)])
        self.b = nn.ModuleList([nn.Linear(4, 6) for _ in range(3)])
        self.joint = nn.Linear(12, 5)

    def forward(self, a, b):
        for la in self.a:
            a = torch.relu(la(a))
        bs = [torch.sigmoid(lb(b)) for lb in self.b]
        b = bs[0] + bs[1] * bs[2]
        return self.joint(torch.cat([a, b], dim=-1)), a.sum(dim=-1)


# -- the small models by name ------------------------------------------------------------------------------------

class MaskedStack(nn.Module):
    """Transformer layers given one (seq, seq) causal mask as an argument: a tensor without the batch, which every stage reads."""

    def __init__(self, d: int = 16, layers: int = 4):
        super().__init__()
        self.layers = nn.ModuleList([nn.TransformerEncoderLayer(d, 2, dim_feedforward=2 * d, dropout=0.0, batch_first=True) for _ in range(layers)])

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, src_mask=mask)
        return x


class ScaledByItem(nn.Module):
    """Four layers; the third divides by a value read back to the host (``.item()``): no CUDA graph can hold it."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        for i, layer in enumerate(self.layers):
            x = torch.relu(layer(x))
            if i == 2:
                x = x / x.abs().max().item()
        return x


class RoutedExperts(nn.Module):
    """A mixture of experts as users write it: each expert takes the rows routed to it, a number that depends on the router's values, and
    its output goes back where the rows came from. ``how``: ``x[mask]`` and ``out[mask] = y`` (top-1, which fx cannot trace); ``nonzero``
    and ``index_add`` (top-2); transformers' eager experts (``torch.where``, ``h[None, idx].reshape(-1, d)``, ``index_add_``)."""

    def __init__(self, how: str, d=16, experts=3):
        super().__init__()
        self.how, self.gate = how, nn.Linear(d, experts)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d)) for _ in range(experts))

    def forward(self, x):
        b, t, d = x.shape
        h = x.reshape(-1, d)
        weights = self.gate(h).softmax(-1)
        out = torch.zeros_like(h)
        if self.how == "mask":
            top = weights.argmax(-1)
            for i, expert in enumerate(self.experts):
                mask = top == i
                out[mask] = expert(h[mask]) * weights[mask, i:i + 1]
            return x + out.view(b, t, d)
        weights, chosen = weights.topk(2, dim=-1)
        for i, expert in enumerate(self.experts):
            if self.how == "nonzero":
                rows, slot = torch.nonzero(chosen == i, as_tuple=True)
                out = out.index_add(0, rows, expert(h[rows]) * weights[rows, slot].unsqueeze(-1))
            else:
                slot, rows = torch.where(F.one_hot(chosen, len(self.experts)).permute(2, 1, 0)[i])
                out.index_add_(0, rows, expert(h[None, rows].reshape(-1, d)) * weights[rows, slot, None])
        return x + out.view(b, t, d)


class ExpertStack(nn.Module):
    """Blocks of RoutedExperts, each written one way of ``hows``: rows of a size set by values inside every block, none between."""

    def __init__(self, hows: tuple[str, ...] = ("mask", "nonzero", "transformers", "mask")):
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 3)
        self.blocks = nn.Sequential(*[RoutedExperts(how) for how in hows])

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))


def build(name: str) -> nn.Module:
    """The named small model with its default sizes, after ``torch.manual_seed(0)``."""
    torch.manual_seed(0)
    return {
        "mlp": MLP, "resnet": ResNet, "unet": UNet, "gpt": GPT, "kwargs": KwargsModel,
        "dataclass": DataclassModel, "two_inputs": TwoInputs, "masked": MaskedStack, "moe": ExpertStack,
    }[name]()


def random_inputs(name: str, batch: int = 8, generator: torch.Generator | None = None):
    """(args, kwargs) that fit ``build(name)``."""
    g = generator
    if name == "mlp":
        return (torch.randn(batch, 8, generator=g),), {}
    if name == "resnet":
        return (torch.randn(batch, 3, 8, 8, generator=g),), {}
    if name == "unet":
        return (torch.randn(batch, 1, 16, 16, generator=g),), {}
    if name == "gpt":
        return (torch.randint(0, 64, (batch, 16), generator=g),), {}
    if name == "kwargs":
        return (torch.randn(batch, 5, 8, generator=g),), {
            "attention_mask": (torch.rand(batch, 5, generator=g) > 0.3).float(),
            "labels": torch.randint(0, 3, (batch,), generator=g),
            "return_hidden": True,
        }
    if name == "dataclass":
        return (torch.randn(batch, 5, 8, generator=g),), {"labels": torch.randint(0, 3, (batch,), generator=g)}
    if name == "two_inputs":
        return (torch.randn(batch, 6, generator=g), torch.randn(batch, 4, generator=g)), {}
    if name == "masked":  # seq 5: not a batch size the tests use, so the mask is never taken for batch rows
        return (torch.randn(batch, 5, 16, generator=g), nn.Transformer.generate_square_subsequent_mask(5)), {}
    if name == "moe":
        return (torch.randn(batch, 5, 8, generator=g),), {}
    raise KeyError(name)


def scalar_loss(output) -> torch.Tensor:
    """A loss that touches every tensor in the output, whatever its structure."""
    leaves = [t for t in tensor_leaves(output) if t.is_floating_point()]
    return sum((t.float() * (k + 1)).sin().sum() for k, t in enumerate(leaves))


def tensor_leaves(output) -> list[torch.Tensor]:
    """The tensors in a model output (tensor, dataclass, dict, list, tuple, nested), in order."""
    if isinstance(output, torch.Tensor):
        return [output]
    if dataclasses.is_dataclass(output):
        output = [getattr(output, f.name) for f in dataclasses.fields(output)]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in tensor_leaves(o)]
    return []


# -- the benchmarks' models: weights drawn per module ------------------------------------------------------------

def _module_seed(seed: int, qualname: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(qualname.encode())) % (2**63)


def init_weights(model: nn.Module, seed: int = 0, only: nn.Module | None = None) -> nn.Module:
    """Draw the parameters of ``model`` deterministically from ``seed``; returns ``model``.

    Each leaf module draws from its own generator, seeded from ``seed`` and the module's qualified name in
    ``model``, with torch's default distributions (kaiming-uniform weights and uniform biases for Linear/Conv,
    ones/zeros for norms). So the values depend neither on the global RNG nor on which other modules exist or were
    initialised: a rank can materialise only its stage of a model built on the meta device and get exactly the
    values of a full build::

        with torch.device("meta"):
            model = TransformerLike()            # no memory
        stage = Back(model, 4)                   # shares model's submodules
        stage.to_empty(device="cpu")             # this rank's storage only
        init_weights(model, seed=0, only=stage)  # == transformer_like(seed=0)'s values

    ``only``: initialise just the modules that are also inside ``only``. Modules whose parameters are still on the
    meta device are skipped.
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


def transformer_like(d: int = 512, hidden: int = 2048, blocks: int = 8, seed: int = 0) -> TransformerLike:
    """``TransformerLike(d, hidden, blocks)`` with parameters drawn from ``seed``; pair it with ``nn.MSELoss()`` and
    a ``(batch, d)`` target.

    Sizes, measured with one intra-op thread on the 2-core AMD EPYC (Zen 5) VM, torch 2.13 CPU, shared
    (``python -m zoo.models``): the default (17.3 M params) at batch 1024 takes ~1.2-1.4 s/step, and as M
    micro-batches 0.9x (M=4), 0.94-1.02x (M=8), 1.2-1.4x (M=32) the whole-batch step; ``(256, 1024, 8)``: ~0.34
    s/step, 1.02x (M=8), 1.33x (M=32). No size reaches both ~0.1-0.3 s/step and free micro-batching at M=32: a
    32-row micro-batch re-reads each weight matrix once per micro-batch (4 MiB per 512x2048 Linear, more than the
    1 MiB L2), and per-op overhead (~10-20 us per op, ~20 ops per block forward+backward) grows with M. The
    defaults keep the D=512, H=2048 shape of the reference numbers in docs/decisions/history.md (2026-11-23)."""
    return init_weights(TransformerLike(d, hidden, blocks), seed)


def cnn_like(in_ch: int = 3, width: int = 32, stages: int = 3, blocks_per_stage: int = 2, num_classes: int = 10,
             seed: int = 0) -> ResNet:
    """The benchmarks' residual CNN: ``ResNet`` with a conv-bn-relu stem and ``stages`` x ``blocks_per_stage``
    blocks, parameters drawn from ``seed``. Input ``(batch, in_ch, H, W)``, output ``(batch, num_classes)`` logits;
    pair it with ``nn.CrossEntropyLoss()``."""
    return init_weights(ResNet(width, blocks_per_stage, num_classes, stages, in_ch, stem_bn=True), seed)


if __name__ == "__main__":  # python -m zoo.models: the benchmark models' sizes and micro-batching cost
    import statistics
    import time

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    for label, model, x, y in [
        ("transformer_like()", transformer_like(), torch.randn(1024, 512, generator=g), torch.randn(1024, 512, generator=g)),
        ("cnn_like()", cnn_like(), torch.randn(256, 3, 32, 32, generator=g), torch.randint(0, 10, (256,), generator=g)),
    ]:
        loss_fn = nn.MSELoss() if y.dtype.is_floating_point else nn.CrossEntropyLoss()
        times: dict[int, list[float]] = {m: [] for m in (1, 4, 8, 32)}
        for rep in range(6):  # M values interleaved; rep 0 is warm-up
            for m in times:
                model.zero_grad(set_to_none=True)
                t0 = time.perf_counter()
                for xs, ys in zip(x.tensor_split(m), y.tensor_split(m)):
                    (loss_fn(model(xs), ys) * (len(xs) / len(x))).backward()
                if rep:
                    times[m].append(time.perf_counter() - t0)
        med = {m: statistics.median(t) for m, t in times.items()}
        print(f"{label}: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M params, batch {len(x)}, 1 thread")
        for m, s in med.items():
            print(f"  M={m:<3d} {s:.3f} s/step  {s / med[1]:.2f}x the whole batch")
