"""What autopipe.verify reports: each quantity compared (``Row``), each comparison (``Check``), and the report a user
prints (``VerifyReport``), with its verdict and tables."""
from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass, field

import torch
from tabulate import tabulate

GRAD_FLOOR = 1e-3  # a gradient's difference is measured against at least GRAD_FLOOR x the model's largest gradient


@dataclass
class Row:
    """One quantity compared: max |a - b| against max |b| of the reference."""

    kind: str                  # "loss", "output", "grad", "buffer"
    name: str
    max_abs_diff: float
    max_abs_ref: float
    note: str = ""
    tolerance: float | None = None  # this row's own bound, where it differs from its check's (tied weights)
    floor: float = 0.0         # the smallest scale the difference is measured against (GRAD_FLOOR)

    @property
    def floored(self) -> bool:
        return self.max_abs_ref < self.floor

    @property
    def rel(self) -> float:  # a difference against a zero scale is infinite; 0 and NaN stay as they are
        scale = max(self.max_abs_ref, self.floor)
        return self.max_abs_diff / scale if scale > 0 else math.inf if self.max_abs_diff > 0 else self.max_abs_diff

    def within(self, tolerance: float) -> bool:
        return self.rel <= (tolerance if self.tolerance is None else self.tolerance)  # NaN is never within

    def worst(self) -> float:  # a sort key: NaN is the worst
        return math.inf if math.isnan(self.rel) else self.rel


@dataclass
class Check:
    """One comparison, ``run`` against ``reference``; a tolerance of None: for information only."""

    name: str
    run: str
    reference: str
    tolerance: float | None
    rows: list[Row] = field(default_factory=list)
    error: str | None = None           # the run raised: the exception, in words
    notes: list[str] = field(default_factory=list)

    @property
    def informational(self) -> bool:
        return self.tolerance is None

    @property
    def failures(self) -> list[Row]:
        return [] if self.informational else [r for r in self.rows if not r.within(self.tolerance)]

    @property
    def passed(self) -> bool:
        return self.informational or (self.error is None and not self.failures)

    def bound(self) -> str:
        return "0" if self.tolerance == 0 else f"{self.tolerance:.0e}"

    def __str__(self) -> str:
        if self.informational and not self.rows:
            return f"[{self.name}] " + "; ".join(self.notes or ["nothing compared"])
        bit = ": bit for bit" if self.tolerance == 0 else ""
        verdict = "info (not part of the verdict)" if self.informational \
            else f"{'PASS' if self.passed else 'FAIL'} (tolerance {self.bound()}{bit})"
        lines = [f"[{self.name}] {verdict}", f"  run:       {self.run}", f"  reference: {self.reference}"]
        lines += [f"  note: {n}" for n in self.notes]
        if self.error is not None:
            return "\n".join([*lines, "  the run raised: " + self.error.replace("\n", "\n    ")])
        return "\n".join([*lines, textwrap.indent(_table(self.rows, self.tolerance), "  ")])


@dataclass
class VerifyReport:
    """What :func:`verify` found. ``print(report)`` shows it; ``report.passed`` is the verdict."""

    model: str
    devices: list[str]
    chunks: int
    checkpoint: str
    mode: str                 # "train" or "eval": the model's own mode
    dtype: torch.dtype        # the model's own floating dtype
    loss: str                 # which loss was used, in words
    structure: list[Check] = field(default_factory=list)
    replay: list[Check] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def checks(self) -> list[Check]:
        return [*self.structure, *self.replay]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def verdict(self) -> str:
        parts = []
        for c in self.checks:
            if c.informational or c.passed != self.passed:  # PASS: every judged check; FAIL: the failing ones
                continue
            if c.error is not None:
                first = c.error.splitlines()[0]
                why = " (why: print the report)" if first.endswith(":") else ""
                parts.append(f"{c.name} raised {first.rstrip(':')}{why}")
            elif not c.passed:
                bad = sorted(c.failures, key=Row.worst, reverse=True)
                names = ", ".join(r.name for r in bad[:3]) + (f", +{len(bad) - 3} more" if len(bad) > 3 else "")
                parts.append(f"{c.name}: {len(bad)} over tolerance {c.bound()} ({names})")
            else:  # the worst row held to the check's own bound (tied weights have theirs)
                worst = max((r for r in c.rows if r.tolerance is None), key=Row.worst, default=None)
                bound = "bit for bit" if c.tolerance == 0 else f"<= {c.tolerance:.0e}"
                parts.append(f"{c.name} {bound} (worst {_fmt(worst.rel) if worst else '-'})")
        return ("PASS: " if self.passed else "FAIL: ") + "; ".join(parts)

    def __str__(self) -> str:
        where = f"{len(self.devices)} x {self.devices[0]}" if len(set(self.devices)) == 1 else ", ".join(self.devices)
        head = (f"autopipe.verify: {self.model} in {self.mode} mode ({dtype_name(self.dtype)}), {len(self.devices)} "
                f"stages on {where} x {self.chunks} micro-batches, checkpoint={self.checkpoint!r}\nloss: {self.loss}")
        return "\n".join([head, *(f"note: {n}" for n in self.notes),
                          *(f"\n{x}" for x in [*self.checks, self.verdict()])])


def _fmt(x: float) -> str:
    return "0" if x == 0 else f"{x:.1e}" if math.isfinite(x) else str(x)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _table(rows: list[Row], tolerance: float | None) -> str:
    shown, hidden = [], []
    for kind, limit in (("loss", 1), ("output", 5), ("grad", 10), ("buffer", 5)):  # the worst of each kind
        of_kind = sorted((r for r in rows if r.kind == kind), key=Row.worst, reverse=True)
        shown += of_kind[:limit]
        if len(of_kind) > limit:
            hidden.append(f"{len(of_kind) - limit} more {kind} rows, each <= {_fmt(of_kind[limit].rel)}")
    body = [[r.kind, r.name + (f" ({r.note})" if r.note else ""), _fmt(r.max_abs_diff),
             _fmt(r.max_abs_ref) + ("*" if r.floored else ""), _fmt(r.rel),
             "" if tolerance is None else "ok" if r.within(tolerance) else "FAIL"] for r in shown]
    text = tabulate(body, headers=["", "name", "max|Δ|", "max|ref|", "max|Δ|/max|ref|", ""], disable_numparse=True)
    text += "\n(" + "; ".join(hidden) + ")" if hidden else ""
    if floor := next((r.floor for r in shown if r.floored), 0.0):  # a gradient zero in exact arithmetic holds noise
        text += f"\n* below {GRAD_FLOOR:.0e} x the largest gradient (rounding noise): max|Δ| divided by {_fmt(floor)}"
    return text
