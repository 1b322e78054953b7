"""The one list of random ops the partitioner and the runtime share."""
import operator

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autopipe.random_ops import is_random_module, is_random_target


@pytest.mark.parametrize("target", [
    F.dropout, F.dropout2d, F.alpha_dropout, torch.dropout, torch.ops.aten.native_dropout.default,
    torch.randn, torch.rand_like, torch.randint, torch.bernoulli, "bernoulli_", "uniform_", "normal_",
    F.rrelu, F.scaled_dot_product_attention,
])
def test_random_targets(target):
    assert is_random_target(target)


@pytest.mark.parametrize("target", [torch.add, "add_", F.relu, operator.add, torch.ops.aten.mm.default,
                                    "transpose", F.layer_norm, "operand"])  # not "rand"
def test_deterministic_targets(target):
    assert not is_random_target(target)


def test_random_modules():
    assert is_random_module(nn.Sequential(nn.Linear(2, 2), nn.Dropout()))
    assert is_random_module(nn.MultiheadAttention(4, 2))
    assert not is_random_module(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))

    class Opaque(nn.Module):  # code fx did not look into: it may draw
        def forward(self, x):
            return x
    assert is_random_module(Opaque())
