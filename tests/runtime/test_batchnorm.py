import copy

import pytest
import torch
import torch.nn as nn

import autopipe


class TwoBranches(nn.Module):
    """Each BatchNorm reads the input through a conv, so its statistics are comparable to the plain model's."""

    def __init__(self, momentum=0.1):
        super().__init__()
        self.a = nn.Conv2d(3, 4, 3)
        self.bn_a = nn.BatchNorm2d(4, momentum=momentum)
        self.b = nn.Conv2d(3, 4, 3)
        self.bn_b = nn.BatchNorm2d(4, momentum=momentum)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        a = torch.relu(self.bn_a(self.a(x))).mean((2, 3))
        b = torch.relu(self.bn_b(self.b(x))).mean((2, 3))
        return self.head(torch.cat([a, b], 1))


@pytest.mark.parametrize("momentum", [0.1, 0.3, None])  # None: cumulative average
@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_deferred_running_statistics_equal_the_plain_model(momentum, checkpoint):
    torch.manual_seed(0)
    model = TwoBranches(momentum)
    plain = copy.deepcopy(model)
    pipe = autopipe.compile(model, devices=3, chunks=4, checkpoint=checkpoint, deferred_batch_norm=True)
    for step in range(3):
        x = torch.randn(10, 3, 8, 8)
        pipe(x).sum().backward()
        plain(x).sum().backward()
    for (n, a), (_, b) in zip(model.named_buffers(), plain.named_buffers()):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    assert model.bn_a.momentum == momentum


def test_without_deferral_statistics_update_once_per_micro_batch():
    torch.manual_seed(0)
    model = TwoBranches()
    pipe = autopipe.compile(model, devices=2, chunks=4)
    pipe(torch.randn(8, 3, 8, 8)).sum().backward()
    assert model.bn_a.num_batches_tracked.item() == 4


def test_compile_does_not_touch_batch_norm_buffers():
    model = TwoBranches()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    autopipe.compile(model, devices=2, chunks=4, example_inputs=(torch.randn(8, 3, 8, 8),))
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
