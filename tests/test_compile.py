"""End to end: autopipe.compile gives the plain model's outputs and gradients, on CPU workers."""
import copy
import pickle
import itertools
import time

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor

import autopipe
from zoo import GPT, build, random_inputs, scalar_loss, tensor_leaves

MODELS = ["mlp", "resnet", "unet", "gpt", "kwargs", "dataclass", "two_inputs", "masked", "moe"]


def reference(model, args, kwargs):
    """Outputs and every parameter's gradient of the plain model."""
    model.zero_grad()
    out = model(*args, **kwargs)
    scalar_loss(out).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    return out, grads


def assert_equivalent(model, pipe, args, kwargs, ref_out, ref_grads, atol=1e-5):
    out = pipe(*args, **kwargs)
    assert type(out) is type(ref_out)
    for got, want in zip(tensor_leaves(out), tensor_leaves(ref_out), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)
    scalar_loss(out).backward()
    for name, p in model.named_parameters():
        if name in ref_grads:
            assert p.grad is not None, f"{name} got no gradient"
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-4, atol=atol, msg=lambda m: f"{name}: {m}")
    model.zero_grad()


def assert_float64_gradients(model, pipe, x):
    """One backward through ``pipe`` leaves on ``model`` the gradients a copy of the plain model gets, to 1e-12."""
    plain = copy.deepcopy(model)
    pipe(x).sin().sum().backward()
    plain(x).sin().sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-12, atol=1e-12, msg=name)


def setup(name, batch=8):
    model = build(name)
    if name in ("gpt", "resnet"):
        model.eval()  # dropout off / BatchNorm statistics fixed: exact comparison (train mode is tested below)
    g = torch.Generator().manual_seed(1)
    args, kwargs = random_inputs(name, batch, g)
    return model, args, kwargs


CONFIGS = [(1, 1, "never"), (2, 2, "always"), (2, 8, "except_last"), (3, 4, "never"), (4, 8, "always"),
           (4, 4, "except_last")]
# the experts' export trace is the slow part of a case: two configs, the rest in test_faithfulness's expert cases
SLOW_MODEL_CONFIGS = {"moe": [(2, 8, "except_last"), (4, 4, "except_last")]}


@pytest.mark.parametrize("devices,chunks,checkpoint,name", [
    (*config, name) for config in CONFIGS for name in MODELS if config in SLOW_MODEL_CONFIGS.get(name, CONFIGS)])
def test_outputs_and_gradients_equal_plain_model(name, devices, chunks, checkpoint):
    model, args, kwargs = setup(name)
    ref_out, ref_grads = reference(model, args, kwargs)
    pipe = autopipe.compile(model, devices=devices, chunks=chunks, checkpoint=checkpoint)
    assert_equivalent(model, pipe, args, kwargs, ref_out, ref_grads)
    assert len(pipe.stages) == devices


@pytest.mark.parametrize("devices,chunks,checkpoint", list(itertools.product([1, 2, 3, 4], [1, 2, 4, 8], ["always", "except_last", "never"])))
def test_mlp_full_grid(devices, chunks, checkpoint):
    model, args, kwargs = setup("mlp")
    ref_out, ref_grads = reference(model, args, kwargs)
    pipe = autopipe.compile(model, devices=devices, chunks=chunks, checkpoint=checkpoint, example_inputs=args)
    assert_equivalent(model, pipe, args, kwargs, ref_out, ref_grads)


def test_gradients_land_on_the_models_own_parameters_and_optimizer_trains():
    """Five AdamW steps through the pipeline leave the same weights as five plain steps."""
    import copy
    model, args, _ = setup("mlp", batch=16)
    plain = copy.deepcopy(model)
    pipe = autopipe.compile(model, devices=2, chunks=4)
    assert {id(p) for p in pipe.parameters()} == {id(p) for p in model.parameters()}
    opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2)
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    target = torch.randn(16, 4)
    pipe_losses, plain_losses = [], []
    for _ in range(5):
        for net, optimizer, losses in ((pipe, opt, pipe_losses), (plain, opt_plain, plain_losses)):
            loss = torch.nn.functional.mse_loss(net(*args), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    assert pipe_losses == pytest.approx(plain_losses, rel=1e-5)
    assert pipe_losses[-1] < pipe_losses[0]
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    state = model.state_dict()
    fresh = build("mlp")
    fresh.load_state_dict(pipe.state_dict())
    torch.testing.assert_close(fresh(*args), model(*args))
    assert set(state) == set(pipe.state_dict())


def test_tied_weights_stay_one_parameter_with_one_gradient():
    model, args, kwargs = setup("gpt")
    ref_out, ref_grads = reference(model, args, kwargs)
    pipe = autopipe.compile(model, devices=4, chunks=2)
    assert_equivalent(model, pipe, args, kwargs, ref_out, ref_grads)
    assert "wte.weight" in pipe.plan.shared_params
    assert pipe.plan.shared_params["wte.weight"][0] == 0 and pipe.plan.shared_params["wte.weight"][-1] == 3
    assert model.lm_head.weight is model.wte.weight


def test_stage_state_dict_uses_the_models_names():
    model, args, _ = setup("gpt")
    pipe = autopipe.compile(model, devices=2, chunks=2, example_inputs=args)
    names = set(model.state_dict())
    for stage in pipe.stages:
        assert set(stage.state_dict()) <= names
        for n, p in stage.named_parameters():
            assert p is model.get_parameter(n)


def test_dropout_replays_in_recompute_and_is_reproducible():
    """Train mode with dropout: recomputation draws the forward's masks, so checkpoint modes agree,
    and a fixed seed gives the same loss and gradients run to run, whatever the thread timing."""
    model = build("gpt").train()
    args, _ = random_inputs("gpt", 8, torch.Generator().manual_seed(3))
    results = []
    for checkpoint in ["never", "always", "except_last", "always"]:
        pipe = autopipe.compile(model, devices=3, chunks=4, checkpoint=checkpoint)
        torch.manual_seed(1234)
        out = pipe(*args)
        scalar_loss(out).backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        model.zero_grad()
    out0, grads0 = results[0]
    for out, grads in results[1:]:
        torch.testing.assert_close(out, out0, rtol=0, atol=0)
        for n in grads0:
            torch.testing.assert_close(grads[n], grads0[n], rtol=1e-5, atol=1e-6)
    torch.manual_seed(99)
    other = pipe(*args)
    assert not torch.equal(other, out0), "a different seed must draw different dropout masks"


def test_dropout_zero_in_train_mode_equals_plain():
    model = build("gpt").train()
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    args, kwargs = random_inputs("gpt", 8, torch.Generator().manual_seed(3))
    ref_out, ref_grads = reference(model, args, kwargs)
    assert_equivalent(model, autopipe.compile(model, devices=2, chunks=4), args, kwargs, ref_out, ref_grads)


def test_eval_and_no_grad_run_without_saving_for_backward():
    model, args, _ = setup("mlp")
    pipe = autopipe.compile(model, devices=2, chunks=4)
    with torch.no_grad():
        out = pipe(*args)
    assert not out.requires_grad
    torch.testing.assert_close(out, model(*args))


def test_batch_that_does_not_divide_by_chunks_and_batch_smaller_than_chunks():
    model, _, _ = setup("mlp")
    pipe = autopipe.compile(model, devices=2, chunks=4)
    x = torch.randn(7, 8)
    torch.testing.assert_close(pipe(x), model(x))
    small = torch.randn(3, 8)
    with pytest.warns(UserWarning, match="smaller than chunks"):
        torch.testing.assert_close(pipe(small), model(small))


def test_loss_inside_model_is_micro_batch_weighted_mean():
    model, args, kwargs = setup("kwargs", batch=7)
    ref = model(*args, **kwargs)["loss"]
    pipe = autopipe.compile(model, devices=2, chunks=3)
    out = pipe(*args, **kwargs)
    torch.testing.assert_close(out["loss"], ref)
    assert set(out) == {"logits", "loss", "hidden"}


def test_input_gradients_flow_back():
    model, args, _ = setup("two_inputs")
    a, b = (t.clone().requires_grad_(True) for t in args)
    scalar_loss(model(a, b)).backward()
    ga, gb = a.grad.clone(), b.grad.clone()
    a.grad = b.grad = None
    model.zero_grad()
    pipe = autopipe.compile(model, devices=3, chunks=4)
    scalar_loss(pipe(a, b)).backward()
    torch.testing.assert_close(a.grad, ga)
    torch.testing.assert_close(b.grad, gb)


def test_step_runs_forward_and_backward():
    model, args, _ = setup("mlp", batch=8)
    target = torch.randn(8, 4)
    loss_ref = torch.nn.functional.mse_loss(model(*args), target)
    loss_ref.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    pipe = autopipe.compile(model, devices=2, chunks=4)
    loss = pipe.step(*args, target=target, loss_fn=torch.nn.functional.mse_loss)
    torch.testing.assert_close(loss, loss_ref.detach())
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref[n])


def test_new_input_shape_replans():
    model, _, _ = setup("gpt")
    pipe = autopipe.compile(model, devices=2, chunks=2)
    x16 = torch.randint(0, 64, (4, 16))
    x8 = torch.randint(0, 64, (4, 8))
    torch.testing.assert_close(pipe(x16), model(x16))
    torch.testing.assert_close(pipe(x8), model(x8))
    assert len(pipe._compiled) == 2


def test_plan_and_code_print():
    model, args, _ = setup("gpt")
    pipe = autopipe.compile(model, devices=4, chunks=8, example_inputs=args)
    text = str(pipe.plan)
    assert "stage" in text and "bubble" in text and "(K - 1)/(K + M - 1)" in text
    assert "3/11" in text
    code = pipe.stages[1].code
    assert "def forward(self" in code and "blocks" in code
    assert "_tensor_constant" not in code
    assert repr(pipe).startswith("Pipeline(GPT")


def test_save_code_writes_one_file_per_stage(tmp_path):
    model, args, _ = setup("unet")
    pipe = autopipe.compile(model, devices=3, chunks=2, example_inputs=args)
    paths = pipe.save_code(tmp_path / "stages")
    assert [p.rsplit("/", 1)[1] for p in paths] == ["stage_0.py", "stage_1.py", "stage_2.py"]
    for p in paths:
        with open(p) as f:
            compile(f.read(), p, "exec")


def test_plan_a_48_block_gpt_on_meta_without_allocating():
    with torch.device("meta"):
        model = GPT(vocab=50304, d=1024, heads=16, layers=48, block=256)
    x = torch.empty(8, 256, dtype=torch.long, device="meta")
    plan = autopipe.plan(model, (x,), devices=8, chunks=32)
    assert plan.n_stages == 8 and plan.imbalance < 1.2
    assert all(p.device.type == "meta" for p in model.parameters())


def test_balance_time_measures_at_micro_batch_size_and_matches_the_plain_model():
    class Recorder(torch.nn.Module):  # a leaf module: fx keeps it whole, so the cost pass runs it eagerly
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(8, 8)
            self.seen: list[int] = []

        def forward(self, x):
            if not isinstance(x, FakeTensor):  # tracing propagates shapes on fake tensors; timing runs real ones
                self.seen.append(x.shape[0])
            return torch.relu(self.linear(x))

    model = torch.nn.Sequential(Recorder(), torch.nn.Linear(8, 8), Recorder(), torch.nn.Linear(8, 2))
    x = torch.randn(10, 8)
    ref_out, ref_grads = reference(model, (x,), {})
    model[0].seen.clear()
    pipe = autopipe.compile(model, devices=2, chunks=4, balance="time", leaf_modules=[Recorder], example_inputs=(x,))
    assert pipe.plan.balance == "time"
    assert model[0].seen and set(model[0].seen) == {3}  # timed on ceil(10 / 4) rows, as a stage will run
    assert_equivalent(model, pipe, (x,), {}, ref_out, ref_grads)


class _MHAModel(torch.nn.Module):
    """nn.MultiheadAttention with attention dropout: its dropout runs inside torch's own code."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.attn = torch.nn.MultiheadAttention(16, 2, dropout=0.5, batch_first=True)
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        h = self.inp(x)
        a, _ = self.attn(h, h, h, need_weights=False)
        return self.out(a + h)


@pytest.mark.parametrize("need_weights", [False, True])
def test_multihead_attention_dropout_replays_and_reproduces(need_weights):
    model = _MHAModel().train()
    if need_weights:  # the Python path of F.multi_head_attention_forward, with F.dropout on the weights
        model.forward = lambda x: model.out(model.attn(model.inp(x), model.inp(x), model.inp(x))[0])
    x = torch.randn(8, 5, 8)
    results = []
    for checkpoint in ["never", "always", "always"]:
        pipe = autopipe.compile(model, devices=2, chunks=4, checkpoint=checkpoint)
        torch.manual_seed(7)
        out = pipe(x)
        out.square().sum().backward()
        results.append((out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        model.zero_grad()
    # fx traces into the attention; its dropout gets the task's generator at codegen like any other
    assert pipe.plan.route == "fx"
    out0, grads0 = results[0]
    for out, grads in results[1:]:
        torch.testing.assert_close(out, out0, rtol=0, atol=0)
        for n in grads0:
            torch.testing.assert_close(grads[n], grads0[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
    model.eval()
    assert autopipe.compile(model, devices=2, chunks=4, example_inputs=(x,)).plan.route == "fx"


class WideMiddles(torch.nn.Module):
    def __init__(self, d=8, wide=64):
        super().__init__()
        self.up = torch.nn.ModuleList(torch.nn.Linear(d, wide) for _ in range(3))
        self.down = torch.nn.ModuleList(torch.nn.Linear(wide, d) for _ in range(3))

    def forward(self, x):
        for up, down in zip(self.up, self.down):
            x = x + down(torch.relu(up(x)))
        return x


def test_crossing_price_and_train_flops_reach_the_cut_and_train_as_the_plain_model():
    """``compile(..., crossing_price=)`` moves the two-stage cut of three narrow-wide-narrow blocks off the wide value
    (only the narrow residual crosses) at 16 FLOPs a byte, with ``balance="train_flops"``; the pipeline is the plain model in float64."""
    torch.manual_seed(0)
    model, x = WideMiddles().double(), torch.randn(8, 8, dtype=torch.float64)
    unpriced = autopipe.plan(model, (x,), devices=2, chunks=2, balance="train_flops")
    assert max(t.shape[-1] for t in unpriced.cut_tensors(0)) == 64
    pipe = autopipe.compile(model, devices=2, chunks=2, balance="train_flops", crossing_price=16.0, example_inputs=(x,))
    assert [list(t.shape) for t in pipe.plan.cut_tensors(0)] == [[8, 8]]  # the narrow residual alone
    assert_float64_gradients(model, pipe, x)
    with pytest.raises(ValueError, match="crossing_price must be a finite number"):
        autopipe.plan(model, (x,), devices=2, crossing_price=-1.0)


class SlowBackward(torch.autograd.Function):
    """The identity whose backward sleeps: a node far dearer to train than its forward or FLOPs say."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(0.03)
        return grad


class SlowToTrainFirst(torch.nn.Module):
    def __init__(self, d=16, blocks=6):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(d, d) for _ in range(blocks))

    def forward(self, x):
        x = SlowBackward.apply(self.blocks[0](x))
        x = SlowBackward.apply(self.blocks[1](x))
        for block in self.blocks[2:]:
            x = torch.tanh(block(x))
        return x


def test_train_time_balances_each_nodes_measured_step_and_trains_as_the_plain_model():
    """``balance="train_time"``: each node weighs its measured forward and backward; the first two of six equal blocks
    each have a backward that sleeps 30 ms, so the cut falls between them (FLOPs and forward times spread the blocks
    3 | 3). The pipeline is the plain model in float64; a model on meta is refused, naming what to do under
    torchrun."""
    torch.manual_seed(0)
    model, x = SlowToTrainFirst().double(), torch.randn(8, 16, dtype=torch.float64)
    by_flops = autopipe.plan(model, (x,), devices=2, chunks=2)
    assert by_flops.stages[0].params[-1].startswith("blocks.2.")
    pipe = autopipe.compile(model, devices=2, chunks=2, balance="train_time", example_inputs=(x,))
    assert pipe.plan.balance == "train_time"
    first = set(pipe.plan.stages[0].params)
    assert {"blocks.0.weight"} <= first <= {f"blocks.{b}.{w}" for b in (0, 1) for w in ("weight", "bias")}, pipe.plan
    assert_float64_gradients(model, pipe, x)
    with torch.device("meta"):
        on_meta = SlowToTrainFirst()
    with pytest.raises(ValueError, match="balance='train_time' runs the model to time it.*give the plan as balance="):
        autopipe.plan(on_meta, (torch.empty(8, 16, device="meta"),), devices=2, balance="train_time")


def test_a_plan_given_as_the_balance_keeps_its_cut_through_pickle():
    """``balance=plan``: the cut of a plan made elsewhere (pickled, as one process hands it to torchrun's ranks),
    kept node for node; a plan of another number of stages is refused naming both."""
    torch.manual_seed(0)
    model, x = SlowToTrainFirst().double(), torch.randn(8, 16, dtype=torch.float64)
    made = pickle.loads(pickle.dumps(autopipe.plan(model, (x,), devices=2, chunks=2, balance=[1, 5])))
    pipe = autopipe.compile(model, devices=2, chunks=4, balance=made, example_inputs=(x,))
    assert [s.params for s in pipe.plan.stages] == [s.params for s in made.stages]
    assert [s.params for s in made.stages] != [s.params for s in autopipe.plan(model, (x,), devices=2).stages]
    assert "the cut is the given plan's (balanced by shares [1, 5])" in pipe.plan.notes
    with pytest.raises(ValueError, match="balance is a plan of 2 stages but 3 are asked for"):
        autopipe.plan(model, (x,), devices=3, balance=made)
    # a V's plan has two stages a device: given back under the V it is kept, on as many devices it is refused
    v_plan = autopipe.plan(model, (x,), devices=2, chunks=2, schedule="zbv", balance=[1, 2, 3, 4])
    kept = autopipe.plan(model, (x,), devices=2, chunks=2, schedule="zbv", balance=v_plan)
    assert [s.nodes for s in kept.stages] == [s.nodes for s in v_plan.stages]
    with pytest.raises(ValueError, match="balance is a plan of 4 stages but 2 are asked for"):
        autopipe.plan(model, (x,), devices=2, balance=v_plan)
    with pytest.raises(ValueError, match="chunks=auto picks among cuts, and balance= a plan fixes one"):
        autopipe.plan(model, (x,), devices=2, chunks="auto", memory_cap=1e9, balance=made)
