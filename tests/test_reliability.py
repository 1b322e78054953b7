"""Bad input gets a clear error before anything runs; a failing stage ends the step promptly."""
import logging
import _thread
import gc
import signal
import threading
import time

import pytest
import torch
import torch.nn as nn

import autopipe
from zoo import MLP, build


def autopipe_threads():
    return [t for t in threading.enumerate() if t.name.startswith("autopipe-")]


# -- bad input ----------------------------------------------------------------

@pytest.mark.parametrize("chunks", [0, -1, 1.5, True])
def test_bad_chunks(chunks):
    with pytest.raises(ValueError, match="chunks must be a positive int"):
        autopipe.compile(MLP(), devices=2, chunks=chunks)


def test_devices_that_do_not_exist_or_none():
    with pytest.raises(ValueError, match="empty list"):
        autopipe.compile(MLP(), devices=[])
    with pytest.raises(ValueError, match="at least 1"):
        autopipe.compile(MLP(), devices=0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="'cuda:7' is a CUDA device but CUDA is not available"):
            autopipe.compile(MLP(), devices=["cuda:7"])
    else:
        with pytest.raises(ValueError, match="'cuda:64' does not exist"):
            autopipe.compile(MLP(), devices=["cuda:64"])
    with pytest.raises(ValueError, match="not a device"):
        autopipe.compile(MLP(), devices=["gpu0"])


def test_more_stages_than_the_graph_can_fill():
    class Tiny(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

        def forward(self, x):
            return self.fc(x).relu()

    with pytest.raises(ValueError, match="only 2 operations.*use at most 2 devices"):
        autopipe.compile(Tiny(), devices=3, example_inputs=(torch.randn(4, 2),))


def test_bad_checkpoint_and_balance():
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        autopipe.compile(MLP(), devices=2, checkpoint="sometimes")
    with pytest.raises(ValueError, match="balance must be one of"):
        autopipe.compile(MLP(), devices=2, balance="vibes")


def test_input_on_the_wrong_device_and_wrong_dtype():
    pipe = autopipe.compile(MLP(), devices=2, chunks=2, example_inputs=(torch.randn(4, 8),))
    with pytest.raises(ValueError, match="argument 'x' is on meta"):
        pipe(torch.randn(4, 8, device="meta"))
    with pytest.raises(TypeError, match=r"argument 'x' has dtype torch.float64.*compiled for torch.float32"):
        pipe(torch.randn(4, 8, dtype=torch.float64))


def test_batch_sizes_that_disagree(caplog):
    """b of 3 rows beside a batch of 4 is not a batch tensor, but it was one when the pipeline was compiled: named before anything runs. A new
    pipeline plans it as a tensor given whole to every micro-batch and fails as the plain model does, on the model's own op, with no error
    logged by FakeTensorMode on the way."""
    model = build("two_inputs")
    pipe = autopipe.compile(model, devices=2, chunks=2)
    pipe(torch.randn(4, 6), torch.randn(4, 4))
    with pytest.raises(autopipe.InputMismatch, match=r"argument 'b' of shape \(3, 4\) was cut into micro-batches when the pipeline was compiled"):
        pipe(torch.randn(4, 6), torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        model(torch.randn(4, 6), torch.randn(3, 4))
    with pytest.raises(RuntimeError, match="Sizes of tensors must match"):
        autopipe.compile(model, devices=2, chunks=2)(torch.randn(4, 6), torch.randn(3, 4))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_non_tensor_where_a_batch_tensor_was():
    pipe = autopipe.compile(MLP(), devices=2, chunks=2, example_inputs=(torch.randn(4, 8),))
    with pytest.raises(TypeError, match="argument 'x' must be a tensor.*got list"):
        pipe([[0.0] * 8] * 4)
    with pytest.raises(TypeError, match="no tensor argument"):
        autopipe.compile(MLP(), devices=2)([[0.0] * 8] * 4)


def test_untraceable_model_names_both_routes_and_the_source_line():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            y = self.fc(x)
            if y.sum() > 0:  # data-dependent control flow
                return y * 2
            return y

    model = DataDependent()
    before = {n: p.clone() for n, p in model.state_dict().items()}
    with pytest.raises(RuntimeError) as info:
        autopipe.compile(model, devices=2, example_inputs=(torch.randn(4, 4),))
    text = str(info.value)
    assert "torch.fx.symbolic_trace" in text and "torch.export" in text
    assert "test_reliability.py" in text and "if y.sum() > 0" in text
    assert "What to try" in text
    # compile must not change the model when it fails
    assert model.training and all(torch.equal(before[n], t) for n, t in model.state_dict().items())


# -- faults -------------------------------------------------------------------

class Bomb(nn.Module):
    """Raises in forward or backward when armed for a micro-batch of a given size."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.armed = None  # ("forward" | "backward", micro-batch rows)

    def forward(self, x):
        y = self.fc(x)
        if self.armed == ("forward", x.shape[0]):
            raise ValueError("boom in forward")
        if self.armed and self.armed[0] == "backward" and self.armed[1] == x.shape[0]:
            return _ExplodeInBackward.apply(y)
        return y


class _ExplodeInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y):
        return y.clone()

    @staticmethod
    def backward(ctx, g):
        raise ArithmeticError("boom in backward")


class WithBomb(nn.Module):
    def __init__(self):
        super().__init__()
        self.pre = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])
        self.bomb = Bomb()
        self.post = nn.ModuleList([nn.Linear(8, 8) for _ in range(3)])

    def forward(self, x):
        for m in self.pre:
            x = torch.tanh(m(x))
        x = self.bomb(x)
        for m in self.post:
            x = torch.tanh(m(x))
        return x


@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_failing_stage_ends_the_step_with_the_original_exception(where, checkpoint):
    model = WithBomb()
    pipe = autopipe.compile(model, devices=3, chunks=4, checkpoint=checkpoint, leaf_modules=[Bomb])
    x = torch.randn(9, 8)  # micro-batches of 3, 2, 2, 2 rows: only micro-batch 0 has 3
    pipe(x).sum().backward()
    gc.collect()  # earlier tests' pipelines stop their workers when collected; only this pipeline's may be running
    threads = set(autopipe_threads())
    model.bomb.armed = (where, 3)
    bomb_stage = next(s.index for s in pipe.plan.stages if "bomb" in s.nodes)
    expected = ValueError if where == "forward" else ArithmeticError
    start = time.perf_counter()
    with pytest.raises(expected, match=f"boom in {where}") as info:
        pipe(x).sum().backward()
    assert time.perf_counter() - start < 10
    note = " ".join(getattr(info.value, "__notes__", []))
    assert f"raised in stage {bomb_stage} (cpu) on micro-batch 0 during {where}" in note
    assert set(autopipe_threads()) <= threads, "the failed step left threads behind"
    model.bomb.armed = None
    out = pipe(x)
    out.sum().backward()
    torch.testing.assert_close(out, model(x))


def test_ctrl_c_during_a_step_stops_it_and_the_pipeline_still_works():
    interrupt_at = [None]  # the forward call that presses Ctrl-C: one in the middle of the step, whatever the load

    class Slow(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            if interrupt_at[0] is not None:
                interrupt_at[0] -= 1
                if interrupt_at[0] == 0:
                    _thread.interrupt_main()
            time.sleep(0.05)
            return self.fc(x)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Slow(), Slow()

        def forward(self, x):
            return self.b(torch.relu(self.a(x)))

    model = Model()
    pipe = autopipe.compile(model, devices=2, chunks=8, leaf_modules=[Slow])
    x = torch.randn(16, 8)
    pipe(x)
    interrupt_at[0] = 4  # of the 16 forward calls of the step's 8 micro-batches on 2 stages
    # Ctrl-C reaches Python through its default SIGINT handler, which a shell's background job runs without
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            pipe(x).sum().backward()
    finally:
        signal.signal(signal.SIGINT, previous)
        interrupt_at[0] = None
    assert all(w.alive and w._tasks.empty() for w in pipe.workers)  # its two workers, idle
    torch.testing.assert_close(pipe(x), model(x))


def test_closing_the_pipeline_leaves_no_threads():
    pipe = autopipe.compile(MLP(), devices=3, chunks=2)
    pipe(torch.randn(4, 8)).sum().backward()
    threads = [w._thread for w in pipe.workers]
    assert all(t.is_alive() for t in threads)
    pipe.close()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)


def test_garbage_collected_pipeline_stops_its_threads():
    import gc
    pipe = autopipe.compile(MLP(), devices=2, chunks=2)
    pipe(torch.randn(4, 8)).sum().backward()
    threads = [w._thread for w in pipe.workers]
    del pipe
    gc.collect()
    for t in threads:
        t.join(5)
    assert not any(t.is_alive() for t in threads)


def test_memory_cap_no_plan_satisfies_names_the_stage_and_the_shortfall():
    from autopipe.passes.partition import NoFeasiblePlan
    model = MLP(hidden=256)
    with pytest.raises(NoFeasiblePlan, match=r"stage \d+ .*needs .* but the cap is .*short"):
        autopipe.compile(model, devices=2, memory_cap=100_000, example_inputs=(torch.randn(4, 8),))
