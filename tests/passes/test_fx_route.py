"""passes/fx_route.py: the fx route of the trace pass, where a size taken from an input's shape is a Proxy: torch's
factories given their sizes one by one (``torch.ones(batch_size, seq_length)``, transformers' default masks) trace."""
from __future__ import annotations

import copy

import torch
from torch import nn

import autopipe
from autopipe.passes.trace import trace


class DefaultMask(nn.Module):
    """Builds the mask it is not given from the input's shape, as transformers' encoders do (``attention_mask =
    torch.ones(batch_size, mask_seq_length, device=...)``), and a zero bias the same way."""

    def __init__(self):
        super().__init__()
        self.embed, self.out = nn.Linear(4, 8), nn.Linear(8, 2)

    def forward(self, x, mask=None):
        batch_size, seq_length = x.shape[:2]
        if mask is None:
            mask = torch.ones(batch_size, seq_length, device=x.device, dtype=x.dtype)
        bias = torch.zeros(batch_size, seq_length, 1, dtype=x.dtype) + torch.empty(batch_size, 1, 1).fill_(0.5)
        h = self.embed(x) * mask[..., None] + bias
        return self.out(h).sum(1)


def test_a_factory_given_sizes_from_the_input_shape_one_by_one_traces_on_fx():
    """fx failed on it ("ones() takes 1 positional argument but 2 were given": a Proxy among *size is no int to torch's
    argument parser), and the model took the export route, or none where export failed too."""
    torch.manual_seed(0)
    model, x = DefaultMask().double(), torch.randn(5, 3, 4, dtype=torch.float64)
    traced = trace(model, (x,), route="fx")
    factories = [n.target for n in traced.graph_module.graph.nodes if n.op == "call_function"
                 and n.target in (torch.ones, torch.zeros, torch.empty)]
    assert factories == [torch.ones, torch.zeros, torch.empty]  # torch's own functions, recorded
    plain = copy.deepcopy(model)
    want = plain(x)
    want.square().sum().backward()
    pipe = autopipe.compile(model, devices=2, chunks=3, route="fx", example_inputs=(x,))  # micro-batches of 2, 2, 1
    got = pipe(x)
    got.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=name)
    assert torch.ones(2, 3).shape == (2, 3) and torch.ones is factories[0]  # torch's functions are put back

