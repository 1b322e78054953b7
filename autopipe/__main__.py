"""The command line: ``python -m autopipe plan|verify FILE.py:FACTORY ...``; ``--help`` explains each command."""
from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import sys
import time
from pathlib import Path
from typing import Any, NoReturn, Sequence

import torch

import autopipe
from autopipe.devices import plan_devices, resolve_devices
from autopipe.options import BALANCE_MODES

EXAMPLES = """\
examples (verify runs the model for real, several times: give it a small config):
  python -m autopipe plan models.py:gpt --factory-arg layers=48 --input-shape 8,1024 --input-dtype long --out stages/
  python -m autopipe verify models.py:gpt --factory-arg layers=2 --input-shape 8,32 --input-dtype long --mode eval
exit status: 0 done (verify: PASS), 1 FAIL or the model could not be built or run, 2 bad arguments
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, not argparse's usage block: "--flag VALUE: what is wrong"
        message = re.sub(r"^argument (\S+): ", r"\1 ", message)
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def require(ok: Any, message: str) -> None:
    if not ok:
        raise argparse.ArgumentTypeError(message)  # bad input from the command line: one line, exit code 2


def parse_shape(text: str) -> tuple[int, ...]:
    dims = text.strip().strip("()[]").strip().rstrip(",").split(",")
    require(all(d.strip().isdigit() and int(d) > 0 for d in dims), f"{text!r} is not a shape: give positive integers "
                                                                   f"separated by commas, e.g. 8,3,224,224")
    return tuple(int(d) for d in dims)


def parse_dtype(text: str):
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
    if text in BALANCE_MODES:
        return text
    shares = [float(s) for s in text.split(",") if re.fullmatch(r"\s*\d*\.?\d+\s*", s)]
    require(len(shares) == text.count(",") + 1 and min(shares) > 0, f"{text!r}: use {', '.join(BALANCE_MODES)}, or "
                                                                    f"per-stage shares such as 1,2,2,1")
    return shares


def parse_devices(text: str) -> int | list[str]:  # N stages (plan) or CPU workers (verify), or a device list
    if text.strip().isdigit():
        require(int(text) > 0, f"{text}: at least 1")
        return int(text)
    try:
        return [str(d) for d in resolve_devices([d.strip() for d in text.split(",") if d.strip()])]
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None


def load_factory(spec: str):  # "path/to/file.py:name" or "package.module:name" -> (the callable, its module)
    source, _, name = spec.rpartition(":")
    require(source and name, f"{spec!r}: expected FILE.py:FACTORY, e.g. models.py:build_model")
    path = Path(source)
    require(path.is_file() or not source.endswith(".py"), f"no such file: {source}")
    try:
        if not path.is_file():
            module = importlib.import_module(source)
        else:
            sys.path.insert(0, str(path.resolve().parent))  # so the file can import its neighbours
            spec = importlib.util.spec_from_file_location("_autopipe_user_" + re.sub(r"\W", "_", path.stem), path)
            module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
    except Exception as e:
        raise argparse.ArgumentTypeError(f"importing {source} failed: {_brief(e)}") from e
    factory = getattr(module, name, None)
    defined = ", ".join(sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_")
                               and getattr(v, "__module__", None) == module.__name__)) or "nothing callable"
    require(factory is not None, f"{source} has no {name!r} (it defines: {defined})")
    require(callable(factory), f"{source}:{name} is a {type(factory).__name__}, not a function or class")
    return factory, module


def run(ns: argparse.Namespace) -> int:
    dtypes, kw_shapes, kw_dtypes = ns.input_dtype or [torch.float32], dict(ns.kwarg_shape), dict(ns.kwarg_dtype)
    require(len(dtypes) in (1, len(ns.input_shape)), f"{len(dtypes)} --input-dtype for {len(ns.input_shape)} "
            f"--input-shape: give one dtype for all, or one per input")
    unknown = sorted(set(kw_dtypes) - set(kw_shapes))
    require(not unknown, f"--kwarg-dtype for {', '.join(unknown)} without a --kwarg-shape")
    require(ns.input_shape or kw_shapes, "give the example input's shape: --input-shape 8,3,224,224 (or --kwarg-shape "
                                         "name=8,128)")
    require(ns.chunks > 0, f"--chunks {ns.chunks}: at least 1")
    require(ns.balance not in ("time", "train_time") or not ns.meta,
            f"--balance {ns.balance} runs the model to time it: add --no-meta")
    factory, module = load_factory(ns.factory)
    leaf_modules = [obj if isinstance(obj := getattr(module, leaf, None), type) else leaf for leaf in ns.leaf_module]
    torch.manual_seed(ns.seed)
    device = "meta" if ns.meta else "cpu"
    t0 = time.perf_counter()
    with torch.device(device):
        model = factory(**dict(ns.factory_arg))
    require(isinstance(model, torch.nn.Module), f"{ns.factory} returned a {type(model).__name__}, not an nn.Module")
    print(f"autopipe: built {type(model).__name__} ({sum(p.numel() for p in model.parameters()) / 1e6:,.1f} M "
          f"parameters) on {device} in {time.perf_counter() - t0:.3f} s", file=sys.stderr)
    if ns.mode != "as-built":
        model.train(ns.mode == "train")

    def tensor(shape, dtype):
        if dtype.is_floating_point or dtype.is_complex:
            return torch.randn(shape, dtype=dtype, device=device)
        high = 1 if dtype == torch.bool else max(ns.int_high, 1)  # 1: zeros (token id 0 indexes every embedding)
        return torch.randint(0, high, shape, dtype=dtype, device=device)
    args = tuple(tensor(s, dtypes[i % len(dtypes)]) for i, s in enumerate(ns.input_shape))
    kwargs = {k: tensor(s, kw_dtypes.get(k, torch.float32)) for k, s in kw_shapes.items()}
    common = dict(chunks=ns.chunks, balance=ns.balance, route=ns.route, leaf_modules=leaf_modules)
    if ns.command == "plan":
        options = autopipe.Options.make(plan_devices(ns.devices), tolerance=ns.tolerance, memory_cap=ns.memory_cap,
                                        verbose=True, **common)
        compiled = autopipe.run_passes(model, args, kwargs, options, generate=ns.out is not None)
        print(compiled.plan)
        for stage in compiled.stages if ns.out is not None else ():
            print(f"wrote {stage.save(ns.out)}")
        return 0
    t0 = time.perf_counter()
    report = autopipe.verify(model, args, kwargs, devices=ns.devices, checkpoint=ns.checkpoint, **common)
    print(report)
    print(f"autopipe: verified in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return 0 if report.passed else 1


MANY = dict(action="append", default=[])  # a repeatable argument
ARGUMENTS = {  # command: [(flag, add_argument keywords)], for "plan verify": both
    "plan verify": [
        ("factory", dict(metavar="FILE.py:FACTORY", help="a Python file (or package.module) and its model factory")),
        ("--input-shape", dict(MANY, type=parse_shape, metavar="8,3,224,224", help="a positional input, batch first")),
        ("--input-dtype", dict(MANY, type=parse_dtype, metavar="DTYPE", help="one for all or one per input (float32)")),
        ("--kwarg-shape", dict(MANY, type=named(parse_shape), metavar="NAME=8,128", help="a keyword input")),
        ("--kwarg-dtype", dict(MANY, type=named(parse_dtype), metavar="NAME=DTYPE", help="its dtype (float32)")),
        ("--factory-arg", dict(MANY, type=named(parse_literal), metavar="KEY=VALUE", help="for the factory: 48, 'x'")),
        ("--devices", dict(type=parse_devices, metavar="N|DEV,DEV", help="stages (plan), CPU workers (verify)")),
        ("--chunks", dict(type=int, help="micro-batches per mini-batch (default %(default)s)")),
        ("--balance", dict(type=parse_balance, default="flops", metavar="|".join(BALANCE_MODES) + "|W,W,...",
                           help="what the partitioner balances (default flops), or per-stage shares")),
        ("--leaf-module", dict(MANY, metavar="NAME", help="a class in the file, or a qualified name, kept whole")),
        ("--route", dict(choices=("auto", "fx", "export"), default="auto", help="tracer (default auto)")),
        ("--traceback", dict(action="store_true", help="on an error, show the full Python traceback")),
    ],
    "plan": [
        ("--memory-cap", dict(type=parse_bytes, metavar="BYTES", help="memory per device: 16GiB, 512MiB, 8e9")),
        ("--tolerance", dict(type=float, default=0.03, help="bottleneck slack to trade for fewer crossing tensors")),
        ("--out", dict(metavar="DIR", help="write the stage_<i>.py files here")),
        ("--meta", dict(action=argparse.BooleanOptionalAction, default=True, help="build on the meta device")),
    ],
    "verify": [
        ("--checkpoint", dict(choices=("except_last", "always", "never"), default="except_last",
                              help="the re-materialisation mode under test (default except_last)")),
        ("--mode", dict(choices=("as-built", "train", "eval"), default="as-built", help="the model's mode")),
        ("--seed", dict(type=int, default=0, help="torch.manual_seed before building the model and inputs")),
        ("--int-high", dict(type=int, default=0, metavar="N", help="integer inputs from [0, N) (default 0: zeros)")),
    ],
}
COMMANDS = {  # command: (help, defaults)
    "plan": ("print where the cuts go (on the meta device); --out writes the stages", dict(devices="8", chunks=8)),
    "verify": ("check one training step of the pipeline against the plain model", dict(devices="2", chunks=4)),
}


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog="autopipe", formatter_class=raw, epilog=EXAMPLES,
                     description="autopipe: compile an unmodified PyTorch model into a GPipe pipeline.")
    parser.add_argument("--version", action="version", version=f"autopipe {autopipe.__version__}")
    parser.set_defaults(seed=0, int_high=0, mode="as-built", meta=False)  # of the flags only one command has
    sub = parser.add_subparsers(dest="command", required=True, metavar="plan|verify", parser_class=_Parser)
    for command, (text, defaults) in COMMANDS.items():
        p = sub.add_parser(command, formatter_class=raw, help=text, description=text, epilog=EXAMPLES)
        for flag, keywords in ARGUMENTS["plan verify"] + ARGUMENTS[command]:
            p.add_argument(flag, **keywords)
        p.set_defaults(**defaults)
    return parser


def _brief(e: BaseException) -> str:
    return f"{type(e).__name__}: " + (str(e).strip().splitlines() or [""])[0]


def _describe(e: BaseException, ns: argparse.Namespace) -> str:
    if type(e).__module__.startswith("autopipe") and isinstance(e, (autopipe.TraceError, ValueError)):
        message = f"{type(e).__name__}: {str(e).strip()}"  # written to be read whole
    else:
        where = [ln.strip() for ln in str(e).splitlines() if ln.strip().startswith("While executing")]
        message = _brief(e) + (f" ({where[0][0].lower()}{where[0][1:]})" if where else "")
    if not (ns.input_dtype or ns.kwarg_dtype) and re.search(r"\b(Long|Int|integer|indices)\b", str(e)):
        message += "\nhint: are some inputs token ids? pass --input-dtype long (or --kwarg-dtype NAME=long)"
    return message + "\n(run with --traceback for the full Python traceback)"


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return run(ns)
    except Exception as e:
        if ns.traceback:
            raise
        usage = isinstance(e, argparse.ArgumentTypeError)
        print(f"autopipe {ns.command}: error: {e if usage else _describe(e, ns)}", file=sys.stderr)
        return 2 if usage else 1


if __name__ == "__main__":
    sys.exit(main())
