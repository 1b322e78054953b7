"""What tracing leaves as it found it: tracing runs the forward, which may assign attributes, write buffers or install
hooks (Note [state the forward assigns], Note [hooks installed in the forward]); each guard here puts one kind of
state back."""
from __future__ import annotations

import contextlib
import itertools
import threading

import torch
import torch.fx as fx

from .diagnostics import ModuleCastRefused, model_line


@contextlib.contextmanager
def buffers_kept(module: torch.nn.Module):
    """Puts back every buffer that tracing wrote (fx and export run some ops on real tensors for real)."""
    saved = [(b, b._version, b.clone()) for b in module.buffers() if b.device.type != "meta" and not b.is_inference()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, version, value in saved:
                if buffer._version != version:
                    buffer.copy_(value)


_MODULE_TABLES = ("_parameters", "_buffers", "_modules")


def module_state(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module, dict, list[dict]]]:
    return [(name, m, dict(vars(m)), [dict(getattr(m, t)) for t in _MODULE_TABLES])
            for name, m in model.named_modules()]


def assigned_since(state: list[tuple[str, torch.nn.Module, dict, list[dict]]]) -> set[str]:
    """The module attributes and tables' entries holding another tensor (or fx Proxy) than in ``state``:
    ``inner.steps``."""
    found = set()
    for owner, m, attributes, tables in state:
        before = attributes | {k: v for table in tables for k, v in table.items()}
        now = vars(m) | {k: v for t in _MODULE_TABLES for k, v in getattr(m, t).items()}
        found.update(f"{owner}.{k}" if owner else k for k, v in now.items() if v is not before.get(k)
                     and isinstance(v, (torch.Tensor, fx.Proxy)))
    return found


# Note [hooks installed in the forward]: a library may install hooks inside the forward on its first call and mark
# that in a model attribute (transformers 5 recording hidden_states). Tracing puts the attribute back, so it must
# also take those hooks off after every trace attempt: else a failed fx attempt's hooks stay while the mark is
# gone, and the export attempt installs them a second time (more hidden states recorded than the model has).
@contextlib.contextmanager
def hooks_kept(model: torch.nn.Module):
    """Every module's hook tables, and torch's global module hooks, put back as tracing found them: each trace starts
    from the model as the user left it, as its first call would (Note [hooks installed in the forward])."""
    tables = [table for m in model.modules() for name, table in vars(m).items() if "hooks" in name
              and isinstance(table, dict)]
    tables += [t for name, t in vars(torch.nn.modules.module).items() if name.startswith("_global_")
               and isinstance(t, dict)]
    saved = [(table, dict(table)) for table in tables]
    try:
        yield
    finally:
        for table, entries in saved:
            if table.keys() != entries.keys():
                table.clear()
                table.update(entries)


# Note [state the forward assigns]: tracing runs the forward, and an assignment in it (self.last = x,
# self.steps = self.steps + 1) would change the user's model: fx leaves a Proxy or a trace-time constant there,
# and non-strict export puts buffers back but leaves a FakeTensor in a new plain attribute. So every run of the
# forward puts back every module's attributes and tables. flat_root names what the forward assigned as it returns:
# export restores attributes before it returns, so a later look misses them. fx refuses an assignment, export
# computes with it, and compile warns that the model keeps its old value.
@contextlib.contextmanager
def module_state_kept(model: torch.nn.Module):
    """Every module's attributes and parameter, buffer and submodule tables put back as tracing found them (Note [state
    the forward assigns]; flat_root's call names the assignments)."""
    state = module_state(model)
    try:
        yield
    finally:
        for _, m, attributes, tables in state:
            vars(m).clear()
            vars(m).update(attributes)
            for t, table in zip(_MODULE_TABLES, tables):
                getattr(m, t).clear()
                getattr(m, t).update(table)


@contextlib.contextmanager
def scalar_buffers_kept(module: torch.nn.Module, every_buffer: bool = False):
    """Puts back the module's 0-dim buffers (all, if asked): FakeTensorMode runs ops on real 0-dim CPU tensors for
    real, bumping BatchNorm's ``num_batches_tracked``. BatchNorm(momentum=None) runs with momentum 0.1 meanwhile: it
    averages by 1 / num_batches_tracked, which a fake tensor cannot give, and no shape depends on it."""
    saved = [(b, b.clone()) for b in module.buffers() if (every_buffer or b.dim() == 0) and b.device.type != "meta"]
    norms = [m for m in module.modules() if isinstance(m, torch.nn.modules.batchnorm._NormBase) and m.momentum is None]
    for m in norms:
        m.momentum = 0.1
    try:
        yield
    finally:
        for m in norms:
            m.momentum = None
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


_CASTS_CHECKED = threading.RLock()  # one patch of torch.nn.Module._apply at a time


@contextlib.contextmanager
def module_casts_checked(model: torch.nn.Module):
    """While tracing: a forward's cast or move of a module of the model (``self.sub = self.sub.to(x.dtype)``,
    ``.float()``, ``.half()``, ``.type()``, ``.cuda()``, ``.cpu()``: each is ``Module._apply``) that gives every
    parameter and buffer back as it is, the plain model's no-op, is one here too, on both routes: export's fake
    parameters would be swapped ("Couldn't swap Linear.weight"). One that would change a parameter or buffer is
    ModuleCastRefused, naming the module and the line: a graph cannot change the model's tensors, and fx would change
    them for real. Calls from other threads, on other modules or not from the model's code run as they are."""
    modules = {id(m): name for name, m in model.named_modules()}
    tracer_thread = threading.get_ident()
    with _CASTS_CHECKED:
        apply = torch.nn.Module._apply

        def checked(module: torch.nn.Module, fn, recurse: bool = True):
            where = model_line() if threading.get_ident() == tracer_thread and id(module) in modules else ""
            if not where:
                return apply(module, fn, recurse)
            for name, t in itertools.chain(module.named_parameters(recurse=recurse),
                                           module.named_buffers(recurse=recurse)):
                applied = fn(t)  # not under no_grad as _apply: fx would take it for the forward's grad switch
                if applied is not t:
                    raise ModuleCastRefused(_cast_refused(modules[id(module)] or type(model).__name__, name, where,
                                                          t, applied))
            return module

        torch.nn.Module._apply = checked
        try:
            yield
        finally:
            torch.nn.Module._apply = apply


def _cast_refused(path: str, name: str, where: str, before: torch.Tensor, after: torch.Tensor) -> str:
    changes = [f"{k} {getattr(before, k)} to {getattr(after, k)}" for k in ("dtype", "device")
               if getattr(before, k) != getattr(after, k)] or ["layout (a copy)"]
    return (f"the forward casts {path!r} ({where}), changing {name}'s {' and '.join(changes)}, which a graph cannot "
            f"do. Cast it so before compiling; see docs/faithfulness.md")
