"""pipe.clip_grad_norm_ (runtime/clipping.py) is the plain model's torch.nn.utils.clip_grad_norm_: the training loop a
user writes (AdamW, clipping every step, a GPT whose LM head is tied to its embedding) gives the plain model's
parameters and total norms in float64, for the 2-norm and the inf norm. The same loop over torchrun ranks, with a new
sequence length a step: test_distributed.py."""
import math

import pytest
import torch
import torch.nn.functional as F

import autopipe
from zoo import GPT


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def batches(seq_lens):
    g = torch.Generator().manual_seed(1)
    for seq in seq_lens:
        yield torch.randint(0, 64, (8, seq), generator=g), torch.randint(0, 64, (8, seq), generator=g)


def gpt64() -> GPT:
    torch.manual_seed(0)
    torch.set_default_dtype(torch.float64)
    try:
        return GPT(vocab=64, d=32, heads=4, layers=4, block=32, dropout=0.0)
    finally:
        torch.set_default_dtype(torch.float32)


def plain_loop(seq_lens, max_norm, norm_type=2.0, accumulate=1):
    """The loop on the plain model in one process: parameters after the last step, each batch's loss and each
    optimizer step's total norm (the gradients of ``accumulate`` batches summed before each)."""
    model = gpt64()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, norms = [], []
    for k, (ids, target) in enumerate(batches(seq_lens)):
        loss = lm_loss(model(ids), target)
        loss.backward()
        losses.append(loss.item())
        if (k + 1) % accumulate:
            continue
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm, norm_type).item())
        opt.step()
        opt.zero_grad()
    return dict(model.named_parameters(remove_duplicate=False)), losses, norms


@pytest.mark.parametrize("schedule,norm_type", [("gpipe", 2.0), ("1f1b", math.inf)])
def test_clipping_in_process_is_the_plain_models(schedule, norm_type):
    params, losses, norms = plain_loop([16] * 3, 0.5, norm_type)
    model = gpt64()
    pipe = autopipe.compile(model, devices=2, chunks=4, schedule=schedule)
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    for k, (ids, target) in enumerate(batches([16] * 3)):
        loss = pipe.step(ids, target=target, loss_fn=lm_loss)
        norm = pipe.clip_grad_norm_(0.5, norm_type)
        assert norm.item() == pytest.approx(norms[k], rel=1e-12) and norms[k] > 0.5  # clipping is active
        opt.step()
        opt.zero_grad()
        assert loss.item() == pytest.approx(losses[k], rel=1e-12)
    # after three AdamW steps: Adam divides by each gradient's own root mean square, so a parameter whose gradient is
    # near 0 carries the sums' last-bit differences into its update at lr's scale (2.5e-12 measured on an AMD EPYC)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, params[name], rtol=1e-10, atol=1e-11)
