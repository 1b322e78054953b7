"""Re-materialisation (runtime/task.py): which micro-batches are recomputed, what a stage keeps, and that the
recompute repeats the forward exactly. Faithfulness on real models is in tests/test_faithfulness.py."""
import pytest
import torch

import autopipe
from zoo import build, random_inputs, scalar_loss

RECOMPUTED = {"never": set(), "except_last": {0, 1, 2}, "always": {0, 1, 2, 3}}


@pytest.mark.parametrize("checkpoint", list(RECOMPUTED))
def test_each_mode_recomputes_its_micro_batches_once_on_every_stage(checkpoint):
    pipe = autopipe.compile(build("mlp"), devices=3, chunks=4, checkpoint=checkpoint)
    scalar_loss(pipe(torch.randn(16, 8))).backward()
    for stage in range(3):
        recomputes = [e.micro_batch for e in pipe.timeline.events if e.stage == stage and e.kind == "recompute"]
        assert sorted(recomputes) == sorted(RECOMPUTED[checkpoint])  # once each, never twice
        backward = {e.micro_batch: e.start for e in pipe.timeline.events if e.stage == stage and e.kind == "backward"}
        for e in pipe.timeline.events:  # a recompute comes before its micro-batch's backward
            if e.stage == stage and e.kind == "recompute":
                assert e.end <= backward[e.micro_batch]


def test_a_recomputed_micro_batch_keeps_only_its_inputs():
    """checkpoint='always': between forward and backward a stage holds its micro-batches' inputs, nothing more;
    its peak adds one micro-batch's activations (GPipe sec. 2.3)."""
    model = build("mlp").double()
    x = torch.randn(16, 8, dtype=torch.float64)
    kept = {}
    for checkpoint in ("never", "always"):
        pipe = autopipe.compile(model, devices=2, chunks=4, checkpoint=checkpoint, track_memory=True)
        scalar_loss(pipe(x)).backward()
        kept[checkpoint] = [s.kept for s in pipe.memory.stages]
        recompute = [s.recompute_peak for s in pipe.memory.stages]
    inputs = [16 * 8 * 8, 16 * 32 * 8]  # stage 0 keeps x; stage 1 a (16, 32) float64 hidden state
    assert kept["always"] == inputs
    assert all(a < n for a, n in zip(kept["always"], kept["never"]))
    assert all(0 < r <= n / 4 for r, n in zip(recompute, kept["never"]))  # one micro-batch of the saved activations


@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_recompute_gives_the_same_gradients_as_keeping_the_activations_bit_for_bit(name):
    """Dropout (GPT, train mode) and BatchNorm (ResNet, train mode): the recompute draws the same numbers and
    leaves the running statistics as the forward set them."""
    args, kwargs = random_inputs(name, 8, torch.Generator().manual_seed(0))
    results = []
    for checkpoint in ("never", "always"):
        model = build(name).train()
        pipe = autopipe.compile(model, devices=2, chunks=4, checkpoint=checkpoint)
        torch.manual_seed(3)
        scalar_loss(pipe(*args, **kwargs)).backward()
        results.append(({n: p.grad for n, p in model.named_parameters()}, {n: b.clone() for n, b in model.named_buffers()}))
    (grads0, buffers0), (grads1, buffers1) = results
    for n in grads0:
        torch.testing.assert_close(grads1[n], grads0[n], rtol=0, atol=0, msg=lambda m: f"{n}: {m}")
    for n in buffers0:
        torch.testing.assert_close(buffers1[n], buffers0[n], rtol=0, atol=0, msg=lambda m: f"{n}: {m}")
