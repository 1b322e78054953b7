"""passes/codegen.py: stages decide randomness, in-place writes and devices in their own code.

A stage runs as plain generated code: its random ops draw from its ``generator`` argument (so a
recomputed forward replays the forward exactly, and the global generator is never touched), an
input it writes in place is cloned in the code, and no device literal is left in it.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

import autopipe.passes.partition
from autopipe.passes.codegen import Stage, codegen
from autopipe.passes.cost import cost
from autopipe.passes.inplace_writes import find_inplace_writes
from autopipe.passes.partition import NoFeasiblePlan, partition
from autopipe.passes.trace import trace
from autopipe.random_ops import UnroutedRandomOp

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")  # trace's warnings about fx and dropout


def build(model, args, n_stages=1, route="fx", balance="flops", **trace_kwargs):
    traced = trace(model, args, route=route, **trace_kwargs)
    with torch.enable_grad():  # cost() can leave grad mode off after an exported no_grad region: keep tests apart
        costed = cost(traced)
    plan = partition(costed, n_stages, balance=balance)
    return traced, plan, codegen(traced.graph_module, plan)


def n_ops(traced) -> int:
    return sum(n.op in ("call_function", "call_method", "call_module") for n in traced.graph_module.graph.nodes)


def run(stages, plan, flat_inputs, seed=None):
    """The stages in order, each on detached leaf inputs as the runtime gives them, each with its own
    generator; returns the model outputs and, per stage, (inputs, outputs) for ``backward``."""
    values = dict(zip(plan.graph_inputs, flat_inputs))
    saved = []
    for stage in stages:
        inputs = [v.detach().requires_grad_(v.is_floating_point()) if isinstance(v, torch.Tensor) else v
                  for v in (values[name] for name in stage.input_names)]
        kwargs = {}
        if stage.uses_rng:
            kwargs["generator"] = torch.Generator().manual_seed(1000 * seed + stage.index)
        outputs = stage(*inputs, **kwargs)
        saved.append((inputs, outputs))
        values.update(zip(stage.output_names, outputs))
    return [values[name] for name in plan.graph_outputs], saved


def backward(stages, plan, saved, output_grads):
    """Gradients flow between stages as tensors, last stage first; returns d(loss)/d(graph input)."""
    grads = dict(zip(plan.graph_outputs, output_grads))
    for stage, (inputs, outputs) in zip(reversed(stages), reversed(saved)):
        roots = [(o, grads[n]) for n, o in zip(stage.output_names, outputs)
                 if n in grads and isinstance(o, torch.Tensor) and o.requires_grad]
        if roots:
            torch.autograd.backward([o for o, _ in roots], [g for _, g in roots])
        for name, x in zip(stage.input_names, inputs):
            if isinstance(x, torch.Tensor) and x.grad is not None:
                grads[name] = grads[name] + x.grad if name in grads else x.grad
    return [grads.get(name) for name in plan.graph_inputs]


# -- every random op draws from the stage's generator ----------------------------------

class Op(nn.Module):
    """linear -> the random op -> linear: gradients reach the input through the op."""

    def __init__(self, op, d=6, shape=None):
        super().__init__()
        self.inp = nn.Linear(d, d)
        self.op = op if isinstance(op, nn.Module) else None
        self.fn = None if isinstance(op, nn.Module) else op
        self.out = nn.Linear(d, d)
        self.shape = shape

    def forward(self, x):
        h = self.inp(x)
        if self.shape is not None:
            h = h.reshape(self.shape)
        h = self.op(h) if self.op is not None else self.fn(h)
        return self.out(h.reshape(x.shape))


def attention(h, p=0.3):
    q = h.reshape(h.shape[0], 1, 3, 2)
    return F.scaled_dot_product_attention(q, q, q, dropout_p=p).reshape(h.shape)


RANDOM = {
    "F.dropout": lambda: Op(lambda h: F.dropout(h, 0.3)),
    "F.dropout-inplace": lambda: Op(lambda h: F.dropout(h * 1, 0.3, inplace=True)),
    "nn.Dropout": lambda: Op(nn.Dropout(0.3)),
    "F.dropout1d": lambda: Op(lambda h: F.dropout1d(h, 0.5), shape=(-1, 3, 2)),
    "nn.Dropout1d": lambda: Op(nn.Dropout1d(0.5), shape=(-1, 3, 2)),
    "F.dropout2d": lambda: Op(lambda h: F.dropout2d(h, 0.5), shape=(-1, 3, 2, 1)),
    "nn.Dropout2d": lambda: Op(nn.Dropout2d(0.5), shape=(-1, 3, 2, 1)),
    "F.dropout3d": lambda: Op(lambda h: F.dropout3d(h, 0.5), shape=(-1, 3, 2, 1, 1)),
    "nn.Dropout3d": lambda: Op(nn.Dropout3d(0.5), shape=(-1, 3, 2, 1, 1)),
    "torch.dropout": lambda: Op(lambda h: torch.dropout(h, 0.3, True)),
    "F.alpha_dropout": lambda: Op(lambda h: F.alpha_dropout(h, 0.3, training=True)),
    "nn.AlphaDropout": lambda: Op(nn.AlphaDropout(0.3)),
    "F.feature_alpha_dropout": lambda: Op(lambda h: F.feature_alpha_dropout(h, 0.4, True), shape=(-1, 3, 2)),
    "nn.FeatureAlphaDropout": lambda: Op(nn.FeatureAlphaDropout(0.4), shape=(-1, 3, 2)),
    "F.rrelu": lambda: Op(lambda h: F.rrelu(h, training=True)),
    "nn.RReLU": lambda: Op(nn.RReLU(0.1, 0.4)),
    "torch.rand_like": lambda: Op(lambda h: h * torch.rand_like(h)),
    "torch.randn_like": lambda: Op(lambda h: h + torch.randn_like(h)),
    "torch.randint_like": lambda: Op(lambda h: h * torch.randint_like(h, 3)),
    "torch.randint_like-low": lambda: Op(lambda h: h * torch.randint_like(h, 1, 4)),
    "torch.bernoulli": lambda: Op(lambda h: h * torch.bernoulli(torch.sigmoid(h))),
    "torch.rand": lambda: Op(lambda h: h * torch.rand(h.shape)),
    "Tensor.uniform_": lambda: Op(lambda h: h * torch.empty_like(h).uniform_(0, 2)),
    "Tensor.bernoulli_": lambda: Op(lambda h: h * torch.empty_like(h).bernoulli_(0.5)),
    "sdpa-dropout": lambda: Op(attention),
    "nn.MultiheadAttention": lambda: Op(MHA()),
    "nn.TransformerEncoderLayer": lambda: Op(nn.TransformerEncoderLayer(6, 2, 12, dropout=0.3, batch_first=True),
                                             shape=(-1, 1, 6)),
}
EXPORT_FAILS = set()


class MHA(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(6, 2, dropout=0.3, batch_first=True)

    def forward(self, h):
        s = h.reshape(h.shape[0], 1, 6)
        return self.attn(s, s, s, need_weights=False)[0].reshape(h.shape)


def _model(name):
    torch.manual_seed(0)
    return RANDOM[name]().double().train()


def _draw(stage, x, seed):
    """Output and input gradient of one call; the input is a leaf that requires grad, as in the runtime."""
    x = x.detach().requires_grad_(True)
    (out,) = stage(x, generator=torch.Generator().manual_seed(seed))
    out.pow(2).sum().backward()
    return out.detach(), x.grad


@pytest.mark.parametrize("route", ["fx", "export"])
@pytest.mark.parametrize("name", list(RANDOM))
def test_random_op_replays_from_the_generator(name, route):
    model = _model(name)
    x = torch.randn(8, 6, dtype=torch.float64)
    _, _, (stage,) = build(model, (x,), route=route)
    assert stage.uses_rng and "generator" in stage.code

    torch.manual_seed(123)
    first = _draw(stage, x, seed=7)
    global_after = torch.rand(4)
    again = _draw(stage, x, seed=7)
    other = _draw(stage, x, seed=8)
    torch.manual_seed(123)
    assert torch.equal(torch.rand(4), global_after), "the stage drew from the global generator"
    for a, b in zip(first, again):
        assert torch.equal(a, b)  # bit-identical: output and the input's gradient
    assert not torch.equal(first[0], other[0])

    # the same numbers torch itself draws from a generator in that state
    torch.manual_seed(7)
    want = model(x)
    torch.testing.assert_close(first[0], want.detach())


@pytest.mark.parametrize("route", ["fx", "export"])
def test_dropout_code_names_the_generator(route):
    model = Op(nn.Dropout(0.1)).train()
    x = torch.randn(4, 6)
    _, _, (stage,) = build(model, (x,), route=route)
    code = stage.code
    assert "def forward(self, x, generator = None):" in code
    assert "autopipe.random_ops.dropout(" in code and "generator = generator" in code
    assert "call_with_generator" not in code and "autopipe_random_ops" not in code
    if route == "fx":  # the module's constants and mode baked in, readable
        assert "op = autopipe.random_ops.dropout(inp, p = 0.1, training = True, inplace = False, " \
               "generator = generator)" in code


def test_eval_mode_and_zero_probability_draw_nothing():
    model = Op(nn.Dropout(0.5)).eval()
    x = torch.randn(4, 6)
    _, _, (stage,) = build(model, (x,))
    assert not stage.uses_rng and "generator" not in stage.code
    torch.testing.assert_close(stage(x)[0], model(x))
    model = Op(lambda h: F.dropout(h, 0.0) + F.scaled_dot_product_attention(h[:, None, None], h[:, None, None],
                                                                            h[:, None, None])[:, 0, 0]).train()
    _, _, (stage,) = build(model, (x,))
    assert not stage.uses_rng


def test_stages_each_take_their_own_generator():
    torch.manual_seed(0)
    model = nn.Sequential(*[Op(nn.Dropout(0.2)) for _ in range(4)]).train()
    x = torch.randn(8, 6)
    traced, plan, stages = build(model, (x,), n_stages=4)
    assert all(s.uses_rng for s in stages)
    first, _ = run(stages, plan, [x], seed=1)
    again, _ = run(stages, plan, [x], seed=1)
    other, _ = run(stages, plan, [x], seed=2)
    assert torch.equal(first[0], again[0]) and not torch.equal(first[0], other[0])


class Noisy(nn.Module):
    """A user module kept whole: its code is not in the graph."""

    def forward(self, h):
        return h * torch.rand_like(h) + F.dropout(h, 0.2) + torch.empty_like(h).normal_()


def test_opaque_user_module_runs_under_call_with_generator():
    torch.manual_seed(0)
    model = Op(Noisy()).double().train()
    x = torch.randn(8, 6, dtype=torch.float64)
    _, _, (stage,) = build(model, (x,), leaf_modules=[Noisy])
    assert "op_module = self.op" in stage.code
    assert "op = autopipe.random_ops.call_with_generator(op_module, generator, inp)" in stage.code
    torch.manual_seed(5)
    first = _draw(stage, x, seed=3)
    marker = torch.rand(3)
    again = _draw(stage, x, seed=3)
    torch.manual_seed(5)
    assert torch.equal(torch.rand(3), marker)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


@torch.fx.wrap
def noisy_function(h):
    return h * torch.rand_like(h)


def test_wrapped_user_function_runs_under_call_with_generator():
    model = Op(lambda h: noisy_function(h)).train()
    x = torch.randn(8, 6)
    _, _, (stage,) = build(model, (x,))
    assert "call_with_generator(noisy_function_fn, generator, inp)" in stage.code
    a = stage(x, generator=torch.Generator().manual_seed(1))[0]
    b = stage(x, generator=torch.Generator().manual_seed(1))[0]
    assert torch.equal(a, b)


def assert_replays_from_its_generator(stage, x):
    """The stage's draws come from its generator argument alone: one seed, one result, and the global generator untouched."""
    torch.manual_seed(0)
    first = stage(x, generator=torch.Generator().manual_seed(1))[0]
    marker = torch.rand(2)
    again = stage(x, generator=torch.Generator().manual_seed(1))[0]
    torch.manual_seed(0)
    assert torch.equal(torch.rand(2), marker) and torch.equal(first, again)
    return first


def stochastic_depth(h, p, training):
    """torchvision.ops.stochastic_depth as torchvision writes it: fx.wrap'ed, in a module whose name begins with "torch"."""
    if not training or p == 0.0:
        return h
    noise = torch.empty([h.shape[0]] + [1] * (h.ndim - 1), dtype=h.dtype, device=h.device).bernoulli_(1 - p)
    return h * noise.div_(1 - p)


stochastic_depth.__module__ = "torchvision.ops.stochastic_depth"
torch.fx.wrap("stochastic_depth")


def test_a_wrapped_function_of_a_library_named_torch_something_draws_from_the_generator():
    """ConvNeXt's and EfficientNet's stochastic depth drew from the global generator: a recomputed stage trained on other masks."""
    model = Op(lambda h: stochastic_depth(h, 0.5, True)).train()
    x = torch.randn(64, 6)
    _, _, (stage,) = build(model, (x,))
    assert "call_with_generator(stochastic_depth_fn, generator, inp, 0.5, True)" in stage.code
    first = assert_replays_from_its_generator(stage, x)
    assert not torch.equal(first, stage(x, generator=torch.Generator().manual_seed(2))[0])


class ContextRegions(nn.Module):
    """torch.export captures no_grad and autocast regions as higher-order ops around subgraphs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        h = self.lin(x)
        with torch.no_grad():
            m = F.dropout(h, 0.5)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            k = F.dropout(h, 0.5)
        return h * m + k


class FractionalPool(nn.Module):
    """Draws its pooling regions in aten.rand, in eval too."""

    def __init__(self):
        super().__init__()
        self.pool = nn.FractionalMaxPool2d(2, output_size=3)

    def forward(self, x):
        return self.pool((x[:, :, None] * x[:, None, :])[:, None]).flatten(1)


@pytest.mark.parametrize("module, route", [(ContextRegions, "export"), (FractionalPool, "fx"),
                                           (FractionalPool, "export")])  # fx cannot hold a no_grad region
def test_random_ops_inside_opaque_calls_replay(module, route):
    model = module().train()
    x = torch.randn(4, 6)
    _, _, (stage,) = build(model, (x,), route=route)
    assert stage.uses_rng
    assert_replays_from_its_generator(stage, x)


class FusedKernel(nn.Module):
    """CPU flash attention with dropout: a kernel that draws from the default generator only."""

    def forward(self, x):
        q = x.reshape(x.shape[0], 2, 3, 2)
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q, 0.25)
        return out.reshape(x.shape)


@pytest.mark.parametrize("route", ["fx", "export"])
def test_unroutable_random_op_is_refused_at_codegen(route):
    x = torch.randn(4, 12)
    traced = trace(FusedKernel().train(), (x,), route=route)
    plan = partition(cost(traced), 1)
    with pytest.raises(UnroutedRandomOp) as info:
        codegen(traced.graph_module, plan)
    message = str(info.value)
    assert "_scaled_dot_product_flash_attention_for_cpu" in message and "stage 0" in message
    assert "model.eval()" in message and "generator" in message
    if route == "export":
        assert "test_codegen.py" in message  # the user's source line


# -- in-place writes to a stage input --------------------------------------------------

class InplaceAfterCut(nn.Module):
    def __init__(self, act):
        super().__init__()
        self.l1 = nn.Linear(6, 6)
        self.act = act
        self.l2 = nn.Linear(6, 3)

    def forward(self, x):
        return self.l2(self.act(self.l1(x)))


INPLACE = {
    "nn.ReLU(inplace)": lambda: InplaceAfterCut(nn.ReLU(inplace=True)),
    "nn.Hardswish(inplace)": lambda: InplaceAfterCut(nn.Hardswish(inplace=True)),
    "nn.ReLU6(inplace)": lambda: InplaceAfterCut(nn.ReLU6(inplace=True)),
    "F.relu(inplace=True)": lambda: InplaceAfterCut(Fn(lambda h: F.relu(h, inplace=True))),
    "F.leaky_relu positional": lambda: InplaceAfterCut(Fn(lambda h: F.leaky_relu(h, 0.1, True))),
    "torch.relu_": lambda: InplaceAfterCut(Fn(lambda h: torch.relu_(h))),
    "Tensor.mul_": lambda: InplaceAfterCut(Fn(lambda h: h.mul_(2))),
    "view then zero_": lambda: InplaceAfterCut(Fn(_zero_first_column)),
}


class Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, h):
        return self.fn(h)


def _zero_first_column(h):
    h.view(h.shape[0], 2, 3)[:, 0].zero_()
    return h


@pytest.mark.parametrize("route", ["fx", "export"])
@pytest.mark.parametrize("name", list(INPLACE))
def test_inplace_write_right_after_a_cut(name, route):
    torch.manual_seed(0)
    model = INPLACE[name]().double()
    x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
    # equal shares of the flops: the cut falls right after l1, the heaviest op
    traced, plan, stages = build(model, (x.detach(),), n_stages=2, route=route, balance=[1, 1])
    assert plan.stages[0].nodes[-1].startswith("l1") and set(stages[0].output_names) <= set(stages[1].input_names)
    written = [s for s in stages if s.cloned_inputs]
    assert written, [s.code for s in stages]
    assert all(f"{s.cloned_inputs[0]}_writable = {s.cloned_inputs[0]}.clone()" in s.code for s in written)

    outputs, saved = run(stages, plan, [x.detach()])
    received = {name: x for s, (ins, _) in zip(stages, saved) for name, x in zip(s.input_names, ins)}
    before = {name: t.clone() for name, t in received.items()}
    (grad_x,) = backward(stages, plan, saved, [torch.ones_like(outputs[0])])
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, t in received.items():
        assert torch.equal(t, before[name]), f"stage input {name} was written"

    model.zero_grad()
    want = model(x)
    want.sum().backward()
    torch.testing.assert_close(outputs[0], want.detach())
    torch.testing.assert_close(grad_x, x.grad)
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad)


def test_no_clone_for_writes_to_tensors_made_in_the_stage():
    model = InplaceAfterCut(nn.ReLU(inplace=True))
    _, _, (stage,) = build(model, (torch.randn(2, 6),))
    assert stage.cloned_inputs == [] and "clone" not in stage.code


class ReadAfterWrite(nn.Module):
    """``a`` is written in place by a later stage and read again after the write."""

    def __init__(self, output_a=False):
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.output_a = output_a

    def forward(self, x):
        a = self.l1(x)
        b = self.l2(a)
        a.mul_(2)
        c = self.l3(b)
        return (c, a) if self.output_a else c + a


@pytest.mark.parametrize("output_a", [False, True])
def test_a_plan_that_cuts_a_write_off_from_its_read_is_refused(output_a, monkeypatch):
    """The safety net under partition, which keeps each write with the reads that must see it and so refuses this
    model at one stage per op (tests/passes/test_partition.py): a plan made blind to the writes is refused here."""
    model = ReadAfterWrite(output_a)
    traced = trace(model, (torch.randn(2, 4),), route="fx")
    with pytest.raises(NoFeasiblePlan, match="mul_ .*writes in place to l1, which .* reads afterwards"):
        partition(cost(traced), n_ops(traced))
    def blind(gm):
        return dataclasses.replace(find_inplace_writes(gm), reads=())

    monkeypatch.setattr(autopipe.passes.partition, "find_inplace_writes", blind)
    plan = partition(cost(traced), n_ops(traced))
    with pytest.raises(ValueError, match="mul_.*writes in place to l1") as info:
        codegen(traced.graph_module, plan)
    assert ("model's output" in str(info.value)) == output_a


def test_write_seen_only_inside_its_stage_is_fine():
    model = ReadAfterWrite()
    traced, plan, (stage,) = build(model, (torch.randn(2, 4),))
    x = torch.randn(2, 4)
    torch.testing.assert_close(stage(x)[0], model(x))



class ClampedThenViewed(nn.Module):
    """OLMo's clip_qkv: ``v.clamp_()`` on a projection, then views of ``v`` read by later stages."""

    def __init__(self):
        super().__init__()
        self.v, self.body = nn.Linear(16, 16), nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])

    def forward(self, x):
        v = self.v(x)
        v.clamp_(-0.1, 0.1)
        v = v.view(x.shape[0], 4, 4).transpose(1, 2)
        return self.body(x) + v[:, :, 0:4].reshape(x.shape[0], 16)


def test_a_later_stage_reading_a_view_of_what_a_stage_wrote_and_sent_is_fine():
    model, x = ClampedThenViewed().double(), torch.randn(4, 16, dtype=torch.double)
    traced = trace(model, (x,), route="fx")
    plan = partition(cost(traced), 4, balance=(1, 1, 1, 1))
    assert any(n.startswith("transpose") and t.consumers for n, t in plan.tensors.items())  # the view crosses a cut
    stages = codegen(traced.graph_module, plan)
    got, _ = run(stages, plan, traced.flat_inputs((x,), {}))
    torch.testing.assert_close(got[0], model(x), rtol=1e-12, atol=1e-12)

# -- devices ---------------------------------------------------------------------------

def _gpt2():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(cfg), torch.randint(0, 64, (4, 8))


def test_export_route_stage_code_names_no_device():
    model, ids = _gpt2()
    traced = trace(model.train(), (), {"input_ids": ids, "labels": ids}, route="export")
    assert "device(type=" in traced.graph_module.code  # export wrote the device into the graph
    plan = partition(cost(traced), 2)
    stages = codegen(traced.graph_module, plan)
    for stage in stages:
        assert "device(type=" not in stage.code
        assert "stage_device = self.stage_device" in stage.code
        assert stage.uses_rng  # GPT-2's dropout, attention dropout included
    flat = traced.flat_inputs((), {"input_ids": ids, "labels": ids})
    first, _ = run(stages, plan, flat, seed=0)
    again, _ = run(stages, plan, flat, seed=0)
    assert all(torch.equal(a, b) for a, b in zip(first, again))

    model.eval()  # and the pipeline equals the model
    traced = trace(model, (), {"input_ids": ids, "labels": ids}, route="export")
    plan = partition(cost(traced), 2)
    stages = codegen(traced.graph_module, plan)
    assert not any(s.uses_rng for s in stages)
    got, _ = run(stages, plan, traced.flat_inputs((), {"input_ids": ids, "labels": ids}))
    want = model(input_ids=ids, labels=ids)
    torch.testing.assert_close(got[0], want.loss)


def test_stage_device_follows_the_stage():
    model, ids = _gpt2()
    traced = trace(model.eval(), (ids,), route="export")
    plan = partition(cost(traced), 1)
    (stage,) = codegen(traced.graph_module, plan)
    assert stage.stage_device == torch.device("cpu") and stage.device == stage.stage_device
    stage.to("meta")  # moves the model's own parameters, as the runtime places a stage
    assert stage.stage_device == torch.device("meta")
    (logits,) = stage(ids.to("meta"))[:1]
    assert logits.device.type == "meta" and logits.shape == (4, 8, 64)



class PositionsUnderNoGrad(nn.Module):
    """Llama's rotary embedding in small: export puts the no_grad region, and the device it names, in a subgraph."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        with torch.no_grad():
            positions = torch.arange(x.shape[1], device=x.device, dtype=torch.float32)
        return self.lin(x) * positions[:, None]


def test_a_device_named_inside_an_export_subgraph_follows_the_stage():
    model, x = PositionsUnderNoGrad(), torch.randn(4, 6, 8)
    traced = trace(model, (x,), route="export")
    (region,) = [m for name, m in traced.graph_module.named_children() if isinstance(m, fx.GraphModule)]
    assert "device(type='cpu')" in region.code  # what a stage traced on the CPU and run on a GPU must not keep
    (stage,) = codegen(traced.graph_module, partition(cost(traced), 1))
    subgraphs = [m for m in stage.modules() if isinstance(m, fx.GraphModule) and m is not stage]
    assert subgraphs and all("device(type=" not in m.code and "self.stage_device" in m.code for m in subgraphs)
    assert "device(type='cpu')" in region.code  # the traced graph is the caller's: copied, not rewritten
    torch.testing.assert_close(stage(x)[0], model(x))
    stage.to("meta")
    assert [m.stage_device for m in subgraphs] == [torch.device("meta")]
    assert stage(x.to("meta"))[0].device.type == "meta"

# -- running statistics ----------------------------------------------------------------

class BN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.free = nn.BatchNorm2d(4, track_running_stats=False)

    def forward(self, x):
        return self.free(self.bn(self.conv(x))).mean((2, 3))


@pytest.mark.parametrize("route", ["fx", "export"])
def test_running_buffers(route):
    model = BN().train()
    _, _, (stage,) = build(model, (torch.randn(2, 3, 6, 6),), route=route)
    want = {id(b) for b in (model.bn.running_mean, model.bn.running_var, model.bn.num_batches_tracked)}
    assert {id(b) for b in stage.running_buffers} == want
    model.eval()
    _, _, (stage,) = build(model, (torch.randn(2, 3, 6, 6),), route=route)
    assert stage.running_buffers == []


def test_deepcopy_keeps_the_stage_facts():
    import copy
    model = BN().train()
    _, _, (stage,) = build(model, (torch.randn(2, 3, 6, 6),))
    twin = copy.deepcopy(stage)
    assert twin.stage_device == stage.stage_device and twin.input_names == stage.input_names
    copied = {id(b) for b in twin.running_buffers}
    assert len(copied) == 3 and copied == {id(b) for b in twin.buffers()}  # the copy's own buffers
    assert not copied & {id(b) for b in stage.running_buffers}


def test_save_code_is_importable_text(tmp_path):
    model = Op(nn.Dropout(0.1)).train()
    _, _, stages = build(model, (torch.randn(4, 6),))
    path = stages[0].save(tmp_path)
    text = open(path).read()
    assert text.startswith("import torch\nimport autopipe.random_ops\n")
    assert isinstance(stages[0], Stage) and isinstance(stages[0].graph, fx.Graph)

