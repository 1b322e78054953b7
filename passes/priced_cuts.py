"""The cut solver with crossings priced (numpy only, no graph knowledge): stage [a, b) costs its nodes' weights plus
``crossing_price`` times the bytes live across its first and its last cut, what it receives and sends over the link.

Exact as passes/cut_solver.py is: first the least priced bottleneck B* (ignoring ``kept_whole``, as there), by
bisection over a feasibility test that is one prefix maximum per stage: with u[b] = W[b] + p L[b] and v[a] = W[a] -
p L[a], stage [a, b) costs u[b] - v[a], so cut s can be at b iff the largest v over the positions cut s - 1 reaches
before b is >= u[b] - bound. Then the least priced bottleneck of the plans that keep every ``kept_whole`` entry (B*
where one does), and among its plans the fewest then smallest crossing tensors: a layered shortest path, one position
at a time.

Note [a priced tolerance]: unpriced, the tolerance buys fewer crossings with balance. Priced, the bytes are in each
stage's cost already, and spending the tolerance on fewer tensors gave a slower step than the optimum's (Llama-3-70B at
K=8: one-tensor cuts only, and a last stage far under the others). So a priced plan is the least priced bottleneck,
ties to the fewest crossings, and the tolerance is only what keeping ``kept_whole`` may cost."""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from .cut_solver import CutProblem, CutSolution, NoCutKeepsWhole, live_across_positions, validated_size
from .kept_ranges import KeptRanges
from .shared_devices import balance_devices


class _Priced:
    """The problem as u, v and the cut keys over positions 0..N."""

    def __init__(self, problem: CutProblem, crossing_price: float):
        if not (crossing_price >= 0 and math.isfinite(crossing_price)):
            raise ValueError(f"crossing_price must be finite and non-negative, got {crossing_price!r}")
        if problem.memory_cap is not None:
            raise ValueError("a crossing_price and a memory_cap cannot be solved together yet: leave one of them out")
        self.n, self.k = validated_size(problem), problem.n_stages
        prefix = np.concatenate(([0.0], np.cumsum(np.asarray(problem.weights, dtype=float))))
        self.tensors, self.data = live_across_positions(problem, self.n)
        priced = crossing_price * self.data.astype(float)
        self.u, self.v = prefix + priced, prefix - priced
        self.kept = KeptRanges(problem.kept_whole, self.n)
        cuts = self.k - 1
        scale = cuts * int(self.data.max()) + 1
        worst = cuts * (int(self.tensors.max()) * scale + int(self.data.max()))
        self.keys = self.tensors.astype(np.int64 if worst < 2**61 else object) * scale + self.data
        self.infinity = 2 * worst + 1

    def band(self, s: int) -> range:
        """Where cut s may be: each stage holds a node."""
        return range(s, self.n - self.k + s + 1)

    def costs(self, starts: Sequence[int]) -> np.ndarray:
        first = np.asarray(starts)
        return self.u[np.append(first[1:], self.n)] - self.v[first]

    def feasible(self, bound: float) -> tuple[int, ...] | None:
        """A plan whose every stage costs <= bound, ignoring kept_whole; None if there is none."""
        reach = np.zeros(self.n + 1, dtype=bool)
        reach[0] = True
        layers = [reach]
        for s in range(1, self.k + 1):
            best = np.maximum.accumulate(np.where(reach, self.v, -np.inf))
            reach = np.zeros(self.n + 1, dtype=bool)
            band = np.arange(self.band(s).start, self.band(s).stop)
            reach[band] = self.u[band] - best[band - 1] <= bound
            layers.append(reach)
        if not reach[self.n]:
            return None
        plan, b = [], self.n
        for s in range(self.k - 1, 0, -1):
            a = np.flatnonzero(layers[s][:b] & (self.u[b] - self.v[:b] <= bound))
            b = int(a[np.argmax(self.v[a])])
            plan.append(b)
        return (0, *reversed(plan))

    def fewest(self, bound: float, kept: KeptRanges | None) -> tuple[int, ...] | None:
        """Within bound and keeping ``kept``: the least summed cut key, ties to the cheapest stage (None: no plan)."""
        totals = np.full(self.n + 1, self.infinity, dtype=self.keys.dtype)
        totals[0] = 0
        choice = []
        for s in range(1, self.k + 1):
            fresh = np.full(self.n + 1, self.infinity, dtype=self.keys.dtype)
            picked = np.full(self.n + 1, -1)
            for b in self.band(s):
                a = np.arange(s - 1, b)
                ok = (totals[a] < self.infinity) & (self.u[b] - self.v[a] <= bound)
                if kept:
                    ok &= kept.allows(a, b)
                a = a[ok]
                if a.size:
                    least = totals[a].min()
                    ties = a[totals[a] == least]
                    picked[b] = ties[np.argmax(self.v[ties])]
                    fresh[b] = least + self.keys[b]
            totals = fresh
            choice.append(picked)
        if not totals[self.n] < self.infinity:
            return None
        plan, b = [], self.n
        for s in range(self.k, 1, -1):
            b = int(choice[s - 1][b])
            plan.append(b)
        return (0, *reversed(plan))


def _least(probe, ceiling: float) -> tuple[float, tuple[int, ...] | None]:
    """The least bound at which ``probe(bound) -> (plan or None, its worst stage)`` finds a plan, and that plan: exact,
    by bisection until no float lies between a bound without a plan and a plan's own bottleneck."""
    plan, top = probe(ceiling)
    if plan is None:
        return math.inf, None
    bottom = 0.0
    while True:
        at = bottom + (top - bottom) / 2
        if not bottom < at < top:
            return top, plan
        found, worst = probe(at)
        if found is None:
            bottom = at
        else:
            plan, top = found, min(worst, at)


def solve_priced_cuts(problem: CutProblem, crossing_price: float) -> CutSolution:
    """solve_cuts with each stage also paying ``crossing_price`` (cost units per byte) for the bytes live across its
    first and last cut: the least priced bottleneck, and among its plans the fewest crossings (Note [a priced
    tolerance]); NoCutKeepsWhole where no plan within (1 + tolerance) of it keeps every ``kept_whole`` entry.
    ``memory_cap`` is refused."""
    chain = _Priced(problem, crossing_price)
    ceiling = float(chain.u.max() - chain.v.min()) + 1.0  # no stage costs more

    def relaxed(bound: float):
        plan = chain.feasible(bound)
        return plan, float(chain.costs(plan).max()) if plan is not None else math.inf

    def keeping(bound: float):
        plan = chain.fewest(bound, chain.kept)
        return plan, float(chain.costs(plan).max()) if plan is not None else math.inf

    optimum, best = _least(relaxed, ceiling)
    least = optimum if chain.fewest(optimum, chain.kept) is not None else _least(keeping, ceiling)[0]
    if least > (1.0 + problem.tolerance) * optimum:
        entry = chain.kept.broken(chain.fewest(optimum, None) or best)
        raise NoCutKeepsWhole(f"no {chain.k} stages within {(1.0 + problem.tolerance) * optimum:g} (the priced optimum "
                              f"{optimum:g} times 1 + tolerance) keep one of {list(problem.kept_whole[entry])} in one "
                              f"stage; the least priced bottleneck of a plan that keeps them all is {least:g}", entry,
                              least, optimum)
    plan = chain.fewest(least, chain.kept)
    if problem.v_devices:  # Note [stages balanced as their device's sum]; Note [a priced tolerance]
        plan = balance_devices(plan, problem.v_devices, problem.weights, lambda a, b: chain.u[b] - chain.v[a],
                               chain.kept.allows, chain.keys, 0.0).starts
    costs = chain.costs(plan)
    cuts = np.asarray(plan[1:], dtype=int)
    return CutSolution(starts=tuple(int(a) for a in plan), stage_costs=tuple(float(c) for c in costs),
                       bottleneck=float(costs.max()), optimum=float(optimum),
                       cut_tensors=tuple(int(t) for t in chain.tensors[cuts]),
                       cut_bytes=tuple(int(d) for d in chain.data[cuts]), stage_memory=tuple(0.0 for _ in plan))
