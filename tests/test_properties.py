"""Property tests: random models with branches, long skips, several inputs and outputs and shared
parameters, random K, chunks and checkpoint mode: outputs and gradients equal the plain model's."""
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings, strategies as st

import autopipe
from zoo import scalar_loss

D = 6
ACTIVATIONS = [torch.tanh, torch.sigmoid, torch.relu, lambda v: v * 0.5]


class RandomDAG(nn.Module):
    """ops: (kind, a, b, layer) with a, b indices of earlier values; kind in linear | add | mul | cat."""

    def __init__(self, n_inputs, ops, outputs, n_layers):
        super().__init__()
        self.n_inputs = n_inputs
        self.ops = ops
        self.outputs = outputs
        self.layers = nn.ModuleList([nn.Linear(D, D) for _ in range(n_layers)])
        self.fold = nn.Linear(2 * D, D)

    def forward(self, *inputs):
        values = list(inputs)
        for kind, a, b, layer, act in self.ops:
            if kind == "linear":
                v = ACTIVATIONS[act](self.layers[layer](values[a]))  # a layer may be used twice: shared
            elif kind == "add":
                v = values[a] + values[b]
            elif kind == "mul":
                v = values[a] * torch.sigmoid(values[b])
            else:
                v = self.fold(torch.cat([values[a], values[b]], dim=-1))
            values.append(v)
        outs = tuple(values[i] for i in self.outputs)
        return outs if len(outs) > 1 else outs[0]


@st.composite
def random_models(draw):
    n_inputs = draw(st.integers(1, 3))
    n_ops = draw(st.integers(3, 14))
    n_layers = draw(st.integers(1, 5))
    ops = []
    for k in range(n_ops):
        available = n_inputs + k
        kind = draw(st.sampled_from(["linear", "linear", "add", "mul", "cat"]))
        a = draw(st.integers(0, available - 1))
        b = draw(st.integers(0, available - 1))
        ops.append((kind, a, b, draw(st.integers(0, n_layers - 1)), draw(st.integers(0, len(ACTIVATIONS) - 1))))
    total = n_inputs + n_ops
    outputs = sorted(set([total - 1] + draw(st.lists(st.integers(n_inputs, total - 1), max_size=2))))
    return RandomDAG(n_inputs, ops, outputs, n_layers), n_inputs


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=random_models(),
    devices=st.integers(1, 4),
    chunks=st.integers(1, 5),
    checkpoint=st.sampled_from(["always", "except_last", "never"]),
    batch=st.integers(1, 9),
    seed=st.integers(0, 2**16),
)
def test_random_models_match_the_plain_model(spec, devices, chunks, checkpoint, batch, seed):
    model, n_inputs = spec
    torch.manual_seed(seed)
    for p in model.parameters():
        nn.init.normal_(p, std=0.5)
    # float64: micro-batching changes only the order of sums, so the tolerances can be tight (in float32 a
    # gradient of size ~10 was 1.7e-5 off in one element: rounding, 2e-15 in float64)
    model.double()
    inputs = [torch.randn(batch, D, dtype=torch.float64, requires_grad=True) for _ in range(n_inputs)]
    devices = min(devices, len(model.ops))  # every op is at least one graph node

    model.zero_grad()
    ref = model(*inputs)
    scalar_loss(ref).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    ref_input_grads = [x.grad.clone() if x.grad is not None else None for x in inputs]
    model.zero_grad()
    for x in inputs:
        x.grad = None

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # batch < chunks warns by design
        pipe = autopipe.compile(model, devices=devices, chunks=chunks, checkpoint=checkpoint)
        out = pipe(*inputs)
    refs = ref if isinstance(ref, tuple) else (ref,)
    outs = out if isinstance(out, tuple) else (out,)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs):
        torch.testing.assert_close(o, r, rtol=1e-10, atol=1e-10)
    scalar_loss(out).backward()
    for n, p in model.named_parameters():
        if n in ref_grads:
            torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-9, atol=1e-10)
        else:
            assert p.grad is None or not p.grad.any()
    for x, g in zip(inputs, ref_input_grads):
        if g is None:
            assert x.grad is None or not x.grad.any()
        else:
            torch.testing.assert_close(x.grad, g, rtol=1e-9, atol=1e-10)
    pipe.close()
