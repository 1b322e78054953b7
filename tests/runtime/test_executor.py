"""The executor runs each task, and pipe.step's loss, in the caller's thread-local state: a float32 GPT trained under
the caller's CPU bfloat16 autocast, compiled inside it on its first call, is the plain model micro-batched by hand
under the same autocast (the loss too: cross-entropy runs in float32 there, as autocast casts it)."""
import copy

import pytest
import torch
import torch.nn.functional as F

import autopipe
from zoo import GPT

CHUNKS = 2


def lm_loss(logits, target):
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def by_hand(model, ids, target):
    """The plain model micro-batched by hand (gradient accumulation) under bf16 autocast: a backward per micro-batch
    of its loss weighted by its share of the rows."""
    outputs, loss = [], 0.0
    for x, y in zip(ids.chunk(CHUNKS), target.chunk(CHUNKS)):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            outputs.append(model(x))
            part = lm_loss(outputs[-1], y) * (len(x) / len(ids))
        part.backward()
        loss = loss + part.detach()
    return torch.cat(outputs).detach(), loss


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_a_pipeline_compiled_inside_autocast_trains_as_the_plain_model_under_it(schedule):
    torch.manual_seed(0)
    model = GPT(vocab=64, d=32, heads=4, layers=2, block=16, dropout=0.0)
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    ids, target = torch.randint(0, 64, (8, 16), generator=g), torch.randint(0, 64, (8, 16), generator=g)
    expected_out, expected_loss = by_hand(reference, ids, target)
    pipe = autopipe.compile(model, devices=2, chunks=CHUNKS, schedule=schedule)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        if schedule == "gpipe":  # compiled here, on its first call
            with torch.no_grad():
                out = pipe(ids)
            assert type(out) is torch.Tensor and out.dtype == torch.bfloat16
            assert torch.equal(out, expected_out)
        loss = pipe.step(ids, target=target, loss_fn=lm_loss)
    assert loss.dtype == torch.float32  # the loss ran under autocast: cross-entropy in float32
    torch.testing.assert_close(loss, expected_loss.detach(), rtol=1e-6, atol=0)
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6, msg=name)
