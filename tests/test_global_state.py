"""autopipe/global_state.py: whatever a compiler pass changes in torch's global state, the guard puts
back, whether the pass returns or raises; and a real leak (a ``@torch.no_grad()`` rotary embedding, as
Hugging Face's LLaMA had, exported as torch's ``wrap_with_set_grad_enabled`` op) is caught."""
from __future__ import annotations

import random

import numpy
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from autopipe.global_state import GlobalStateLeak, differences, preserved_global_state, snapshot

_kept: list = []  # context managers a "pass" entered and never exited


@pytest.fixture(autouse=True)
def _clean_up_leaks():
    before = snapshot()
    yield
    _kept.clear()  # the guard undid their effects; exiting them now would undo them twice
    assert differences(before, snapshot()) == [], "a test itself leaked global state"


def _leak(context_manager):
    """Enter a context manager and never exit it, as a pass that raised half way would."""
    context_manager.__enter__()
    _kept.append(context_manager)


def _flip_autocast_cpu():
    torch.set_autocast_enabled("cpu", not torch.is_autocast_enabled("cpu"))
    torch.set_autocast_dtype("cpu", torch.float16)


def _enable_autocast_cuda():
    torch.set_autocast_enabled("cuda", True)  # the flags exist without a GPU


def _set_numpy_seed():
    numpy.random.seed(123)
    numpy.random.rand(3)


def _module_hook():
    torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)


def _patch_module_call():
    torch.nn.Module.__call__ = lambda self, *a, **k: None  # what fx's tracer does while it traces


def _fx_tracing_flag():
    import torch.fx._symbolic_trace as st

    st._is_fx_tracing_flag = True


class _Mode(TorchFunctionMode):
    pass


class _DispatchMode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _grad_off_through_torchs_hop():
    """torch 2.13's wrap_with_set_grad_enabled: grad mode is not restored when the body raises."""
    from torch._higher_order_ops.wrap import wrap_with_set_grad_enabled

    def body():
        raise RuntimeError("the body failed")

    try:
        wrap_with_set_grad_enabled(False, body)
    except RuntimeError:
        pass


def _push_saved_tensors_hooks():
    _leak(torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t))


# (piece, what a careless pass does, how the caller reads that piece)
CHANGES = [
    ("grad mode", lambda: torch.set_grad_enabled(False), torch.is_grad_enabled),
    ("grad mode", _grad_off_through_torchs_hop, torch.is_grad_enabled),
    ("grad mode", lambda: _leak(torch.no_grad()), torch.is_grad_enabled),
    ("forward-mode AD", lambda: torch._C._set_fwd_grad_enabled(False), torch._C._is_fwd_grad_enabled),
    ("autograd multithreading", lambda: torch.autograd.set_multithreading_enabled(False),
     torch._C._is_multithreading_enabled),
    ("anomaly mode", lambda: torch.set_anomaly_enabled(True, False),
     lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled())),
    ("autocast (cpu)", _flip_autocast_cpu,
     lambda: (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"))),
    ("autocast (cpu)", lambda: _leak(torch.autocast("cpu", dtype=torch.bfloat16)),
     lambda: (torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu"), torch.is_autocast_cache_enabled())),
    ("autocast (cuda)", _enable_autocast_cuda, lambda: torch.is_autocast_enabled("cuda")),
    ("autocast cache", lambda: torch.set_autocast_cache_enabled(False), torch.is_autocast_cache_enabled),
    ("autocast nesting", torch.autocast_increment_nesting,
     lambda: (torch.autocast_increment_nesting(), torch.autocast_decrement_nesting())),
    ("default dtype", lambda: torch.set_default_dtype(torch.float64), torch.get_default_dtype),
    ("default device", lambda: torch.set_default_device("meta"),
     lambda: (torch.get_default_device(), torch.empty(1).device)),
    ("torch function mode stack", lambda: _leak(torch.device("meta")),
     lambda: (torch.get_default_device(), torch.empty(1).device, torch._C._len_torch_function_stack())),
    ("torch function mode stack", lambda: _leak(_Mode()), torch._C._len_torch_function_stack),
    ("torch dispatch mode stack", lambda: _leak(_DispatchMode()), torch._C._len_torch_dispatch_stack),
    ("torch dispatch mode stack", lambda: _leak(torch._subclasses.fake_tensor.FakeTensorMode()),
     lambda: (torch._C._len_torch_dispatch_stack(), type(torch.ones(1)).__name__)),
    ("saved tensors hooks", _push_saved_tensors_hooks,
     lambda: torch._C._autograd._top_saved_tensors_default_hooks(True)),
    ("saved tensors hooks", lambda: _leak(torch.autograd.graph.disable_saved_tensors_hooks("no")),
     torch._C._autograd._saved_tensors_hooks_is_enabled),
    ("CPU RNG", lambda: (torch.manual_seed(123), torch.rand(3)), lambda: (torch.get_rng_state(), torch.initial_seed())),
    ("CPU RNG", lambda: torch.rand(3), torch.get_rng_state),
    ("Python random", lambda: random.random(), random.getstate),
    ("NumPy random", _set_numpy_seed, lambda: numpy.random.get_state()[1].tolist()),
    ("deterministic algorithms", lambda: torch.use_deterministic_algorithms(True, warn_only=True),
     lambda: (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())),
    ("torch.utils.deterministic.fill_uninitialized_memory",
     lambda: setattr(torch.utils.deterministic, "fill_uninitialized_memory",
                     not torch.utils.deterministic.fill_uninitialized_memory),
     lambda: torch.utils.deterministic.fill_uninitialized_memory),
    ("torch.backends.cudnn.deterministic", lambda: setattr(torch.backends.cudnn, "deterministic", True),
     lambda: torch.backends.cudnn.deterministic),
    ("torch.backends.cudnn.benchmark", lambda: setattr(torch.backends.cudnn, "benchmark", True),
     lambda: torch.backends.cudnn.benchmark),
    ("torch.backends.cudnn.enabled", lambda: setattr(torch.backends.cudnn, "enabled", False),
     lambda: torch.backends.cudnn.enabled),
    ("torch.backends.mkldnn.enabled", lambda: setattr(torch.backends.mkldnn, "enabled", False),
     lambda: torch.backends.mkldnn.enabled),
    ("intra-op threads", lambda: torch.set_num_threads(1 if torch.get_num_threads() != 1 else 2),
     torch.get_num_threads),
    ("float32 matmul precision", lambda: torch.set_float32_matmul_precision("medium"),
     lambda: (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.fp32_precision,
              torch.backends.mkldnn.matmul.fp32_precision)),
    ("torch.backends.cuda.matmul.allow_tf32",
     lambda: setattr(torch.backends.cuda.matmul, "allow_tf32", not torch.backends.cuda.matmul.allow_tf32),
     lambda: (torch.backends.cuda.matmul.allow_tf32, torch.get_float32_matmul_precision())),
    ("scaled dot product attention backends", lambda: torch.backends.cuda.enable_flash_sdp(False),
     torch.backends.cuda.flash_sdp_enabled),
    ("global nn.Module hooks", _module_hook, lambda: dict(torch.nn.modules.module._global_forward_hooks)),
    ("fx tracer patches", _patch_module_call, lambda: torch.nn.Module.__dict__["__call__"]),
    ("fx tracer patches", _fx_tracing_flag, torch.fx._symbolic_trace.is_fx_tracing),
]
# pieces that share their state with others (old and new TF32 switches): another piece's setter may
# be the one that puts it back
_SHARED = {"torch.backends.cuda.matmul.allow_tf32"}
IDS = [f"{piece}-{i}" for i, (piece, _, _) in enumerate(CHANGES)]


def _same_reading(a, b):
    if isinstance(a, tuple) or isinstance(b, tuple):
        return isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b) and all(_same_reading(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


@pytest.mark.parametrize("piece, change, read", CHANGES, ids=IDS)
def test_a_pass_that_changes_a_piece_leaves_it_as_it_was(piece, change, read):
    before, whole = read(), snapshot()
    with preserved_global_state() as guard:
        change()
        assert not _same_reading(read(), before), "the fake pass changed nothing"
    assert _same_reading(read(), before)
    assert piece in guard.restored or (piece in _SHARED and guard.restored)
    assert differences(whole, snapshot()) == []


@pytest.mark.parametrize("piece, change, read", CHANGES, ids=IDS)
def test_a_pass_that_changes_a_piece_and_raises_leaves_it_as_it_was(piece, change, read):
    before, whole = read(), snapshot()
    with pytest.raises(ValueError, match="the pass failed"):
        with preserved_global_state() as guard:
            change()
            raise ValueError("the pass failed")
    assert _same_reading(read(), before)
    assert piece in guard.restored or (piece in _SHARED and guard.restored)
    assert differences(whole, snapshot()) == []


def test_the_pieces_restore_from_their_non_default_values_too():
    """The caller's own non-default state is what comes back, not torch's defaults."""
    with preserved_global_state():  # the outer guard cleans up this test's own settings
        torch.set_grad_enabled(False)
        torch.set_default_dtype(torch.float64)
        torch.set_autocast_enabled("cpu", True)
        torch.set_default_device("meta")
        inner_before = snapshot()
        with preserved_global_state() as guard:
            torch.set_grad_enabled(True)
            torch.set_default_dtype(torch.float32)
            torch.set_autocast_enabled("cpu", False)
            torch.set_default_device("cpu")
        assert differences(inner_before, snapshot()) == []
        assert set(guard.restored) >= {"grad mode", "default dtype", "autocast (cpu)", "default device"}
        assert not torch.is_grad_enabled() and torch.get_default_dtype() == torch.float64
        assert torch.empty(1).device.type == "meta"
    assert torch.is_grad_enabled() and torch.empty(1).device.type == "cpu"


def test_nothing_changed_nothing_restored():
    with preserved_global_state() as guard:
        torch.ones(3) @ torch.ones(3)
    assert guard.restored == []


def test_inference_mode_left_on_cannot_be_undone_so_it_is_reported():
    """Only the entered guard object can end inference mode; a block that keeps one alive is an error."""
    assert not torch.is_inference_mode_enabled()
    with pytest.raises(GlobalStateLeak, match="inference mode"):
        with preserved_global_state() as guard:
            torch.set_default_dtype(torch.float64)
            _leak(torch.inference_mode())
    assert torch.get_default_dtype() == torch.float32  # everything else was still put back
    assert "default dtype" in guard.restored
    _kept.pop().__exit__(None, None, None)
    assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()


def test_inference_mode_left_on_while_raising_keeps_the_original_error_with_a_note():
    with pytest.raises(ValueError, match="the pass failed") as info:
        with preserved_global_state():
            _leak(torch.inference_mode())
            raise ValueError("the pass failed")
    assert any("inference mode" in note for note in getattr(info.value, "__notes__", []))
    _kept.pop().__exit__(None, None, None)


def test_inference_mode_ended_by_its_own_context_is_fine():
    with preserved_global_state() as guard:
        with torch.inference_mode():
            torch.ones(2) * 2
    assert guard.restored == [] and not torch.is_inference_mode_enabled()


# -- a real model ---------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def _tiny_llama():
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    with torch.random.fork_rng():  # random weights, without moving the generator the fixture checks
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    return model, ids


def test_llama_traced_by_export_leaves_grad_mode_on():
    from autopipe.passes.trace import trace

    model, ids = _tiny_llama()
    assert torch.is_grad_enabled()
    with preserved_global_state():
        traced = trace(model, (ids,), route="export")
    assert torch.is_grad_enabled()
    # trace() guards itself too (the leak, below, is in running the graph's no_grad op, not in export)
    traced = trace(model, (ids,), route="export")
    assert torch.is_grad_enabled()
    assert traced.route == "export"


class NoGradRotary(torch.nn.Module):
    """A rotary embedding whose forward is @torch.no_grad(), as Hugging Face's LlamaRotaryEmbedding was up to
    transformers 5.23 (5.24 dropped the decorator), applied to a linear layer's output."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 8, 2).float() / 8), persistent=False)

    @torch.no_grad()
    def angles(self, positions):
        freqs = positions[..., None].float() * self.inv_freq
        return torch.cat((freqs, freqs), dim=-1).cos()

    def forward(self, x):  # x: (batch, seq, 8)
        return self.proj(x) * self.angles(torch.arange(x.shape[1]))


def test_a_no_grad_region_in_the_graph_leaks_grad_mode_off_without_the_guard_and_not_with_it():
    """The real leak: export records a @torch.no_grad() region as wrap_with_set_grad_enabled(False, body, ...),
    whose torch 2.13 implementation does not restore grad mode when the body raises. Passes run graph nodes on
    fake inputs and catch failures (the cost pass does, for flop counting): grad mode stays off in the caller
    unless guarded."""
    from autopipe.passes.trace import trace

    with torch.random.fork_rng():  # random weights, without moving the generator the fixture checks
        model, x = NoGradRotary(), torch.randn(4, 3, 8)
    traced = trace(model, (x,), route="export")
    hops = [n for n in traced.graph_module.graph.nodes if "wrap_with_set_grad_enabled" in str(n.target)]
    assert hops, "the rotary embedding's no_grad is a wrap_with_set_grad_enabled node"
    node = hops[0]
    assert node.args[0] is False

    def run_node_as_a_pass_would():  # the body fails (here: called without its inputs)
        body = traced.graph_module.get_submodule(node.args[1].target)
        try:
            node.target(node.args[0], body)
        except Exception:
            pass

    run_node_as_a_pass_would()
    leaked = not torch.is_grad_enabled()
    torch.set_grad_enabled(True)
    assert leaked, "torch restores grad mode here now: the guard is no longer needed for this case"

    with preserved_global_state() as guard:
        run_node_as_a_pass_would()
    assert torch.is_grad_enabled()
    assert guard.restored == ["grad mode"]


def test_llama_trace_and_cost_inside_the_guard_leave_grad_mode_on():
    from autopipe.passes.cost import cost
    from autopipe.passes.trace import trace

    model, ids = _tiny_llama()
    with preserved_global_state():
        cost(trace(model, (ids,), route="export"))
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("route", ["fx", "export"])
def test_compiling_inside_autocast_leaves_no_fake_cast_in_its_cache(route):
    """The passes' fake runs would leave FakeTensor casts of the real parameters in the cache of the caller's autocast
    region, which the caller's own next op on a parameter then returns (Note [autocast cache])."""
    import torch.nn.functional as F

    import autopipe
    from zoo import GPT
    # the model's initialisation and the step's seed are no leak of the passes'
    with torch.random.fork_rng(devices=[]), torch.autocast("cpu", dtype=torch.bfloat16):
        model = GPT(vocab=64, d=32, heads=4, layers=2, block=16, dropout=0.0)
        ids = torch.randint(0, 64, (4, 16))
        pipe = autopipe.compile(model, devices=2, chunks=2, route=route, example_inputs=(ids,))
        weight = model.blocks[0].fc.weight
        assert type(F.linear(torch.randn(3, 32), weight)) is torch.Tensor
        assert type(pipe(ids)) is torch.Tensor
