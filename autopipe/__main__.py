"""The command line: ``python -m autopipe plan|verify FILE.py:FACTORY ...``; ``--help`` explains each command."""
from __future__ import annotations

import argparse
import ast
import contextlib
import importlib.machinery
import importlib.util
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, NoReturn, Sequence

PLAN_EXAMPLE = """\
example:
  python -m autopipe plan models.py:gpt --factory-arg layers=48 --input-shape 8,1024 --input-dtype long \\
      --devices 8 --chunks 32 --out stages/
  python -m autopipe plan hf.py:build --kwarg-shape input_ids=8,128 --kwarg-dtype input_ids=long --balance params
"""
VERIFY_EXAMPLE = """\
example (a small config: it runs for real, several times):
  python -m autopipe verify models.py:gpt --factory-arg layers=2 --input-shape 8,32 --input-dtype long --mode eval

exit status: 0 PASS, 1 FAIL (or the model could not be built or run), 2 bad arguments
"""


class UsageError(argparse.ArgumentTypeError):
    """Bad input from the command line: one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block: "--flag VALUE: what is wrong"
        message = re.sub(r"^argument (\S+): ", r"\1 ", message)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def require(ok: Any, message: str) -> None:
    if not ok:
        raise UsageError(message)


def parse_shape(text: str) -> tuple[int, ...]:
    dims = text.strip().strip("()[]").strip().rstrip(",").split(",")
    require(all(d.strip().isdigit() and int(d) > 0 for d in dims),
            f"{text!r} is not a shape: give positive integers separated by commas, e.g. 8,3,224,224")
    return tuple(int(d) for d in dims)


def parse_dtype(text: str):
    import torch
    name = text.strip().lower()
    dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}.get(name, name), None)
    require(isinstance(dtype, torch.dtype), f"{text!r} is not a torch dtype: use e.g. float32, bfloat16, long, bool")
    return dtype


def parse_literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word is a string


def named(parse_value):
    """A NAME=VALUE argument, as (NAME, parse_value(VALUE))."""
    def parse(item: str) -> tuple[str, Any]:
        name, sep, value = (part.strip() for part in item.partition("="))
        require(sep and name and value, f"{item!r}: expected NAME=VALUE")
        return name, parse_value(value)
    return parse


def parse_bytes(text: str) -> float:
    m = re.fullmatch(r"\s*(\d+\.?\d*(?:e[+-]?\d+)?)\s*([kmgt]?)(i?)b?\s*", text, re.IGNORECASE)
    require(m, f"{text!r}: expected a size such as 16GiB, 512MiB or 8e9")
    return float(m[1]) * (1024 if m[3] else 1000) ** " kmgt".find(m[2].lower())


def parse_balance(text: str) -> str | list[float]:
    if text in ("flops", "params", "time"):
        return text
    shares = [float(s) for s in text.split(",") if re.fullmatch(r"\s*\d*\.?\d+\s*", s)]
    require(len(shares) == text.count(",") + 1 and min(shares) > 0,
            f"{text!r}: use flops, params, time, or per-stage shares such as 1,2,2,1")
    return shares


def parse_devices(text: str) -> int | list[str]:
    """``N`` (stages to plan, CPU workers to verify on) or a comma-separated list of devices, checked."""
    from autopipe.compile import resolve_devices
    if text.strip().isdigit():
        require(int(text) > 0, f"{text}: at least 1")
        return int(text)
    try:
        return [str(d) for d in resolve_devices([d.strip() for d in text.split(",") if d.strip()])]
    except (ValueError, TypeError) as e:
        raise UsageError(f"{text!r}: {e}") from None


def load_factory(spec: str):
    """``path/to/file.py:name`` or ``package.module:name`` -> (the callable, its module)."""
    source, _, name = spec.rpartition(":")
    require(source and name, f"{spec!r}: expected FILE.py:FACTORY, e.g. models.py:build_model")
    path = Path(source)
    is_file = source.endswith(".py") or os.sep in source or path.exists()
    require(path.is_file() or not is_file, f"no such file: {source}")
    try:
        if not is_file:
            module = importlib.import_module(source)
        else:
            sys.path.insert(0, str(path.resolve().parent))  # so the file can import its neighbours
            loader = importlib.machinery.SourceFileLoader("_autopipe_user_" + re.sub(r"\W", "_", path.stem), str(path))
            module = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
            sys.modules[loader.name] = module
            loader.exec_module(module)
    except Exception as e:
        raise UsageError(f"importing {source} failed: {_brief(e)}") from e
    factory = getattr(module, name, None)
    defined = sorted(k for k, v in vars(module).items()
                     if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__)
    hint = f" (it defines: {', '.join(defined)})" if defined else ""
    require(factory is not None, f"{source} has no {name!r}{hint}")
    kind = type(factory).__name__
    require(callable(factory), f"{source}:{name} is a {kind}, not a function or class that builds a model")
    return factory, module


def run(ns: argparse.Namespace) -> int:
    """plan or verify, once every argument is checked."""
    import torch
    from autopipe.compile import Options, plan_devices, run_passes
    from autopipe.verify import verify
    dtypes, kw_shapes, kw_dtypes = ns.input_dtype or [torch.float32], dict(ns.kwarg_shape), dict(ns.kwarg_dtype)
    require(len(dtypes) in (1, len(ns.input_shape)), f"{len(dtypes)} --input-dtype for {len(ns.input_shape)} "
            f"--input-shape: give one dtype for all, or one per input")
    unknown = sorted(set(kw_dtypes) - set(kw_shapes))
    require(not unknown, f"--kwarg-dtype for {', '.join(unknown)} without a --kwarg-shape")
    require(ns.input_shape or kw_shapes,
            "give the example input's shape: --input-shape 8,3,224,224 (or --kwarg-shape name=8,128)")
    require(ns.chunks > 0, f"--chunks {ns.chunks}: at least 1")
    require(ns.int_high >= 0, f"--int-high {ns.int_high}: 0 (zeros) or more")
    require(ns.balance != "time" or not ns.meta, "--balance time runs the model to time it: add --no-meta")
    factory, module = load_factory(ns.factory)
    leaf_modules = [obj if isinstance(obj := getattr(module, leaf, None), type) else leaf for leaf in ns.leaf_module]
    torch.manual_seed(ns.seed)
    call = f"{getattr(factory, '__name__', factory)}({', '.join(f'{k}={v!r}' for k, v in ns.factory_arg)})"
    t0 = time.perf_counter()
    try:
        with torch.device("meta") if ns.meta else contextlib.nullcontext():
            model = factory(**dict(ns.factory_arg))
    except Exception as e:
        raise UsageError(f"{call} raised {_brief(e)}") from e
    require(isinstance(model, torch.nn.Module), f"{call} returned a {type(model).__name__}, not an nn.Module")
    print(f"autopipe: built {type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:,.1f} M "
          f"parameters) {'on meta' if ns.meta else 'on cpu'} in {time.perf_counter() - t0:.3f} s", file=sys.stderr)
    if ns.mode != "as-built":
        model.train(ns.mode == "train")

    def tensor(shape, dtype):
        if ns.meta:
            return torch.empty(shape, dtype=dtype, device="meta")
        if dtype.is_floating_point or dtype.is_complex:
            return torch.randn(shape, dtype=dtype)
        if ns.int_high > 0 and dtype != torch.bool:
            return torch.randint(0, ns.int_high, shape, dtype=dtype)
        return torch.zeros(shape, dtype=dtype)  # token ids 0 index every embedding
    args = tuple(tensor(s, dtypes[i % len(dtypes)]) for i, s in enumerate(ns.input_shape))
    kwargs = {k: tensor(s, kw_dtypes.get(k, torch.float32)) for k, s in kw_shapes.items()}
    t0 = time.perf_counter()
    try:
        if ns.command == "plan":
            options = Options.make(plan_devices(ns.devices), chunks=ns.chunks, balance=ns.balance, route=ns.route,
                                   leaf_modules=leaf_modules, tolerance=ns.tolerance, memory_cap=ns.memory_cap,
                                   verbose=True)
            compiled = run_passes(model, args, kwargs, options, generate=ns.out is not None)
            print(compiled.plan)
            for stage in compiled.stages if ns.out is not None else ():
                print(f"wrote {stage.save(ns.out)}")
            return 0
        report = verify(model, args, kwargs, devices=ns.devices, chunks=ns.chunks, checkpoint=ns.checkpoint,
                        balance=ns.balance, leaf_modules=leaf_modules, route=ns.route)
    except Exception as e:
        floats = any(t.is_floating_point() for t in (*args, *kwargs.values()))
        if floats and re.search(r"\b(Long|Int|integer|indices)\b", str(e)):
            e.add_note("hint: are some inputs token ids? pass --input-dtype long (or --kwarg-dtype NAME=long)")
        raise
    print(report)
    print(f"autopipe: verified in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0 if report.passed else 1


MANY = dict(action="append", default=[])  # a repeatable argument
ARGUMENTS = {  # command: [(flag, add_argument keywords)], for "plan verify": both
    "plan verify": [
        ("factory", dict(metavar="FILE.py:FACTORY", help="a Python file (or package.module) and its function or class "
                         "that returns the nn.Module")),
        ("--input-shape", dict(MANY, type=parse_shape, metavar="8,3,224,224",
                               help="shape of a positional example input (repeatable); dim 0 is the batch")),
        ("--input-dtype", dict(MANY, type=parse_dtype, metavar="DTYPE", help="dtype of the positional inputs: one for "
                               "all, or one per --input-shape (default float32; long for token ids)")),
        ("--kwarg-shape", dict(MANY, type=named(parse_shape), metavar="NAME=8,128", help="shape of a keyword input")),
        ("--kwarg-dtype", dict(MANY, type=named(parse_dtype), metavar="NAME=DTYPE", help="its dtype (float32)")),
        ("--factory-arg", dict(MANY, type=named(parse_literal), metavar="KEY=VALUE",
                               help="keyword argument for the factory, a Python literal (layers=48)")),
        ("--devices", dict(type=parse_devices, metavar="N|DEV,DEV,...", help="N stages (plan) or CPU workers "
                           "(verify), default %(default)s; or a device list such as cpu,cpu,cpu")),
        ("--chunks", dict(type=int, help="micro-batches per mini-batch, GPipe's M (default %(default)s)")),
        ("--balance", dict(type=parse_balance, default="flops", metavar="flops|params|time|W,W,...", help="what the "
                           "partitioner balances: FLOPs (default), parameters, measured time or per-stage shares")),
        ("--leaf-module", dict(MANY, metavar="NAME", help="keep a module whole when tracing: a class defined in the "
                               "file, or a qualified name (blocks.0); repeatable")),
        ("--route", dict(choices=("auto", "fx", "export"), default="auto", help="tracer: fx, then export (auto)")),
        ("--traceback", dict(action="store_true", help="on an error, show the full Python traceback")),
    ],
    "plan": [
        ("--memory-cap", dict(type=parse_bytes, metavar="BYTES", help="memory per device (16GiB, 512MiB, 8e9): "
                              "weights, gradients, optimizer state and activations of every stage must fit")),
        ("--tolerance", dict(type=float, default=0.03, help="plans within this fraction of the best bottleneck "
                             "compete on fewest tensors crossing")),
        ("--out", dict(metavar="DIR", help="write the generated stage_<i>.py files here")),
        ("--meta", dict(action=argparse.BooleanOptionalAction, default=True, help="build the model and inputs on the "
                        "meta device (default; no memory); --no-meta builds them for real on the CPU")),
    ],
    "verify": [
        ("--checkpoint", dict(choices=("except_last", "always", "never"), default="except_last",
                              help="the re-materialisation mode under test (default except_last)")),
        ("--mode", dict(choices=("as-built", "train", "eval"), default="as-built", help="the model's mode for the "
                        "step: as the factory returns it (default; a new nn.Module trains), train, or eval")),
        ("--seed", dict(type=int, default=0, help="torch.manual_seed before building the model and inputs")),
        ("--int-high", dict(type=int, default=0, metavar="N",
                            help="integer inputs (token ids) drawn uniformly from [0, N); default 0: all zeros")),
    ],
}
COMMANDS = {  # command: (help, epilog, defaults, including those of flags only the other command has)
    "plan": ("plan a model from a Python file on the meta device (no memory, no devices): print where the cuts go\n"
             "and, with --out, write each stage's code; each pass's seconds go to stderr", PLAN_EXAMPLE,
             dict(devices="8", chunks=8, seed=0, int_high=0, mode="as-built")),
    "verify": ("check that the pipeline computes the model: one training step against the plain model, in float64\n"
               "(tolerance 1e-10) and, re-materialised, bit for bit; a per-parameter table and a verdict",
               VERIFY_EXAMPLE, dict(devices="2", chunks=4, meta=False)),
}


def build_parser() -> argparse.ArgumentParser:
    from autopipe import __version__
    raw = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog="autopipe", formatter_class=raw, epilog=PLAN_EXAMPLE,
                     description="autopipe: compile an unmodified PyTorch model into a GPipe pipeline.")
    parser.add_argument("--version", action="version", version=f"autopipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    for command, (text, epilog, defaults) in COMMANDS.items():
        p = sub.add_parser(command, formatter_class=raw, help=text, description=text, epilog=epilog)
        for flag, keywords in ARGUMENTS["plan verify"] + ARGUMENTS[command]:
            p.add_argument(flag, **keywords)
        p.set_defaults(**defaults)
    return parser


def _brief(e: BaseException) -> str:
    return f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0]


def _describe(e: BaseException) -> str:
    """autopipe's own errors are written to be read whole; others by their first line and the graph node."""
    from autopipe.passes.trace import TraceError
    if type(e).__module__.startswith("autopipe") and isinstance(e, (TraceError, ValueError)):
        message = f"{type(e).__name__}: {str(e).strip()}"
    else:
        where = [ln.strip() for ln in str(e).splitlines() if ln.strip().startswith("While executing")]
        message = _brief(e) + (f" ({where[0][0].lower()}{where[0][1:]})" if where else "")
    return message + "".join(f"\n{n}" for n in getattr(e, "__notes__", []) if n.startswith("hint:"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return run(ns)
    except KeyboardInterrupt:
        print(f"autopipe {ns.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if ns.traceback:
            raise
        usage = isinstance(e, UsageError)
        print(f"autopipe {ns.command}: error: {e if usage else _describe(e)}"
              + ("" if usage else "\n(run with --traceback for the full Python traceback)"), file=sys.stderr)
        return 2 if usage else 1


if __name__ == "__main__":
    sys.exit(main())
