"""The CUDA path (streams, device placement, inline backward): runs where a GPU is, skips cleanly elsewhere."""
import pytest
import torch

import autopipe
from models import build, random_inputs, scalar_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("name", ["mlp", "gpt", "unet"])
def test_stages_on_cuda_match_the_plain_model(name):
    model = build(name).eval()
    args, kwargs = random_inputs(name, 8, torch.Generator().manual_seed(0))
    reference = build(name).eval().cuda()
    ref = reference(*[a.cuda() for a in args])
    scalar_loss(ref).backward()
    count = torch.cuda.device_count()
    devices = [f"cuda:{i % count}" for i in range(2)]
    pipe = autopipe.compile(model, devices=devices, chunks=4, track_memory=True)
    torch.cuda.reset_peak_memory_stats()
    out = pipe(*args)  # CPU inputs are copied to the first stage's device
    torch.testing.assert_close(out.cpu(), ref.detach().cpu(), rtol=1e-4, atol=1e-4)
    scalar_loss(out).backward()
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.cpu(), q.grad.cpu(), rtol=1e-3, atol=1e-4, msg=lambda m: f"{n}: {m}")
    assert all(s.cuda_peak is not None for s in pipe.memory.stages)  # the step raised the peak from the reset
    # the user's own peak statistics are never reset: a high peak from before a step survives it
    spike = torch.empty(1 << 28, device="cuda:0")
    del spike
    high = torch.cuda.max_memory_allocated("cuda:0")
    scalar_loss(pipe(*args)).backward()
    assert torch.cuda.max_memory_allocated("cuda:0") >= high


def test_torchrun_runtime_refuses_a_cuda_model_before_any_process_group(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as under torchrun; nothing may connect before the refusal
    model = build("mlp").cuda()
    with pytest.raises(NotImplementedError, match=r"on cuda:0: .*CPU stages over gloo"):
        autopipe.compile(model, chunks=2)
    assert not torch.distributed.is_initialized()
