"""``with preserved_global_state() as guard``: compiling runs model code that may leave torch's global state changed
(a Hugging Face ``@torch.no_grad()`` rotary embedding, exported by torch, leaves grad mode off when its body raises);
on exit the guard puts back what changed, named in ``guard.restored`` (Note [global state across tracing]). Enter and
exit it on the same thread."""
from __future__ import annotations

import contextlib
import operator
import random
import sys
from functools import partial
from typing import Any, Callable

import torch
import torch.fx._symbolic_trace
import torch.utils._device
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

_autograd = torch._C._autograd
Piece = tuple[Callable[[], Any], Callable[[Any], None]]  # how to read it, how to put a reading back


class GlobalStateLeak(RuntimeError):
    """A piece of global state changed inside the guard and could not be put back."""


def _group(*pieces: Piece) -> Piece:
    def set(values):
        for (_, setter), value in zip(pieces, values):
            setter(value)
    return lambda: tuple(get() for get, _ in pieces), set


def _attribute(path: str) -> Piece:  # "torch.<...>.<attr>"
    owner_path, _, attr = path.rpartition(".")
    owner = operator.attrgetter(owner_path.partition(".")[2])(torch)
    hooks = getattr(owner, attr, None)
    if isinstance(hooks, dict):  # put back in place: RemovableHandles hold the dict
        def set(saved):
            hooks.clear()
            hooks.update(saved)
        return lambda: dict(hooks), set
    return lambda: getattr(owner, attr, None), partial(setattr, owner, attr)


def _stack(modes: Callable, length: Callable, pop: Callable,
           push: Callable) -> Piece:  # a mode stack: its very mode objects, in order
    def set(saved):
        while length():
            pop()
        for mode in saved:
            push(mode)
    return lambda: tuple(modes()), set


def _set_top_saved_tensors_hooks(top) -> None:
    while (now := _autograd._top_saved_tensors_default_hooks(True)) is not None and not _same(now, top):
        _autograd._pop_saved_tensors_default_hooks()  # pushed in the block and never popped
    if now is None and top is not None:
        _autograd._push_saved_tensors_default_hooks(*top)  # the block popped the caller's


def _autocast_nesting() -> int:
    depth = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return depth


def _set_autocast_nesting(depth: int) -> None:
    while (now := _autocast_nesting()) != depth:
        (torch.autocast_increment_nesting if now < depth else torch.autocast_decrement_nesting)()


def _inference_mode_leak(was_on: bool) -> None:
    raise GlobalStateLeak(f"inference mode was {'on' if was_on else 'off'} before the block and not after: an entered "
                          "torch.inference_mode() outlived it, and only that object can end it")


_CUDA = torch.backends.cuda
_AUTOCAST_DEVICES = ["cpu", "cuda", "xpu", "mps", "hpu", "xla", "ipu", "mtia", "maia",
                     torch._C._get_privateuse1_backend_name()]
_MODULE_HOOKS = ["backward_pre_hooks", "backward_hooks", "is_full_backward_hook", "forward_pre_hooks", "forward_hooks",
                 "forward_hooks_always_called", "forward_hooks_with_kwargs", "module_registration_hooks",
                 "parameter_registration_hooks", "buffer_registration_hooks"]
_FLAGS = ["torch.utils.deterministic.fill_uninitialized_memory", *(f"torch.backends.{flag}" for flag in (
    "cudnn.enabled", "cudnn.benchmark", "cudnn.benchmark_limit", "cudnn.deterministic", "cudnn.allow_tf32",
    "mkldnn.enabled", "cuda.matmul.allow_tf32", "cuda.matmul.allow_fp16_reduced_precision_reduction",
    "cuda.matmul.allow_bf16_reduced_precision_reduction",
    # the fp32_precision API after the older switches it overlaps with
    "fp32_precision", "cuda.matmul.fp32_precision", "cudnn.fp32_precision", "cudnn.conv.fp32_precision",
    "cudnn.rnn.fp32_precision", "mkldnn.fp32_precision", "mkldnn.matmul.fp32_precision", "mkldnn.conv.fp32_precision",
    "mkldnn.rnn.fp32_precision"))]
PIECES: dict[str, Piece] = {  # the mode stacks first: the default device and the saved tensors hooks live on them
    "torch dispatch mode stack": _stack(_get_current_dispatch_mode_stack, torch._C._len_torch_dispatch_stack,
                                        _pop_mode, _push_mode),
    "torch function mode stack": _stack(torch.overrides._get_current_function_mode_stack,
                                        torch._C._len_torch_function_stack, torch._C._pop_torch_function_stack,
                                        torch._C._push_on_torch_function_stack),
    "default device": _group(_attribute("torch.utils._device.CURRENT_DEVICE"),
                             _attribute("torch._GLOBAL_DEVICE_CONTEXT.device_context")),
    "saved tensors hooks": _group(  # as torch.autograd.graph.disable_saved_tensors_hooks puts its message back
        (partial(_autograd._top_saved_tensors_default_hooks, True), _set_top_saved_tensors_hooks),
        (_autograd._saved_tensors_hooks_get_disabled_error_message,
         lambda message: _autograd._saved_tensors_hooks_enable() if message is None
         else _autograd._saved_tensors_hooks_disable(message))),
    "inference mode": (torch.is_inference_mode_enabled, _inference_mode_leak),  # checked: nothing else can end it
    "grad mode": (torch.is_grad_enabled, torch.set_grad_enabled),
    "forward-mode AD": (torch._C._is_fwd_grad_enabled, torch._C._set_fwd_grad_enabled),
    "autograd multithreading": (torch._C._is_multithreading_enabled, torch._C._set_multithreading_enabled),
    "anomaly mode": (lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
                     lambda saved: torch.set_anomaly_enabled(*saved)),
    **{f"autocast ({d})": _group((partial(torch.get_autocast_dtype, d), partial(torch.set_autocast_dtype, d)),
                                 (partial(torch.is_autocast_enabled, d), partial(torch.set_autocast_enabled, d)))
       for d in dict.fromkeys(_AUTOCAST_DEVICES) if torch.amp.is_autocast_available(d)},
    "autocast cache": (torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled),
    "autocast nesting": (_autocast_nesting, _set_autocast_nesting),
    "default dtype": (torch.get_default_dtype, torch.set_default_dtype),
    "CPU RNG": (torch.get_rng_state, torch.set_rng_state),
    "Python random": (random.getstate, random.setstate),
    "deterministic algorithms": (lambda: (torch.are_deterministic_algorithms_enabled(),
                                          torch.is_deterministic_algorithms_warn_only_enabled()),
                                 lambda saved: torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])),
    "intra-op threads": (torch.get_num_threads, torch.set_num_threads),
    "float32 matmul precision": (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    "scaled dot product attention backends": _group(
        *((getattr(_CUDA, f"{kind}_sdp_enabled"), getattr(_CUDA, f"enable_{kind}_sdp"))
          for kind in ("flash", "mem_efficient", "math", "cudnn")),
        (_CUDA.fp16_bf16_reduction_math_sdp_allowed, _CUDA.allow_fp16_bf16_reduction_math_sdp)),
    "fx tracer patches": _group(*map(_attribute, ["torch.nn.Module.__call__", "torch.nn.Module.__getattr__",
                                                  "torch.fx._symbolic_trace._is_fx_tracing_flag"])),
    "global nn.Module hooks": _group(*(_attribute(f"torch.nn.modules.module._global_{h}") for h in _MODULE_HOOKS)),
    **{path: _attribute(path) for path in _FLAGS},
}


def _pieces_now() -> dict[str, Piece]:
    """PIECES, the CUDA generators once CUDA is initialised (as torch.random.fork_rng), NumPy's once imported."""
    pieces = dict(PIECES)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        pieces["CUDA RNG"] = torch.cuda.get_rng_state_all, torch.cuda.set_rng_state_all
    if "numpy" in sys.modules:
        pieces["NumPy random"] = sys.modules["numpy"].random.get_state, sys.modules["numpy"].random.set_state
    return pieces


def _same(a: Any, b: Any) -> bool:
    """Equal plain data, tensors and arrays; identical objects otherwise."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        a, b = list(a.items()), list(b.items())
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, torch.Tensor) or type(a).__module__ == "numpy":  # and NumPy's scalars
        return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
    return a is b or isinstance(a, (bool, int, float, complex, str, bytes, torch.dtype, torch.device)) and a == b


def snapshot() -> dict[str, Any]:
    return {name: get() for name, (get, _) in _pieces_now().items()}


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    return [name for name in before if name not in after or not _same(before[name], after[name])]


# Note [global state across tracing]: tracing runs the user's code, which may leave torch's global state changed
# (Hugging Face rotary embeddings under @torch.no_grad() left grad mode off in the caller). The whole chain of
# passes runs inside preserved_global_state, which puts back grad mode, RNG, autocast, default dtype and device,
# thread counts and the other flags it lists, also when tracing fails.
class preserved_global_state(contextlib.ContextDecorator):
    """Snapshots torch's global state on entry; on exit, also by exception, puts back whatever changed; GlobalStateLeak
    names what could not be (as a note on the block's own exception, if it raised)."""

    def __enter__(self) -> preserved_global_state:
        self.before, self.restored = snapshot(), []
        return self

    def __exit__(self, kind, error, traceback) -> None:
        pieces = _pieces_now()
        failures: dict[str, str] = {}
        for _ in range(2):  # a second round for pieces that share state (the old and new TF32 switches)
            for name in [n for n in self.before if n in pieces and n not in failures]:
                get, set = pieces[name]
                try:
                    if not _same(get(), self.before[name]):
                        set(self.before[name])  # only then: some setters warn, some cost
                        self.restored.append(name)
                except Exception as e:  # noqa: BLE001 - every piece gets its chance
                    failures[name] = str(e) if isinstance(e, GlobalStateLeak) else f"{type(e).__name__}: {e}"
        self.restored = [name for name in dict.fromkeys(self.restored) if name not in failures]
        if failures:
            what = "; ".join(f"{name}: {why}" for name, why in failures.items())
            leak = GlobalStateLeak(f"global state changed and was not put back: {what}")
            if error is None:
                raise leak
            if hasattr(error, "add_note"):  # Python >= 3.11
                error.add_note(f"autopipe.global_state: {leak}")


@contextlib.contextmanager
def autocast_cache_off():
    """Note [autocast cache]: autocast keeps the low-precision cast of each leaf tensor that requires grad (a
    parameter) for as long as its region lasts, keyed by the tensor. Compiling inside the caller's autocast runs the
    model on fake tensors; a cast it left in the cache is a FakeTensor that the caller's next op on that parameter,
    in the same region, would get (``F.linear(x, w)`` returning a FakeTensor). The passes run with the cache off, so
    they neither leave fake casts nor read the caller's real ones; the caller's setting comes back on exit."""
    was = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(was)
