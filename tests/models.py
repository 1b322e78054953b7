"""Small real models for the tests: none is an nn.Sequential, each exercises a graph shape."""
from __future__ import annotations

import dataclasses

import torch
import torch.nn as nn
import torch.nn.functional as F


class MLP(nn.Module):
    def __init__(self, d_in=8, hidden=32, d_out=4, depth=6):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d_in if i == 0 else hidden, hidden) for i in range(depth)])
        self.out = nn.Linear(hidden, d_out)

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.out(x)


class ResBlock(nn.Module):
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
    """A residual CNN with BatchNorm."""

    def __init__(self, c=8, blocks=4, classes=5):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 3, padding=1)
        self.blocks = nn.ModuleList([ResBlock(c) for _ in range(blocks)])
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        x = self.stem(x)
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(dim=(2, 3)))


class UNet(nn.Module):
    """Long skips: each encoder level feeds the decoder level at the other end of the graph."""

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


class CausalSelfAttention(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))


class GPTBlock(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.proj = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """A small GPT: token + position embeddings, a tied LM head, dropout."""

    def __init__(self, vocab=64, d=32, heads=4, layers=4, block=16, dropout=0.1):
        super().__init__()
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(block, d)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList([GPTBlock(d, heads, dropout) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied

    def forward(self, idx):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


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


def random_inputs(name: str, batch: int = 8, generator: torch.Generator | None = None):
    """(args, kwargs) that fit the named model."""
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
    raise KeyError(name)


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return {
        "mlp": MLP, "resnet": ResNet, "unet": UNet, "gpt": GPT, "kwargs": KwargsModel,
        "dataclass": DataclassModel, "two_inputs": TwoInputs,
    }[name]()


def scalar_loss(output) -> torch.Tensor:
    """A loss that touches every tensor in the output, whatever its structure."""
    leaves = [t for t in tensor_leaves(output) if t.is_floating_point()]
    return sum((t.float() * (k + 1)).sin().sum() for k, t in enumerate(leaves))


def tensor_leaves(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if dataclasses.is_dataclass(output):
        output = [getattr(output, f.name) for f in dataclasses.fields(output)]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [t for o in output for t in tensor_leaves(o)]
    return []
