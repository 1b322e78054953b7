"""passes/custom_gradients.py: a model's custom autograd.Functions keep their backward through both routes (they traced into the
forward and dropped it: other gradients, silently), and a reentrant torch.utils.checkpoint inside the model (Hugging Face's
gradient_checkpointing_enable()) gives the plain model's gradients (export traced it under no_grad: none reached the layers)."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint as checkpoint
from torch import nn

import autopipe

REGISTER_HOOK = torch.Tensor.register_hook
REGISTERED_APPLY = torch.autograd.Function.__dict__["apply"]


class GradReverse(torch.autograd.Function):
    """Domain-adversarial training's gradient reversal: identity forward, negated (and scaled) backward."""

    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return -ctx.scale * grad, None


class SqrtClipped(torch.autograd.Function):
    """RecurrentGemma's SqrtBoundDerivative: sqrt with its gradient clipped."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x.sqrt()

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return grad / (4 * x).sqrt().clamp(min=1.0)


class ScaledAndNorm(torch.autograd.Function):
    """Two outputs, a None and a constant among them, a constant argument, setup_context style; a made-up backward."""

    @staticmethod
    def forward(x, weight, eps=1e-6):
        return x * weight, None, x.norm(dim=-1, keepdim=True) + eps, "tag"

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:2])

    @staticmethod
    def backward(ctx, grad, _none, grad_norm, _tag):
        x, weight = ctx.saved_tensors
        return grad * weight * 0.5 + grad_norm, (grad * x).sum(0) * 2.0, None


class MaskedDropout(torch.autograd.Function):
    """DeBERTa / SEW-D's XDropout: the mask drawn in forward, reused by backward."""

    @staticmethod
    def forward(ctx, x, p):
        mask = torch.empty_like(x).bernoulli_(1 - p).bool()
        ctx.save_for_backward(mask)
        ctx.scale = 1 / (1 - p)
        return x.masked_fill(~mask, 0) * ctx.scale

    @staticmethod
    def backward(ctx, grad):
        (mask,) = ctx.saved_tensors
        return grad.masked_fill(~mask, 0) * ctx.scale, None


class WithFunctions(nn.Module):
    def __init__(self, d=8):
        super().__init__()
        self.a, self.b, self.c, self.head = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, 3)
        self.weight = nn.Parameter(torch.rand(d) + 0.5)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        h = self.b(GradReverse.apply(h, 0.7))
        h = SqrtClipped.apply(h.pow(2) + 0.01)
        scaled, _, norm, _ = ScaledAndNorm.apply(self.c(h), self.weight, 1e-3)
        return self.head(scaled / norm)


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("route", ["fx", "export"])
def test_custom_functions_keep_their_backward_on_both_routes(route):
    torch.manual_seed(0)
    model = WithFunctions().double()
    x = torch.randn(8, 8, dtype=torch.float64)
    plain = copy.deepcopy(model)
    plain(x).pow(2).sum().backward()
    pipe = autopipe.compile(model, devices=2, chunks=4, route=route)
    pipe(x).pow(2).sum().backward()
    code = "".join(s.code for s in pipe.stages)
    assert pipe.plan.route == route and all(f"{f}_apply(" in code for f in ("GradReverse", "SqrtClipped", "ScaledAndNorm"))
    want, got = _grads(plain), _grads(model)
    assert want.keys() == got.keys()
    for name in want:  # the reversal alone flips the sign of a and of the input's gradient: any dropped backward is far off
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12, msg=name)


class RandomFunction(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.b(MaskedDropout.apply(self.a(x), 0.4))


@pytest.mark.parametrize("route", ["fx", "export"])
def test_a_function_that_draws_replays_its_draws_when_recomputed(route):
    model = RandomFunction().double().train()
    x = torch.randn(8, 8, dtype=torch.float64)
    grads = {}
    for mode in ("never", "always"):
        torch.manual_seed(3)
        pipe = autopipe.compile(model, devices=2, chunks=4, checkpoint=mode, route=route)
        model.zero_grad()
        pipe(x).sum().backward()
        grads[mode] = _grads(model)
        assert "call_with_generator" in "".join(s.code for s in pipe.stages)  # its kernels draw from the task's generator
        pipe.close()
    for name in grads["never"]:
        assert torch.equal(grads["always"][name], grads["never"][name]), name


class InPlaceFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.mark_dirty(x)
        return x.mul_(2)

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class SizedFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows):
        return x * rows

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def test_what_export_cannot_keep_whole_is_refused_naming_the_function():
    class Writes(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)

        def forward(self, x):
            return InPlaceFunction.apply(self.a(x) + 1)

    class Sized(Writes):
        def forward(self, x):
            return SizedFunction.apply(self.a(x), x.shape[0])

    for route in ("fx", "export"):  # on fx it was a call the in-place analysis could not see into: a recompute wrote the input again
        with pytest.raises((autopipe.TraceError, TypeError), match="InPlaceFunction.*writes its input in place"):
            autopipe.compile(Writes(), devices=2, chunks=2, route=route, example_inputs=(torch.randn(4, 4),))
    with pytest.raises(autopipe.TraceError, match="SizedFunction.apply is given .*set by the batch size"):
        autopipe.compile(Sized(), devices=2, chunks=2, route="export", example_inputs=(torch.randn(4, 4),))
    # on fx the size is a traced value, passed to the call at run time: each micro-batch's own, which compile warns about, as for h * x.shape[0]
    with pytest.warns(UserWarning, match="sized_function_apply, .*test_custom_gradients.py:\\d+: .* computes batch rows with .*a number set by the batch size"):
        pipe = autopipe.compile(Sized().double(), devices=2, chunks=2, route="fx", example_inputs=(torch.randn(4, 4, dtype=torch.float64),))
    assert pipe.plan.route == "fx" and any("SizedFunction.apply" in note for note in pipe.plan.notes)


class Checkpointed(nn.Module):
    def __init__(self, reentrant, input_needs_grad):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4))
        self.head = nn.Linear(8, 2)
        self.reentrant, self.input_needs_grad = reentrant, input_needs_grad

    def forward(self, x):
        if self.input_needs_grad:
            x = x * self.head.weight.sum()  # a parameter upstream: the checkpoint's input requires grad
        for block in self.blocks:
            x = checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(x)


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("input_needs_grad", [True, False])
def test_checkpoints_inside_the_model_give_the_plain_models_gradients(reentrant, input_needs_grad):
    """Reentrant: as in the plain model, the blocks get no gradient where the checkpoint's input needs none (torch warns there)."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant, input_needs_grad).double()
    x = torch.randn(8, 8, dtype=torch.float64)
    plain = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's "None of the inputs have requires_grad=True"
        plain(x).pow(2).sum().backward()
        pipe = autopipe.compile(model, devices=2, chunks=4)
        pipe(x).pow(2).sum().backward()
    want, got = _grads(plain), _grads(model)
    assert want.keys() == got.keys() and ("blocks.0.0.weight" in want) == (input_needs_grad or not reentrant)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12, msg=name)
    assert any("re-materialises" in note for note in pipe.plan.notes) == reentrant


def test_a_reentrant_checkpoint_traced_without_grad_is_refused_once_requires_grad_changes():
    """Traced where no input of the checkpoint needed a gradient, the graph gives the checkpointed blocks none: right until the input or a
    parameter upstream asks for one (unfreezing an embedding), when the plain model gives them gradients and the pipeline gave None."""
    torch.manual_seed(0)
    model = Checkpointed(reentrant=True, input_needs_grad=False).double()
    x = torch.randn(8, 8, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pipe = autopipe.compile(model, devices=2, chunks=4, example_inputs=(x,))
        pipe(x).sum().backward()
        with pytest.raises(autopipe.InputMismatch, match="changed requires_grad since the pipeline was compiled"):
            pipe(x.clone().requires_grad_()).sum().backward()


class InRegion(nn.Module):
    """A kept Function inside a no_grad or autocast region, which export holds as a subgraph."""

    def __init__(self, region):
        super().__init__()
        self.region, self.a, self.b, self.c = region, nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        if self.region == "autocast":  # Llama's rotary embedding: an autocast-disabled region
            with torch.autocast("cpu", enabled=False):
                h = self.b(GradReverse.apply(h, 0.5))
        else:
            with torch.no_grad():
                m = GradReverse.apply(h * 2, 0.5)
            h = self.b(h) + m
        return self.c(torch.tanh(h))


@pytest.mark.parametrize("region", ["autocast", "no_grad"])
def test_a_function_inside_an_exported_region_is_called_there_too(region):
    """export_route swapped the custom op back for the Function's call in the top graph only: the region's subgraph kept calling it."""
    torch.manual_seed(0)
    model = InRegion(region).double()
    x = torch.randn(8, 8, dtype=torch.float64)
    plain = copy.deepcopy(model)
    plain(x).pow(2).sum().backward()
    pipe = autopipe.compile(model, devices=2, chunks=4)
    pipe(x).pow(2).sum().backward()
    assert pipe.plan.route == "export"
    for (name, a), b in zip(plain.named_parameters(), model.parameters()):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-12, atol=1e-12, msg=name)


def test_a_users_own_patches_of_apply_and_register_hook_stay():
    """A trace patches torch.autograd.Function.apply and Tensor.register_hook for its thread, and puts back what it found, not what torch
    had when autopipe was imported."""
    calls = []
    users_apply = classmethod(lambda cls, *args, **kwargs: calls.append(cls) or REGISTERED_APPLY.__get__(None, cls)(*args, **kwargs))
    users_register_hook = lambda tensor, hook: REGISTER_HOOK(tensor, hook)  # noqa: E731
    torch.autograd.Function.apply, torch.Tensor.register_hook = users_apply, users_register_hook
    try:
        autopipe.plan(WithFunctions(), torch.randn(4, 8), devices=2, chunks=2)
        assert torch.autograd.Function.__dict__["apply"] is users_apply and torch.Tensor.__dict__["register_hook"] is users_register_hook
        model = WithFunctions()
        pipe = autopipe.compile(model, devices=2, chunks=2, example_inputs=(torch.randn(4, 8),))
        pipe(torch.randn(4, 8)).sum().backward()
        assert GradReverse in calls  # the pipeline calls the Function through the user's apply
    finally:
        torch.autograd.Function.apply, torch.Tensor.register_hook = REGISTERED_APPLY, REGISTER_HOOK


@pytest.mark.parametrize("reentrant", [True, False])
def test_hugging_face_gradient_checkpointing_trains_like_the_plain_model(reentrant):
    """gradient_checkpointing_enable() defaulted to torch's reentrant checkpoint before transformers 5: every gradient was None through the
    pipeline."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=4, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2LMHeadModel(config).double().train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    ids = torch.randint(0, 64, (4, 16))
    plain = copy.deepcopy(model)
    plain(input_ids=ids, labels=ids).loss.backward()
    pipe = autopipe.compile(model, devices=2, chunks=2)
    pipe(input_ids=ids, labels=ids).loss.backward()
    want, got = _grads(plain), _grads(model)
    assert len(got) == len(want) == len(list(model.parameters()))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)


def test_functions_of_a_model_run_as_torch_runs_them_once_traced():
    """The patch on torch.autograd.Function.apply lives only while a trace runs."""
    apply = torch.autograd.Function.__dict__["apply"]
    autopipe.plan(WithFunctions(), torch.randn(4, 8), devices=2, chunks=2)
    assert torch.autograd.Function.__dict__["apply"] is apply
    x = torch.randn(3, requires_grad=True)
    GradReverse.apply(x, 1.0).sum().backward()
    assert torch.equal(x.grad, -torch.ones(3))
    assert F.relu(SqrtClipped.apply(x.detach().abs())).shape == (3,)


def test_a_tensor_hook_registered_in_the_forward_is_refused_naming_the_line():
    """torch.export recorded the forward without it: the hook never ran through the pipeline (1.4 off where it scaled a gradient)."""
    class Hooked(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

        def forward(self, x):
            h = torch.tanh(self.a(x))
            if h.requires_grad:
                h.register_hook(lambda grad: grad * 3.0)
            return self.b(h)

    class MultiHooked(Hooked):
        def forward(self, x):
            h = torch.tanh(self.a(x))
            torch.autograd.graph.register_multi_grad_hook((h,), lambda grads: None)
            return self.b(h)

    with pytest.raises(autopipe.TraceError, match=r"registers a gradient hook on a tensor \(.*test_custom_gradients.py:\d+: h.register_hook"):
        autopipe.compile(Hooked(), devices=2, chunks=2, example_inputs=(torch.randn(4, 8),))
    with pytest.raises(autopipe.TraceError, match=r"registers a gradient hook on a tensor \(.*test_custom_gradients.py:\d+: torch.autograd.graph"):
        autopipe.compile(MultiHooked(), devices=2, chunks=2, route="export", example_inputs=(torch.randn(4, 8),))
    assert torch.Tensor.register_hook is REGISTER_HOOK  # torch's again
