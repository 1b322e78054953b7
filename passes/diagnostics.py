"""What a failed trace says, and where: the trace errors, and a node's or an error's place in the user's code (module
path, file and line), which every pass's messages name."""
from __future__ import annotations

import functools
import linecache
import logging
import os
import re
import sys
import traceback
from typing import Any, Iterator, Sequence

import torch
import torch.fx as fx


class TraceError(RuntimeError):
    """Neither fx nor torch.export could capture the model, or trace refuses what it would capture."""


class ModuleCastRefused(TraceError):
    """The forward casts or moves a module of the model in a way that changes a parameter or buffer
    (model_state.module_casts_checked): refused on every route, none of which tries the next."""


class BatchSpecialised(TraceError):
    """The model's Python fixes or bounds the batch size, so no graph runs every micro-batch size: trace it again
    with ``static_batch=<rows>`` once per micro-batch size. ``errors`` holds each route's ``(route, exception)``."""

    def __init__(self, message: str, errors: list[tuple[str, BaseException]], batch_size: int):
        super().__init__(message)
        self.errors = errors
        self.batch_size = batch_size


def listed(names: Sequence[str], most: int = 4) -> str:
    return ", ".join(names[:most]) + (f" (+{len(names) - most} more)" if len(names) > most else "")


def node_where(node: fx.Node) -> str:
    """The node's module path and the user's source line (its innermost frame outside torch), where traced."""
    stack = node.meta.get("nn_module_stack")
    path = list(stack.values())[-1][0] if stack else (node.target if node.op == "call_module" else "")
    parts = [f"node {node.name}"] + ([f"module {path}"] if path else [])
    # a frame is 'File "f.py", line 3, in forward' then, unless the file could not be read, its code
    frames = re.findall(r'File "(.+)", line (\d+), in .*(?:\n(?!\s*File )\s*(.*))?', node.meta.get("stack_trace") or "")
    frames = [f for f in frames if not f[0].startswith(os.path.dirname(torch.__file__))] or frames
    if frames:
        file, line, code = frames[-1]
        parts.append(f"{file}:{line}: {code.strip()}" if code.strip() else f"{file}:{line}")
    return ", ".join(parts)


def source_of(node: fx.Node | None) -> str:
    frame = (node.meta.get("stack_trace") or "").strip().splitlines()[-2:] if node is not None else []
    return f"; at {' '.join(f.strip() for f in frame)}" if frame else ""


def specialises_batch(error: BaseException | None) -> bool:
    """Did torch.export fail because the model's Python fixed (or bounded) the dynamic batch? By the error's type
    (torch/_dynamo/exc.py, symbolic_shapes.py), or by torch's message where a version wraps them otherwise."""
    from torch._dynamo.exc import UserErrorType
    from torch.fx.experimental.symbolic_shapes import ConstraintViolationError

    violation = UserErrorType.CONSTRAINT_VIOLATION
    return any(isinstance(e, ConstraintViolationError) or getattr(e, "error_type", None) is violation
               or "Constraints violated" in first_line(e) and "batch" in str(e) for e in causes(error))


def causes(error: BaseException | None) -> Iterator[BaseException]:
    """``error`` and the exceptions it was raised from or while handling, innermost last."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def explain_failures(model: torch.nn.Module, errors: list[tuple[str, BaseException]],
                     batch_size: int | None = None) -> str:
    lines = [f"autopipe could not trace {type(model).__name__}:"]
    lines += [f"  - {route}: {type(e).__name__}: {first_line(e)}{user_frame(e, model)}" for route, e in errors]
    if batch_size is not None:
        lines.append(f"The model's Python treats the batch size ({batch_size}) as a constant, so no graph runs every "
                     f"micro-batch size. It can still be pipelined with equal micro-batches: trace(..., "
                     f"static_batch=<rows per micro-batch>) exports it at that size with no dynamic dimension. Or make "
                     f"the code batch-generic (x.shape[0] rather than len(x) or an int, expand(x.shape[0]) rather than "
                     f"repeat(n, ...)).")
    else:
        lines.append("What to try: make data-dependent Python control flow tensor-free (torch.where, torch.cond), "
                     "keep untraceable submodules whole with compile(..., leaf_modules=[TheirClass]) (fx route), "
                     "or pass the non-tensor arguments that steer control flow as plain Python values.")
    return "\n".join(lines)


def first_line(error: BaseException) -> str:
    return str(error).strip().partition("\n")[0] or repr(error)


def user_frame(error: BaseException | None, model: torch.nn.Module) -> str:
    """" in module 'path' (file:line in function: code)" for the innermost frame of ``error`` in the model's own code,
    or ""; with ``error`` None, of the stack now (export deciding a branch)."""
    if (found := _innermost_model_frame(error)) is None:
        return ""
    frame, line = found
    code = frame.f_code
    owner = frame.f_locals.get(code.co_varnames[0]) if code.co_argcount else None
    path = {id(m): name for name, m in model.named_modules()}.get(id(owner))
    where = f" in module {path or type(model).__name__!r}" if path is not None else ""
    source = linecache.getline(code.co_filename, line).strip()
    return f"{where} ({code.co_filename}:{line} in {code.co_name}: {source})"


def model_line() -> str:
    """"file:line: code" of the innermost frame of the user's code in the stack now, or ""."""
    if (found := _innermost_model_frame(None)) is None:
        return ""
    frame, line = found
    return f"{frame.f_code.co_filename}:{line}: {linecache.getline(frame.f_code.co_filename, line).strip()}"


def _innermost_model_frame(error: BaseException | None) -> tuple[Any, int] | None:
    """(frame, line) of the innermost frame of the user's code in ``error``'s traceback (None: the stack now)."""
    if error is not None:
        frames = [(frame, line) for frame, line in traceback.walk_tb(error.__traceback__)
                  if in_model_code(frame.f_code.co_filename)]
        return frames[-1] if frames else None
    frame = sys._getframe(1)
    while frame is not None and not in_model_code(frame.f_code.co_filename):
        frame = frame.f_back
    return (frame, frame.f_lineno) if frame is not None else None


def in_model_code(filename: str) -> bool:
    """Is ``filename`` the user's code (a model's, a library's), not torch's, autopipe's, logging's (export_route's
    filter), nor code that trace, fx or export generate?"""
    return not filename.startswith(_not_model_code())


@functools.cache
def _not_model_code() -> tuple[str, ...]:
    autopipe = sys.modules.get("autopipe")  # the passes are autopipe.passes, which an editable install keeps apart
    folders = (os.path.dirname(torch.__file__), os.path.dirname(__file__), os.path.dirname(logging.__file__),
               *([os.path.dirname(autopipe.__file__)] if getattr(autopipe, "__file__", None) else []))
    return (*(folder + os.sep for folder in folders), "<string>", "<eval_with_key")
