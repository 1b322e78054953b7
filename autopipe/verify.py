"""autopipe.verify: does the pipeline compute the user's model? One training step, compared.

    report = autopipe.verify(model, (x,), devices=2, chunks=4)
    print(report)            # per-parameter table, outputs, loss, verdict
    assert report.passed

Each check runs one training step (forward, loss, backward) twice and compares
the loss, every output tensor, every parameter's gradient and every buffer
after the step (BatchNorm running statistics). Nothing of the caller's is
touched: every run works on a deep copy of the model; the global RNG (forked),
grad mode and intra-op thread count are restored, and the model, its mode and
its parameters' ``.grad`` stay as they were. The model runs in the mode it is
in (``train()`` or ``eval()``).

**structure** -- the pipeline under test, on a float64 copy of the model and of
its floating inputs, against the plain float64 model run by hand on the same
micro-batches (a loop: split the inputs on dim 0 as the pipeline does, run the
model on each piece, merge the outputs as the pipeline does: concatenated, a
0-dim output as the micro-batch-size-weighted mean). That loop is GPipe's
semantics. It equals the whole-batch model except where the model mixes the
rows of a batch (BatchNorm in training mode, a loss averaged over tokens inside
the model); the report shows that difference too, for information. In float64
a correct pipeline agrees to ~1e-15 relative; the tolerance is 1e-10, so float
noise cannot hide a structural error and cannot fake one.

**replay** -- in the model's own dtype, the pipeline with ``checkpoint="always"``
(every micro-batch re-materialised in backward) against ``checkpoint="never"``,
both with ``intra_op_threads=1`` and the same seed: re-materialisation must
reproduce the forward bit for bit, so the tolerance is 0. One exception: the
gradient of a parameter several stages hold (tied weights) is summed from
several workers in an order that depends on thread timing, so two runs of the
*same* mode differ in its last bits; those rows get a float bound (1e-5 relative
in float32) and say so. For information the report adds the pipeline
(``"never"``) against the plain loop at one thread in the model's dtype: the
float noise floor of the same math in another order.

Random numbers. Whether the model's forward is random in its mode is found by
running it, not guessed: three forwards of the same input, under seed 1, seed 1
and seed 2. Three outcomes:

* deterministic (all equal): as above.
* random (dropout in training mode: equal under one seed, different under two):
  the pipeline draws its numbers per (stage, micro-batch) by design, so it can
  never equal the plain model's single draw. The structure part then compares
  with the plain model in ``eval()`` (dropout off) -- or is skipped, with a note,
  if the model is random in eval mode too -- and the replay part, which runs in
  the model's own mode with the same seed, is the check that the pipeline's
  dropout masks are replayed exactly (a ``checkpoint="except_last"`` step mixes
  the two micro-batch paths that replay compares, so it is not run separately).
* irreproducible (different under the same seed: a Python counter, the model's
  own torch.Generator): compared with the plain model anyway, with a note; a
  traced pipeline runs what the model did when it was traced, so expect FAIL.

If the model cannot run in float64 (the plain float64 copy raises, e.g. a dtype
error), the structure part runs in the model's own dtype, pipeline and loop at
one intra-op thread, with a float tolerance (1e-4 relative for float32), and
the report says so.

A row's number is max |a - b| / max |b|, b the reference. A gradient that is
zero in exact arithmetic (an attention key bias's: softmax ignores a constant
added to every score) holds only rounding noise; so a gradient's max |b| is
floored at 1e-3 x the model's largest gradient (marked ``*`` in the table).

The loss: ``loss_fn(output) -> scalar`` if given (close over your targets).
Otherwise the model's own loss if the output is a scalar or has ``.loss``
(``output["loss"]`` for a dict), else ``sum(leaf * R_k)`` over the floating
output leaves with a fixed random projection ``R_k`` (seeded by the leaf's
position: deterministic; unlike a sum of squares it does not vanish through a
final LayerNorm).

verify compiles the model three times (structure, and the two replay modes) and
runs the plain model a few times: use a small config of the model.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from tabulate import tabulate

STRUCTURE_TOLERANCE = 1e-10          # float64: a correct pipeline is at ~1e-15
OWN_DTYPE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}
# Replay, for a parameter several stages hold (tied weights) only: its gradient is summed from several
# workers in an order that depends on thread timing, so two runs of the same mode differ in the last bits.
SHARED_GRAD_TOLERANCE = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# A gradient that is zero in exact arithmetic (an attention key bias's: softmax ignores a constant added to
# every score) holds only rounding noise, ~1e-16 of the gradients it was summed from, in whatever order; its
# max|Δ| is measured against GRAD_FLOOR x the largest gradient of the model instead of its own ~0.
GRAD_FLOOR = 1e-3
CHECKPOINT_MODES = ("always", "except_last", "never")
SEED = 0
SHOWN_ROWS = 10


# -- the report -------------------------------------------------------------------

@dataclass
class Row:
    """One quantity compared between a run and its reference."""

    kind: str                  # "loss", "output", "grad", "buffer"
    name: str
    max_abs_diff: float        # max |a - b|
    max_abs_ref: float         # max |b|
    note: str = ""             # "no gradient in the pipeline", "shape (8, 4) vs (8, 5)"
    tolerance: float | None = None  # this row's own bound, where it differs from its check's
    floor: float = 0.0         # the smallest scale the difference is measured against (see GRAD_FLOOR)

    @property
    def floored(self) -> bool:
        return self.max_abs_ref < self.floor

    @property
    def rel(self) -> float:
        """max |a - b| / max(max |b|, floor) (0 when equal; inf when that scale is 0 and a differs)."""
        if self.note.startswith("shape"):
            return math.inf
        if self.max_abs_diff == 0:
            return 0.0
        if math.isnan(self.max_abs_diff):
            return math.nan
        scale = max(self.max_abs_ref, self.floor)
        return self.max_abs_diff / scale if scale > 0 else math.inf

    def within(self, tolerance: float) -> bool:
        bound = tolerance if self.tolerance is None else self.tolerance
        return self.rel <= bound  # NaN is never within


@dataclass
class Check:
    """One comparison: ``run`` against ``reference``, one training step each."""

    name: str                          # "structure", "micro-batching", "replay", "noise floor"
    run: str                           # what was run, in words
    reference: str                     # what it was compared with
    tolerance: float | None            # None: for information only, not part of the verdict
    rows: list[Row] = field(default_factory=list)
    error: str | None = None           # the run raised: the exception, in words
    notes: list[str] = field(default_factory=list)

    @property
    def informational(self) -> bool:
        return self.tolerance is None

    @property
    def passed(self) -> bool:
        if self.informational:
            return True
        return self.error is None and all(r.within(self.tolerance) for r in self.rows)

    @property
    def failures(self) -> list[Row]:
        if self.tolerance is None:
            return []
        return [r for r in self.rows if not r.within(self.tolerance)]

    @property
    def worst(self) -> Row | None:
        return max(self.rows, key=_sort_key) if self.rows else None

    def __str__(self) -> str:
        if self.informational and not self.rows and self.error is None:
            return f"[{self.name}] " + "; ".join(self.notes or ["nothing compared"])
        if self.informational:
            verdict = "info (not part of the verdict)"
        else:
            bound = "0: bit for bit" if self.tolerance == 0 else f"{self.tolerance:.0e}"
            verdict = f"{'PASS' if self.passed else 'FAIL'} (tolerance {bound})"
        lines = [f"[{self.name}] {verdict}", f"  run:       {self.run}", f"  reference: {self.reference}"]
        lines += [f"  note: {n}" for n in self.notes]
        if self.error is not None:
            lines.append("  the run raised: " + self.error.replace("\n", "\n    "))
            return "\n".join(lines)
        if not self.rows:
            lines.append("  (nothing compared)")
            return "\n".join(lines)
        limit = SHOWN_ROWS if not self.informational else SHOWN_ROWS // 2
        lines.append(_indent(_table(self.rows, self.tolerance, limit), "  "))
        lines.append("  " + self.summary())
        return "\n".join(lines)

    def summary(self) -> str:
        parts = []
        for kind, label in (("grad", "parameter gradients"), ("output", "outputs"), ("buffer", "buffers")):
            rows = [r for r in self.rows if r.kind == kind]
            if not rows:
                continue
            worst = max(rows, key=_sort_key)
            text = f"{len(rows)} {label}: worst {_fmt(worst.rel)} ({worst.name})"
            if self.tolerance is not None:
                bad = sum(not r.within(self.tolerance) for r in rows)
                text += f", {bad} over tolerance" if bad else ", all within tolerance"
            parts.append(text)
        return "; ".join(parts)


@dataclass
class VerifyReport:
    """What :func:`verify` found. ``print(report)`` shows it; ``report.passed`` is the verdict."""

    model: str
    devices: list[str]
    chunks: int
    checkpoint: str
    mode: str                                         # "train" or "eval": the model's own mode
    dtype: torch.dtype                                # the model's own (floating) dtype
    loss: str                                         # which loss was used, in words
    structure: list[Check] = field(default_factory=list)
    replay: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def checks(self) -> list[Check]:
        return [*self.structure, *self.replay]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failures(self) -> list[tuple[str, Row]]:
        """(check name, row) for every row over its tolerance."""
        return [(c.name, r) for c in self.checks for r in c.failures]

    def verdict(self) -> str:
        judged = [c for c in self.checks if not c.informational]
        if self.passed:
            parts = []
            for c in judged:
                plain = [r for r in c.rows if r.tolerance is None]
                own = [r for r in c.rows if r.tolerance is not None]
                worst = max(plain, key=_sort_key) if plain else None
                bound = "bit for bit" if c.tolerance == 0 else f"<= {c.tolerance:.0e}"
                text = f"{c.name} {bound} (worst {_fmt(worst.rel) if worst else '-'})"
                w = max(own, key=_sort_key) if own else None
                if w is not None and w.rel > 0:
                    text += f", tied weights <= {w.tolerance:.0e} (worst {_fmt(w.rel)})"
                parts.append(text)
            return "PASS: " + "; ".join(parts)
        bad = []
        for c in judged:
            if c.passed:
                continue
            if c.error is not None:
                bad.append(f"{c.name} raised {c.error.splitlines()[0]}")
            else:
                names = ", ".join(r.name for r in sorted(c.failures, key=_sort_key, reverse=True)[:3])
                more = len(c.failures) - 3
                bound = "tolerance 0" if c.tolerance == 0 else f"tolerance {c.tolerance:.0e}"
                bad.append(f"{c.name}: {len(c.failures)} over {bound} ({names}{f', +{more} more' if more > 0 else ''})")
        return "FAIL: " + "; ".join(bad)

    def __str__(self) -> str:
        head = (f"autopipe.verify: {self.model} in {self.mode} mode ({_dtype_name(self.dtype)}), "
                f"{len(self.devices)} stages on {_devices_text(self.devices)} x {self.chunks} micro-batches, "
                f"checkpoint={self.checkpoint!r}")
        lines = [head, f"loss: {self.loss}"]
        lines += [f"note: {n}" for n in self.notes]
        for check in self.checks:
            lines += ["", str(check)]
        lines += ["", self.verdict()]
        return "\n".join(lines)


def _sort_key(row: Row) -> float:
    rel = row.rel
    return math.inf if math.isnan(rel) else rel


def _fmt(x: float) -> str:
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf"
    return "0" if x == 0 else f"{x:.1e}"


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line for line in text.splitlines())


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _devices_text(devices: Sequence[str]) -> str:
    if len(set(devices)) == 1:
        return f"{len(devices)} x {devices[0]}"
    return ", ".join(devices)


def _table(rows: list[Row], tolerance: float | None, grad_rows: int = SHOWN_ROWS) -> str:
    """Loss and outputs, then the worst parameter gradients and buffers."""
    shown: list[Row] = []
    hidden = []
    for kind, limit in (("loss", None), ("output", 5), ("grad", grad_rows), ("buffer", 5)):
        of_kind = sorted((r for r in rows if r.kind == kind), key=_sort_key, reverse=True)
        keep = of_kind if limit is None else of_kind[:limit]
        shown += keep
        if len(of_kind) > len(keep):
            hidden.append(f"{len(of_kind) - len(keep)} more {kind} rows, each <= {_fmt(of_kind[len(keep)].rel)}")
    body = []
    for r in shown:
        ok = "" if tolerance is None else ("ok" if r.within(tolerance) else "FAIL")
        ref = _fmt(r.max_abs_ref) + ("*" if r.floored else "")
        body.append([r.kind, r.name, _fmt(r.max_abs_diff), ref, _fmt(r.rel), ok, r.note])
    headers = ["", "name", "max|Δ|", "max|ref|", "max|Δ|/max|ref|", "", ""]
    if not any(r.note for r in shown):
        headers, body = headers[:-1], [b[:-1] for b in body]
    text = tabulate(body, headers=headers, disable_numparse=True)
    if hidden:
        text += "\n(" + "; ".join(hidden) + ")"
    floored = [r for r in shown if r.floored]
    if floored:
        text += (f"\n* below {GRAD_FLOOR:.0e} x the largest gradient ({_fmt(floored[0].floor / GRAD_FLOOR)}): "
                 f"max|Δ| is divided by {_fmt(floored[0].floor)} instead (a gradient that is zero in exact "
                 f"arithmetic, such as an attention key bias's, holds only rounding noise)")
    return text


# -- one training step, recorded ------------------------------------------------------------

@dataclass
class _Step:
    outputs: list[tuple[str, torch.Tensor]]
    loss: torch.Tensor
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    has_model_loss: bool = False
    shared: dict[str, tuple[int, ...]] = field(default_factory=dict)  # parameters held by several stages


def _record(model: torch.nn.Module, output: Any, loss: torch.Tensor) -> _Step:
    grads = {n: (p.grad.detach().clone() if p.grad is not None else None)
             for n, p in model.named_parameters() if p.requires_grad}
    buffers = {n: b.detach().clone() for n, b in model.named_buffers()}
    outputs = [(n, t.detach().clone()) for n, t in _leaves(output)]
    return _Step(outputs=outputs, loss=loss.detach().clone(), grads=grads, buffers=buffers,
                 has_model_loss=_model_loss(output) is not None)


def _leaves(obj: Any, prefix: str = "output") -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor in a (nested) output: tuples, lists, dicts, dataclasses, ModelOutput."""
    if isinstance(obj, torch.Tensor):
        return [(prefix, obj)]
    if isinstance(obj, Mapping):
        items = list(obj.items())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        items = [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    elif isinstance(obj, (list, tuple)):
        items = [(f"[{i}]", v) for i, v in enumerate(obj)]
    else:
        return []
    out = []
    for key, value in items:
        name = f"{prefix}{key}" if str(key).startswith("[") else f"{prefix}.{key}"
        out += _leaves(value, name)
    return out


def _compare(kind: str, name: str, got: torch.Tensor | None, want: torch.Tensor | None) -> Row:
    note = ""
    if got is None or want is None:
        if got is None and want is None:
            return Row(kind, name, 0.0, 0.0)
        present = got if got is not None else want
        note = f"no {'gradient' if kind == 'grad' else 'value'} in the {'run' if got is None else 'reference'}"
        got = got if got is not None else torch.zeros_like(present)
        want = want if want is not None else torch.zeros_like(present)
    if got.shape != want.shape:
        return Row(kind, name, math.inf, math.inf, note=f"shape {tuple(got.shape)} vs {tuple(want.shape)}")
    if got.dtype != want.dtype or not (want.is_floating_point() or want.is_complex()):
        got, want = got.double(), want.double()
    got, want = got.detach().cpu(), want.detach().cpu()
    same = (got == want) | (torch.isnan(got) & torch.isnan(want))
    diff = torch.where(same, torch.zeros((), dtype=got.dtype), (got - want).abs())
    max_diff = diff.max().item() if diff.numel() else 0.0
    finite = want[torch.isfinite(want)].abs()
    max_ref = finite.max().item() if finite.numel() else 0.0
    if diff.numel() and torch.isnan(diff).any():
        max_diff = math.nan
    return Row(kind, name, float(max_diff), float(max_ref), note=note)


def _compare_steps(run: _Step, ref: _Step, buffers: bool = True, shared_tolerance: float | None = None) -> list[Row]:
    """Rows for the loss, every output leaf, every parameter's gradient and (with ``buffers``) every buffer.
    ``shared_tolerance``: the bound for the gradient of a parameter that several stages hold (tied weights),
    which the pipeline sums from several workers in an order that depends on thread timing."""
    rows = [_compare("loss", "loss", run.loss, ref.loss)]
    names_run = [n for n, _ in run.outputs]
    names_ref = [n for n, _ in ref.outputs]
    if names_run != names_ref:
        missing = sorted(set(names_ref) - set(names_run))
        extra = sorted(set(names_run) - set(names_ref))
        rows.append(Row("output", "structure", math.inf, math.inf,
                        note=f"shape of the output differs: missing {missing}, extra {extra}"))
    by_name = dict(run.outputs)
    for name, want in ref.outputs:
        if name in by_name:
            rows.append(_compare("output", name, by_name[name], want))
    shared = {**ref.shared, **run.shared}
    for name, want in ref.grads.items():
        row = _compare("grad", name, run.grads.get(name), want)
        if shared_tolerance is not None and name in shared:
            row.tolerance = shared_tolerance
            stages = ", ".join(str(s) for s in shared[name])
            row.note = (row.note + "; " if row.note else "") + (
                f"held by stages {stages} (tied): bound {shared_tolerance:.0e}")
        rows.append(row)
    grad_rows = [r for r in rows if r.kind == "grad" and math.isfinite(r.max_abs_ref)]
    largest = max((r.max_abs_ref for r in grad_rows), default=0.0)
    for r in grad_rows:
        r.floor = GRAD_FLOOR * largest
    if buffers:
        for name, want in ref.buffers.items():
            if name in run.buffers:
                rows.append(_compare("buffer", name, run.buffers[name], want))
    return rows


# -- the loss ---------------------------------------------------------------------------------

def _model_loss(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.dim() == 0 else None
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


def _projection(index: int, like: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 + index)
    return torch.randn(like.shape, generator=g, dtype=torch.float64).to(device=like.device, dtype=like.dtype)


def default_loss(output: Any) -> torch.Tensor:
    """The model's own loss (a scalar output, ``.loss``, ``["loss"]``), else ``sum(leaf * R_k)`` over the
    floating output leaves with fixed random projections ``R_k``."""
    loss = _model_loss(output)
    if loss is not None:
        return loss
    leaves = [t for _, t in _leaves(output) if t.is_floating_point()]
    if not leaves:
        raise TypeError(f"the model's output ({type(output).__name__}) holds no floating tensor to take a loss of; "
                        f"pass loss_fn=")
    return sum((t * _projection(k, t)).sum() for k, t in enumerate(leaves))


def _describe_loss(loss_fn: Callable | None, step: _Step) -> str:
    if loss_fn is not None:
        return f"loss_fn={getattr(loss_fn, '__qualname__', repr(loss_fn))}"
    if step.has_model_loss:
        return "the model's own loss (its scalar output or .loss)"
    n = sum(1 for _, t in step.outputs if t.is_floating_point())
    return f"sum(output * fixed random projection) over {n} floating output tensor(s)"


# -- micro-batches by hand ----------------------------------------------------------------------

def micro_batch_sizes(batch: int, chunks: int) -> list[int]:
    """As the pipeline splits (README, Options): sizes differ by at most one, the first ones larger;
    a batch smaller than ``chunks`` runs as ``batch`` micro-batches of one row."""
    chunks = max(1, min(chunks, batch))
    base, extra = divmod(batch, chunks)
    return [base + (1 if i < extra else 0) for i in range(chunks)]


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _batch_size(args: tuple, kwargs: dict) -> int:
    for t in _tensors((args, kwargs)):
        if t.dim() > 0:
            return t.shape[0]
    raise ValueError("no tensor argument with a batch dimension (dim 0) to split into micro-batches")


def _split(obj: Any, sizes: list[int]) -> list[Any]:
    """``obj`` cut into ``len(sizes)`` pieces: tensors on dim 0 (0-dim tensors go to every piece)."""
    n = len(sizes)
    if isinstance(obj, torch.Tensor):
        return [obj] * n if obj.dim() == 0 else list(torch.split(obj, sizes))
    if isinstance(obj, Mapping):
        columns = {k: _split(v, sizes) for k, v in obj.items()}
        return [type(obj)((k, columns[k][i]) for k in obj) if type(obj) is not dict else
                {k: columns[k][i] for k in obj} for i in range(n)]
    if isinstance(obj, (list, tuple)):
        columns = [_split(v, sizes) for v in obj]
        rows = [[c[i] for c in columns] for i in range(n)]
        if isinstance(obj, tuple) and hasattr(obj, "_fields"):
            return [type(obj)(*r) for r in rows]
        return [type(obj)(r) for r in rows]
    return [obj] * n


def _merge(parts: list[Any], sizes: list[int]) -> Any:
    """Micro-batch outputs merged as the pipeline merges them: tensors concatenated on dim 0,
    a 0-dim floating tensor as the micro-batch-size-weighted mean."""
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            if not first.is_floating_point():
                return first
            total = sum(sizes)
            return sum(p * (s / total) for p, s in zip(parts, sizes))
        return torch.cat(parts)
    if isinstance(first, Mapping):
        merged = {k: _merge([p[k] for p in parts], sizes) for k in first}
        if hasattr(first, "to_tuple"):  # a Hugging Face ModelOutput
            return type(first)(**merged)
        return merged if type(first) is dict else type(first)(merged)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        return dataclasses.replace(first, **{f.name: _merge([getattr(p, f.name) for p in parts], sizes)
                                             for f in dataclasses.fields(first) if f.init})
    if isinstance(first, (list, tuple)):
        merged = [_merge([p[i] for p in parts], sizes) for i in range(len(first))]
        if isinstance(first, tuple) and hasattr(first, "_fields"):
            return type(first)(*merged)
        return type(first)(merged)
    return first


# -- running ------------------------------------------------------------------------------------

@contextlib.contextmanager
def _threads(n: int | None):
    if n is None:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _copy(model: torch.nn.Module, dtype: torch.dtype | None, mode: bool | None = None) -> torch.nn.Module:
    """A deep copy with no gradients, cast to ``dtype`` (floating parameters and buffers), in ``mode``."""
    try:
        twin = copy.deepcopy(model)
    except Exception as e:
        raise TypeError(f"autopipe.verify works on deep copies of the model, and copy.deepcopy({type(model).__name__}) "
                        f"failed: {type(e).__name__}: {e}") from e
    for p in twin.parameters():
        p.grad = None
    if dtype is not None:
        twin.to(dtype)
    if mode is not None:
        twin.train(mode)
    return twin


def _cast_inputs(obj: Any, dtype: torch.dtype | None) -> Any:
    """Detached inputs; floating tensors cast to ``dtype``."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t
    if isinstance(obj, Mapping):
        items = {k: _cast_inputs(v, dtype) for k, v in obj.items()}
        return items if type(obj) is dict else type(obj)(items)
    if isinstance(obj, (list, tuple)):
        items = [_cast_inputs(v, dtype) for v in obj]
        return type(obj)(*items) if isinstance(obj, tuple) and hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _loop_step(model, args, kwargs, chunks, loss_fn, threads) -> _Step:
    """The plain model on the micro-batches, one autograd graph, one backward."""
    sizes = micro_batch_sizes(_batch_size(args, kwargs), chunks)
    pieces = list(zip(_split(args, sizes), _split(kwargs, sizes)))
    torch.manual_seed(SEED)
    with _threads(threads), torch.enable_grad():
        output = _merge([model(*a, **k) for a, k in pieces], sizes)
        loss = loss_fn(output)
        loss.backward()
    return _record(model, output, loss)


def _whole_step(model, args, kwargs, loss_fn, threads) -> _Step:
    torch.manual_seed(SEED)
    with _threads(threads), torch.enable_grad():
        output = model(*args, **kwargs)
        loss = loss_fn(output)
        loss.backward()
    return _record(model, output, loss)


def _pipeline_step(model, args, kwargs, devices, chunks, checkpoint, loss_fn, compile_kwargs) -> _Step:
    from autopipe.compile import compile as compile_pipeline
    pipe = compile_pipeline(model, devices=list(devices), chunks=chunks, checkpoint=checkpoint, **compile_kwargs)
    try:
        torch.manual_seed(SEED)
        with torch.enable_grad():
            output = pipe(*args, **kwargs)
            loss = loss_fn(output)
            loss.backward()
        step = _record(model, output, loss)
        step.shared = _shared_params(model, getattr(pipe.plan, "shared_params", None) or {})
        return step
    finally:
        close = getattr(pipe, "close", None)
        if close is not None:
            close()


def _shared_params(model: torch.nn.Module, shared: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """The plan's tied weights under the names ``named_parameters()`` gives them (one name per tensor)."""
    canonical = {}
    for name, p in model.named_parameters():
        canonical.setdefault(id(p), name)
    out = {}
    for name, stages in shared.items():
        try:
            p = model.get_parameter(str(name))
        except AttributeError:
            continue
        if id(p) in canonical:
            out[canonical[id(p)]] = tuple(stages)
    return out


def _error_text(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    text = f"{type(e).__name__}: {lines[0] if lines else ''}"
    if len(lines) > 1:
        text += "\n" + "\n".join(lines[1:6]) + ("\n..." if len(lines) > 6 else "")
    notes = [n for n in getattr(e, "__notes__", []) if n.startswith("autopipe")]
    return text + "".join(f"\n{n}" for n in notes)


DETERMINISTIC, RANDOM, IRREPRODUCIBLE = "deterministic", "random", "irreproducible"


def _randomness(model: torch.nn.Module, args, kwargs) -> str:
    """How the model's forward behaves in its current mode, found by running it (on a copy, no_grad,
    one thread) three times on the same input: under seed 1, seed 1 again, seed 2.

    ``DETERMINISTIC``: all equal. ``RANDOM``: equal under the same seed, different under another (dropout in
    training mode). ``IRREPRODUCIBLE``: different under the same seed -- the forward depends on state
    other than its inputs, parameters, buffers and the global RNG (a Python counter, its own generator);
    a traced pipeline cannot follow that. Buffers are reset before each call: a forward that updates
    its buffers (running statistics) and reads them is state the pipeline keeps too."""
    twin = _copy(model, None)
    buffers = [(b, b.clone()) for b in twin.buffers()]
    results = []
    for seed in (1, 1, 2):
        with torch.no_grad():
            for buffer, before in buffers:  # buffer updates (running statistics) are state the pipeline keeps too
                buffer.copy_(before)
        torch.manual_seed(seed)
        with torch.no_grad(), _threads(1):
            results.append([t for _, t in _leaves(twin(*args, **kwargs))])
    if not _same(results[0], results[1]):
        return IRREPRODUCIBLE
    return DETERMINISTIC if _same(results[0], results[2]) else RANDOM


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(
        x.shape == y.shape and bool(((x == y) | (torch.isnan(x) & torch.isnan(y))).all()) for x, y in zip(a, b))


def _floating_dtype(model: torch.nn.Module) -> torch.dtype:
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            return t.dtype
    return torch.get_default_dtype()


class _Runner:
    """The runs of one verify call: same devices, chunks, loss and compile options throughout."""

    def __init__(self, model, args, kwargs, devices, chunks, loss_fn, compile_kwargs):
        self.model, self.args, self.kwargs = model, args, kwargs
        self.devices, self.chunks, self.loss_fn = devices, chunks, loss_fn
        self.compile_kwargs = compile_kwargs

    def inputs(self, dtype):
        return _cast_inputs(self.args, dtype), _cast_inputs(self.kwargs, dtype)

    def pipeline(self, dtype, checkpoint, mode=None, threads=None) -> _Step:
        args, kwargs = self.inputs(dtype)
        options = dict(self.compile_kwargs)
        if threads is not None:
            options["intra_op_threads"] = threads
        return _pipeline_step(_copy(self.model, dtype, mode), args, kwargs, self.devices, self.chunks, checkpoint,
                              self.loss_fn, options)

    def loop(self, dtype, mode=None, threads=None) -> _Step:
        args, kwargs = self.inputs(dtype)
        return _loop_step(_copy(self.model, dtype, mode), args, kwargs, self.chunks, self.loss_fn, threads)

    def whole(self, dtype, mode=None, threads=None) -> _Step:
        args, kwargs = self.inputs(dtype)
        return _whole_step(_copy(self.model, dtype, mode), args, kwargs, self.loss_fn, threads)

    def randomness(self, dtype, mode=None) -> str:
        args, kwargs = self.inputs(dtype)
        return _randomness(_copy(self.model, dtype, mode), args, kwargs)


def _check(name: str, run: str, reference: str, tolerance: float | None, run_fn: Callable[[], _Step],
           ref: _Step, buffers: bool = True, notes: Sequence[str] = (), shared_tolerance: float | None = None) -> Check:
    check = Check(name=name, run=run, reference=reference, tolerance=tolerance, notes=list(notes))
    try:
        step = run_fn()
    except Exception as e:  # the pipeline failed: that is the finding
        check.error = _error_text(e)
        return check
    check.rows = _compare_steps(step, ref, buffers=buffers, shared_tolerance=shared_tolerance)
    return check


# -- verify -------------------------------------------------------------------------------------

def verify(
    model: torch.nn.Module,
    example_inputs: Any,
    example_kwargs: dict[str, Any] | None = None,
    *,
    devices: int | Sequence[str | torch.device] = 2,
    chunks: int = 4,
    checkpoint: str = "except_last",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    **compile_kwargs: Any,
) -> VerifyReport:
    """Check that ``autopipe.compile(model, ...)`` computes ``model``: one training step through the
    pipeline against the plain model, in float64 (structure) and in the model's own dtype (replay).
    See the module docstring for what is compared and why; ``print(report)`` for the findings.

    ``devices=N`` means N CPU workers (``["cpu"] * N``); a list is used as given. ``loss_fn(output)``
    returns the scalar to differentiate (default: the model's own loss, else a fixed random projection
    of every floating output). ``compile_kwargs`` go to ``autopipe.compile`` (``balance``,
    ``leaf_modules``, ``route``, ``deferred_batch_norm``, ...). Nothing of the caller's changes: the
    model, its parameters' ``.grad``, its mode, the global RNG, grad mode and thread count."""
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"checkpoint must be one of {CHECKPOINT_MODES}, got {checkpoint!r}")
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive int, got {chunks!r}")
    if isinstance(devices, bool) or not isinstance(devices, (int, list, tuple)):
        raise TypeError(f"devices must be an int (that many CPU workers) or a list of devices, got {devices!r}")
    if isinstance(devices, int):
        if devices < 1:
            raise ValueError(f"devices must be at least 1, got {devices}")
        device_list = ["cpu"] * devices
    else:
        device_list = [str(torch.device(d)) for d in devices]
    if example_inputs is None:
        args = ()
    else:
        args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    kwargs = dict(example_kwargs or {})

    cuda = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with torch.random.fork_rng(devices=cuda), _threads(torch.get_num_threads()), torch.enable_grad():
        return _verify(model, args, kwargs, device_list, chunks, checkpoint, loss_fn, compile_kwargs)


def _verify(model, args, kwargs, devices, chunks, checkpoint, loss_fn, compile_kwargs) -> VerifyReport:
    own = _floating_dtype(model)
    training = model.training
    mode_name = "train" if training else "eval"
    given_loss = loss_fn
    loss_fn = loss_fn or default_loss
    runner = _Runner(model, args, kwargs, devices, chunks, loss_fn, compile_kwargs)
    deferred = bool(compile_kwargs.get("deferred_batch_norm", False))
    buffer_notes = ["deferred_batch_norm=True tracks BatchNorm statistics over the whole mini-batch, unlike the "
                    "micro-batch loop: buffers not compared"] if deferred else []
    sizes = micro_batch_sizes(_batch_size(args, kwargs), chunks)
    ckpt = f"checkpoint={checkpoint!r}"
    loop_text = f"the plain model by hand on the same {len(sizes)} micro-batches {tuple(sizes)}"

    # The plain model in its own dtype must run: if it does not, that is the caller's error, not the pipeline's.
    reference_own = runner.loop(own, threads=1)
    report = VerifyReport(model=type(model).__name__, devices=list(devices), chunks=chunks, checkpoint=checkpoint,
                          mode=mode_name, dtype=own, loss=_describe_loss(given_loss, reference_own))
    if len(sizes) < chunks:
        report.notes.append(f"batch {sum(sizes)} < chunks={chunks}: {len(sizes)} micro-batches of one row")

    # -- structure: the pipeline against the plain model, float64 --------------------------------
    def plan_structure(dtype):
        """(randomness in the model's mode, the mode to compare in or None, the plain reference or None)."""
        randomness = runner.randomness(dtype)
        compare_mode: bool | None = training
        if randomness == RANDOM:
            compare_mode = False if training and runner.randomness(dtype, mode=False) == DETERMINISTIC else None
        reference = runner.loop(dtype, mode=compare_mode, threads=1) if compare_mode is not None else None
        return randomness, compare_mode, reference

    dtype, tolerance, threads = torch.float64, STRUCTURE_TOLERANCE, None
    try:
        randomness, compare_mode, reference = plan_structure(dtype)
    except Exception as e:
        dtype, tolerance, threads = own, OWN_DTYPE_TOLERANCE.get(own, 1e-4), 1
        report.notes.append(f"the model does not run in float64 ({_error_text(e).splitlines()[0]}): the structure "
                            f"part runs in {_dtype_name(own)}, pipeline and loop at one intra-op thread, with a float "
                            f"tolerance")
        randomness, compare_mode, reference = plan_structure(dtype)
    where = _dtype_name(dtype) + (", 1 thread per worker" if threads else "")
    random = randomness == RANDOM
    if randomness == IRREPRODUCIBLE:
        report.notes.append(f"the model's forward is not reproducible in {mode_name} mode: two calls with the same "
                            f"input and seed gave different outputs, so it depends on state other than its inputs, "
                            f"parameters, buffers and the global RNG (a Python counter, its own torch.Generator, "
                            f"...). A traced pipeline runs what the model did when it was traced and cannot follow "
                            f"that state: expect differences")
    if random:
        report.notes.append(
            f"the model draws random numbers in {mode_name} mode (two seeds gave different outputs); the pipeline "
            f"draws its own per (stage, micro-batch), so it cannot equal the plain model's draws. The structure part "
            + ("compares with the plain model in eval mode (dropout off); " if compare_mode is not None else
               "is skipped: the model is random in eval mode too; ")
            + f"the replay part compares the pipeline with itself in {mode_name} mode, same seed, bit for bit")
    if compare_mode is None:
        report.structure.append(Check("structure", "-", "-", None,
                                      notes=["skipped: the model is random in eval mode too, so no mode compares "
                                             "with the plain model"]))
    else:
        compare_name = "train" if compare_mode else "eval"
        extra = " (dropout off)" if random else ""
        report.structure.append(_check(
            "structure", f"pipeline {ckpt}, {compare_name} mode{extra}, {where}",
            f"{loop_text}, {compare_name} mode, {_dtype_name(dtype)}, 1 thread", tolerance,
            lambda: runner.pipeline(dtype, checkpoint, mode=compare_mode, threads=threads), reference,
            buffers=not deferred, notes=buffer_notes))
        if randomness == DETERMINISTIC:
            # For information: how far GPipe's micro-batch semantics are from the whole batch for this model.
            whole = runner.whole(dtype, threads=1)
            info = Check("micro-batching", f"{loop_text}, {_dtype_name(dtype)}",
                         f"the plain model on the whole batch of {sum(sizes)}, {_dtype_name(dtype)}", None,
                         rows=_compare_steps(reference, whole))
            worst = info.worst
            if worst is not None and worst.rel > tolerance:
                info.notes.append("this model mixes the rows of a batch (BatchNorm in training mode, a mean loss "
                                  "over tokens, ...): a pipeline computes per micro-batch, as GPipe defines it, so "
                                  "the structure check compares with the micro-batch loop")
            report.structure.append(info)

    # -- replay: re-materialisation against none, the model's own dtype, bit for bit -------------
    one = f"{_dtype_name(own)}, 1 thread per worker, seed {SEED}"
    try:
        never_own = runner.pipeline(own, "never", threads=1)
    except Exception as e:
        report.replay.append(Check("replay", f"pipeline checkpoint='always', {mode_name} mode, {one}",
                                   f"pipeline checkpoint='never', {one}", 0.0,
                                   error=f"checkpoint='never' raised: {_error_text(e)}"))
        return report
    report.replay.append(_check(
        "replay", f"pipeline checkpoint='always' (every micro-batch re-materialised), {mode_name} mode, {one}",
        f"pipeline checkpoint='never' (nothing re-materialised), {one}", 0.0,
        lambda: runner.pipeline(own, "always", threads=1), never_own,
        shared_tolerance=SHARED_GRAD_TOLERANCE.get(own, 1e-5)))
    if any(r.tolerance is not None and r.rel > 0 for r in report.replay[-1].rows):
        report.replay[-1].notes.append(
            "a parameter that several stages hold (tied weights) gets its gradient summed from several workers; "
            "summed in an order that depends on thread timing, two runs of the same mode differ in its last bits, "
            "so its rows have a float bound")
    if random:
        report.replay.append(Check("noise floor", "-", "-", None,
                                   notes=["not shown: the model draws random numbers, and the plain model's draws "
                                          "differ from the pipeline's"]))
    else:
        report.replay.append(Check(
            "noise floor", f"pipeline checkpoint='never', {one}", f"{loop_text}, {_dtype_name(own)}, 1 thread",
            None, rows=_compare_steps(never_own, reference_own)))
    return report
