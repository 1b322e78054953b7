"""What a failed pass says, and where: the compile and trace errors, a node's or an error's place in the user's code
(module path, file and line), which every pass's messages name, and ``failures_named``, which makes any exception that
escapes a pass autopipe's."""
from __future__ import annotations

import contextlib
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


class CompileError(RuntimeError):
    """A compiler pass failed on the model: the message names the pass, the model's line where known, and what to try;
    the exception raised there is the ``__cause__``."""

    def __init__(self, message: str, pass_name: str = ""):
        super().__init__(message)
        self.pass_name = pass_name


class TraceError(CompileError):
    """The trace pass could not capture the model (neither fx nor torch.export), or refuses what it would capture."""

    def __init__(self, message: str, pass_name: str = "trace"):
        super().__init__(message, pass_name)


class ModuleCastRefused(TraceError):
    """The forward casts or moves a module of the model in a way that changes a parameter or buffer
    (model_state.module_casts_checked): refused on every route, none of which tries the next."""


class BatchSpecialised(TraceError):
    """The model's Python fixes or bounds the batch size, so no graph runs every micro-batch size: trace it again
    with ``static_batch=<rows>`` once per micro-batch size (Note [batch-specialised models]). ``errors`` holds each
    route's ``(route, exception)``."""

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
    frames = [f for f in frames if in_model_code(f[0])] or frames
    if frames:
        file, line, code = frames[-1]
        parts.append(f"{shown(file)}:{line}: {code.strip()}" if code.strip() else f"{shown(file)}:{line}")
    return ", ".join(parts)


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
    lines += [f"  - {route}: {type(e).__name__}: {first_line(e)}{_located(e, model)}" for route, e in errors]
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


def _located(error: BaseException, model: torch.nn.Module) -> str:
    """Where in the model ``error`` was raised: the model's frame in its traceback, else the node a graph raised it
    at."""
    if where := user_frame(error, model):
        return where
    return f" (at {node_where(node)})" if (node := raised_at(error)) is not None else ""


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
    return f"{where} ({shown(code.co_filename)}:{line} in {code.co_name}: {source})"


def model_line() -> str:
    """"file:line: code" of the innermost frame of the user's code in the stack now, or ""."""
    if (found := _innermost_model_frame(None)) is None:
        return ""
    frame, line = found
    return f"{shown(frame.f_code.co_filename)}:{line}: {linecache.getline(frame.f_code.co_filename, line).strip()}"


def model_frame() -> str:
    """The innermost frame of the user's code in the stack now as a stack trace of that frame (node.stack_trace, which
    node_where reads): torch's recorded stack traces summarise every frame, for every node."""
    if (found := _innermost_model_frame(None)) is None:
        return ""
    frame, line = found
    file = frame.f_code.co_filename
    return f'File "{file}", line {line}, in {frame.f_code.co_name}\n    {linecache.getline(file, line).strip()}'


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


def shown(filename: str) -> str:
    """``filename`` as messages name it: relative to the working directory or to the folder on sys.path it is
    imported from (site-packages: ``transformers/models/...``), whichever is shorter; as it is where neither holds."""
    folders = [os.getcwd(), *(p for p in sys.path if p and os.path.isabs(p))]
    relative = [filename[len(f) + 1:] for f in folders if filename.startswith(f.rstrip(os.sep) + os.sep)]
    return min(relative, key=len, default=filename)


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


# Note [the node an error was raised at]: an fx Interpreter's error says "While executing %name" in its text alone;
# autopipe's interpreters (trace.MutableArguments) keep the node on the exception, for failures_named to name the
# model's line (node_where) of an error raised while a graph runs.
_FAILED_AT = "_autopipe_failed_at"


def failed_at(error: BaseException, node: fx.Node) -> None:
    """Keeps ``node`` on ``error`` as where it was raised (Note [the node an error was raised at]); the innermost
    node where graphs nest."""
    if getattr(error, _FAILED_AT, None) is None:
        with contextlib.suppress(AttributeError):  # an exception type without a __dict__
            setattr(error, _FAILED_AT, node)


def raised_at(error: BaseException) -> fx.Node | None:
    """The graph node ``error`` (or an error it was raised from) was raised at, where an autopipe interpreter ran it."""
    return next((node for e in causes(error) if (node := getattr(e, _FAILED_AT, None)) is not None), None)


def where_in_model(error: BaseException, model: torch.nn.Module | None) -> tuple[str, str]:
    """(where, module path): " at node n, module m, file:line: code" for the node a graph raised ``error`` at, else
    " in module m (file:line ...)" for the innermost frame of the model's code in its traceback; ("", "") if neither."""
    if (node := raised_at(error)) is not None:
        stack = node.meta.get("nn_module_stack")
        return f" at {node_where(node)}", list(stack.values())[-1][0] if stack else ""
    for e in causes(error):
        if model is not None and (frame := user_frame(e, model)):
            return frame, (re.match(r" in module '([^']*)'", frame) or [None, ""])[1]
    return "", ""


# Errors a user must see as they are: no wrapping makes them clearer (a warning made an error by -W error included)
PASSED_AS_THEY_ARE = (MemoryError, torch.OutOfMemoryError, Warning)


def raised_by_autopipe(error: BaseException) -> bool:
    """One of autopipe's own named errors: of a class autopipe defines, or raised by a ``raise`` in autopipe's code
    (ValueError for a bad option); not torch's nor the model's, nor an autopipe bug."""
    if type(error).__module__.split(".")[0] == "autopipe":
        return True
    frames = list(traceback.walk_tb(error.__traceback__))
    if not frames:
        return False
    frame, line = frames[-1]
    file = frame.f_code.co_filename
    return not in_model_code(file) and not file.startswith(os.path.dirname(torch.__file__) + os.sep) \
        and linecache.getline(file, line).lstrip().startswith("raise ")


@contextlib.contextmanager
def failures_named(pass_name: str, model: torch.nn.Module | None = None) -> Iterator[None]:
    """Any exception escaping the pass leaves it as autopipe's: a CompileError (TraceError in the trace pass) naming
    the pass, the model's line and what to try, the exception chained; autopipe's own named errors and
    PASSED_AS_THEY_ARE pass unchanged (docs/faithfulness.md, "Errors named before anything runs")."""
    try:
        yield
    except Exception as e:
        if isinstance(e, PASSED_AS_THEY_ARE) or raised_by_autopipe(e):
            raise
        where, module = where_in_model(e, model)
        where = where.strip() or "no line of the model found"
        said = re.sub(r"^\S+\.(?:cpp|h|cu):\d+: ", "", first_line(e))  # torch's C++ file and line, no help here
        said = said if len(said) <= 160 else said[:159] + "…"
        keep = f"leaf_modules=[{module!r}] (keeps it whole), " if module else ""
        error = TraceError if pass_name == "trace" else CompileError
        raise error(f"autopipe's {pass_name} pass failed: {type(e).__name__}: {said} ({where}). Try {keep}"
                    f"route='export', chunks=1, or example inputs of the sizes training uses; see docs/faithfulness.md",
                    pass_name) from e
