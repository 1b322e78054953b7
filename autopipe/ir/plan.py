"""Plan: the partition pass's typed result and what a user reads first (``print(pipe.plan)``): where the cuts
are, what crosses them, and GPipe's bubble (K-1)/(M+K-1) (Huang et al. 2019, sec. 2.3)."""
from __future__ import annotations

from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import torch
from tabulate import tabulate

from .capture import CaptureReport
from .step_time import PredictedStepTime, Timed, Validation, validate


@dataclass(frozen=True)
class TargetCount:
    """How one micro-batch counts what a mean divides by: for a mean-reduced cross-entropy or NLL loss, its
    class-index targets not equal to ``ignore_index``, each weighed by the class weight where there is one (torch's
    ``total_weight``); for a mean over rows a mask selected (``x[mask].mean()``), the mask's true entries times the
    elements of a row (``per_row``). The micro-batches' means, weighted by these counts over their sum, are the plain
    model's mean."""

    target: str                 # the node of the targets, or of the mask, computed from the model's inputs alone
    ignore_index: int | None = None  # None: ``target`` is a mask of selected rows
    weight: str | None = None   # the qualified name of the class-weight tensor
    per_row: int = 1            # a mask's: the elements the mean takes from each row it selects


@dataclass(frozen=True)
class TensorInfo:
    """A value that leaves one stage: a cross-cut tensor or a graph output."""

    name: str
    shape: tuple[int, ...]      # at the traced (whole mini-batch) size
    dtype: torch.dtype
    nbytes: int
    producer: int               # stage index; -1 for a graph input
    consumers: tuple[int, ...]  # stage indices that read it
    is_output: bool = False     # also an output of the model
    kind: str = "tensor"        # "tensor", or a Python value computed in the graph: "int", "size", "other"
    # dim 0 = rows_per_sample x batch at any batch (a (batch * seq, ...) tensor: seq); 0: not the batch
    rows_per_sample: int = 1
    # an output whose micro-batch parts concatenate to the plain value (each sample's rows together)
    merges: bool = True
    mixes_samples: tuple[str,
                         ...] = ()  # (the node it is computed from that mixes samples, how): u @ v.T of two batches
    # a 0-dim float output over micro-batches: "mean" (size-weighted), "sum", "count" or "unknown"
    scalar_merge: str = "mean"
    count: TargetCount | None = None  # scalar_merge "count": the mean weighted by each micro-batch's count of targets
    # dim 0: rows a mask selected from the batch's rows, in their order (x[mask]): parts concatenate
    selected_rows: bool = False
    # an output no batch input reaches (a parameter returned as it is, a norm of the weights): every micro-batch gives
    # the plain model's value, so the first part is the output, and its gradient goes to that part alone
    batch_free: bool = False

    @property
    def batched(self) -> bool:
        """Dim 0 grows with the batch: split into micro-batches."""
        return self.rows_per_sample > 0


@dataclass(frozen=True)
class StagePlan:
    index: int
    device: torch.device
    nodes: tuple[str, ...]        # graph nodes it owns, in order
    replicated: tuple[str, ...]   # cheap input-only nodes it recomputes instead of receiving
    inputs: tuple[str, ...]       # graph inputs and tensors from earlier stages, in call order
    outputs: tuple[str, ...]      # tensors it sends on or returns as model outputs
    params: tuple[str, ...]       # qualified names of the parameters and buffers it holds
    param_bytes: int
    flops: int
    cost: float                   # in the units of the balance objective


@dataclass
class Plan:
    stages: list[StagePlan]
    tensors: dict[str, TensorInfo]
    graph_inputs: list[str]
    graph_outputs: list[str]      # the node behind each flat model output
    chunks: int
    balance: str
    route: str                    # which tracer captured the model
    lower_bound: float            # max(total / K, largest node): no plan can beat it
    optimum: float                # the best bottleneck on this node order
    tolerance: float
    shared_params: dict[str, tuple[int, ...]] = field(default_factory=dict)  # tied weights: name -> stages
    notes: list[str] = field(default_factory=list)
    # batch rows that depend on other samples (h - h.mean(0), roll): warned at compile
    across_micro_batches: list[str] = field(default_factory=list)
    pass_seconds: dict[str, float] = field(default_factory=dict)  # filled by autopipe.compile / autopipe.plan
    memory: Any = None    # passes/memory_model: a PredictedMemory, each stage's predicted bytes
    choice: Any = None    # passes/memory_model: an AutoChoice, when chunks/schedule/checkpoint were "auto"
    cuda_graphs: CaptureReport | None = None  # cuda_graphs=True: each stage captured or eager, and why
    crossing_price: float = 0.0   # cost units per byte live across a cut, paid by both its stages (0: not priced)
    step_time: PredictedStepTime | None = None  # passes/step_time.py: each stage's predicted seconds, term by term
    holders: tuple[int, ...] = ()  # the device of each stage where some hold several (a V, interleaved); (): one each

    @property
    def n_stages(self) -> int:
        return len(self.stages)

    @property
    def bottleneck(self) -> float:
        return max(s.cost for s in self.stages)

    @property
    def priced_bottleneck(self) -> float:
        """The largest stage cost with ``crossing_price`` times the bytes live across its first and last cut."""
        crossing = [sum(t.nbytes for t in self.cut_tensors(c)) for c in range(self.n_stages - 1)]
        edges = [0, *crossing, 0]
        return max(s.cost + self.crossing_price * (edges[s.index] + edges[s.index + 1]) for s in self.stages)

    @property
    def total_cost(self) -> float:
        return sum(s.cost for s in self.stages)

    @property
    def imbalance(self) -> float:
        """max / mean stage cost; 1.0 is perfectly balanced."""
        mean = self.total_cost / self.n_stages
        return self.bottleneck / mean if mean else 1.0

    @property
    def device_costs(self) -> dict[int, tuple[tuple[int, ...], float]]:
        """Per device: the stages it holds and their summed cost, what its step runs (a device a stage where
        ``holders`` is empty)."""
        held: dict[int, tuple[tuple[int, ...], float]] = {}
        for s, device in zip(self.stages, self.holders or range(self.n_stages)):
            stages, cost = held.get(device, ((), 0.0))
            held[device] = ((*stages, s.index), cost + s.cost)
        return dict(sorted(held.items()))

    @property
    def bubble(self) -> Fraction:
        return Fraction(self.n_stages - 1, self.chunks + self.n_stages - 1)

    @property
    def predicted_speedup(self) -> float:
        """Over one device: total work / busiest device (its stages' sum), times the share of clock cycles not in
        the bubble."""
        busiest = max((cost for _, cost in self.device_costs.values()), default=0.0)
        return float(1 - self.bubble) * self.total_cost / busiest if busiest else 1.0

    def validate(self, timeline: Timed) -> Validation:
        """The predicted step time (``step_time``, set by passes/step_time.py's ``predict_step_time``) beside what
        ``timeline`` (``pipe.timeline`` after a step) measured, per stage and term; a stage more than 10% off names
        the term that misses most."""
        if self.step_time is None:
            raise ValueError("the plan has no predicted step time: call autopipe.passes.step_time.predict_step_time("
                             "costed, plan, node_times) first (benchmarks/cost_model.py shows how)")
        return validate(self.step_time, timeline)

    def cut_tensors(self, cut: int) -> list[TensorInfo]:
        """Tensors live across the cut between stage ``cut`` and ``cut + 1``."""
        return [t for t in self.tensors.values() if 0 <= t.producer <= cut < max(t.consumers, default=-1)]

    def __str__(self) -> str:
        def moved(names: tuple[str, ...]) -> str:  # the values that cross a cut: made by a stage, not graph inputs
            infos = [self.tensors[n] for n in names if n in self.tensors and self.tensors[n].producer >= 0]
            return f"{len(infos)} / {human_bytes(sum(t.nbytes for t in infos))}"

        total = self.total_cost or 1.0
        rows = [[s.index, str(s.device), len(s.nodes), human_bytes(s.param_bytes), f"{100 * s.cost / total:.1f}%",
                 moved(s.inputs), moved(s.outputs),
                 _shorten(", ".join(n for n in s.inputs if n not in self.graph_inputs) or "-")] for s in self.stages]
        table = tabulate(rows,
                         headers=["stage", "device", "nodes", "params", f"{self.balance} share", "in (n / bytes)",
                                  "out (n / bytes)", "receives"])
        lines = [f"Plan: {self.n_stages} stages x {self.chunks} micro-batches, balanced by {self.balance}, "
                 f"traced by {self.route}", table, "Cuts (tensors crossing, at the whole mini-batch):"]
        for c in range(self.n_stages - 1):
            crossing = self.cut_tensors(c)
            names = ", ".join(f"{t.name}{list(t.shape)}" for t in crossing) or "nothing"
            lines.append(f"  cut {c}|{c + 1}: {len(crossing)} tensor(s), "
                         f"{human_bytes(sum(t.nbytes for t in crossing))}: {_shorten(names, 100)}")
        bound = self.bottleneck / self.lower_bound if self.lower_bound else 1.0
        if self.crossing_price:
            lines.append(f"crossings priced at {self.crossing_price:g} {self.balance} a byte: largest stage with its "
                         f"link {self.priced_bottleneck:.4g}, the priced optimum {self.optimum:.4g}")
        # Note [the lower bound and the optimum]: max(total/K, largest node) ignores that a stage holds whole nodes,
        # so it can sit well under the least bottleneck (an MLP's Linear is 5% of a stage of a deep LM at K=16);
        # the optimum is the exact least bottleneck on the node order, and the tolerance spends the rest on fewer
        # crossings: max / bound = (optimum / bound) x (max / optimum).
        exact = ""
        if self.optimum == self.optimum and self.lower_bound and self.optimum and not self.crossing_price:
            exact = (f": optimum / bound {self.optimum / self.lower_bound:.3f} x max / optimum "
                     f"{self.bottleneck / self.optimum:.3f}")
        lines += [f"imbalance (max/mean stage): {self.imbalance:.3f}   max / lower bound {bound:.3f}{exact}   (lower "
                  f"bound = max(total/K, largest node))",
                  *self._device_lines(),
                  f"bubble (K - 1)/(K + M - 1) = {self.bubble} = {float(self.bubble):.3f}   predicted speedup "
                  f"{self.predicted_speedup:.2f}x on {len(self.device_costs)} devices (efficiency "
                  f"{100 * self.predicted_speedup / len(self.device_costs):.0f}%)"]
        replicas = {n: f" (on {d[0]}, replicated to {', '.join(map(str, d[1:]))} each step)"
                    for n, d in self.param_devices.items() if len(d) > 1}
        shared = [f"{n} in stages {list(s)}{replicas.get(n, '')}" for n, s in self.shared_params.items()]
        if shared:
            lines.append("shared parameters (one tensor, gradients summed in stage order): " + ", ".join(shared))
        if self.pass_seconds:
            passes = ", ".join(f"{n} {t:.2f} s" for n, t in self.pass_seconds.items())
            lines.append(f"compiled in {sum(self.pass_seconds.values()):.2f} s: {passes}")
        lines += [str(x) for x in (self.cuda_graphs, self.memory, self.choice, self.step_time) if x is not None]
        lines.extend(f"note: {n}" for n in self.notes + self.across_micro_batches)
        return "\n".join(lines)

    __repr__ = __str__

    def _device_lines(self) -> list[str]:
        """Where a device holds several stages: each device's stages and share, and the max/mean device."""
        if len(set(self.holders)) == len(self.holders):
            return []
        held, total = self.device_costs, self.total_cost or 1.0
        shares = ", ".join(f"{d} {list(stages)} {100 * cost / total:.1f}%" for d, (stages, cost) in held.items())
        worst = max(cost for _, cost in held.values()) * len(held) / total
        return [f"devices (the stages each holds, {self.balance} share): {shares}; imbalance "
                f"(max/mean device): {worst:.3f}"]

    @property
    def param_devices(self) -> dict[str, tuple[torch.device, ...]]:
        """Each parameter's and buffer's devices: the first stage using it holds it (compile places it there); a
        stage on another device runs on a replica refreshed every step (runtime/task.py)."""
        devices: dict[str, dict[torch.device, None]] = {}  # an ordered set per name
        for sp in self.stages:
            for name in sp.params:
                devices.setdefault(name, {})[sp.device] = None
        return {name: tuple(d) for name, d in devices.items()}


def human_bytes(n: float) -> str:
    for prefix in ("", "Ki", "Mi", "Gi", "Ti"):
        if abs(n) < 1024 or prefix == "Ti":
            return f"{n:.1f} {prefix}B" if prefix else f"{n:.0f} B"
        n /= 1024


def _shorten(text: str, width: int = 48) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."
