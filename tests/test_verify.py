"""autopipe.verify: PASS on correct pipelines, FAIL -- naming the parameter -- on pipelines that do not
compute the model, and nothing of the caller's touched."""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import autopipe
from autopipe.runtime.microbatch import micro_batch_sizes
from autopipe.verify import STRUCTURE_TOLERANCE, default_loss
from autopipe.verify_report import GRAD_FLOOR, Row, VerifyReport
from zoo import build, random_inputs


# -- PASS: the test models, in the modes that matter ---------------------------------------------

@pytest.mark.parametrize("name, mode", [
    ("mlp", "eval"),
    ("resnet", "train"),        # BatchNorm per micro-batch; running statistics compared too
    ("gpt", "train"),           # dropout: compared with itself under checkpoint='never', and in eval mode
    ("kwargs", "eval"),         # keyword arguments, a bool, a dict output holding the model's own loss
    ("dataclass", "eval"),
    ("two_inputs", "eval"),
    ("masked", "train"),        # a (seq, seq) mask given whole to every micro-batch
    # the experts ("moe": rows of a size set by values) cost ~26 s here: test_compile and test_faithfulness run them
    ("unet", "eval"),           # long skips
])
def test_the_test_models_pass(name, mode):
    model = build(name).train(mode == "train")
    args, kwargs = random_inputs(name)
    report = autopipe.verify(model, args, kwargs, devices=2, chunks=4)
    assert isinstance(report, VerifyReport)
    assert report.passed, f"\n{report}"
    text = str(report)
    assert "PASS" in text and "FAIL" not in text
    first_param = next(n for n, _ in model.named_parameters())
    assert first_param in text or "more grad rows" in text
    assert report.structure[0].tolerance == STRUCTURE_TOLERANCE


def test_dropout_in_training_mode_is_compared_in_eval_mode_and_replayed_in_training_mode():
    model = build("gpt").train()
    args, kwargs = random_inputs("gpt")
    report = autopipe.verify(model, args, kwargs, devices=2, chunks=4)
    assert report.passed, f"\n{report}"
    assert report.mode == "train"
    assert "eval mode" in report.structure[0].reference and "dropout off" in report.structure[0].run
    assert "train mode" in report.replay[0].run
    assert any("draws random numbers in train mode" in n for n in report.notes)
    # the tied embedding / LM head: held by two stages, its gradient summed in thread-timing order
    tied = [r for r in report.replay[0].rows if r.name == "wte.weight"]
    assert tied and tied[0].tolerance is not None and "held by stages" in tied[0].note
    assert model.training


def test_batchnorm_in_training_mode_is_compared_per_micro_batch():
    model = build("resnet").train()
    args, kwargs = random_inputs("resnet")
    report = autopipe.verify(model, args, kwargs, devices=2, chunks=4)
    assert report.passed, f"\n{report}"
    info = next(c for c in report.structure if c.name == "micro-batching")
    assert info.informational and "mixes the rows of a batch" in " ".join(info.notes)
    assert any(r.kind == "buffer" and r.name.endswith("running_mean") for r in report.structure[0].rows)


def test_a_batch_that_does_not_divide_merges_the_model_loss_as_a_weighted_mean():
    model = build("kwargs").eval()
    args, kwargs = random_inputs("kwargs", batch=7)
    report = autopipe.verify(model, args, kwargs, devices=2, chunks=4)
    assert report.passed, f"\n{report}"
    assert "(2, 2, 2, 1)" in report.structure[0].reference
    assert report.loss.startswith("the model's own loss")


def test_a_custom_loss_fn_and_four_stages():
    model = build("mlp").eval()
    args, _ = random_inputs("mlp")
    target = torch.randn(8, 4)
    report = autopipe.verify(model, args, devices=4, chunks=4, checkpoint="always",
                             loss_fn=lambda out: F.mse_loss(out, target))
    assert report.passed, f"\n{report}"
    assert "loss_fn=" in report.loss and report.checkpoint == "always" and len(report.devices) == 4


# -- FAIL: pipelines that do not compute the model -----------------------------------------------

class Annealed(nn.Module):
    """Counts its calls in a Python int and scales one branch by it (a warm-up kept as Python state).
    Tracing bakes the count it saw; the plain model's changes on every call. Only ``b`` sees the count."""

    def __init__(self):
        super().__init__()
        self.a = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.b = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = x
        for layer in self.a:
            h = torch.tanh(layer(h))
        return h + self.b(x) * (1 + 0.1 * self.calls)


def test_python_state_that_tracing_freezes_fails_and_the_table_names_the_parameter():
    torch.manual_seed(0)
    model = Annealed().eval()
    report = autopipe.verify(model, (torch.randn(8, 8),), devices=2, chunks=4)
    assert not report.passed
    structure = report.structure[0]
    assert not structure.passed and structure.error is None
    # the loss is linear in the output, so a's gradients do not see the scale: exactly b's rows fail
    failing_grads = {r.name for r in structure.failures if r.kind == "grad"}
    assert failing_grads == {"b.weight", "b.bias"}
    text = str(report)
    assert "FAIL" in text and "b.weight" in text and "tolerance 1e-10" in text
    assert report.verdict().startswith("FAIL: structure")
    assert any("not reproducible" in n for n in report.notes)


class NoisyOwnGenerator(nn.Module):
    """Adds noise drawn from a torch.Generator the model owns (seeded augmentation). The plain model draws for
    micro-batch 0's four layers, then micro-batch 1's, ...; a pipeline's stages draw in another order."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.noise = torch.Generator().manual_seed(1234)

    def forward(self, x):
        for layer in self.layers:
            h = layer(x)
            x = torch.tanh(h + 0.1 * torch.randn(h.shape, generator=self.noise))
        return x


def test_randomness_from_the_models_own_generator_fails():
    torch.manual_seed(0)
    report = autopipe.verify(NoisyOwnGenerator().train(), (torch.randn(8, 8),), devices=2, chunks=4)
    assert not report.passed, f"\n{report}"
    assert any("not reproducible" in n and "torch.Generator" in n for n in report.notes)
    structure = report.structure[0]
    if structure.error is not None:  # torch 2.11's fx cannot carry a Generator argument: autopipe refuses
        assert "TraceError" in structure.error and "Generator" in structure.error, structure.error
        return
    assert {r.name for r in structure.failures if r.kind == "grad"} >= {"layers.0.weight"}
    assert "layers.0.weight" in str(report)


class RunningScale(nn.Module):
    """Scales by a running mean of |h| it updates under no_grad in its own forward (a buffer, not BatchNorm): each
    micro-batch's backward needs the scale its forward saw, which later micro-batches overwrite in place."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.register_buffer("scale", torch.full((8,), 2.0))

    def forward(self, x):
        h = self.a(x)
        if self.training:
            with torch.no_grad():
                self.scale.mul_(0.9).add_(0.1 * h.abs().mean(0))
        return self.b(h * self.scale)


@pytest.mark.parametrize("checkpoint", ["never", "except_last", "always"])
def test_a_forward_that_writes_a_buffer_it_reads_gets_the_micro_batch_loops_gradients(checkpoint):
    """fx would lose the no_grad region and the write (the export route keeps both); each task's graph keeps the
    buffer as its forward saw it, and a recompute starts from that value."""
    torch.manual_seed(0)
    model, x = RunningScale().train(), torch.randn(16, 8)
    report = autopipe.verify(model, (x,), devices=2, chunks=4, checkpoint=checkpoint)
    assert report.passed, report
    assert torch.equal(model.scale, torch.full((8,), 2.0))  # verify ran copies
    twin = copy.deepcopy(model).double()
    pipe = autopipe.compile(twin, devices=2, chunks=4, checkpoint=checkpoint)
    pipe(x.double()).sum().backward()
    for part in x.double().chunk(4):  # the loop a user would write: a backward per micro-batch
        model.double()(part).sum().backward()
    assert torch.allclose(twin.scale, model.scale, rtol=0, atol=1e-12)
    assert all(torch.allclose(p.grad, q.grad, rtol=0, atol=1e-12) for p, q in zip(twin.parameters(), model.parameters()))


def test_a_forward_that_updates_and_reads_its_buffers_counts_as_deterministic():
    from autopipe.verify import DETERMINISTIC, IRREPRODUCIBLE, _randomness, default_loss
    torch.manual_seed(0)
    x = torch.randn(8, 8)
    model = RunningScale().train()
    assert _randomness(model, (x,), {}, default_loss) == DETERMINISTIC
    assert torch.equal(model.scale, torch.full((8,), 2.0))  # on a copy
    assert _randomness(Annealed(), (x,), {}, default_loss) == IRREPRODUCIBLE


class GatedDropout(nn.Module):
    """A branch behind a zero-initialised gain (layer scale, ReZero, Swin V2's post-norm): its dropout changes no output at first, only the
    gain's gradient."""

    def __init__(self):
        super().__init__()
        self.branch = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
        self.gain = nn.Parameter(torch.zeros(8))
        self.head = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, x):
        return self.head(x + self.gain * self.branch(x))


def test_dropout_that_only_the_gradients_show_is_found_and_compared_in_eval_mode():
    """The outputs alone called this model deterministic: the structure part compared the pipeline's dropout masks with the plain
    model's in train mode and failed on a correct pipeline (timm's Swin V2 CR, whose post-norm gains start at zero)."""
    torch.manual_seed(0)
    report = autopipe.verify(GatedDropout().train(), (torch.randn(8, 8),), devices=2, chunks=2)
    assert report.passed, f"\n{report}"
    assert any("draws random numbers in train mode" in n for n in report.notes)
    assert "eval mode" in report.structure[0].reference


def test_a_difference_in_the_last_bit_fails_the_replay():
    from autopipe.verify import _compare_steps, _Step
    from autopipe.verify_report import Check
    w = torch.tensor([1.0, 2.0, 3.0])
    ref = _Step(outputs=[("output", w)], loss=w.sum(), grads={"w": w}, buffers={})
    off = _Step(outputs=[("output", w)], loss=w.sum(), grads={"w": torch.nextafter(w, w + 1)}, buffers={})
    check = Check("replay", "run", "reference", 0.0, rows=_compare_steps(off, ref))
    assert not check.passed and [r.name for r in check.failures] == ["w"]
    assert Check("replay", "run", "reference", 0.0, rows=_compare_steps(ref, ref)).passed


class Float32Inside(nn.Module):
    """Casts its input to float32 itself: a float64 copy cannot run (Linear: float vs double)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        x = x.float()
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def test_a_model_that_cannot_run_in_float64_is_checked_in_its_own_dtype():
    torch.manual_seed(0)
    report = autopipe.verify(Float32Inside().eval(), (torch.randn(8, 8),), devices=2, chunks=4)
    assert report.passed, f"\n{report}"
    assert any("does not run in float64" in n for n in report.notes)
    assert report.structure[0].tolerance == 1e-4
    assert "float32, 1 thread per worker" in report.structure[0].run


# -- the caller's state ----------------------------------------------------------------------

def test_nothing_of_the_callers_changes():
    model = build("resnet").train()
    args, _ = random_inputs("resnet")
    for p in model.parameters():
        p.grad = torch.full_like(p, 3.0)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    grads = {n: p.grad for n, p in model.named_parameters()}
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    threads = torch.get_num_threads()
    with torch.no_grad():
        report = autopipe.verify(model, args, devices=2, chunks=4)
        assert not torch.is_grad_enabled()
    assert report.passed, f"\n{report}"
    assert torch.equal(torch.get_rng_state(), rng)
    assert torch.get_num_threads() == threads
    assert model.training
    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]) and p.grad is grads[n] and bool((p.grad == 3.0).all()), n
    for n, b in model.named_buffers():
        assert torch.equal(b, buffers[n]), n


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x, mask):
        return self.a(x) * mask.sum()


def test_bad_arguments_are_named():
    model = build("mlp")
    args, _ = random_inputs("mlp")
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        autopipe.verify(model, args, checkpoint="sometimes")
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        autopipe.verify(model, args, chunks=0)
    with pytest.raises(ValueError, match="devices must be at least 1"):
        autopipe.verify(model, args, devices=0)
    with pytest.raises(TypeError, match="devices must be an int"):
        autopipe.verify(model, args, devices="cpu")


def test_a_tensor_argument_without_the_batch_goes_whole_to_every_micro_batch():
    """In the pipeline and in verify's loop by hand alike (it was refused as a batch mismatch)."""
    assert autopipe.verify(Masked(), (torch.randn(8, 4),), {"mask": torch.ones(3, 1)}).passed


def test_an_error_in_the_plain_model_is_raised_not_reported():
    model = build("gpt")
    with pytest.raises((IndexError, RuntimeError)):
        autopipe.verify(model, (torch.full((8, 16), 10_000),))  # token ids past the vocabulary


# -- the pieces --------------------------------------------------------------------------

def test_rows_measure_against_the_reference_with_a_floor_for_zero_gradients():
    assert Row("grad", "w", 1e-3, 1.0).rel == 1e-3
    assert Row("grad", "w", 0.0, 0.0).rel == 0.0
    assert Row("grad", "w", 1.0, 0.0).rel == math.inf
    assert math.isnan(Row("grad", "w", math.nan, 1.0).rel) and not Row("grad", "w", math.nan, 1.0).within(1.0)
    noise = Row("grad", "k_proj.bias", 1e-17, 1e-17, floor=GRAD_FLOOR * 10.0)
    assert noise.floored and noise.rel == pytest.approx(1e-15)
    assert Row("grad", "w", 1e-6, 1.0, tolerance=1e-5).within(0.0)


def test_default_loss_uses_the_models_loss_or_a_fixed_projection():
    assert default_loss(torch.tensor(2.5)) == 2.5
    assert default_loss({"loss": torch.tensor(1.5), "logits": torch.ones(2)}) == 1.5
    out = (torch.ones(3, 4), torch.arange(3))
    assert torch.equal(default_loss(out), default_loss(out))  # deterministic
    assert default_loss(out) != default_loss((torch.ones(3, 4) * 2, torch.arange(3)))
    with pytest.raises(TypeError, match="no floating tensor"):
        default_loss(torch.arange(3))


def test_micro_batch_sizes_as_the_pipeline_splits():
    assert micro_batch_sizes(8, 4) == [2, 2, 2, 2]
    assert micro_batch_sizes(7, 4) == [2, 2, 2, 1]
    assert micro_batch_sizes(3, 4) == [1, 1, 1]


class CheckpointedInTraining(nn.Module):
    """Dropout, and blocks under a reentrant checkpoint in training only (as Hugging Face's gradient checkpointing): eval mode skips the
    code a training step runs."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(8, 8)
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Dropout(0.2)) for _ in range(3))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        h = self.embed(x)
        for block in self.blocks:
            h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=True) if self.training else block(h)
        return self.head(h)


def test_a_random_model_is_also_checked_in_train_mode_with_its_draws_fixed(monkeypatch):
    """verify compared a model with dropout in eval mode only, and replayed the pipeline against itself: a pipeline that lost every gradient
    through a reentrant checkpoint (as it did) passed. With every random draw fixed (random_ops.FixedDraws), a training step of the plain
    model and the pipeline compute the same numbers."""
    import threading

    import autopipe.passes.custom_gradients as custom_gradients
    torch.manual_seed(0)
    model, x = CheckpointedInTraining().train(), torch.randn(8, 8)
    report = autopipe.verify(model, (x,), devices=2, chunks=4)
    assert report.passed, report
    fixed = next(c for c in report.structure if c.name == "structure, draws fixed")
    assert "train mode" in fixed.run and {r.name for r in fixed.rows if r.kind == "grad" and r.max_abs_ref > 0} >= {"blocks.0.0.weight"}

    original = custom_gradients._apply

    def under_no_grad(cls, *args, **kwargs):  # the bug as it was: export traced the checkpoint under no_grad
        if cls is torch.utils.checkpoint.CheckpointFunction and threading.get_ident() in custom_gradients._tracing:
            with torch.no_grad():
                return args[0](*args[2:])
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(custom_gradients, "_apply", under_no_grad)
    report = autopipe.verify(model, (x,), devices=2, chunks=4)
    assert not report.passed and [c.name for c in report.checks if not c.passed] == ["structure, draws fixed"], report


def test_a_model_random_in_eval_mode_too_is_checked_in_train_mode_with_its_draws_fixed():
    """Random in eval mode too (a Function drawing a mask in either mode), the structure check has nothing to compare: the fixed-draws
    check still does."""
    class MaskedDropout(torch.autograd.Function):  # DeBERTa's XDropout, drawing in eval mode too
        @staticmethod
        def forward(ctx, x):
            mask = torch.empty_like(x).bernoulli_(0.6).bool()
            ctx.save_for_backward(mask)
            return x.masked_fill(~mask, 0) / 0.6

        @staticmethod
        def backward(ctx, grad):
            (mask,) = ctx.saved_tensors
            return grad.masked_fill(~mask, 0) / 0.6

    class RandomInEval(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return self.b(MaskedDropout.apply(self.a(x)))

    torch.manual_seed(0)
    report = autopipe.verify(RandomInEval().train(), (torch.randn(8, 8),), devices=2, chunks=2)
    assert report.passed, report
    assert [c.name for c in report.structure if not c.informational] == ["structure, draws fixed"]


def test_a_running_mean_of_centred_values_is_measured_against_the_buffers_scale():
    """A BatchNorm after a BatchNorm keeps a running mean of ~1e-18, whose rounding differs between the pipeline and the loop: measured
    against itself it failed verify (the fixed-draws check of EfficientNet and DeepLabV3, 1.2 'off'); buffers get the gradients' floor."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.1), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32),
                          nn.BatchNorm1d(32), nn.BatchNorm1d(32), nn.Linear(32, 2)).train()
    report = autopipe.verify(model, (torch.randn(16, 16),), devices=2, chunks=2)
    assert report.passed, report
    rows = {r.name: r for c in report.structure for r in c.rows if r.kind == "buffer"}
    assert rows["3.running_mean"].max_abs_ref < 1e-15 < rows["3.running_mean"].floor
