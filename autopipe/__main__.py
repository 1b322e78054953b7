"""The autopipe command line: plan a model from a Python file without memory or devices; verify it.

    python -m autopipe plan models.py:build_gpt --input-shape 8,1024 --input-dtype long --devices 8 --chunks 32 \\
        --out stages/
    python -m autopipe verify models.py:build_gpt --input-shape 8,32 --input-dtype long --devices 2 --chunks 4

``plan`` loads the factory from the file, builds the model under
``torch.device("meta")`` (no memory, however large the model), makes example
inputs of the given shapes on meta, runs the compiler passes (trace, cost,
partition; codegen with ``--out``), prints the plan and writes one readable
``stage_<i>.py`` per stage. Each pass's time goes to stderr.

``verify`` builds the model with real weights on the CPU (use a small config),
runs ``autopipe.verify`` on it -- one training step through the pipeline
against the plain model, in float64 and in the model's own dtype -- prints the
report, and exits 0 on PASS, 1 on FAIL (2 on a usage error).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, NoReturn, Sequence

EXAMPLE = """\
example:
  # models.py defines  def gpt(): return GPT(layers=48, d=1024)
  python -m autopipe plan models.py:gpt --input-shape 8,1024 --input-dtype long \\
      --devices 8 --chunks 32 --out stages/

  # a torchvision-style CNN with keyword arguments to the factory, planned by parameters
  python -m autopipe plan nets.py:resnet --factory-arg depth=50 --input-shape 32,3,224,224 \\
      --devices 4 --balance params

  # a model with keyword inputs (Hugging Face style)
  python -m autopipe plan hf.py:build --kwarg-shape input_ids=8,128 --kwarg-dtype input_ids=long \\
      --kwarg-shape attention_mask=8,128 --kwarg-dtype attention_mask=long --devices 4
"""

VERIFY_EXAMPLE = """\
example:
  # does the pipeline compute my model? (a small config: it runs for real, several times)
  python -m autopipe verify models.py:gpt --factory-arg layers=2 --input-shape 8,32 --input-dtype long \\
      --devices 2 --chunks 4

  # in training mode (dropout, BatchNorm per micro-batch), every micro-batch re-materialised
  python -m autopipe verify nets.py:resnet --input-shape 8,3,32,32 --mode train --checkpoint always

exit status: 0 PASS, 1 FAIL (or the model could not be built or run), 2 bad arguments
"""

_DTYPE_ALIASES = {"long": "int64", "int": "int32", "float": "float32", "double": "float64", "half": "float16",
                  "bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


class UsageError(Exception):
    """Bad input from the command line: one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# -- parsing helpers -------------------------------------------------------------

def parse_shape(text: str, what: str) -> tuple[int, ...]:
    parts = [p.strip() for p in text.strip().strip("()[]").split(",")]
    if parts and parts[-1] == "":  # a trailing comma, as in a Python tuple
        parts.pop()
    try:
        shape = tuple(int(p) for p in parts)
    except ValueError:
        shape = ()
    if not shape or any(s <= 0 for s in shape):
        raise UsageError(f"{what} {text!r} is not a shape: give positive integers separated by commas, "
                         f"e.g. 8,3,224,224")
    return shape


def parse_dtype(text: str, what: str):
    import torch
    name = _DTYPE_ALIASES.get(text.strip().lower(), text.strip().lower())
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise UsageError(f"{what} {text!r} is not a torch dtype: use e.g. float32, bfloat16, long, int32, bool")
    return dtype


def parse_named(items: Sequence[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.strip() or not value.strip():
            raise UsageError(f"{what} {item!r}: expected NAME=VALUE")
        out[name.strip()] = value.strip()
    return out


def parse_bytes(text: str) -> float:
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([kKmMgGtT]?)(i?)[bB]?\s*", text)
    if not m:
        raise UsageError(f"--memory-cap {text!r}: expected a size such as 16GiB, 512MiB or 8e9")
    try:
        value = float(m.group(1))
    except ValueError:
        raise UsageError(f"--memory-cap {text!r}: expected a size such as 16GiB, 512MiB or 8e9") from None
    power = "kmgt".find(m.group(2).lower()) + 1 if m.group(2) else 0
    return value * (1024 if m.group(3) else 1000) ** power


def parse_literal(text: str) -> Any:
    import ast
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word is a string


def parse_balance(text: str):
    if text in ("flops", "params", "time"):
        return text
    try:
        shares = [float(s) for s in text.split(",")]
    except ValueError:
        shares = []
    if not shares or any(s <= 0 for s in shares):
        raise UsageError(f"--balance {text!r}: use flops, params, time, or per-stage shares such as 1,2,2,1")
    return shares


# -- loading the model -------------------------------------------------------------

def check_factory_spec(spec: str) -> tuple[str, str, bool]:
    """``path/to/file.py:name`` or ``package.module:name`` -> (source, name, is_file), checked before anything runs."""
    source, sep, name = spec.rpartition(":")
    if not sep or not source or not name:
        raise UsageError(f"{spec!r}: expected FILE.py:FACTORY, e.g. models.py:build_model")
    is_file = source.endswith(".py") or os.sep in source or Path(source).exists()
    if is_file and not Path(source).is_file():
        raise UsageError(f"no such file: {source}")
    return source, name, is_file


def load_factory(spec: str):
    """``path/to/file.py:name`` (or ``package.module:name``) -> (the callable, its module)."""
    source, name, is_file = check_factory_spec(spec)
    path = Path(source)
    if is_file:
        module_name = f"_autopipe_user_{re.sub(r'[^0-9a-zA-Z_]', '_', path.stem)}"
        loader_spec = importlib.util.spec_from_file_location(module_name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise UsageError(f"{source} is not a Python file that can be imported")
        module = importlib.util.module_from_spec(loader_spec)
        sys.path.insert(0, str(path.resolve().parent))  # so the file can import its neighbours
        sys.modules[module_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:
            raise UsageError(f"importing {source} failed: {type(e).__name__}: {_first_line(e)}") from e
    else:
        try:
            module = importlib.import_module(source)
        except Exception as e:
            raise UsageError(f"cannot import module {source!r}: {type(e).__name__}: {_first_line(e)}") from e
    factory = getattr(module, name, None)
    if factory is None:
        defined = sorted(k for k, v in vars(module).items()
                         if callable(v) and not k.startswith("_") and getattr(v, "__module__", None) == module.__name__)
        raise UsageError(f"{source} has no {name!r}" + (f" (it defines: {', '.join(defined)})" if defined else ""))
    if not callable(factory):
        raise UsageError(f"{source}:{name} is a {type(factory).__name__}, not a function or class that builds a model")
    return factory, module


def _describe(e: BaseException) -> str:
    """autopipe's own errors are written to be read whole; others by their first line and the graph node."""
    from autopipe.passes.trace import TraceError
    text = str(e).strip()
    if isinstance(e, (TraceError, ValueError)) and type(e).__module__.startswith("autopipe"):
        message = text
    else:
        lines = text.splitlines()
        message = lines[0] if lines else ""
        where = next((ln.strip() for ln in lines[1:] if ln.strip().startswith("While executing")), None)
        if where:
            message += f" ({where[0].lower()}{where[1:]})"
    notes = [n for n in getattr(e, "__notes__", []) if n.startswith("hint:")]
    return f"{type(e).__name__}: {message}" + "".join(f"\n{n}" for n in notes)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else ""


def build_model(factory, kwargs: dict[str, Any], meta: bool):
    import torch
    where = torch.device("meta") if meta else contextlib.nullcontext()
    try:
        with where:
            model = factory(**kwargs)
    except Exception as e:
        call = ", ".join(f"{k}={v!r}" for k, v in kwargs.items())
        raise UsageError(f"{getattr(factory, '__name__', factory)}({call}) "
                         f"raised {type(e).__name__}: {_first_line(e)}") from e
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{getattr(factory, '__name__', factory)}() returned a {type(model).__name__}, "
                         f"not an nn.Module")
    return model


def build_model_reporting(factory, kwargs: dict[str, Any], meta: bool):
    """build_model, with its size and seconds on stderr."""
    t0 = time.perf_counter()
    model = build_model(factory, kwargs, meta)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"autopipe: built {type(model).__name__} ({n_params / 1e6:,.1f} M parameters) "
          f"{'on meta' if meta else 'on cpu'} in {time.perf_counter() - t0:.3f} s", file=sys.stderr, flush=True)
    return model


def example_tensor(shape, dtype, meta: bool, int_high: int = 0):
    import torch
    if meta:
        return torch.empty(shape, dtype=dtype, device="meta")
    if dtype.is_floating_point or dtype.is_complex:
        return torch.randn(shape, dtype=dtype)
    if int_high > 0 and dtype != torch.bool:
        return torch.randint(0, int_high, shape, dtype=dtype)
    return torch.zeros(shape, dtype=dtype)  # token ids 0 index every embedding


def plan_devices(spec: str):
    import torch
    from autopipe.compile import resolve_devices
    if spec.strip().isdigit():
        n = int(spec)
        if n < 1:
            raise UsageError(f"--devices {spec}: at least 1")
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        return [torch.device("cuda", i) if i < count else torch.device("cpu") for i in range(n)]  # as autopipe.plan
    try:
        return resolve_devices([d.strip() for d in spec.split(",") if d.strip()])
    except (ValueError, TypeError) as e:
        raise UsageError(f"--devices {spec!r}: {e}") from None


# -- example inputs, for plan and verify --------------------------------------------------

class InputSpec:
    """The example inputs named on the command line, checked before anything is built."""

    def __init__(self, ns: argparse.Namespace):
        import torch
        self.shapes = [parse_shape(s, "--input-shape") for s in ns.input_shape]
        self.dtypes = [parse_dtype(d, "--input-dtype") for d in ns.input_dtype]
        if len(self.dtypes) > 1 and len(self.dtypes) != len(self.shapes):
            raise UsageError(f"{len(self.dtypes)} --input-dtype for {len(self.shapes)} --input-shape: give one dtype "
                             f"for all, or one per input")
        self.kw_shapes = {k: parse_shape(v, f"--kwarg-shape {k}=")
                          for k, v in parse_named(ns.kwarg_shape, "--kwarg-shape").items()}
        self.kw_dtypes = {k: parse_dtype(v, f"--kwarg-dtype {k}=")
                          for k, v in parse_named(ns.kwarg_dtype, "--kwarg-dtype").items()}
        unknown = sorted(set(self.kw_dtypes) - set(self.kw_shapes))
        if unknown:
            raise UsageError(f"--kwarg-dtype for {', '.join(unknown)} without a --kwarg-shape")
        if not self.shapes and not self.kw_shapes:
            raise UsageError("give the example input's shape: --input-shape 8,3,224,224 (or --kwarg-shape name=8,128)")
        self.default_dtype = self.dtypes[0] if len(self.dtypes) == 1 else torch.float32

    def make(self, meta: bool, int_high: int = 0) -> tuple[tuple, dict]:
        import torch
        args = tuple(example_tensor(s, self.dtypes[i] if len(self.dtypes) > 1 else self.default_dtype, meta, int_high)
                     for i, s in enumerate(self.shapes))
        kwargs = {k: example_tensor(s, self.kw_dtypes.get(k, torch.float32), meta, int_high)
                  for k, s in self.kw_shapes.items()}
        return args, kwargs


def leaf_modules_from(module, names: Sequence[str]) -> list:
    """Each --leaf-module: a class defined in the factory's file, or a module's qualified name."""
    return [obj if isinstance(obj := getattr(module, name, None), type) else name for name in names]


def hint_token_ids(e: BaseException, args: tuple, kwargs: dict) -> None:
    floats = [t for t in (*args, *kwargs.values()) if t.is_floating_point()]
    if floats and re.search(r"\b(Long|Int|integer|indices)\b", str(e)):
        e.add_note("hint: are some inputs token ids? pass --input-dtype long (or --kwarg-dtype NAME=long)")


# -- the plan command ------------------------------------------------------------------

def run_passes(model, args: tuple, kwargs: dict, devices, chunks: int, balance, leaf_modules, tolerance: float,
               memory_cap, route: str, out: str | None):
    """trace -> cost -> partition (-> codegen with ``out``): autopipe.run_passes, the chain compile runs,
    each pass reported on stderr (autopipe/progress.py)."""
    from autopipe.compile import Options, run_passes as chain
    from autopipe.progress import Progress

    options = Options.make(devices, chunks=chunks, balance=balance, leaf_modules=leaf_modules,
                           tolerance=tolerance, memory_cap=memory_cap, route=route, verbose=True)
    compiled = chain(model, args, kwargs, options, generate=out is not None, progress=Progress(verbose=True))
    paths = [stage.save(out) for stage in compiled.stages] if out is not None else []
    return compiled.plan, paths


def cmd_plan(ns: argparse.Namespace) -> int:
    check_factory_spec(ns.factory)
    inputs = InputSpec(ns)
    factory_kwargs = {k: parse_literal(v) for k, v in parse_named(ns.factory_arg, "--factory-arg").items()}
    balance = parse_balance(ns.balance)
    memory_cap = parse_bytes(ns.memory_cap) if ns.memory_cap else None
    if ns.chunks < 1:
        raise UsageError(f"--chunks {ns.chunks}: at least 1")
    if balance == "time" and ns.meta:
        raise UsageError("--balance time runs the model to time it: add --no-meta (real weights and inputs)")
    devices = plan_devices(ns.devices)

    factory, module = load_factory(ns.factory)
    leaf_modules = leaf_modules_from(module, ns.leaf_module)
    model = build_model_reporting(factory, factory_kwargs, ns.meta)
    args, kwargs = inputs.make(ns.meta)

    try:
        plan, paths = run_passes(model, args, kwargs, devices, ns.chunks, balance, leaf_modules, ns.tolerance,
                                 memory_cap, ns.route, ns.out)
    except Exception as e:
        hint_token_ids(e, args, kwargs)
        raise
    print(plan)
    for path in paths:
        print(f"wrote {path}")
    return 0


# -- the verify command ------------------------------------------------------------------

def cmd_verify(ns: argparse.Namespace) -> int:
    import torch

    check_factory_spec(ns.factory)
    inputs = InputSpec(ns)
    factory_kwargs = {k: parse_literal(v) for k, v in parse_named(ns.factory_arg, "--factory-arg").items()}
    balance = parse_balance(ns.balance)
    if ns.chunks < 1:
        raise UsageError(f"--chunks {ns.chunks}: at least 1")
    if ns.int_high < 0:
        raise UsageError(f"--int-high {ns.int_high}: 0 (zeros) or more")
    devices = verify_devices(ns.devices)

    factory, module = load_factory(ns.factory)
    leaf_modules = leaf_modules_from(module, ns.leaf_module)
    torch.manual_seed(ns.seed)
    model = build_model_reporting(factory, factory_kwargs, meta=False)
    if ns.mode != "as-built":
        model.train(ns.mode == "train")
    args, kwargs = inputs.make(meta=False, int_high=ns.int_high)

    from autopipe.verify import verify
    options: dict[str, Any] = {"balance": balance, "route": ns.route}
    if leaf_modules:
        options["leaf_modules"] = leaf_modules
    t0 = time.perf_counter()
    try:
        report = verify(model, args, kwargs, devices=devices, chunks=ns.chunks, checkpoint=ns.checkpoint, **options)
    except Exception as e:
        hint_token_ids(e, args, kwargs)
        raise
    print(report)
    print(f"autopipe: verified in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0 if report.passed else 1


def verify_devices(spec: str):
    """``N``: N CPU workers; or a comma-separated list of devices."""
    text = spec.strip()
    if text.isdigit():
        if int(text) < 1:
            raise UsageError(f"--devices {spec}: at least 1")
        return int(text)
    devices = [d.strip() for d in text.split(",") if d.strip()]
    from autopipe.compile import resolve_devices
    try:
        resolve_devices(devices)
    except (ValueError, TypeError) as e:
        raise UsageError(f"--devices {spec!r}: {e}") from None
    return devices


def _add_model_arguments(p: argparse.ArgumentParser) -> None:
    """The factory and its example inputs: the same for plan and verify."""
    p.add_argument("factory", metavar="FILE.py:FACTORY",
                   help="a Python file and the function (or class) in it that returns the nn.Module; "
                        "also package.module:FACTORY")
    p.add_argument("--input-shape", action="append", default=[], metavar="8,3,224,224",
                   help="shape of a positional example input (repeat for several inputs); dim 0 is the batch")
    p.add_argument("--input-dtype", action="append", default=[], metavar="DTYPE",
                   help="dtype of the positional inputs: one for all, or one per --input-shape "
                        "(float32 default; long for token ids; bfloat16, int32, bool, ...)")
    p.add_argument("--kwarg-shape", action="append", default=[], metavar="NAME=8,128",
                   help="shape of a keyword example input (repeatable)")
    p.add_argument("--kwarg-dtype", action="append", default=[], metavar="NAME=DTYPE",
                   help="dtype of a keyword input (default float32)")
    p.add_argument("--factory-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="keyword argument for the factory; VALUE is a Python literal (layers=48, name='gpt2')")


def build_parser() -> argparse.ArgumentParser:
    from autopipe import __version__
    parser = _Parser(prog="autopipe", formatter_class=argparse.RawDescriptionHelpFormatter,
                     description="autopipe: compile an unmodified PyTorch model into a GPipe pipeline.\n\n"
                                 "commands:\n  plan   plan a model from a Python file (no memory, no devices): print "
                                 "where the cuts go and write each stage's code\n"
                                 "  verify check that the pipeline computes the model: one training step against the "
                                 "plain model (per-parameter table; exit 0 PASS, 1 FAIL)",
                     epilog=EXAMPLE)
    parser.add_argument("--version", action="version", version=f"autopipe {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    p = sub.add_parser(
        "plan", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLE,
        help="plan a model from a Python file",
        description="Load FILE.py:FACTORY, build the model on the meta device (no memory), trace it with example "
                    "inputs of the given shapes, partition it into balanced stages, print the plan, and with --out "
                    "write one stage_<i>.py per stage. Each pass's seconds go to stderr.")
    _add_model_arguments(p)
    p.add_argument("--devices", default="8", metavar="N|DEV,DEV,...",
                   help="number of stages, or a comma-separated device list such as cuda:0,cuda:1 (default 8)")
    p.add_argument("--chunks", type=int, default=8, help="micro-batches per mini-batch, GPipe's M (default 8)")
    p.add_argument("--balance", default="flops", metavar="flops|params|time|W,W,...",
                   help="what to balance: FLOPs (default), parameters, measured time (needs --no-meta), "
                        "or per-stage shares")
    p.add_argument("--memory-cap", default=None, metavar="BYTES",
                   help="memory per device (16GiB, 512MiB, 8e9): weights, gradients, optimizer state and "
                        "activations of every stage must fit")
    p.add_argument("--leaf-module", action="append", default=[], metavar="NAME",
                   help="keep a module whole when tracing: a class defined in the file, or a module's qualified "
                        "name (blocks.0); repeatable")
    p.add_argument("--route", choices=("auto", "fx", "export"), default="auto",
                   help="tracer: torch.fx, then torch.export if fx fails (auto, default)")
    p.add_argument("--tolerance", type=float, default=0.03,
                   help="plans within this fraction of the best bottleneck compete on fewest tensors crossing")
    p.add_argument("--out", default=None, metavar="DIR", help="write the generated stage_<i>.py files here")
    p.add_argument("--meta", action=argparse.BooleanOptionalAction, default=True,
                   help="build the model and inputs on the meta device (default; no memory). --no-meta builds "
                        "them for real on the CPU")
    p.add_argument("--traceback", action="store_true", help="on an error, show the full Python traceback")
    p.set_defaults(run=cmd_plan)

    v = sub.add_parser(
        "verify", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=VERIFY_EXAMPLE,
        help="check that the pipeline computes the model",
        description="Load FILE.py:FACTORY, build the model with real weights on the CPU (keep the config small: it "
                    "runs several times), and run autopipe.verify: one training step through the pipeline against "
                    "the plain model on the same micro-batches in float64 (structure, tolerance 1e-10), and "
                    "checkpoint='always' against 'never' in the model's own dtype (replay, bit for bit). Prints a "
                    "per-parameter table and the verdict; exit status 0 on PASS, 1 on FAIL.")
    _add_model_arguments(v)
    v.add_argument("--devices", default="2", metavar="N|DEV,DEV,...",
                   help="N CPU workers (default 2), or a comma-separated device list such as cpu,cpu,cpu")
    v.add_argument("--chunks", type=int, default=4, help="micro-batches per mini-batch, GPipe's M (default 4)")
    v.add_argument("--checkpoint", choices=("except_last", "always", "never"), default="except_last",
                   help="the re-materialisation mode under test (default except_last)")
    v.add_argument("--mode", choices=("as-built", "train", "eval"), default="as-built",
                   help="the model's mode for the step: as the factory returns it (default; a new nn.Module is in "
                        "training mode), train, or eval")
    v.add_argument("--balance", default="flops", metavar="flops|params|time|W,W,...",
                   help="what the partitioner balances (default flops)")
    v.add_argument("--leaf-module", action="append", default=[], metavar="NAME",
                   help="keep a module whole when tracing (a class in the file, or a qualified name); repeatable")
    v.add_argument("--route", choices=("auto", "fx", "export"), default="auto",
                   help="tracer: torch.fx, then torch.export if fx fails (auto, default)")
    v.add_argument("--seed", type=int, default=0, help="torch.manual_seed before building the model and inputs")
    v.add_argument("--int-high", type=int, default=0, metavar="N",
                   help="integer inputs (token ids) drawn uniformly from [0, N); default 0: all zeros")
    v.add_argument("--traceback", action="store_true", help="on an error, show the full Python traceback")
    v.set_defaults(run=cmd_verify)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return ns.run(ns)
    except UsageError as e:
        if ns.traceback:
            raise
        print(f"autopipe {ns.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"autopipe {ns.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # tracing or planning failed
        if ns.traceback:
            raise
        print(f"autopipe {ns.command}: error: {_describe(e)}\n(run with --traceback for the full Python traceback)",
              file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
