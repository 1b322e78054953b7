"""Balanced contiguous pipeline cuts with the fewest tensors crossing them, exactly.

Two parts: the pure solver (``solve_cuts``: numpy, no torch) and, at the bottom,
the graph adapter ``partition`` that builds a ``CutProblem`` from a traced graph.

The model
---------
Nodes 0..N-1 come in a fixed topological order; a plan cuts them into K
non-empty contiguous stages. Cut position p (0 <= p <= N) sits just before node
p. A tensor produced by node i and last read by node l is live across positions
i+1..l; a replicable producer's tensor never is (each stage that reads it
recomputes it), and positions 0 and N carry nothing. With W the prefix sums of
the weights and L[p] the bytes live across position p, stage [a, b)

    costs  W[b] - W[a] + comm_cost_per_byte * (L[a] + L[b])
    holds  node_memory[a:b] + each shared tensor it touches + activation_multiplier * L[a]

so the communication term charges a stage with everything live across either
of its boundary cuts, skip connections passing through it included. Writing
the cost as closing[b] - opening[a] (closing = W + comm*L, opening = W - comm*L)
is what lets the searches below run as whole-array passes.

The algorithm (N nodes, E edges, K stages)
------------------------------------------
1. Live tensors and bytes at every position: one difference array over each
   tensor's [producer+1, last reader] range, O(N + E).
2. The least bottleneck B*. It is the cost of some stage, and "is there a
   K-stage plan with every stage <= B that fits memory?" is monotone in B, so
   bisect on B (chains-on-chains partitioning: Bokhari 1988; Nicol 1994; Pinar
   & Aykanat 2004). Every probe snaps the bracket onto stage costs: a feasible
   one lowers the top to its own plan's bottleneck, an infeasible one raises
   the bottom to the cheapest stage it could not afford (nothing it computed
   changes below that), so the loop stops exactly on B*, in some 20-30 probes.
   - A relaxation first: cost_floor(a, b) = min(closing[b:]) - max(opening[:a+1])
     never exceeds the cost and, like the memory reach made monotone, never
     grows when a stage is split, so "at most K stages" is "exactly K" and the
     probe is the greedy that makes each stage as long as it may, O(K log N).
     Without a communication term or activation memory (the default) this is
     the problem itself.
   - Otherwise its optimum is where an exact-K search starts, probing by
     reachability over prefixes, layer by layer, over only the band of
     positions where the relaxation lets cut k sit at that bound (two greedy
     sweeps); near B* the bands are narrow. Without a communication term stage
     [a, b) is allowed exactly for b in (a, end[a]], so a layer is a union of
     intervals: one difference array. With it, b is reached if some reached
     start whose memory reaches b has opening[a] >= closing[b] - B: a maximum
     over the intervals covering b, which a sparse table run backwards gives
     for a whole band at once. O(sum of band sizes * log N) per probe.
3. Among plans whose stages all cost <= (1 + tolerance) * B*: the fewest
   crossing tensors, then bytes. A cut's crossing tensors and bytes depend
   only on its position, so this is a shortest path through exactly K layers
   (PipeDream's planner, Narayanan et al. 2019, runs the same prefix DP on one
   criterion), with the pair packed into one integer key and each layer again
   only over its cut's band. Each layer takes, for every end b, the least key
   over the admissible starts: without a communication term the intervals
   covering b (the backward sparse table); with it also opening[a] >=
   closing[b] - bound, so the intervals go into a segment tree whose nodes keep
   them sorted by opening (a merge sort tree) and a query is one suffix minimum
   per level: O(band log^2 N) per layer.
4. If no plan fits memory, the most memory-balanced plan (the same snapping
   bisection, on memory instead of cost) names the stages over the cap and by
   how much; its worst stage is the least cap that would do.
"""

from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch
import torch.fx as fx

from autopipe.plan import Plan, StagePlan, TensorInfo
from autopipe.random_ops import is_random_target
from .cost import CostedGraph


@dataclass(frozen=True)
class CutProblem:
    """A node chain to cut into ``n_stages`` contiguous pipeline stages (see the module docstring)."""

    weights: Sequence[float]  # cost of node i; nodes are in a fixed topological order 0..N-1
    out_bytes: Sequence[int]  # size of node i's output tensor(s)
    consumers: Sequence[Sequence[int]]  # consumers[i]: node indices j > i that read node i's output
    n_stages: int  # K: the exact number of non-empty contiguous stages
    tolerance: float = 0.03  # plans with bottleneck <= (1 + tolerance) * optimum are balanced enough
    comm_cost_per_byte: float = 0.0  # a stage also costs this much per byte live across either of its cuts
    # replicable[i]: every stage reading node i recomputes it, so its output never crosses a cut
    # (its weight still counts once, where it sits in the order)
    replicable: Sequence[bool] | None = None
    node_memory: Sequence[float] | None = None  # resident bytes of node i (params, grads, optimizer state)
    # (bytes, nodes): a tensor (a tied weight, say) held by every stage that holds any of the nodes
    shared_memory: Sequence[tuple[float, Sequence[int]]] | None = None
    activation_multiplier: float = 0.0  # a stage also holds this times the bytes live across its first cut
    memory_cap: float | None = None  # per-stage cap on the memory above; None: no cap


@dataclass(frozen=True)
class CutSolution:
    """The chosen plan and the numbers that justify it."""

    starts: tuple[int, ...]  # stage s covers nodes [starts[s], starts[s+1]); starts[0] == 0; len == K
    stage_costs: tuple[float, ...]
    bottleneck: float  # max(stage_costs)
    optimum: float  # the least possible bottleneck (before tolerance)
    cut_tensors: tuple[int, ...]  # per cut c (between stages c and c+1): distinct tensors live across it
    cut_bytes: tuple[int, ...]
    stage_memory: tuple[float, ...]


class NoFeasiblePlan(ValueError):
    """No split into the requested number of stages fits the memory cap; the message names the
    stages of the most memory-balanced split that are over it, and by how many bytes."""


def solve_cuts(problem: CutProblem) -> CutSolution:
    """The plan with the least bottleneck, or, among plans within tolerance of it, the one with
    the fewest (then smallest) tensors crossing cuts; every stage within the memory cap."""
    chain = _Chain(problem)
    optimum = _least_bottleneck(chain)
    starts = _fewest_crossings(chain, (1.0 + problem.tolerance) * optimum)
    return chain.solution(starts, optimum)


# ---- the problem as arrays over cut positions ---------------------------------------------


class _Chain:
    """Everything the searches need, as arrays over cut positions 0..N (position p is just before node p)."""

    def __init__(self, problem: CutProblem):
        n = _validated_size(problem)
        self.n, self.stages, self.cap = n, problem.n_stages, problem.memory_cap
        self.comm = float(problem.comm_cost_per_byte)
        self.prefix = np.concatenate(([0.0], np.cumsum(np.asarray(problem.weights, dtype=float))))
        self.live_tensors, self.live_bytes = _live_across_positions(problem, n)
        self.opening = self.prefix - self.comm * self.live_bytes
        self.closing = self.prefix + self.comm * self.live_bytes
        self.memory = _Memory(problem, self.live_bytes, n)
        self.memory_end = np.full(n, n) if self.cap is None else self.memory.reach(self.cap)
        self.envelope = np.maximum.accumulate(self.memory_end)  # memory_end itself when monotone
        self.floor_close = np.minimum.accumulate(self.closing[::-1])[::-1]
        self.floor_open = np.maximum.accumulate(self.opening)
        self.floor_open_descending = -self.floor_open[::-1]
        self.ceiling = float(self.closing.max() - self.opening.min())  # no stage costs more

    def cost(self, a, b):
        """Cost of stage [a, b); the one expression every comparison with a bound uses."""
        return self.closing[b] - self.opening[a]

    def worst_stage(self, starts: Sequence[int]) -> float:
        first = np.asarray(starts)
        return float(self.cost(first, np.append(first[1:], self.n)).max())

    def cost_floor(self, a, b):
        """A lower bound on cost(a, b) that grows with b and shrinks with a (cost itself without a
        communication term): suffix minimum of closing at b minus prefix maximum of opening at a."""
        return self.floor_close[b] - self.floor_open[a]

    def floor_end(self, a, bound: float):
        """For each start a: the last end b with cost_floor(a, b) <= bound."""
        return _last_within(self.floor_close, self.floor_open[a], bound)

    def floor_start(self, b: int, bound: float) -> int:
        """The first start a with cost_floor(a, b) <= bound."""
        return self.n - int(_last_within(self.floor_open_descending, -self.floor_close[b], bound))

    def bands(self, bound: float) -> tuple[list[int], list[int], float]:
        """Where cut k can be in a plan whose stages all cost <= bound: [low[k], high[k]], from the
        relaxation (cost_floor for the cost, memory reach made monotone) by greedy from both ends; and the
        least larger bound at which these would widen (the next stage the greedy could stretch)."""
        n, k = self.n, self.stages
        high, widen = [0], math.inf
        for s in range(1, k + 1):
            a = high[-1]
            by_cost, limit = int(self.floor_end(a, bound)), min(int(self.envelope[a]), n - k + s)
            if by_cost < limit:
                widen = min(widen, float(self.cost_floor(a, by_cost + 1)))
            high.append(min(by_cost, limit))
        low = [n]
        for s in range(k - 1, -1, -1):
            b = low[-1]
            by_cost, by_memory = self.floor_start(b, bound), int(np.searchsorted(self.envelope, b))
            if by_cost > max(by_memory, s):
                widen = min(widen, float(self.cost_floor(by_cost - 1, b)))
            low.append(max(by_cost, by_memory, s))
        return low[::-1], high, widen

    def cut_keys(self) -> tuple[np.ndarray, int]:
        """Per position: (crossing tensors, crossing bytes) packed into one integer that orders
        sums over at most K-1 cuts lexicographically; int64 unless that could overflow."""
        tensors, data = self.live_tensors, self.live_bytes  # both 0 at positions 0 and N
        cuts = self.stages - 1
        scale = cuts * int(data.max()) + 1
        worst = cuts * (int(tensors.max()) * scale + int(data.max()))
        if worst < 2**61:
            return tensors * scale + data, 2**62
        keys = np.array([int(t) * scale + int(d) for t, d in zip(tensors, data)], dtype=object)
        return keys, 2 * worst + 1

    def solution(self, starts: Sequence[int], optimum: float) -> CutSolution:
        first = np.asarray(starts)
        last = np.append(first[1:], self.n)
        costs = self.cost(first, last)
        return CutSolution(
            starts=tuple(int(a) for a in starts),
            stage_costs=tuple(float(c) for c in costs),
            bottleneck=float(costs.max()),
            optimum=float(optimum),
            cut_tensors=tuple(int(self.live_tensors[p]) for p in first[1:]),
            cut_bytes=tuple(int(self.live_bytes[p]) for p in first[1:]),
            stage_memory=tuple(float(m) for m in self.memory.held(first, last)),
        )


def _validated_size(problem: CutProblem) -> int:
    """Number of nodes, after rejecting inputs that would make the answer meaningless."""
    n, k = len(problem.weights), problem.n_stages
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"n_stages must be a positive integer, got {k!r}")
    if k > n:
        raise ValueError(f"n_stages={k} but the graph has only {n} nodes, and every stage needs at least "
                         f"one: use at most {n} stages")
    for name in ("out_bytes", "consumers", "replicable", "node_memory"):
        value = getattr(problem, name)
        if value is not None and len(value) != n:
            raise ValueError(f"{name} has {len(value)} entries but weights has {n}")
    for name, values in (("weights", problem.weights), ("out_bytes", problem.out_bytes),
                         ("node_memory", problem.node_memory or ()),
                         ("shared_memory sizes", [size for size, _ in problem.shared_memory or ()])):
        array = np.asarray(values, dtype=float)
        if not np.all(np.isfinite(array) & (array >= 0)):
            raise ValueError(f"{name} must be finite and non-negative")
    for name in ("tolerance", "comm_cost_per_byte", "activation_multiplier"):
        value = getattr(problem, name)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{name} must be finite and non-negative, got {value!r}")
    if problem.memory_cap is not None and not problem.memory_cap >= 0:
        raise ValueError(f"memory_cap must be non-negative or None, got {problem.memory_cap!r}")
    for _, nodes in problem.shared_memory or ():
        if not all(0 <= i < n for i in nodes):
            raise ValueError(f"shared_memory names nodes outside 0..{n - 1}: {list(nodes)}")
    return n


def _live_across_positions(problem: CutProblem, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Tensors and bytes live across every cut position, from one difference array: O(N + E)."""
    readers_per_node = np.fromiter(map(len, problem.consumers), dtype=np.int64, count=n)
    readers = np.fromiter(itertools.chain.from_iterable(problem.consumers), dtype=np.int64,
                          count=int(readers_per_node.sum()))
    edge_source = np.repeat(np.arange(n), readers_per_node)
    backward = (readers <= edge_source) | (readers >= n)
    if backward.any():
        i = int(np.flatnonzero(backward)[0])
        raise ValueError(f"consumers[{edge_source[i]}] names node {readers[i]}: consumers must come "
                         f"later in the order, below {n}")
    producers = np.flatnonzero(readers_per_node)
    offsets = np.cumsum(readers_per_node) - readers_per_node
    last_reader = np.maximum.reduceat(readers, offsets[producers]) if producers.size else producers
    if problem.replicable is not None:  # recomputed by every reader: never crosses a cut
        crosses = ~np.asarray(problem.replicable, dtype=bool)[producers]
        producers, last_reader = producers[crosses], last_reader[crosses]
    size = np.asarray(problem.out_bytes, dtype=np.int64)[producers]
    tensors, data = np.zeros(n + 2, np.int64), np.zeros(n + 2, np.int64)
    np.add.at(tensors, producers + 1, 1)
    np.add.at(tensors, last_reader + 1, -1)
    np.add.at(data, producers + 1, size)
    np.add.at(data, last_reader + 1, -size)
    return np.cumsum(tensors)[: n + 1], np.cumsum(data)[: n + 1]


class _Memory:
    """What stage [a, b) holds: its nodes' memory, every shared tensor it touches, and
    activation_multiplier times the bytes it receives."""

    def __init__(self, problem: CutProblem, live_bytes: np.ndarray, n: int):
        own = np.zeros(n) if problem.node_memory is None else np.array(problem.node_memory, dtype=float)
        spans: dict[tuple[int, ...], float] = {}
        for size, nodes in problem.shared_memory or ():
            members = tuple(sorted(set(int(i) for i in nodes)))
            if len(members) == 1:
                own[members[0]] += size  # a tensor only one node touches is that node's memory
            elif members:
                spans[members] = spans.get(members, 0.0) + float(size)
        # per shared tensor: the first member at or after each position (n: none), so that
        # stage [a, b) touches it exactly when next_member[a] < b
        self.shared = []
        for members, size in spans.items():
            ext = np.append(members, n)
            self.shared.append((size, ext[np.searchsorted(members, np.arange(n + 1))]))
        self.prefix = np.concatenate(([0.0], np.cumsum(own)))
        self.activation = float(problem.activation_multiplier) * live_bytes
        self.n = n

    def held(self, a, b):
        """Memory of stage [a, b), elementwise over arrays of starts and ends."""
        total = self.prefix[b] - self.prefix[a] + self.activation[a]
        for size, next_member in self.shared:
            total = total + size * (next_member[a] < b)
        return total

    def reach(self, cap: float) -> np.ndarray:
        """For each start a: the last end b with held(a, b) <= cap (a itself when node a alone does
        not fit). held grows with b, so this is a binary search, run for all starts at once."""
        starts = np.arange(self.n)
        fits, over = starts.copy(), np.full(self.n, self.n + 1)
        while True:
            open_ = over - fits > 1
            if not open_.any():
                return fits
            middle = (fits + over) // 2
            ok = self.held(starts, middle) <= cap
            fits = np.where(open_ & ok, middle, fits)
            over = np.where(open_ & ~ok, middle, over)


def _last_within(ascending: np.ndarray, base: np.ndarray, bound: float) -> np.ndarray:
    """For each base: the last index j with ascending[j] - base <= bound (-1: none).

    searchsorted on base + bound can be off by a rounding; this settles on the answer of the
    subtraction itself, so it agrees with every other place that compares a cost with a bound.
    """
    last = np.searchsorted(ascending, base + bound, side="right") - 1
    size = len(ascending)
    while True:  # forward over runs of equal values that still fit
        after = np.minimum(last + 1, size - 1)
        forward = (last + 1 < size) & (ascending[after] - base <= bound)
        if not forward.any():
            break
        last = np.where(forward, np.searchsorted(ascending, ascending[after], side="right") - 1, last)
    while True:  # back over runs that do not
        here = np.maximum(last, 0)
        back = (last >= 0) & (ascending[here] - base > bound)
        if not back.any():
            return last
        last = np.where(back, np.searchsorted(ascending, ascending[here], side="left") - 1, last)


# ---- step 2: the least bottleneck ---------------------------------------------------------

_Probe = Callable[[float], "tuple[float, tuple[int, ...] | None]"]


def _smallest_bound(probe: _Probe, bottom: float, ceiling: float) -> tuple[float, tuple[int, ...] | None]:
    """The least bound at which ``probe`` finds a plan, and that plan ((inf, None): none at all).

    probe(bound) returns (its plan's own worst stage, plan) if it finds one, else (a value above
    bound that the answer cannot be below, None); ``bottom`` is a lower bound on the answer and
    no stage value exceeds ``ceiling``. Both probe results are attained stage values, so the
    bracket closes exactly on the answer, not near it. Until a plan is found the bound gallops
    up from ``bottom`` in doubling steps, because probes near the answer are the cheap ones.
    """
    top, plan, step = math.inf, None, (ceiling - bottom) * 2.0**-12
    while bottom < top:
        at = min(bottom + step, ceiling) if plan is None else bottom + (top - bottom) / 2
        value, found = probe(at)
        if found is not None:
            top, plan = value, found
        elif at >= ceiling:
            return math.inf, None
        else:
            bottom, step = value, 2 * step
    return top, plan


def _least_bottleneck(chain: _Chain) -> float:
    """B*. The greedy solves the relaxation (cost_floor for the cost, memory reach made monotone)
    exactly: that is the whole problem when there is no communication term and splitting a stage
    never adds memory, and otherwise the lower bound the exact-K search starts from."""
    optimum, _ = _smallest_bound(_greedy_probe(chain), 0.0, chain.ceiling)
    splitting_is_free = chain.comm == 0 and (chain.cap is None or not chain.memory.activation.any())
    if not (splitting_is_free or math.isinf(optimum)):
        probe = _interval_probe(chain) if chain.comm == 0 else _threshold_probe(chain)
        optimum, _ = _smallest_bound(probe, optimum, chain.ceiling)
    if math.isinf(optimum):
        _raise_no_fit(chain)
    return optimum


def _greedy_probe(chain: _Chain) -> _Probe:
    """Make every stage as long as the bound and the memory envelope allow, on cost_floor. When
    splitting a stage never costs or holds more, at most K stages is as good as exactly K."""
    n = chain.n

    def probe(bound: float):
        a, worst, blocked, starts = 0, 0.0, math.inf, []
        for _ in range(chain.stages):
            by_cost, by_memory = int(chain.floor_end(a, bound)), int(chain.envelope[a])
            if by_cost < by_memory:
                blocked = min(blocked, float(chain.cost_floor(a, by_cost + 1)))
            b = min(by_cost, by_memory)
            if b <= a:
                break
            starts.append(a)
            worst, a = max(worst, float(chain.cost_floor(a, b))), b
            if a == n:
                return worst, tuple(starts)
        return blocked, None

    return probe


def _interval_probe(chain: _Chain) -> _Probe:
    """Exact-K reachability without a communication term: stage [a, b) is allowed exactly for b in
    (a, end[a]], end = min(cost end, memory end), so each stage is one union of intervals."""
    n, k = chain.n, chain.stages

    def probe(bound: float):
        low, high, widen = chain.bands(bound)
        if any(lo > hi for lo, hi in zip(low, high)):
            return widen, None
        end = lambda a: np.minimum(chain.floor_end(a, bound), chain.memory_end[a])  # noqa: E731
        layers = _reachable(n, low, high, end)
        if not layers[k][n]:
            # nothing here changes below the bands' widening or the cheapest one-node
            # extension of a reached stage that the bound (not memory) stops
            starts = np.flatnonzero(np.logical_or.reduce(layers[:k])[:n])
            by_cost = chain.floor_end(starts, bound)
            stopped = by_cost < chain.memory_end[starts]
            extend = chain.cost_floor(starts[stopped], by_cost[stopped] + 1)
            return min(widen, float(extend.min(initial=math.inf))), None
        plan = _trace_back(n, low, high, lambda s, a, b: layers[s - 1][a] & (end(a) >= b), chain.cost)
        return chain.worst_stage(plan), plan

    return probe


def _threshold_probe(chain: _Chain) -> _Probe:
    """Exact-K reachability with a communication term: b is reached if some reached start a whose
    memory reaches b has opening[a] >= closing[b] - bound, so each stage is one max over the
    intervals covering b (a backward sparse table over that cut's band) and a comparison."""
    n, k = chain.n, chain.stages

    def probe(bound: float):
        low, high, blocked = chain.bands(bound)
        if any(lo > hi for lo, hi in zip(low, high)):
            return blocked, None
        reach = np.zeros(n + 1, dtype=bool)
        reach[0] = True
        layers = [reach]
        for s in range(1, k + 1):
            starts, first, last = _stage_intervals(reach, low, high, s, lambda a: chain.memory_end[a])
            band = slice(low[s], high[s] + 1)
            size = high[s] - low[s] + 1
            best = _cover_reduce(chain.opening[starts], first, last, size, np.maximum, -math.inf)
            cost = chain.closing[band] - best  # inf where no start covers
            hit = cost <= bound
            # nothing here changes below the bands' widening or the cheapest stage missed
            blocked = min(blocked, float(cost[~hit].min(initial=math.inf)))
            reach = np.zeros(n + 1, dtype=bool)
            reach[band] = hit
            layers.append(reach)
        if not reach[n]:
            return blocked, None
        plan = _trace_back(
            n, low, high,
            lambda s, a, b: layers[s - 1][a] & (chain.memory_end[a] >= b) & (chain.cost(a, b) <= bound),
            chain.cost)
        return chain.worst_stage(plan), plan

    return probe


def _stage_intervals(reach, low, high, s, end_of):
    """The starts reached in cut s-1's band and the ends (a, end_of(a)] each may close stage s
    at, clipped to cut s's band and counted from its first position."""
    starts = low[s - 1] + np.flatnonzero(reach[low[s - 1]: high[s - 1] + 1])
    first = np.maximum(starts + 1, low[s]) - low[s]
    last = np.minimum(end_of(starts), high[s]) - low[s]
    ok = first <= last
    return starts[ok], first[ok], last[ok]


def _reachable(n: int, low: list[int], high: list[int], end_of) -> list[np.ndarray]:
    """layers[k][p]: nodes [0, p) split into exactly k stages with cut k in [low[k], high[k]],
    stage [a, b) allowed iff a < b <= end_of(a). What one more stage reaches from a set of starts
    is a union of intervals: one difference array per stage, over its cut's band."""
    reach = np.zeros(n + 1, dtype=bool)
    reach[0] = True
    layers = [reach]
    for s in range(1, len(low)):
        _, first, last = _stage_intervals(reach, low, high, s, end_of)
        size = high[s] - low[s] + 1
        cover = np.bincount(first, minlength=size + 1) - np.bincount(last + 1, minlength=size + 1)
        reach = np.zeros(n + 1, dtype=bool)
        reach[low[s]: high[s] + 1] = np.cumsum(cover[:size]) > 0
        layers.append(reach)
    return layers


def _trace_back(n: int, low: list[int], high: list[int], admissible, price) -> tuple[int, ...]:
    """Walk back from position n: stage s takes the cheapest start in cut s-1's band that
    ``admissible(s, starts, b)`` accepts (one always exists when position n was reached)."""
    plan, b = [], n
    for s in range(len(low) - 1, 0, -1):
        a = np.arange(low[s - 1], min(high[s - 1], b - 1) + 1)
        a = a[admissible(s, a, b)]
        b = int(a[np.argmin(price(a, b))])
        plan.append(b)
    return tuple(reversed(plan))


# ---- step 3: the fewest crossings within tolerance -----------------------------------------


def _fewest_crossings(chain: _Chain, bound: float) -> tuple[int, ...]:
    """Exactly K stages, each costing <= bound and fitting memory, with the least summed cut key:
    a shortest path through K layers, each layer over its cut's band only."""
    n, k, (low, high, _) = chain.n, chain.stages, chain.bands(bound)
    keys, infinity = chain.cut_keys()
    end_of = lambda a: np.minimum(chain.memory_end[a], chain.floor_end(a, bound))  # noqa: E731
    # totals[s][p - low[s]]: the least key sum of s stages covering nodes [0, p)
    totals = [np.zeros(1, dtype=keys.dtype)]
    for s in range(1, k + 1):
        reached = np.zeros(n + 1, dtype=bool)
        reached[low[s - 1]: high[s - 1] + 1] = totals[-1] < infinity
        starts, first, last = _stage_intervals(reached, low, high, s, end_of)
        size, band = high[s] - low[s] + 1, slice(low[s], high[s] + 1)
        values = totals[-1][starts - low[s - 1]]
        if chain.comm == 0:
            best = _cover_reduce(values, first, last, size, np.minimum, infinity)
        else:
            # the starts that may close at b are those with fl(closing[b] - opening) <= bound: a
            # suffix of them sorted by opening (read as fl(-opening - -closing[b]), the same number)
            opening = chain.opening[starts]
            order = np.argsort(opening)
            rank = np.empty(len(starts), np.int64)
            rank[order] = np.arange(len(starts))
            qualifying = _last_within(-opening[order][::-1], -chain.closing[band], bound) + 1
            best = _cover_min_ranked(values, first, last, size, rank, len(starts) - qualifying, infinity)
        totals.append(np.minimum(best + keys[band], infinity))
    assert totals[k][0] < infinity, "the optimal plan is within its own bound"

    def admissible(s, a, b):
        return ((totals[s - 1][a - low[s - 1]] == totals[s][b - low[s]] - keys[b])
                & (chain.memory_end[a] >= b) & (chain.cost(a, b) <= bound))

    return _trace_back(n, low, high, admissible, chain.cost)


def _cover_reduce(values, first, last, size: int, ufunc: np.ufunc, identity) -> np.ndarray:
    """For every position b < size: ufunc (min or max) over values[i] of the intervals
    [first[i], last[i]] that cover b.

    A sparse table (Bender & Farach-Colton 2000) run backwards: an interval is the union of two
    blocks of length 2^j, j = floor(log2(length)), that may overlap; each block's value is
    reduced into level j, then each level is pushed into the two halves below it. min and max do
    not mind the overlap. O(size log size + intervals).
    """
    if not len(values):
        return np.full(size, identity, dtype=np.asarray(values).dtype)
    level = np.frexp(last - first + 1)[1] - 1
    levels = int(level.max()) + 1
    table = np.full(levels * size, identity, dtype=values.dtype)
    ufunc.at(table, level * size + first, values)
    ufunc.at(table, level * size + last + 1 - (1 << level), values)
    table = table.reshape(levels, size)
    for j in range(levels - 1, 0, -1):
        half, below = 1 << (j - 1), table[j - 1]
        ufunc(below, table[j], out=below)
        ufunc(below[half:], table[j][:-half], out=below[half:])
    return table[0]


def _cover_min_ranked(values, first, last, size: int, rank, need, infinity) -> np.ndarray:
    """For every position b < size: the min over values[i] of the intervals [first[i], last[i]]
    that cover b and have rank[i] >= need[b] (ranks 0..len-1, need 0..len).

    A segment tree over positions whose nodes keep their intervals sorted by rank (a merge sort
    tree): each interval sits in its O(log size) canonical nodes, and a query takes, in each node
    on its leaf-to-root path, the suffix from need[b] on. Every node's suffix minima come from one
    cumulative minimum over all entries, kept apart by lifting each node above the next.
    """
    count = len(values)
    if not count:
        return np.full(size, infinity, dtype=np.asarray(values).dtype)
    leaves = 1 << (size - 1).bit_length()
    nodes, owners = [], []
    owner, low, high = np.arange(count), first + leaves, last + 1 + leaves
    while owner.size:  # canonical nodes, bottom-up
        left, right = (low & 1).astype(bool), (high & 1).astype(bool)
        high = high - right
        nodes += [low[left], high[right]]
        owners += [owner[left], owner[right]]
        low, high = (low + left) >> 1, high >> 1
        keep = low < high
        low, high, owner = low[keep], high[keep], owner[keep]
    node, owner = np.concatenate(nodes), np.concatenate(owners)
    key = np.sort(node * (count + 1) + rank[owner])  # unique: an interval is in a node at most once
    by_rank = np.empty(count, np.int64)
    by_rank[rank] = np.arange(count)
    node, owner = key // (count + 1), by_rank[key % (count + 1)]
    distinct, dense = np.unique(values, return_inverse=True)  # dense < count: lift by count + 1
    lift = np.concatenate(([0], np.cumsum(node[1:] != node[:-1]))) * (count + 1)
    suffix = np.append(np.minimum.accumulate((dense[owner] + lift)[::-1])[::-1] - lift, len(distinct))
    path = (np.arange(size) + leaves) >> np.arange(leaves.bit_length())[:, None]
    where = np.searchsorted(key, path * (count + 1) + need)
    inside = where < key.size
    inside[inside] = node[where[inside]] == path[inside]
    best = suffix[np.where(inside, where, key.size)].min(axis=0)
    return np.append(distinct, infinity).astype(values.dtype)[best]


# ---- step 4: when nothing fits --------------------------------------------------------------


def _raise_no_fit(chain: _Chain):
    """Raise NoFeasiblePlan naming the over-cap stages of the most memory-balanced plan: the same
    snapping search, with memory as the stage value and every position open to every cut."""
    n, k, memory = chain.n, chain.stages, chain.memory
    low, high = list(range(k)) + [n], [0] + [n - k + s for s in range(1, k + 1)]

    def probe(cap: float):
        end = memory.reach(cap)
        layers = _reachable(n, low, high, lambda a: end[a])
        if not layers[k][n]:
            starts = np.flatnonzero(np.logical_or.reduce(layers[:k])[:n] & (end < n))
            return float(memory.held(starts, end[starts] + 1).min(initial=math.inf)), None
        plan = _trace_back(n, low, high, lambda s, a, b: layers[s - 1][a] & (end[a] >= b), memory.held)
        return float(max(chain.solution(plan, 0.0).stage_memory)), plan

    least_cap, plan = _smallest_bound(probe, 0.0, math.inf)
    held = chain.solution(plan, 0.0).stage_memory
    ends = plan[1:] + (n,)
    over = "; ".join(
        f"stage {s} (nodes {plan[s]}..{ends[s] - 1}) needs {_bytes(held[s])} but the cap is "
        f"{_bytes(chain.cap)}: {_bytes(held[s] - chain.cap)} short"
        for s in range(k) if held[s] > chain.cap)
    raise NoFeasiblePlan(
        f"no split into {k} stages fits memory_cap; in the most memory-balanced one, {over}. "
        f"That split needs a cap of {_bytes(least_cap)}: raise the cap, add devices, or hold less "
        f"per stage (fewer micro-batches in flight, smaller optimizer state)")


def _bytes(amount: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if amount >= size:
            return f"{amount / size:.1f} {unit} ({amount:,.0f} bytes)"
    return f"{amount:,.0f} bytes"


# ---- graph adapter: CostedGraph -> CutProblem -> Plan ----


def partition(
    costed: CostedGraph,
    n_stages: int,
    *,
    devices: Sequence[torch.device] | None = None,
    chunks: int = 1,
    balance: "str | Sequence[float]" = "flops",
    tolerance: float = 0.03,
    comm_cost_per_byte: float = 0.0,
    memory_cap: float | None = None,
    optimizer_state_multiple: float = 2.0,
    notes: Sequence[str] = (),
    pass_seconds: dict[str, float] | None = None,
) -> Plan:
    """Cut the traced graph into ``n_stages`` contiguous stages (see module docstring)."""
    gm = costed.traced.graph_module
    graph = gm.graph
    every = [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    if n_stages < 1:
        raise ValueError(f"devices must name at least one device (got {n_stages} stages)")
    output_node = next(n for n in graph.nodes if n.op == "output")
    output_args = [a for a in output_node.args[0] if isinstance(a, fx.Node)]
    every_weight = _weights(costed, every, balance)
    replicable = _replicable(costed, every, set(output_args), every_weight, n_stages)
    free = {n for n, r in zip(every, replicable) if r}
    # A getitem of a tuple-valued node (qkv.split(...)[0]) stays in its producer's stage, so only
    # tensors cross cuts, never a tuple that still carries its producer's autograd graph.
    attached: dict[fx.Node, fx.Node] = {}
    for n in every:
        source = n.args[0] if n.args else None
        if (n not in free and n.op == "call_function" and n.target is operator.getitem
                and isinstance(source, fx.Node) and source in set(every) - free
                and not isinstance(source.meta.get("val"), torch.Tensor)):
            attached[n] = attached.get(source, source)
    members: dict[fx.Node, list[fx.Node]] = {}
    for n, root in attached.items():
        members.setdefault(root, []).append(n)
    weight_by_node = dict(zip(every, every_weight))
    # Replicated nodes belong to no stage (each consumer recomputes them): the solver sees the rest.
    order = [n for n in every if n not in free and n not in attached]
    weights = [weight_by_node[n] + sum(weight_by_node[m] for m in members.get(n, ())) for n in order]
    if n_stages > len(order):
        raise ValueError(
            f"{n_stages} stages asked for, but the traced graph has only {len(order)} operations to spread over them; "
            f"use at most {max(len(order), 1)} devices"
        )
    index = {n: i for i, n in enumerate(order)}
    end = len(order)
    consumers: list[list[int]] = []
    group_of = {m: root for root, ms in members.items() for m in ms}
    out_bytes = []
    for n in order:
        group = [n] + members.get(n, [])
        crossing = [m for m in group if _is_tensor_valued(m) and (m is not n or not members.get(n))]
        users = set()
        for m in crossing:  # sizes and other Python values travel for free in-process
            users |= {index[group_of.get(u, u)] for u in m.users if group_of.get(u, u) in index} - {index[n]}
            if m in output_args:
                users.add(end)  # model outputs travel to the end of the pipeline
        consumers.append(sorted(users))
        out_bytes.append(sum(costed.costs[m.name].out_bytes for m in crossing))

    param_users: dict[str, set[int]] = {}
    for i, n in enumerate(order):
        for m in [n] + members.get(n, []):
            for p in costed.costs[m.name].params:
                param_users.setdefault(p, set()).add(i)
    multiple = 1.0
    if memory_cap is not None:
        multiple = 1.0 + 1.0 + optimizer_state_multiple  # weights + grads + optimizer state
    shared_memory = [(costed.tensor_bytes[p] * (multiple if _is_param(gm, p) else 1.0), sorted(users))
                     for p, users in param_users.items()]

    if isinstance(balance, str):
        problem = CutProblem(
            weights=weights,
            out_bytes=out_bytes,
            consumers=[[c for c in cs if c < end] + ([end - 1] if end in cs and i < end - 1 else []) for i, cs in enumerate(consumers)],
            n_stages=n_stages,
            tolerance=tolerance,
            comm_cost_per_byte=comm_cost_per_byte,
            shared_memory=shared_memory,
            activation_multiplier=float(chunks) if memory_cap is not None else 0.0,
            memory_cap=memory_cap,
        )
        solution = solve_cuts(problem)
        starts = list(solution.starts)
        optimum = solution.optimum
    else:
        starts = _split_by_shares(weights, list(balance), n_stages)
        optimum = float("nan")

    stage_of: dict[fx.Node, int] = {}
    for s in range(n_stages):
        stop = starts[s + 1] if s + 1 < n_stages else end
        for n in order[starts[s]:stop]:
            stage_of[n] = s
            for m in members.get(n, []):
                stage_of[m] = s
    plan = _build_plan(costed, order, stage_of, free, dict(zip(every, every_weight)), n_stages, devices, chunks,
                       balance, tolerance, optimum, output_args)
    plan.notes.extend(notes)
    if pass_seconds is not None:
        plan.pass_seconds = pass_seconds  # the caller's running dict: later passes' seconds join it
    return plan


def _is_tensor_valued(n: fx.Node) -> bool:
    val = n.meta.get("val")
    return isinstance(val, torch.Tensor) or (
        isinstance(val, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in val))


def _is_param(gm: fx.GraphModule, name: str) -> bool:
    try:
        gm.get_parameter(name)
        return True
    except AttributeError:
        return False


def _weights(costed: CostedGraph, order: list, balance) -> list[float]:
    if balance == "params":
        seen: set[str] = set()
        weights = []
        for n in order:
            fresh = [p for p in costed.costs[n.name].params if p not in seen]
            seen.update(fresh)
            weights.append(float(sum(costed.tensor_bytes[p] for p in fresh)))
        return weights
    if balance == "time":
        missing = [n.name for n in order if costed.costs[n.name].seconds is None]
        if missing:
            raise ValueError("balance='time' needs measured node times; compile with real example inputs (not meta)")
        return [costed.costs[n.name].seconds for n in order]
    return [float(costed.costs[n.name].flops) for n in order]


def _split_by_shares(weights: list[float], shares: list[float], n_stages: int) -> list[int]:
    """A user-given share of the work per stage: cut where the running cost crosses each share."""
    if len(shares) != n_stages or any(s <= 0 for s in shares):
        raise ValueError(f"balance as a list needs {n_stages} positive per-stage weights, got {shares}")
    total = sum(weights) or 1.0
    targets, acc = [], 0.0
    for s in shares[:-1]:
        acc += s / sum(shares)
        targets.append(acc * total)
    starts, running, t = [0], 0.0, 0
    for i, w in enumerate(weights):
        running += w
        while t < len(targets) and running >= targets[t] and len(starts) < n_stages:
            starts.append(min(i + 1, len(weights) - (n_stages - len(starts))))
            t += 1
    while len(starts) < n_stages:
        starts.append(len(weights) - (n_stages - len(starts)))
    for s in range(1, n_stages):  # keep every stage non-empty
        starts[s] = max(starts[s], starts[s - 1] + 1)
    return starts


def _replicable(costed: CostedGraph, order: list, outputs: set, weights: list[float], n_stages: int) -> list[bool]:
    """Cheap nodes computed from graph inputs and buffers only (masks, position ids):
    every stage that needs one recomputes it instead of receiving it."""
    gm = costed.traced.graph_module
    budget = 0.01 * sum(weights) / n_stages
    free: set = set()
    result = []
    for i, n in enumerate(order):
        ok = (
            weights[i] <= budget
            and n not in outputs
            and not _is_random(n)
            and not _is_inplace(n)
            and n.op != "call_module"
            and all(
                a.op == "placeholder" or a in free or (a.op == "get_attr" and not _is_param(gm, a.target))
                for a in n.all_input_nodes
            )
        )
        if ok:
            free.add(n)
        result.append(ok)
    return result


def _target_name(n: fx.Node) -> str:
    target = n.target
    name = target if isinstance(target, str) else getattr(target, "__name__", str(target))
    return name.split(".")[0] if "." in name and not isinstance(target, str) else name


def _is_random(n: fx.Node) -> bool:
    return is_random_target(n.target)


def _is_inplace(n: fx.Node) -> bool:
    name = _target_name(n)
    return (n.op == "call_method" and name.endswith("_")) or n.target in (operator.setitem,) or (
        isinstance(n.target, torch._ops.OpOverload) and n.target._schema.is_mutable)


def _build_plan(costed, order, stage_of, free, weight_of, n_stages, devices, chunks,
                balance, tolerance, optimum, output_args) -> Plan:
    gm = costed.traced.graph_module
    every = [n for n in gm.graph.nodes if n in stage_of or n in free]
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    batch = costed.traced.batch_size
    devices = list(devices) if devices is not None else [torch.device("cpu")] * n_stages

    # Which stages need each value: a replicated node is needed wherever its users are.
    needed_in: dict[fx.Node, set[int]] = {}
    for n in reversed(every):
        if n in free:
            needed_in[n] = set()
            for u in n.users:
                if u in stage_of and u not in free:
                    needed_in[n].add(stage_of[u])
                elif u in needed_in and u in free:
                    needed_in[n] |= needed_in[u]
    tensors: dict[str, TensorInfo] = {}
    stage_inputs: list[list[str]] = [[] for _ in range(n_stages)]
    stage_outputs: list[list[str]] = [[] for _ in range(n_stages)]
    replicated: list[list[str]] = [[] for _ in range(n_stages)]

    def users_stages(n: fx.Node) -> set[int]:
        stages = set()
        for u in n.users:
            if u in free:
                stages |= needed_in[u]
            elif u in stage_of:
                stages.add(stage_of[u])
        return stages

    for p in placeholders:
        consumers = sorted(users_stages(p))
        tensors[p.name] = _info(p, -1, consumers, p in output_args, batch)
        for s in consumers:
            stage_inputs[s].append(p.name)
    for n in every:
        if n in free:
            for s in sorted(needed_in[n]):
                replicated[s].append(n.name)
            continue
        s = stage_of[n]
        later = sorted(c for c in users_stages(n) if c != s)
        if any(c < s for c in later):
            raise AssertionError(f"node {n.name} feeds an earlier stage: the order is not topological")
        if later or n in output_args:
            tensors[n.name] = _info(n, s, later, n in output_args, batch)
            stage_outputs[s].append(n.name)
            for c in later:
                stage_inputs[c].append(n.name)

    param_stages: dict[str, set[int]] = {}
    for n in every:
        stages = needed_in[n] if n in free else {stage_of[n]}
        for p in costed.costs[n.name].params:
            param_stages.setdefault(p, set()).update(stages)
    stages = []
    for s in range(n_stages):
        own = [n for n in every if n not in free and stage_of[n] == s]
        params = sorted(p for p, st in param_stages.items() if s in st)
        stages.append(StagePlan(
            index=s,
            device=torch.device(devices[s]),
            nodes=tuple(n.name for n in own),
            replicated=tuple(replicated[s]),
            inputs=tuple(stage_inputs[s]),
            outputs=tuple(stage_outputs[s]),
            params=tuple(params),
            param_bytes=sum(costed.tensor_bytes[p] for p in params),
            flops=sum(costed.costs[n.name].flops for n in own),
            cost=sum(weight_of[n] for n in own),
        ))
    weights = [weight_of[n] for n in order]
    total = sum(weights)
    lower_bound = max(total / n_stages, max(weights, default=0.0))
    shared = {p: tuple(sorted(st)) for p, st in param_stages.items() if len(st) > 1 and _is_param(gm, p)}
    return Plan(
        stages=stages,
        tensors=tensors,
        graph_inputs=[p.name for p in placeholders],
        graph_outputs=[a.name for a in output_args],
        chunks=chunks,
        balance=balance if isinstance(balance, str) else f"shares {list(balance)}",
        route=costed.traced.route,
        lower_bound=lower_bound,
        optimum=optimum,
        tolerance=tolerance,
        shared_params=shared,
    )


def _info(n: fx.Node, producer: int, consumers, is_output: bool, batch: int) -> TensorInfo:
    """What crosses a cut, as the wire needs it: shapes at the whole batch, Python values by kind."""
    val = n.meta.get("val")
    kind, batched = "tensor", False
    if isinstance(val, torch.Tensor):
        shape, dtype, nbytes = tuple(int(d) for d in val.shape), val.dtype, val.numel() * val.element_size()
        batched = bool(val.dim()) and (isinstance(val.shape[0], torch.SymInt) or int(val.shape[0]) == batch)
    else:
        shape, dtype, nbytes = (), torch.int64, 0
        if isinstance(val, (int, torch.SymInt)):
            kind = "int"
        elif isinstance(val, (tuple, list, torch.Size)) and all(isinstance(v, (int, torch.SymInt)) for v in val):
            kind, shape = "size", (len(val),)
        else:
            kind = "other"
    return TensorInfo(name=n.name, shape=shape, dtype=dtype, nbytes=nbytes, producer=producer,
                      consumers=tuple(consumers), is_output=is_output, kind=kind, batched=batched)
