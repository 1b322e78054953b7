"""Leave torch's global state as it was found: ``preserved_global_state()``.

Compiling a model runs the model's own Python (fx's symbolic tracer, torch.export,
fake-tensor shape propagation, flop counting), and that Python may change process- or
thread-wide state and not change it back, above all when something raises half way.
A real case: Hugging Face decoder LMs decorate their rotary-embedding ``forward`` with
``@torch.no_grad()``; torch.export captures that as the ``wrap_with_set_grad_enabled``
higher-order op, whose Python implementation (torch 2.13) sets grad mode off, calls the
body and sets it back with no ``try/finally``: a pass that runs the op and meets an
exception in the body (the cost pass does, on purpose, and catches it) leaves
``torch.is_grad_enabled()`` False in the caller.

    with preserved_global_state() as guard:
        traced = trace(model, args)
    guard.restored        # names of what had to be put back (empty when nothing leaked)

On entry the guard snapshots every piece in ``PIECES`` (below); on exit, normal or by
exception, it puts back each piece that differs, with torch's own setters where they
exist. What it covers:

* autograd: grad mode, forward-mode AD, autograd's multithreading, anomaly mode (and its
  ``check_nan``), saved-tensors default hooks (the top of the stack and the global
  enabled flag; the stack depth is not readable, leaked hooks are popped until the top is
  the caller's again);
* inference mode: CHECKED, not restored. It can only change by keeping an entered
  ``torch.inference_mode()`` (a C++ RAII guard) alive past the block, and nothing but
  that object can end it; the guard raises ``GlobalStateLeak`` instead (after restoring
  everything else). ``with torch.inference_mode()`` and the decorator always end it;
* autocast, per device type torch has autocast for: enabled and dtype; the weight cache
  flag; the nesting count (``torch.autocast_increment/decrement_nesting``);
* default dtype; default device (``torch.set_default_device`` and a leaked
  ``with torch.device(...)``: the ``DeviceContext`` objects themselves are put back);
* the torch-function mode stack and the torch-dispatch mode stack (user modes and the
  fake / proxy / functional "infra" modes): the very mode objects, in order;
* random number generators: torch's CPU generator (state and seed), every CUDA device's
  if CUDA was initialised on entry (what ``torch.random.fork_rng`` did for compile; CUDA
  first initialised inside the block keeps the generators it started there),
  Python's ``random``, and NumPy's global generator if NumPy is imported;
* ``torch.use_deterministic_algorithms`` (mode and ``warn_only``),
  ``torch.utils.deterministic.fill_uninitialized_memory``;
* backend flags: cuDNN (enabled, benchmark, benchmark_limit, deterministic, allow_tf32),
  mkldnn enabled, cuBLAS reduced-precision reductions and allow_tf32, the float32 matmul
  precision (old API) and every ``fp32_precision`` setting (new API), the scaled-dot-
  product-attention backend switches;
* ``torch.get_num_threads()``;
* what fx's symbolic tracer patches while tracing (``nn.Module.__call__`` /
  ``__getattr__``, its is-tracing flag) and the global ``nn.Module`` hooks
  (``register_module_forward_hook`` & co.).

Grad mode, autocast, inference mode, the mode stacks, the saved-tensors hooks and the
default device are thread-local: enter and exit the guard on the same thread, the one
that runs the passes. Not covered: the interop thread count (settable once per process),
generators other than the global ones (a model's own ``torch.Generator`` objects are its
state), MPS/XPU generators, registries that are meant to grow (pytree node types,
custom ops), and any state of the user's own Python.

Setters run only for pieces that differ, so a guard over code that changes nothing calls
no setter (some emit deprecation warnings, some cost: ``set_num_threads``). A setter that
fails does not stop the others; the failures are raised together as ``GlobalStateLeak``
at the end, or, when the block itself raised, added as a note to that exception.
"""
from __future__ import annotations

import contextlib
import random
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch

__all__ = ["GlobalStateLeak", "GlobalStateGuard", "PIECES", "preserved_global_state", "snapshot", "differences"]


class GlobalStateLeak(RuntimeError):
    """A piece of global state changed inside the guard and could not be put back."""


@dataclass(frozen=True)
class Piece:
    """One piece of global state: how to read it and how to put a reading back."""

    name: str
    get: Callable[[], Any]
    set: Callable[[Any], None]
    absent_when_none: bool = False  # a None reading means "does not exist yet" (NumPy not imported)


# -- readers and writers --------------------------------------------------------------------


def _set_inference_mode(value: bool) -> None:
    raise GlobalStateLeak(
        f"inference mode is {'on' if not value else 'off'} after the block and was "
        f"{'on' if value else 'off'} before: an entered torch.inference_mode() was kept alive past it, "
        f"and only that object can end it"
    )


def _autocast_device_types() -> list[str]:
    candidates = ["cpu", "cuda", "xpu", "mps", "hpu", "xla", "ipu", "mtia", "maia",
                  torch._C._get_privateuse1_backend_name()]
    found = []
    for device_type in dict.fromkeys(candidates):
        try:
            if torch._C._is_autocast_available(device_type):
                torch.is_autocast_enabled(device_type)
                torch.get_autocast_dtype(device_type)
                found.append(device_type)
        except (RuntimeError, ValueError, AttributeError):
            pass
    return found


def _autocast_piece(device_type: str) -> Piece:
    def get():
        return torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type)

    def set(value):
        enabled, dtype = value
        torch.set_autocast_dtype(device_type, dtype)
        torch.set_autocast_enabled(device_type, enabled)

    return Piece(f"autocast ({device_type})", get, set)


def _get_autocast_nesting() -> int:
    depth = torch.autocast_increment_nesting() - 1
    torch.autocast_decrement_nesting()
    return depth


def _set_autocast_nesting(depth: int) -> None:
    now = _get_autocast_nesting()
    for _ in range(depth - now):
        torch.autocast_increment_nesting()
    for _ in range(now - depth):
        torch.autocast_decrement_nesting()


def _get_function_modes() -> tuple:
    return tuple(torch._C._get_function_stack_at(i) for i in range(torch._C._len_torch_function_stack()))


def _set_function_modes(modes: tuple) -> None:
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()
    for mode in modes:
        torch._C._push_on_torch_function_stack(mode)


def _get_dispatch_modes() -> tuple:
    return tuple(torch._C._get_dispatch_stack_at(i) for i in range(torch._C._len_torch_dispatch_stack()))


def _set_dispatch_modes(modes: tuple) -> None:
    from torch.utils._python_dispatch import _pop_mode, _push_mode

    while torch._C._len_torch_dispatch_stack():
        _pop_mode()
    for mode in modes:
        _push_mode(mode)


def _get_default_device() -> tuple:
    import torch.utils._device as device_module

    context = getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
    return device_module.CURRENT_DEVICE, context


def _set_default_device(value: tuple) -> None:
    # The DeviceContext modes themselves live on the function-mode stack, put back before.
    import torch.utils._device as device_module

    device_module.CURRENT_DEVICE, torch._GLOBAL_DEVICE_CONTEXT.device_context = value


def _get_saved_tensors_hooks() -> tuple:
    autograd = torch._C._autograd
    return autograd._top_saved_tensors_default_hooks(True), autograd._saved_tensors_hooks_is_enabled()


def _set_saved_tensors_hooks(value: tuple) -> None:
    autograd = torch._C._autograd
    top, enabled = value
    for _ in range(1024):  # hooks pushed and never popped: pop them until the caller's are on top
        now = autograd._top_saved_tensors_default_hooks(True)
        if now is None or _same(now, top):
            break
        autograd._pop_saved_tensors_default_hooks()
    if top is not None and not _same(autograd._top_saved_tensors_default_hooks(True), top):
        autograd._push_saved_tensors_default_hooks(*top)  # the block popped the caller's hooks
    if enabled:
        autograd._saved_tensors_hooks_enable()
    elif autograd._saved_tensors_hooks_is_enabled():
        # re-disable with the caller's message unknown: torch's own wording
        autograd._saved_tensors_hooks_disable(
            "Saved tensors default hooks are disabled (restored by autopipe.global_state)")


def _get_cuda_rng() -> Any:
    return tuple(torch.cuda.get_rng_state_all())


def _set_cuda_rng(states) -> None:
    torch.cuda.set_rng_state_all(list(states))


def _get_numpy_rng() -> Any:
    numpy = sys.modules.get("numpy")
    return numpy.random.get_state() if numpy is not None else None


def _set_numpy_rng(state) -> None:
    sys.modules["numpy"].random.set_state(state)


_SDP = ("flash_sdp_enabled", "mem_efficient_sdp_enabled", "math_sdp_enabled", "cudnn_sdp_enabled",
        "fp16_bf16_reduction_math_sdp_allowed")
_SDP_SETTERS = ("enable_flash_sdp", "enable_mem_efficient_sdp", "enable_math_sdp", "enable_cudnn_sdp",
                "allow_fp16_bf16_reduction_math_sdp")


def _get_sdp() -> tuple:
    return tuple(getattr(torch.backends.cuda, getter)() for getter in _SDP)


def _set_sdp(value: tuple) -> None:
    for setter, enabled in zip(_SDP_SETTERS, value):
        getattr(torch.backends.cuda, setter)(enabled)


def _attribute_piece(path: str, name: str | None = None) -> Piece | None:
    """A plain attribute such as ``torch.backends.cudnn.benchmark`` (None if torch has none)."""
    owner_path, _, attr = path.rpartition(".")
    try:
        owner: Any = torch
        for part in owner_path.split(".")[1:]:
            owner = getattr(owner, part)
        getattr(owner, attr)
    except (AttributeError, RuntimeError):
        return None
    return Piece(name or path, lambda: getattr(owner, attr), lambda value: setattr(owner, attr, value))


def _get_fx_patches() -> tuple:
    import torch.fx._symbolic_trace as symbolic_trace

    module = torch.nn.Module
    return module.__dict__.get("__call__"), module.__dict__.get("__getattr__"), symbolic_trace._is_fx_tracing_flag


def _set_fx_patches(value: tuple) -> None:
    import torch.fx._symbolic_trace as symbolic_trace

    call, getattr_, flag = value
    for attr, original in (("__call__", call), ("__getattr__", getattr_)):
        if original is None:
            if attr in torch.nn.Module.__dict__:
                delattr(torch.nn.Module, attr)
        else:
            setattr(torch.nn.Module, attr, original)
    symbolic_trace._is_fx_tracing_flag = flag


_GLOBAL_HOOK_DICTS = (
    "_global_backward_pre_hooks", "_global_backward_hooks", "_global_is_full_backward_hook",
    "_global_forward_pre_hooks", "_global_forward_hooks", "_global_forward_hooks_always_called",
    "_global_forward_hooks_with_kwargs", "_global_module_registration_hooks",
    "_global_parameter_registration_hooks", "_global_buffer_registration_hooks",
)


def _get_module_hooks() -> tuple:
    import torch.nn.modules.module as module_module

    out = []
    for attr in _GLOBAL_HOOK_DICTS:
        value = getattr(module_module, attr, None)
        out.append(dict(value) if isinstance(value, dict) else value)
    return tuple(out)


def _set_module_hooks(value: tuple) -> None:
    import torch.nn.modules.module as module_module

    for attr, saved in zip(_GLOBAL_HOOK_DICTS, value):
        now = getattr(module_module, attr, None)
        if isinstance(now, dict) and isinstance(saved, dict):
            now.clear()  # the same dict object: hooks' RemovableHandles keep a reference to it
            now.update(saved)
        else:
            setattr(module_module, attr, saved)


def _pieces() -> list[Piece]:
    pieces: list[Piece | None] = [
        # the stacks first: the default device and the hooks live on them
        Piece("torch dispatch mode stack", _get_dispatch_modes, _set_dispatch_modes),
        Piece("torch function mode stack", _get_function_modes, _set_function_modes),
        Piece("default device", _get_default_device, _set_default_device),
        Piece("saved tensors hooks", _get_saved_tensors_hooks, _set_saved_tensors_hooks),
        Piece("inference mode", torch.is_inference_mode_enabled, _set_inference_mode),
        Piece("grad mode", torch.is_grad_enabled, torch.set_grad_enabled),
        Piece("forward-mode AD", torch._C._is_fwd_grad_enabled, torch._C._set_fwd_grad_enabled),
        Piece("autograd multithreading", torch._C._is_multithreading_enabled, torch._C._set_multithreading_enabled),
        Piece("anomaly mode", lambda: (torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()),
              lambda v: torch.set_anomaly_enabled(*v)),
        *[_autocast_piece(d) for d in _autocast_device_types()],
        Piece("autocast cache", torch.is_autocast_cache_enabled, torch.set_autocast_cache_enabled),
        Piece("autocast nesting", _get_autocast_nesting, _set_autocast_nesting),
        Piece("default dtype", torch.get_default_dtype, torch.set_default_dtype),
        Piece("CPU RNG", torch.get_rng_state, torch.set_rng_state),
        Piece("Python random", random.getstate, random.setstate),
        Piece("NumPy random", _get_numpy_rng, _set_numpy_rng, absent_when_none=True),
        Piece("deterministic algorithms",
              lambda: (torch.are_deterministic_algorithms_enabled(),
                       torch.is_deterministic_algorithms_warn_only_enabled()),
              lambda v: torch.use_deterministic_algorithms(v[0], warn_only=v[1])),
        _attribute_piece("torch.utils.deterministic.fill_uninitialized_memory"),
        Piece("intra-op threads", torch.get_num_threads, torch.set_num_threads),
        Piece("float32 matmul precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
        Piece("scaled dot product attention backends", _get_sdp, _set_sdp),
        Piece("fx tracer patches", _get_fx_patches, _set_fx_patches),
        Piece("global nn.Module hooks", _get_module_hooks, _set_module_hooks),
    ]
    for path in ("torch.backends.cudnn.enabled", "torch.backends.cudnn.benchmark",
                 "torch.backends.cudnn.benchmark_limit", "torch.backends.cudnn.deterministic",
                 "torch.backends.cudnn.allow_tf32", "torch.backends.mkldnn.enabled",
                 "torch.backends.cuda.matmul.allow_tf32",
                 "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction",
                 "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction",
                 # the fp32_precision API (torch >= 2.9), after the old API it overlaps with
                 "torch.backends.fp32_precision", "torch.backends.cuda.matmul.fp32_precision",
                 "torch.backends.cudnn.fp32_precision", "torch.backends.cudnn.conv.fp32_precision",
                 "torch.backends.cudnn.rnn.fp32_precision", "torch.backends.mkldnn.fp32_precision",
                 "torch.backends.mkldnn.matmul.fp32_precision", "torch.backends.mkldnn.conv.fp32_precision",
                 "torch.backends.mkldnn.rnn.fp32_precision"):
        pieces.append(_attribute_piece(path))
    return [p for p in pieces if p is not None]


PIECES: list[Piece] = _pieces()


def _pieces_now() -> list[Piece]:
    """PIECES, plus the CUDA generators once CUDA is initialised (they exist from then on)."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return PIECES + [Piece("CUDA RNG", _get_cuda_rng, _set_cuda_rng)]
    return PIECES


# -- comparing ---------------------------------------------------------------------------------

_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device)


def _same(a: Any, b: Any) -> bool:
    """Equal values for plain data, equal contents for tensors and arrays, identity otherwise."""
    if isinstance(a, _PLAIN) or isinstance(b, _PLAIN):
        return type(a) is type(b) and a == b
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and bool(torch.equal(a, b)))
    if isinstance(a, (tuple, list)) or isinstance(b, (tuple, list)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) or isinstance(b, dict):
        return (type(a) is type(b) and list(a) == list(b)
                and all(_same(a[k], b[k]) for k in a))
    if type(a).__module__ == "numpy" and type(b).__module__ == "numpy":
        import numpy
        return bool(numpy.array_equal(a, b))
    return a is b


def snapshot() -> dict[str, Any]:
    """Every piece's current value, by name (what the guard saves on entry)."""
    return {piece.name: piece.get() for piece in _pieces_now()}


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """Names of the pieces whose values differ between two snapshots."""
    return [name for name in before if name not in after or not _same(before[name], after[name])]


# -- the guard -----------------------------------------------------------------------------------


@dataclass
class GlobalStateGuard:
    """What ``preserved_global_state`` yields: the snapshot and, after exit, what it put back."""

    before: dict[str, Any]
    restored: list[str] = field(default_factory=list)  # names of the pieces that had changed

    def restore(self) -> list[str]:
        """Put back every piece that differs from ``before``; returns their names.
        Raises GlobalStateLeak for pieces that could not be put back."""
        pieces = {p.name: p for p in _pieces_now()}
        failures: dict[str, str] = {}
        restored: list[str] = []
        for _ in range(2):  # a second round for pieces that share state (old and new TF32 switches)
            for name, value in self.before.items():
                piece = pieces.get(name)
                if piece is None or name in failures or (value is None and piece.absent_when_none):
                    continue
                try:
                    if _same(piece.get(), value):
                        continue
                    piece.set(value)
                    if name not in restored:
                        restored.append(name)
                except GlobalStateLeak as e:
                    failures[name] = str(e)
                except Exception as e:  # noqa: BLE001 - every piece gets its chance
                    failures[name] = f"could not be put back: {type(e).__name__}: {e}"
        self.restored.extend(r for r in restored if r not in failures)
        if failures:
            raise GlobalStateLeak("global state changed and was not put back: "
                                  + "; ".join(f"{name}: {why}" for name, why in failures.items()))
        return restored


@contextlib.contextmanager
def preserved_global_state() -> Iterator[GlobalStateGuard]:
    """Snapshot torch's global state on entry, put back whatever changed on exit (also on
    exception). Yields a :class:`GlobalStateGuard`; ``guard.restored`` names what was put back."""
    guard = GlobalStateGuard(before=snapshot())
    try:
        yield guard
    except BaseException as error:
        try:
            guard.restore()
        except GlobalStateLeak as leak:
            if hasattr(error, "add_note"):
                error.add_note(f"autopipe.global_state: {leak}")
        raise
    guard.restore()
