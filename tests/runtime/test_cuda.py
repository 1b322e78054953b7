"""The CUDA path (streams, device placement, inline backward, stages on streams of their own and on SM slices): runs
where a GPU is, skips cleanly elsewhere
(``make gpu`` runs it on a lent GPU). What a CPU can check of these tests runs here too: the timing model's trace;
placement on another device than the trace's is tests/test_placement.py's.

The checks of one GPU, each against the plain model on the same GPU: several stages on one GPU, tied weights, an
export-route transformers model traced on the CPU, dropout re-materialised bit for bit, bf16 autocast, CPU
inputs to a model on the GPU. float32 runs without TF32 (the fixture below), so the pipeline and the plain model
differ only by the order of float32 sums (a micro-batch's GEMMs pick other kernels than the whole batch's).
"""
import copy
import re

import pytest
import torch
import torch.nn.functional as F

import autopipe
from zoo import GPT, ZOO, build, random_inputs, scalar_loss, tensor_leaves

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

CUDA = "cuda:0"


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def on_gpu(model):
    """The model moved to the GPU, and a deep copy of it there: the plain reference (ties are kept)."""
    model = model.to(CUDA)
    return model, copy.deepcopy(model)


def assert_close(got, want, rtol, atol, what=""):
    """``torch.testing.assert_close`` with ``atol`` relative to the largest ``|want|``."""
    scale = want.detach().abs().max().item() if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol * max(scale, 1e-12), msg=lambda m: f"{what}: {m}")


def assert_grads_match(model, reference, rtol=1e-3, atol=1e-4):
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        if q.grad is None:
            assert p.grad is None, f"{name}: a gradient the plain model does not have"
            continue
        assert p.grad is not None, f"{name}: no gradient"
        assert p.grad.device == q.grad.device, f"{name}: gradient on {p.grad.device}, plain model's on {q.grad.device}"
        assert_close(p.grad, q.grad, rtol, atol, name)


def relative_error(got, want) -> float:
    got, want = got.detach().float(), want.detach().float()
    return ((got - want).norm() / want.norm().clamp_min(1e-12)).item()


def tokens(batch=8, seq=16, vocab=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq), generator=g), torch.randint(0, vocab, (batch, seq), generator=g)


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@cuda
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
    if count == 1:  # one allocator, one peak: the report says the two stages share it
        assert "cuda:0, shared with stage 1" in str(pipe.memory), str(pipe.memory)
    # the user's own peak statistics are never reset: a high peak from before a step survives it
    spike = torch.empty(1 << 28, device="cuda:0")
    del spike
    high = torch.cuda.max_memory_allocated("cuda:0")
    scalar_loss(pipe(*args)).backward()
    assert torch.cuda.max_memory_allocated("cuda:0") >= high


def assert_two_ranks_match_the_in_process_pipeline(tmp_path, backend, **env):
    """Two torchrun processes train the GPT one step: the backend they chose, and the in-process pipeline's loss
    and gradients (same seeds, same CUDA generators)."""
    from test_distributed import gpt_batch, launch, lm_loss
    run = launch("gpt", 2, tmp_path, CHECKPOINT="always", **env)
    assert run.codes == [0, 0], run.log()
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert [r["backend"] for r in results] == [backend, backend]
    ids, target = (t.to(CUDA) for t in gpt_batch())
    torch.manual_seed(0)
    model = GPT(vocab=64, d=32, heads=4, layers=4, block=16, dropout=0.1).train().to(CUDA)
    pipe = autopipe.compile(model, devices=[CUDA] * 2, chunks=4, checkpoint="always")
    torch.manual_seed(100)
    loss = pipe.step(ids, target=target, loss_fn=lm_loss)
    assert results[-1]["losses"][0] == pytest.approx(loss.item(), rel=1e-5)
    for r in results:
        for name, grad in r["grads"].items():
            torch.testing.assert_close(grad, model.get_parameter(name).grad.cpu(), rtol=1e-4, atol=1e-5)


@cuda
def test_two_processes_on_one_gpu_over_gloo_match_the_in_process_pipeline(tmp_path):
    """torchrun with a CUDA model: each rank's stages run on the GPU, messages go through host memory (gloo), so
    two processes can share the one GPU (NCCL cannot share it)."""
    assert_two_ranks_match_the_in_process_pipeline(tmp_path, "gloo", DEVICE=CUDA, CUDA_VISIBLE_DEVICES="0")


# -- the plain model's results on one GPU ------------------------------------------------------------------

@cuda
@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet", "unet"])
def test_four_stages_on_one_gpu_match_the_plain_model(name):
    model, reference = on_gpu(build(name).eval())
    args, _ = random_inputs(name, 8, torch.Generator().manual_seed(0))
    args = [a.to(CUDA) for a in args]
    pipe = autopipe.compile(model, devices=[CUDA] * 4, chunks=4, example_inputs=args)
    assert [str(s.device) for s in pipe.stages] == [CUDA] * 4
    for step in range(2):  # the second step reuses the workers, the stages and the gradients' buffers
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        out, ref = pipe(*args), reference(*args)
        assert out.device == ref.device
        assert_close(out, ref, 1e-4, 1e-4, f"output, step {step}")
        scalar_loss(out).backward()
        scalar_loss(ref).backward()
        assert_grads_match(model, reference)
    ran = {(e.stage, e.kind) for e in pipe.timeline.events}
    assert {(s, k) for s in range(4) for k in ("forward", "backward")} <= ran


@cuda
def test_tied_embedding_and_head_on_two_stages_of_one_gpu():
    torch.manual_seed(0)
    model, reference = on_gpu(GPT(dropout=None, tied=True))
    ids, targets = (t.to(CUDA) for t in tokens())
    pipe = autopipe.compile(model, devices=[CUDA] * 2, chunks=4, example_inputs=(ids,))
    assert pipe.plan.shared_params == {"wte.weight": (0, 1)}  # the embedding on stage 0, the LM head on stage 1
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.5), torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(2):
        opt.zero_grad(set_to_none=True)
        ref_opt.zero_grad(set_to_none=True)
        out, ref = pipe(ids), reference(ids)
        assert_close(out, ref, 1e-4, 1e-4, f"logits, step {step}")  # step 1: after one update of the one tensor
        lm_loss(out, targets).backward()
        lm_loss(ref, targets).backward()
        assert_grads_match(model, reference)
        opt.step()
        ref_opt.step()
    assert model.lm_head.weight is model.wte.weight
    assert_close(model.wte.weight, reference.wte.weight, 1e-4, 1e-4, "wte.weight after two updates")


@cuda
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_export_route_model_traced_on_the_cpu_runs_on_the_gpu(name):
    pytest.importorskip("transformers")
    model, _, kwargs = ZOO[name]()  # on the CPU, eval(): export writes device=cpu into the graph it traces
    reference = copy.deepcopy(model).to(CUDA)
    pipe = autopipe.compile(model, devices=[CUDA] * 2, chunks=4, example_kwargs=kwargs)
    assert pipe.plan.route == "export" and "traced by export" in str(pipe.plan)
    for stage in pipe.stages:
        assert stage.device == torch.device(CUDA)
        lines = [line for line in stage.code.splitlines() if not line.lstrip().startswith("#")]  # the header names it
        literals = [line.strip() for line in lines if re.search(r"cpu|cuda", line)]  # also aten's *_for_cpu ops
        assert not literals, f"stage {stage.index} names a device: {literals}"
        left = [n for n, t in [*stage.named_parameters(), *stage.named_buffers()] if t.device != torch.device(CUDA)]
        assert not left, f"stage {stage.index} holds tensors off the GPU: {left}"
    kwargs = {k: v.to(CUDA) for k, v in kwargs.items()}
    out, ref = pipe(**kwargs), reference(**kwargs)
    assert type(out) is type(ref)
    for k, (got, want) in enumerate(zip(tensor_leaves(out), tensor_leaves(ref), strict=True)):
        assert got.device == want.device
        assert_close(got, want, 1e-4, 1e-4, f"output {k}")
    scalar_loss(out).backward()
    scalar_loss(ref).backward()
    assert_grads_match(model, reference)


@cuda
def test_dropout_recompute_is_bit_for_bit_on_the_gpu():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model = GPT(dropout=0.1).to(CUDA).train()
    ids, targets = (t.to(CUDA) for t in tokens())
    outs, grads, pipes = {}, {}, {}
    # The math attention kernel: the memory-efficient kernel's backward sums with atomics, so two runs of the
    # same backward may differ in the last bit whatever autopipe does.
    with sdpa_kernel(SDPBackend.MATH):
        for mode in ("never", "always"):
            pipes[mode] = pipe = autopipe.compile(model, devices=[CUDA] * 2, chunks=4, checkpoint=mode,
                                                  example_inputs=(ids,))
            assert all(s.uses_rng for s in pipe.stages)  # dropout draws from the task's CUDA generator
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            out = pipe(ids)
            lm_loss(out, targets).backward()
            outs[mode], grads[mode] = out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
        assert torch.equal(outs["always"], outs["never"])
        for n, g in grads["never"].items():
            assert torch.equal(grads["always"][n], g), f"{n}: the recomputed forward differs from the first"
        torch.manual_seed(2)  # and dropout did draw: another seed, other masks
        with torch.no_grad():
            assert not torch.equal(pipes["always"](ids), outs["always"])


@cuda
def test_bf16_autocast_around_the_step_reaches_every_stage():
    torch.manual_seed(0)
    model, reference = on_gpu(GPT(dropout=None))
    ids, targets = (t.to(CUDA) for t in tokens())
    pipe = autopipe.compile(model, devices=[CUDA] * 2, chunks=4, example_inputs=(ids,))
    results = []
    for fn in (pipe, reference):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = fn(ids)
            loss = lm_loss(out, targets)
        loss.backward()
        results.append((out, loss))
    (out, loss), (ref, ref_loss) = results
    assert out.dtype == ref.dtype == torch.bfloat16  # the last stage's Linear ran under autocast
    assert relative_error(out, ref) < 2e-2, relative_error(out, ref)
    assert abs(loss.item() - ref_loss.item()) < 2e-2 * abs(ref_loss.item())
    for (n, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert p.grad.dtype == q.grad.dtype == torch.float32, n
        assert relative_error(p.grad, q.grad) < 5e-2, (n, relative_error(p.grad, q.grad))
    with torch.no_grad():  # autocast stayed with that call: the workers do not keep it
        assert pipe(ids).dtype == torch.float32


@cuda
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_compiled_inside_cuda_autocast_the_step_is_the_plain_model_micro_batched_under_it(schedule):
    """Compiled on its first call inside the caller's autocast: nothing fake reaches the caller (Note [autocast
    cache]), and pipe.step's loss runs under that autocast, as the plain model's (cross-entropy in float32)."""
    torch.manual_seed(0)
    model, reference = on_gpu(GPT(dropout=None))
    ids, targets = (t.to(CUDA) for t in tokens())
    chunks, expected = 4, 0.0
    for x, y in zip(ids.chunk(chunks), targets.chunk(chunks)):  # micro-batched by hand: a backward each
        with torch.autocast("cuda", dtype=torch.bfloat16):
            part = lm_loss(reference(x), y) * (len(x) / len(ids))
        part.backward()
        expected = expected + part.detach()
    pipe = autopipe.compile(model, devices=[CUDA] * 2, chunks=chunks, schedule=schedule)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = pipe.step(ids, target=targets, loss_fn=lm_loss)
        weight = model.blocks[0].fc.weight
        assert type(F.linear(torch.randn(3, weight.shape[1], device=CUDA), weight)) is torch.Tensor
    assert type(loss) is torch.Tensor and loss.dtype == torch.float32
    assert abs(loss.item() - expected.item()) < 1e-5 * abs(expected.item())
    assert_grads_match(model, reference, rtol=1e-3, atol=1e-3)


@cuda
@pytest.mark.parametrize("name", ["mlp", "gpt"])
def test_cpu_inputs_to_a_model_on_the_gpu(name):
    model, reference = on_gpu(build(name).eval())
    args, _ = random_inputs(name, 8, torch.Generator().manual_seed(0))  # on the CPU, as a DataLoader gives them
    float_input = args[0].is_floating_point()
    x = args[0].clone().requires_grad_(float_input)
    x_ref = args[0].clone().requires_grad_(float_input)
    pipe = autopipe.compile(model, devices=[CUDA] * 2, chunks=4)  # compiles on its first call, with the CPU input
    out = pipe(x)
    ref = reference(x_ref.to(CUDA))
    assert out.device == torch.device(CUDA)  # the last stage's device, as the plain model's output
    assert_close(out, ref, 1e-4, 1e-4, "output")
    scalar_loss(out).backward()
    scalar_loss(ref).backward()
    assert_grads_match(model, reference)
    if float_input:  # the input's gradient comes back to the CPU, as through the plain model's x.to("cuda")
        assert x.grad is not None and x.grad.device.type == "cpu"
        assert_close(x.grad, x_ref.grad, 1e-3, 1e-4, "input gradient")


@cuda
@pytest.mark.parametrize("stages_on", ["the caller's stream", "stage streams"])
def test_a_caller_on_its_own_stream_is_waited_for_and_waits_for_the_step(stages_on):
    """The stages compute on the caller's current stream (torchgpipe's compute streams), or on streams of their own
    that join it at each phase: an input still being written there when pipe(x) is called is read after the write,
    and the caller's next kernel on that stream reads the finished output."""
    model, reference = on_gpu(build("mlp").eval())
    args, _ = random_inputs("mlp", 64, torch.Generator().manual_seed(0))
    base = args[0].to(CUDA)
    devices = [CUDA] * 2 if stages_on == "the caller's stream" else stage_streams("streams")
    pipe = autopipe.compile(model, devices=devices, chunks=4, example_inputs=(base,))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        busy = torch.randn(2048, 2048, device=CUDA)
        for _ in range(20):  # keeps the side stream busy, so a missing wait would read x half-written
            busy = busy @ busy / busy.norm()
        x = base + 0 * busy.sum()
        out = pipe(x)
        loss = scalar_loss(out)
        loss.backward()
        after = out * 1  # on the caller's stream: must see the finished output
    torch.cuda.synchronize()
    ref = reference(base)
    scalar_loss(ref).backward()
    assert_close(out, ref, 1e-4, 1e-4, "output")
    assert_close(after, ref, 1e-4, 1e-4, "output read on the caller's stream")
    assert_grads_match(model, reference)


@cuda
def test_the_timeline_of_a_gpu_step_comes_from_cuda_events():
    model, _ = on_gpu(build("gpt").eval())
    args, _ = random_inputs("gpt", 8, torch.Generator().manual_seed(0))
    pipe = autopipe.compile(model, devices=[CUDA] * 2, chunks=4, checkpoint="never",
                            example_inputs=[a.to(CUDA) for a in args])
    scalar_loss(pipe(*[a.to(CUDA) for a in args])).backward()
    timeline = pipe.timeline
    assert len(timeline.events) == 2 * 4 * 2  # forward and backward of 4 micro-batches on 2 stages
    assert all(e.end > e.start for e in timeline.events)
    for stage in range(2):  # one stream: a stage's forwards run in micro-batch order, one after another
        spans = sorted((e.micro_batch, e.start, e.end) for e in timeline.events
                       if e.stage == stage and e.kind == "forward")
        assert all(a[2] <= b[1] + 1e-6 for a, b in zip(spans, spans[1:]))
    assert "device 0" in str(timeline) and 0 < timeline.busy(0) <= timeline.makespan


two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")


@two_gpus
def test_stages_on_two_gpus_copy_on_copy_streams_and_match_the_plain_model():
    torch.manual_seed(0)
    model, reference = on_gpu(GPT(dropout=None, tied=True))
    ids, targets = (t.to(CUDA) for t in tokens())
    pipe = autopipe.compile(model, devices=["cuda:0", "cuda:1"], chunks=4, example_inputs=(ids,))
    for step in range(2):
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        out, ref = pipe(ids), reference(ids)
        assert out.device == torch.device("cuda:1")
        assert_close(out.to(CUDA), ref, 1e-4, 1e-4, f"logits, step {step}")
        lm_loss(out, targets.to("cuda:1")).backward()
        lm_loss(ref, targets).backward()
        assert_grads_match(model, reference)
    runner = pipe.compiled.main.runners[1]
    assert set(runner.copy_streams) == {torch.device("cuda:0"), torch.device("cuda:1")}


@two_gpus
def test_two_processes_on_two_gpus_over_nccl_match_the_in_process_pipeline(tmp_path):
    """A GPU per rank: device memory over NCCL."""
    assert_two_ranks_match_the_in_process_pipeline(tmp_path, "nccl", DEVICE="cuda:{local_rank}")


class AttentionDropoutStack(torch.nn.Module):
    """Blocks of self-attention with attention dropout (``dropout_p`` inside SDPA, as GPT-2's HF code passes it)."""

    def __init__(self, d=64, heads=4, blocks=4, p=0.1):
        super().__init__()
        self.heads, self.p = heads, p
        self.qkv = torch.nn.ModuleList([torch.nn.Linear(d, 3 * d) for _ in range(blocks)])

    def forward(self, x):
        b, t, d = x.shape
        for qkv in self.qkv:
            q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in qkv(x).split(d, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
            x = x + y.transpose(1, 2).reshape(b, t, d)
        return x


@cuda
def test_attention_dropout_keeps_a_fused_kernel_and_replays_exactly():
    """SDPA with dropout runs torch's fused kernel (flash / memory-efficient) on the task generator's state: the
    recomputed forward equals the first, dropout does draw, and the caller's CUDA RNG is untouched."""
    torch.manual_seed(0)
    model = AttentionDropoutStack().to(CUDA).train()
    x = torch.randn(8, 32, 64, device=CUDA)
    outs, grads = {}, {}
    for mode in ("never", "always"):
        pipe = autopipe.compile(model, devices=[CUDA] * 2, chunks=4, checkpoint=mode, example_inputs=(x,))
        assert all("random_ops.scaled_dot_product_attention" in s.code for s in pipe.stages)
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # also seeds the CUDA generators
        cuda_rng = torch.cuda.get_rng_state()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            out = pipe(x)
            out.square().mean().backward()
        assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
        names = {e.name for e in prof.events()}
        assert any("flash_attention" in n or "efficient_attention" in n for n in names), sorted(names)
        assert "aten::_scaled_dot_product_attention_math" not in names
        outs[mode], grads[mode] = out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    assert torch.equal(outs["always"], outs["never"])
    with torch.no_grad():
        model.eval()
        assert not torch.equal(pipe(x), outs["never"])  # without dropout: another output, so dropout drew
    for n, g in grads["never"].items():  # the fused backward may sum with atomics: equal up to rounding
        assert_close(grads["always"][n], g, 1e-4, 1e-5, n)


class MatmulThenAdd(torch.nn.Module):
    """A large matmul, then a tiny add on one column of its result. (Not ``x @ x``, which ties the batch to the
    features: a micro-batch cannot run it, and trace rightly refuses it as batch-specialised.)"""

    def __init__(self, features: int):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(features, features) / features**0.5)

    def forward(self, x):
        return (x @ self.weight)[:, :1] + 1


def seconds_of_matmul_and_add(device: str, features: int) -> tuple[float, float]:
    """balance="time"'s measured seconds of MatmulThenAdd's matmul and add, on ``device``, a batch of ``features`` rows."""
    from passes.cost import cost
    from passes.trace import trace

    model, x = MatmulThenAdd(features).to(device), torch.randn(features, features, device=device)
    costed = cost(trace(model, (x,)), measure_inputs=(x,))
    seconds = {name: c.seconds for name, c in costed.costs.items()}
    matmul = next(s for name, s in seconds.items() if "matmul" in name)
    add = next(s for name, s in seconds.items() if name.startswith("add"))
    return matmul, add


def test_the_timing_model_traces_and_is_timed_on_the_cpu():
    """The GPU test's model, traced and timed on the CPU, where CI runs it: its batch is free."""
    matmul, add = seconds_of_matmul_and_add("cpu", 64)
    assert matmul > 0 and add > 0


@cuda
def test_balance_time_times_gpu_nodes_with_cuda_events():
    """On a GPU the host clock times only a kernel's launch: a large matmul and a tiny add would look alike.
    CUDA events time the kernels."""
    matmul, add = seconds_of_matmul_and_add(CUDA, 4096)
    assert matmul > 20 * add, (matmul, add)


# -- stages on streams of their own, SM slices ------------------------------------------------------------------

def green_contexts_supported() -> bool:
    from torch.cuda import green_contexts
    return torch.cuda.is_available() and green_contexts.SUPPORTED


slices = pytest.mark.skipif(not green_contexts_supported(), reason="needs a CUDA build with green contexts")


def stage_streams(kind: str, k: int = 2) -> list:
    """k streams of cuda:0: plain ones (all SMs each), or autopipe.sm_slices(k) (a green context each)."""
    if kind == "slices":
        if not green_contexts_supported():
            pytest.skip("needs a CUDA build with green contexts")
        return autopipe.sm_slices(k, 0)
    return [torch.cuda.Stream(CUDA) for _ in range(k)]


STREAM_SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1), ("zbv", 1)]


@cuda
@pytest.mark.parametrize("kind", ["streams", "slices"])
@pytest.mark.parametrize("schedule, virtual", STREAM_SCHEDULES)
def test_stages_on_their_own_streams_of_one_gpu_match_the_plain_model(kind, schedule, virtual):
    torch.manual_seed(0)
    model, reference = on_gpu(GPT(dropout=None, layers=4))
    ids, targets = (t.to(CUDA) for t in tokens())
    streams = stage_streams(kind)
    pipe = autopipe.compile(model, devices=streams, chunks=4, schedule=schedule, virtual_stages=virtual,
                            example_inputs=(ids,))
    runners = pipe.compiled.main.runners
    assert [r.stream for r in runners] == [streams[pipe.schedule.device_of(s)] for s in range(len(runners))]
    label = "green context, " if kind == "slices" else "(all SMs)"
    assert label in repr(pipe) and "stage 0 computes on cuda:0 stream" in str(pipe.plan), (repr(pipe), pipe.plan)
    for step in range(2):  # the second step reuses the streams, the events and the allocator's blocks
        model.zero_grad(set_to_none=True)
        reference.zero_grad(set_to_none=True)
        loss = pipe.step(ids, target=targets, loss_fn=lm_loss)
        ref_loss = lm_loss(reference(ids), targets)
        ref_loss.backward()
        assert_close(loss, ref_loss.detach(), 1e-4, 1e-5, f"loss, step {step}")
        assert_grads_match(model, reference)
    ran = {(e.stage, e.kind) for e in pipe.timeline.events}
    assert {(s, "forward") for s in range(len(runners))} <= ran


@cuda
@pytest.mark.parametrize("kind", ["streams", "slices"])
def test_pipe_x_and_backward_on_stage_streams_match_the_plain_model(kind):
    """pipe(x) then loss.backward(): the backward tasks are issued from the engine's thread, each on its stage's
    stream; the events carry the gradients between the streams and back to the caller's."""
    model, reference = on_gpu(build("mlp").eval())
    args, _ = random_inputs("mlp", 8, torch.Generator().manual_seed(0))
    args = [a.to(CUDA) for a in args]
    pipe = autopipe.compile(model, devices=stage_streams(kind, 4), chunks=4, example_inputs=args)
    out, ref = pipe(*args), reference(*args)
    assert_close(out, ref, 1e-4, 1e-4, "output")
    scalar_loss(out).backward()
    scalar_loss(ref).backward()
    assert_grads_match(model, reference)


@cuda
@pytest.mark.parametrize("kind", ["streams", "slices"])
def test_dropout_on_stage_streams_replays_bit_for_bit(kind):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model = GPT(dropout=0.1).to(CUDA).train()
    ids, targets = (t.to(CUDA) for t in tokens())
    streams = stage_streams(kind)
    outs, grads = {}, {}
    with sdpa_kernel(SDPBackend.MATH):  # the memory-efficient kernel's backward sums with atomics
        for mode in ("never", "always"):
            pipe = autopipe.compile(model, devices=streams, chunks=4, checkpoint=mode, example_inputs=(ids,))
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            out = pipe(ids)
            lm_loss(out, targets).backward()
            outs[mode], grads[mode] = out.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
    assert torch.equal(outs["always"], outs["never"])
    for n, g in grads["never"].items():
        assert torch.equal(grads["always"][n], g), f"{n}: the recomputed forward differs from the first"


@slices
def test_sm_slices_are_streams_of_green_contexts_of_equal_sm_counts():
    from autopipe.runtime.streams import slice_size

    props = torch.cuda.get_device_properties(0)
    streams = autopipe.sm_slices(2, 0)
    assert len(streams) == 2 and all(isinstance(s, torch.cuda.Stream) for s in streams)
    assert streams[0] != streams[1] and all(s.device == torch.device(CUDA) for s in streams)
    size = slice_size(props.multi_processor_count, 2, props.major)
    model, _ = on_gpu(build("mlp").eval())
    args, _ = random_inputs("mlp", 8, torch.Generator().manual_seed(0))
    pipe = autopipe.compile(model, devices=streams, chunks=2, example_inputs=[a.to(CUDA) for a in args])
    assert repr(pipe).count(f"green context, {size} SMs") == 2, repr(pipe)
