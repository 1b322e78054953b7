"""The autopipe demo: a small GPT with tied embeddings (not an nn.Sequential) on 4 CPU workers.

Prints the plan and one stage's generated code, trains a few steps with the
loss going down, and shows that the pipeline's gradients equal the plain model's.
Run: make demo   (or: python examples/demo.py)
"""
import copy
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopipe


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.out = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc, self.proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.drop = nn.Dropout(0.1)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.out(y))
        return x + self.drop(self.proj(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, vocab=96, d=64, heads=4, layers=8, block=32):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(block, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one Parameter used by the first and the last stage
        nn.init.normal_(self.wte.weight, std=0.02), nn.init.normal_(self.wpe.weight, std=0.02)  # as GPT-2

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def batch_of_text(generator, batch=32, length=32, vocab=96):
    """A learnable toy language: each token is the previous one plus one, modulo the vocabulary."""
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    seq = (start + torch.arange(length + 1)) % vocab
    return seq[:, :-1], seq[:, 1:]


def main():
    torch.manual_seed(0)
    model = TinyGPT()
    reference = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(0)
    x, y = batch_of_text(generator)

    pipe = autopipe.compile(model, devices=4, chunks=8, example_inputs=(x,), verbose=True)  # passes on stderr
    print(pipe.plan)
    print("\nGenerated code of stage 1 (pipe.stages[1].code):")
    print(pipe.stages[1].code)
    print(pipe.schedule)

    # Gradients equal the plain model's (dropout off for an exact comparison).
    model.eval(), reference.eval()
    loss_fn = lambda logits, target: F.cross_entropy(logits.flatten(0, 1), target.flatten())
    loss_fn(pipe(x), y).backward()
    loss_fn(reference(x), y).backward()
    worst = max((p.grad - q.grad).abs().max().item() for p, q in zip(model.parameters(), reference.parameters()))
    print(f"\nmax |grad(pipeline) - grad(plain model)| over all {sum(1 for _ in model.parameters())} parameters: {worst:.2e}")
    model.zero_grad()

    model.train()
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    print("\nTraining on 4 CPU workers, 8 micro-batches per step:")
    for step in range(1, 31):
        x, y = batch_of_text(generator)
        loss = pipe.step(x, target=y, loss_fn=loss_fn)
        optimizer.step()
        optimizer.zero_grad()
        if step % 5 == 0 or step == 1:
            print(f"  step {step:2d}  loss {loss.item():.3f}")
    pipe.close()
    if worst > 1e-4 or not math.isfinite(loss.item()):
        sys.exit("demo failed: gradients differ from the plain model's")


if __name__ == "__main__":
    main()
