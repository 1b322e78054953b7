"""passes/trace.py: models that bake the batch size into their Python (diffusion UNets broadcasting
a timestep to the batch) fail fx and the dynamic-batch export with ``BatchSpecialised``, and trace at
a static micro-batch size with ``static_batch``; and tracing leaves torch's global state as it was."""
from __future__ import annotations

import copy
import importlib
import random
import sys

import numpy as np
import pytest
import torch
from torch import nn

import autopipe
from autopipe.global_state import differences, snapshot
from autopipe.passes.trace import BatchSpecialised, TraceError, specialises_batch, trace


class TinyUNet(nn.Module):
    """Diffusion-UNet-shaped, with the batch handling such models have: a 0-dim timestep broadcast
    to the batch with ``len(x)`` (a Python int: export specialises the batch to it), shape-driven
    control flow (fx cannot trace it), a time embedding repeated over the image."""

    def __init__(self, channels=3, width=8):
        super().__init__()
        self.time_embed = nn.Sequential(nn.Linear(1, width), nn.SiLU(), nn.Linear(width, width))
        self.conv_in = nn.Conv2d(channels, width, 3, padding=1)
        self.down = nn.Conv2d(width, 2 * width, 3, stride=2, padding=1)
        self.mid = nn.GroupNorm(4, 2 * width)
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.conv_out = nn.Conv2d(2 * width, channels, 3, padding=1)

    def forward(self, x, timesteps):
        t = timesteps
        if t.dim() == 0:
            t = t[None]
        if t.shape[0] != len(x):
            t = t.expand(len(x))
        emb = self.time_embed(t[:, None].to(x.dtype))[:, :, None, None].repeat(1, 1, *x.shape[2:])
        h = self.conv_in(x) + emb
        d = self.mid(self.down(nn.functional.silu(h)))
        return self.conv_out(torch.cat([self.up(d), h], 1))


def _unet(rows=4):
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = TinyUNet().double().eval()
        x = torch.randn(rows, 3, 8, 8, dtype=torch.float64)
    return model, x, torch.tensor(10.0, dtype=torch.float64)


def _run(traced, *args):
    return traced.rebuild_output(traced.graph_module(*traced.flat_inputs(args, {})))


def test_fx_fails_on_the_unet():
    model, x, t = _unet()
    with pytest.raises(TraceError, match="control flow") as info:
        trace(model, (x, t), route="fx")
    assert not isinstance(info.value, BatchSpecialised)


@pytest.mark.parametrize("route", ["auto", "export"])
def test_dynamic_export_finds_the_batch_specialised(route):
    model, x, t = _unet()
    before = snapshot()
    with pytest.raises(BatchSpecialised) as info:
        trace(model, (x, t), route=route)
    error = info.value
    assert isinstance(error, TraceError)
    assert error.batch_size == 4
    routes = [name for name, _ in error.errors]
    assert routes == (["torch.fx.symbolic_trace"] if route == "auto" else []) + [
        "torch.export (non-strict, dynamic batch)"]
    message = str(error)
    assert "static_batch" in message and "Constraints violated" in message
    if route == "auto":
        assert "symbolically traced variables cannot be used as inputs to control flow" in message
    assert differences(before, snapshot()) == []


@pytest.mark.parametrize("rows", [2, 3, 1])
def test_static_batch_traces_a_graph_for_that_many_rows(rows):
    model, x, t = _unet(rows=5)
    traced = trace(model, (x, t), static_batch=rows)
    assert traced.route == "export-static"
    assert traced.static_batch == rows and traced.batch_size == rows
    for node in traced.graph_module.graph.nodes:
        if node.op == "placeholder" and node.name == "x":
            assert tuple(node.meta["val"].shape) == (rows, 3, 8, 8)  # a constant, no batch symbol
    for start in (0, 5 - rows):  # any rows of the batch, not only the traced ones
        part = x[start:start + rows]
        torch.testing.assert_close(_run(traced, part, t), model(part, t), rtol=0, atol=1e-12)


def test_static_batch_graph_gives_the_models_gradients_on_its_own_parameters():
    model, x, t = _unet()
    traced = trace(model, (x, t), static_batch=2)
    model(x[:2], t).square().sum().backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    _run(traced, x[:2], t).square().sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=0, atol=1e-12, msg=n)


def test_static_batch_on_a_batch_generic_model_works_too():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).double()
        x = torch.randn(6, 4, dtype=torch.float64)
    traced = trace(model, (x,), static_batch=3)
    assert traced.route == "export-static" and traced.batch_size == 3
    torch.testing.assert_close(_run(traced, x[3:]), model(x[3:]), rtol=0, atol=1e-12)
    assert trace(model, (x,)).static_batch is None  # and by default the batch stays dynamic


@pytest.mark.parametrize("bad, route, match", [
    (0, "auto", "positive int"), (True, "auto", "positive int"), (2.0, "auto", "positive int"),
    (5, "auto", "more rows"), (2, "fx", "route='auto' or 'export'"),
])
def test_static_batch_arguments_are_checked(bad, route, match):
    model, x, t = _unet()
    with pytest.raises(ValueError, match=match):
        trace(model, (x, t), static_batch=bad, route=route)


def test_other_export_failures_are_not_batch_specialisation():
    class DataDependent(nn.Module):
        def forward(self, x):
            if x.sum() > 0:  # data-dependent control flow: neither fx nor export
                return x * 2
            return x

    with pytest.raises(TraceError) as info:
        trace(DataDependent(), (torch.ones(4, 3),))
    assert not isinstance(info.value, BatchSpecialised)


def test_batch_specialisation_is_recognised_by_type_not_only_by_message():
    from torch._dynamo.exc import UserError, UserErrorType

    cause = UserError(UserErrorType.CONSTRAINT_VIOLATION, "the wording of a future torch")
    wrapped = RuntimeError("export failed")
    wrapped.__cause__ = cause
    assert specialises_batch(wrapped)
    assert not specialises_batch(RuntimeError("export failed"))
    assert not specialises_batch(UserError(UserErrorType.DYNAMIC_CONTROL_FLOW, "if x.sum() > 0"))


# -- global state -----------------------------------------------------------------------------------

class LeavesGradOff(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(3, 3)

    def forward(self, x):
        torch.set_grad_enabled(False)  # runs while the model is traced: a leak into the caller
        return self.linear(x)


class ChangesDtypeThenFails(nn.Module):
    def forward(self, x):
        torch.set_default_dtype(torch.float64)
        torch.manual_seed(123)
        if x.sum() > 0:
            return x
        return -x


def test_trace_puts_back_what_the_models_python_changed():
    model = LeavesGradOff()
    before = snapshot()
    traced = trace(model, (torch.ones(2, 3),))
    assert torch.is_grad_enabled()
    assert differences(before, snapshot()) == []
    assert any("grad mode" in note for note in traced.notes)


def test_trace_puts_back_global_state_when_it_raises():
    before = snapshot()
    with pytest.raises(TraceError):
        trace(ChangesDtypeThenFails(), (torch.ones(2, 3),))
    assert torch.get_default_dtype() == torch.float32
    assert differences(before, snapshot()) == []


# -- diffusers ----------------------------------------------------------------------------------------

def _diffusers_unet():
    diffusers = pytest.importorskip("diffusers")
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = diffusers.UNet2DModel(
            sample_size=8, in_channels=3, out_channels=3, block_out_channels=(8, 16), layers_per_block=1,
            norm_num_groups=4, attention_head_dim=4, down_block_types=("DownBlock2D", "AttnDownBlock2D"),
            up_block_types=("AttnUpBlock2D", "UpBlock2D")).double().eval()
        x = torch.randn(5, 3, 8, 8, dtype=torch.float64)
    return model, x, torch.tensor(10)


def test_diffusers_unet_specialises_on_the_batch():
    """UNet2DModel: fx fails (len() on a proxy in get_timestep_embedding); the dynamic export fails
    with a constraint on the batch (Upsample2D's ``if hidden_states.shape[0] >= 64``)."""
    model, x, t = _diffusers_unet()
    with pytest.raises(BatchSpecialised) as info:
        trace(model, (x, t))
    assert [name for name, _ in info.value.errors] == ["torch.fx.symbolic_trace",
                                                       "torch.export (non-strict, dynamic batch)"]
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("rows", [2, 3])
def test_diffusers_unet_traces_at_a_static_batch(rows):
    model, x, t = _diffusers_unet()
    traced = trace(model, (x, t), static_batch=rows)
    assert traced.route == "export-static" and traced.batch_size == rows
    part = x[5 - rows:]
    got, want = _run(traced, part, t), model(part, t)
    assert type(got) is type(want)
    torch.testing.assert_close(got.sample, want.sample, rtol=0, atol=1e-12)


# -- what an fx graph cannot hold -----------------------------------------------------------------------

class RunningScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x):
        h = self.a(x)
        with torch.no_grad():
            self.scale.mul_(0.9).add_(0.1 * h.abs().mean(0))
        return h * self.scale



class DecaysItsBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("decay", torch.ones(3))

    def forward(self, x):
        self.decay.mul_(0.5)  # every argument a real tensor or constant: fx runs it while tracing
        return x * self.decay


class NoiseInForward(nn.Module):
    """Noise drawn from sizes alone, as diffusion models sample it: fx would draw it once, into a constant."""

    def forward(self, x):
        return x + torch.randn(3)


@pytest.mark.parametrize("model, lost", [(RunningScale(), "switches grad mode"),
                                         (DecaysItsBuffer(), "writes decay in place"),
                                         (NoiseInForward(), "draws random numbers from no traced argument")])
def test_fx_route_refuses_what_its_graph_would_lose_and_export_keeps_it(model, lost):
    """fx records neither a no_grad region nor an op with constant arguments (it runs that op for real at trace
    time): its graph would differentiate the region, drop the write and freeze the noise."""
    x = torch.randn(4, 8 if isinstance(model, RunningScale) else 3)
    buffers = [b.clone() for b in model.buffers()]
    with pytest.raises(TraceError, match=lost):
        trace(model, (x,), route="fx")
    traced = trace(model, (x,))
    assert traced.route == "export" and any(lost in note for note in traced.notes)
    assert all(torch.equal(b, before) for b, before in zip(model.buffers(), buffers))  # tracing wrote nothing
    graph = traced.graph_module.print_readable(print_output=False)
    assert ("randn" if isinstance(model, NoiseInForward) else "mul_") in graph
    if isinstance(model, NoiseInForward):  # new noise on every call, as in the plain model
        import autopipe
        pipe = autopipe.compile(model, devices=1, chunks=2, example_inputs=(x,))
        assert not torch.equal(pipe(x), pipe(x))


class _Counts(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("steps", torch.zeros((), dtype=torch.float64))
        self.register_buffer("table", torch.zeros(1, 1, dtype=torch.float64), persistent=False)
        self.width = 8
        self.last = None  # as Hugging Face declares such attributes: export puts it back itself, before autopipe looks

    def forward(self, x):
        if self.table.shape[1] != self.width:  # a cache rebuilt for a new width, as ConViT's rel_indices for a new length
            self.table = torch.arange(self.width, dtype=x.dtype)[None] / self.width
        self.steps = self.steps + 1  # state carried across calls
        self.last = x.detach()  # kept for a later look
        return x * self.table


class AssignsInForward(nn.Module):
    """A forward that assigns module attributes: a submodule's buffers and a plain attribute, and the root's own buffer."""

    def __init__(self):
        super().__init__()
        self.inner = _Counts()
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).double()
        self.register_buffer("calls", torch.zeros((), dtype=torch.float64))

    def forward(self, x):
        self.calls = self.calls + 1
        return self.head(self.inner(x))


def test_assignments_in_forward_leave_the_model_as_it_was_and_are_named():
    """Tracing runs the forward: fx left its Proxy in ``inner.last`` and a trace-time count in the buffers, and its graph
    read the buffers as constants. Now fx refuses, export computes with the assigned values, the model keeps what it
    held, and compile names each assignment the pipeline does not store; export stores the root's own buffers."""
    import autopipe

    model, x = AssignsInForward(), torch.randn(4, 8, dtype=torch.float64)
    held = {name: b for name, b in model.named_buffers()}
    with pytest.raises(TraceError, match="the forward assigns calls, inner.last, inner.steps, inner.table"):
        trace(model, (x,), route="fx")
    with pytest.warns(UserWarning, match="forward assigns inner.last, inner.steps, inner.table: the pipeline runs"):
        pipe = autopipe.compile(model, devices=2, chunks=2, example_inputs=(x,))
    assert pipe.plan.route == "export" and any("assigns inner.last" in note for note in pipe.plan.notes)
    assert model.inner.last is None and {name: b for name, b in model.named_buffers()} == held
    assert all(not b.any() for b in held.values())

    reference = AssignsInForward()
    reference.load_state_dict(model.state_dict())
    for xs in x.split(2):  # GPipe's loop: one forward and backward a micro-batch
        reference(xs).sum().backward()
    pipe(x).sum().backward()
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, r.grad, rtol=0, atol=1e-12, msg=name)
    assert model.calls.item() == reference.calls.item() == 2  # the root's buffer, stored per micro-batch
    assert model.inner.steps.item() == 0 and reference.inner.steps.item() == 2  # what compile warned about


class NumpyMask(nn.Module):
    """A SpecAugment-like mask from NumPy's generator (wav2vec2's _compute_mask_indices), drawn in training only."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        if self.training:
            x = x * torch.tensor(np.random.rand(x.shape[1]) < 0.5, dtype=x.dtype)
        return self.a(x)


def test_randomness_from_numpy_is_refused_not_frozen_into_the_graph():
    state = np.random.get_state()
    with pytest.raises(TraceError, match="draws from NumPy random"):
        trace(NumpyMask().train(), (torch.randn(4, 8),))
    assert all(np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
               for a, b in zip(state, np.random.get_state()))  # and the caller's generator is where it was
    assert trace(NumpyMask().eval(), (torch.randn(4, 8),)).route == "fx"


# -- a draw made once per process (a first import) is not the forward's -----------------------------------------

DRAWS_AT_IMPORT = """
import random
import numpy as np
np.random.rand(5)  # as jax/_src/clusters/k8s_cluster.py does when transformers first imports it, lazily
random.random()
SCALE = 2.0
"""


@pytest.fixture
def drawing_module(tmp_path, monkeypatch):
    """The name of a module, not yet imported, that draws from NumPy's and Python's generators when it is imported."""
    name = f"draws_at_import_{tmp_path.name}"
    (tmp_path / f"{name}.py").write_text(DRAWS_AT_IMPORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)


class ImportsInForward(nn.Module):
    """Imports a module inside its forward (a lazy import: the first call imports, later calls find it imported);
    with ``layer_drop``, also skips its second layer at random on every call, with Python's generator."""

    def __init__(self, module_name: str, layer_drop: float = 0.0):
        super().__init__()
        self.module_name, self.layer_drop = module_name, layer_drop
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        x = torch.tanh(self.a(x)) * importlib.import_module(self.module_name).SCALE
        if self.layer_drop and random.random() < self.layer_drop:
            return x
        return self.b(x)


def test_a_module_drawing_when_the_forward_first_imports_it_does_not_refuse_the_model(drawing_module):
    torch.manual_seed(0)
    model = ImportsInForward(drawing_module).double()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 8, dtype=torch.float64)
    pipe = autopipe.compile(model, devices=["cpu"] * 2, chunks=4, example_inputs=(x,))
    assert drawing_module in sys.modules  # the trace imported it: its draw happened there
    out, ref = pipe(x), reference(x)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    out.square().sum().backward()
    ref.square().sum().backward()
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=lambda m: f"{name}: {m}")


def test_a_forward_drawing_on_every_call_is_refused_naming_that_generator_alone(drawing_module):
    state = random.getstate()
    with pytest.raises(TraceError, match="draws from Python random") as refused:
        trace(ImportsInForward(drawing_module, layer_drop=0.5), (torch.randn(4, 8),))
    assert "NumPy" not in str(refused.value)  # the import drew from NumPy once: not the forward's draw
    assert random.getstate() == state  # and the caller's generator is where it was


class MaskedTokens(nn.Module):
    """ELECTRA's pretraining head in small: the loss over the tokens a mask keeps (logits[mask == 1])."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 1)

    def forward(self, x, mask):
        return self.b(torch.relu(self.a(x))).squeeze(-1)[mask == 1].pow(2).mean()


@pytest.mark.parametrize("route", ["fx", "export"])
def test_a_size_set_by_values_is_traced_at_its_largest_and_marked(route):
    """FakeTensorMode raised on logits[mask == 1] (DynamicOutputShapeException) and trace refused; with a shape env the rows are u0, at
    most the 24 the mask covers: costed at 24, marked for partition (which keeps them in one stage and follows them, test_faithfulness)."""
    x, mask = torch.randn(4, 6, 8), torch.ones(4, 6, dtype=torch.long)
    mask[1::2, 4:] = 0
    traced = trace(MaskedTokens(), (x, mask), route=route)
    selected = [n for n in traced.graph_module.graph.nodes if n.meta.get("selected_rows")]
    assert selected and all(n.meta["data_dependent"] and n.meta["val"].shape[0] == 24 for n in selected)
    assert all(n.meta["selected_rows"] == (0, "u0") for n in selected)
    assert any("sizes that depend on values" in note for note in traced.notes)


class Layouts(nn.Module):
    """Values whose dim 0 is the batch, k rows of each sample, or neither though an int comparison would say so."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):  # x: (batch, seq, 8) with seq == batch
        h = self.a(x)
        per_token = h.reshape(-1, 8)                  # seq rows a sample
        sequence_major = h.transpose(0, 1)            # (seq, batch, 8): dim 0 is seq, though seq == batch
        weights = self.a.weight.reshape(-1, 4)        # (16, 4): a multiple of the batch, no sample in it
        pairs = h.flatten(1) @ h.flatten(1).t()       # (batch, batch): its dim 1 grows with the batch
        return per_token, sequence_major, weights, pairs, h.shape[0] * h


@pytest.mark.parametrize("route", ["fx", "export"])
def test_rows_per_sample_is_what_a_larger_batch_shows_not_an_int_comparison(route):
    traced = trace(Layouts(), (torch.randn(4, 4, 8),), route=route)
    output = traced.graph_module.graph.output_node().args[0]
    assert [n.meta["rows_per_sample"] for n in output] == [4, 0, 0, 0, 1]
    number = next(n for n in traced.graph_module.graph.nodes if n.meta.get("batch_number"))
    assert number.meta["val"] == 4  # h.shape[0]: a number that differs between micro-batches


def test_an_fx_graph_that_runs_at_its_traced_batch_alone_is_refused_naming_the_batch():
    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)

        def forward(self, x):
            return self.a(x).view(8, 8)  # the batch of 4 written into the model

    with pytest.raises(TraceError, match=r"(?s)batch of 5: RuntimeError: shape '\[8, 8\]' is invalid.*treats the batch size \(4\) as a constant"):
        trace(Fixed(), (torch.randn(4, 2, 8),), route="fx")
    with pytest.raises(TraceError):  # auto: traced again at each micro-batch size, where view(8, 8) fails too
        trace(Fixed(), (torch.randn(4, 2, 8),), route="auto")


class Hooked(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _hooked(where):
    torch.manual_seed(0)
    model = Hooked().double()
    if where == "full":
        model.blocks[1].register_full_backward_hook(lambda m, grad_in, grad_out: (grad_in[0] * 3.0,))
    elif where == "pre":
        model.blocks[2].register_full_backward_pre_hook(lambda m, grad_out: (grad_out[0] * 0.5,))
    elif where == "root_forward":
        model.register_forward_hook(lambda m, args, out: out + 1.0)
        model.register_forward_pre_hook(lambda m, args: (args[0] * 2.0,))
    return model, torch.randn(8, 8, dtype=torch.float64)


@pytest.mark.parametrize("where", ["full", "pre", "root_forward"])
def test_module_hooks_change_the_pipelines_gradients_as_the_plain_models(where):
    """A graph that traces into a module holds no backward hook of its (each was lost, silently: 0.6 off), nor the model's own forward
    hooks on fx (which traced model.forward): fx keeps a module with a backward hook whole, and calls the model as its __call__ does."""
    import copy

    import autopipe
    model, x = _hooked(where)
    plain = copy.deepcopy(model)
    want = plain(x)
    want.pow(2).sum().backward()
    pipe = autopipe.compile(model, devices=2, chunks=4, route="fx")
    got = pipe(x)
    got.pow(2).sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=name)
    assert any("backward hooks" in note for note in pipe.plan.notes) == (where != "root_forward")


def test_backward_hooks_the_pipeline_cannot_run_are_refused_naming_the_module():
    model, x = _hooked("full")
    with pytest.raises(TraceError, match="module 'blocks.1' has a backward hook"):
        trace(model, (x,), route="export")
    model.register_full_backward_hook(lambda m, grad_in, grad_out: None)
    with pytest.raises(TraceError, match="Hooked itself has a backward hook"):
        trace(model, (x,), route="fx")
    model, x = _hooked(None)
    handle = torch.nn.modules.module.register_module_full_backward_hook(lambda m, grad_in, grad_out: None)
    try:  # every module's, the stages' too: on fx it was lost where a graph traced into a module (0.32 off where it scaled a gradient)
        for route in ("fx", "export"):
            with pytest.raises(TypeError, match="a global module backward hook is set"):
                trace(model, (x,), route=route)
    finally:
        handle.remove()


def test_an_autocast_region_in_the_forward_is_kept_by_taking_the_export_route():
    """fx records no autocast switch: the region ran in float32 through the pipeline (1.7e-3 off in bfloat16)."""
    class Autocast(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                h = self.b(self.a(x))
            return h.float()

    torch.manual_seed(0)
    model, x = Autocast(), torch.randn(8, 8)
    with pytest.raises(TraceError, match=r"switches autocast \(torch.autocast\) at .*test_trace.py"):
        trace(model, (x,), route="fx")
    import autopipe
    pipe = autopipe.compile(model, devices=2, chunks=1, example_inputs=(x,))
    assert pipe.plan.route == "export" and torch.equal(pipe(x), model(x))


def window_sizes(sizes, window_size):
    """As torchvision's swin3d _get_window_and_shift_size (fx-wrapped): it writes its list argument."""
    for i in range(len(window_size)):
        if sizes[i] <= window_size[i]:
            window_size[i] = sizes[i]
    return window_size


torch.fx.wrap("window_sizes")


def test_a_function_fx_keeps_whole_may_write_its_list_arguments():
    """fx's Interpreter hands a node its arguments as immutable lists: the shape runs failed on torchvision's swin3d ('immutable_list'
    object does not support mutation), where the generated code, passing a fresh list, runs."""
    class Windowed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.window_size = nn.Linear(8, 8), nn.Linear(8, 8), [4, 16]

        def forward(self, x):
            _, d, h = x.shape
            w = window_sizes((d, h), self.window_size)
            return self.b(self.a(x) * w[0] + w[1])

    import copy

    import autopipe
    model, x = Windowed().double(), torch.randn(4, 6, 8, dtype=torch.float64)
    plain = copy.deepcopy(model)
    plain(x).sum().backward()
    pipe = autopipe.compile(model, devices=2, chunks=2, route="fx", balance="time", example_inputs=(x,))  # time: the cost pass runs it too
    pipe(x).sum().backward()
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=name)


class CastsItsSubmodules(nn.Module):
    """Casts and moves its own submodules in its forward, as transformers' Switch router does (``self.classifier =
    self.classifier.to(self.dtype)``): to the input's dtype and device (a Proxy on fx, which takes the export route),
    or to its own ``dtype`` (both routes). A no-op in the plain model, once it is so."""

    def __init__(self, to_input: bool, dtype=torch.float64):
        super().__init__()
        self.to_input, self.dtype = to_input, dtype
        self.inner, self.gate, self.out = nn.Linear(6, 6), nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 3)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))  # an int buffer, which a cast to a dtype keeps

    def forward(self, x):
        if self.to_input:
            self.inner = self.inner.to(x.dtype)
            self.gate.to(x.device)
        else:
            self.inner = self.inner.to(self.dtype)
            self.gate.to("cpu").type(self.dtype)
            self.out.double()
        return self.out(self.gate(self.inner(x)))


@pytest.mark.parametrize("to_input, route", [(True, "auto"), (False, "fx"), (False, "export")])
def test_a_forward_casting_its_own_submodule_as_it_is_traces_as_the_no_op_it_is(to_input, route):
    """The export route swapped the fake parameters of a cast it ran (torch's "Couldn't swap Linear.weight"), also one
    that changed nothing: a no-op of the plain model, now one in the trace too."""
    torch.manual_seed(0)
    model, x = CastsItsSubmodules(to_input).double(), torch.randn(6, 6, dtype=torch.float64)
    plain = copy.deepcopy(model)
    want = plain(x)
    want.square().sum().backward()
    pipe = autopipe.compile(model, devices=2, chunks=3, route=route, example_inputs=(x,))
    assert pipe.plan.route == ("fx" if route == "fx" else "export")
    got = pipe(x)
    got.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=name)
    model.zero_grad()
    loss = pipe.step(x, target=torch.zeros(6, 3, dtype=torch.float64), loss_fn=nn.functional.mse_loss)
    torch.testing.assert_close(loss, nn.functional.mse_loss(want, torch.zeros(6, 3, dtype=torch.float64)),
                               rtol=1e-12, atol=1e-12)
    assert all(p.dtype == torch.float64 for p in model.parameters()) and model.seen.dtype == torch.long


@pytest.mark.parametrize("route", ["fx", "export"])
def test_a_forward_cast_that_changes_a_parameter_is_refused_by_name_leaving_the_model_as_it_was(route):
    """fx ran the cast for real on the model's parameters (a float64 model left with a float32 submodule); export
    failed on torch's swap. A graph cannot change the model's parameters: refused, naming the module and the line."""
    model, x = CastsItsSubmodules(False, dtype=torch.float32).double(), torch.randn(6, 6, dtype=torch.float64)
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with pytest.raises(TraceError) as refused:
        trace(model, (x,), route=route)
    message = str(refused.value)
    assert message.startswith("the forward casts 'inner' (") and "test_trace.py:" in message
    assert "self.inner = self.inner.to(self.dtype)" in message
    assert "weight's dtype torch.float64 to torch.float32" in message
    assert "Cast it so before compiling" in message and "docs/faithfulness.md" in message
    assert len(message) <= 300
    assert not any("could not trace" in line for line in message.splitlines())  # refused as it is: no route avoids it
    state = model.state_dict()
    assert all(state[name].dtype == t.dtype and torch.equal(state[name], t) for name, t in before.items())


class UpsampledBy(nn.Module):
    """Upsamples to sizes read from an input's values, as a vision model sizes its upsampling from
    ``spatial_shapes.tolist()``."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, x, sizes):
        return self.b(nn.functional.interpolate(self.a(x), size=sizes.tolist()))


@pytest.mark.parametrize("route", ["fx", "export"])
def test_an_op_sized_by_an_inputs_values_is_refused_naming_the_line_the_input_and_the_pass(route):
    """It ended compile with torch's raw "SymIntArrayRef expected to contain only concrete integers", naming no line,
    no input, nothing to do."""
    with pytest.raises(TraceError) as refused:
        autopipe.compile(UpsampledBy(), devices=2, chunks=2, route=route,
                         example_inputs=(torch.randn(4, 3, 8, 8), torch.tensor([12, 12])))
    message = str(refused.value)
    assert "test_trace.py:" in message and "nn.functional.interpolate(self.a(x), size=sizes.tolist())" in message
    assert "the values of 'sizes'" in message and "trace pass" in message and "Pass them as Python ints" in message
    assert "docs/faithfulness.md" in message and len(message) <= 300
    assert "SymIntArrayRef" in str(refused.value.__cause__)  # torch's error, chained
