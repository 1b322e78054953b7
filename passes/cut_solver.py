"""The exact balanced, fewest-crossings cut of a node chain into K contiguous stages (numpy only).

Position p is the cut just before node p. With W the prefix sums of the weights and L[p] the bytes live across p, stage
[a, b) costs W[b] - W[a] and holds each shared tensor it touches and activation_multiplier * L[a]. First the least
bottleneck B*, by bisection snapped onto attained stage costs (chains-on-chains partitioning: Bokhari 1988, Pinar &
Aykanat 2004); then, among plans within (1 + tolerance) B*, the fewest then smallest crossing tensors: a shortest path
through K layers of cut positions (PipeDream's planner, Narayanan et al. 2019). Each layer is whole-array passes over
intervals."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .kept_ranges import KeptRanges
from .shared_devices import balance_devices


@dataclass(frozen=True)
class CutProblem:
    weights: Sequence[float]  # cost of node i; nodes in a fixed topological order 0..N-1
    out_bytes: Sequence[int]  # size of node i's output tensor(s)
    consumers: Sequence[Sequence[int]]  # consumers[i]: nodes j > i that read node i's output
    n_stages: int  # K: the exact number of non-empty contiguous stages
    tolerance: float = 0.03  # plans with bottleneck <= (1 + tolerance) * optimum are balanced enough
    shared_memory: Sequence[tuple[float, Sequence[int]]] | None = None  # (bytes, nodes): once per stage using it
    activation_multiplier: float = 0.0  # a stage also holds this times the bytes live across its first cut
    memory_cap: float | None = None  # per-stage cap on the memory above
    # each entry: (first, last) ranges of nodes that share a node; one stage holds at least one of them whole
    kept_whole: Sequence[Sequence[tuple[int, int]]] = ()
    v_devices: int = 0  # K: the 2K stages lie in a V, balanced as each device's two (passes/shared_devices.py)


@dataclass(frozen=True)
class CutSolution:
    starts: tuple[int, ...]  # stage s covers nodes [starts[s], starts[s+1]); starts[0] == 0
    stage_costs: tuple[float, ...]
    bottleneck: float
    optimum: float  # the least possible bottleneck (before tolerance)
    cut_tensors: tuple[int, ...]  # per cut between stages c and c+1: distinct tensors live across it
    cut_bytes: tuple[int, ...]
    stage_memory: tuple[float, ...]


class NoFeasiblePlan(ValueError):
    """No split fits the memory cap; the message names the most memory-balanced split's stages over it."""


class NoCutKeepsWhole(NoFeasiblePlan):
    """No plan within (1 + tolerance) of the optimum keeps every ``kept_whole`` entry. ``entry``: the index of one that
    the best plan ignoring them breaks; ``least_bottleneck``: the least bottleneck of a plan that keeps them all (inf:
    none at this number of stages); ``optimum``: the least bottleneck of any plan."""

    def __init__(self, message: str, entry: int, least_bottleneck: float, optimum: float):
        super().__init__(message)
        self.entry, self.least_bottleneck, self.optimum = entry, least_bottleneck, optimum


class _Chain:
    """The problem as arrays over cut positions 0..N."""

    def __init__(self, problem: CutProblem):
        n = self.n = validated_size(problem)
        self.stages, self.cap = problem.n_stages, problem.memory_cap
        self.prefix = np.concatenate(([0.0], np.cumsum(np.asarray(problem.weights, dtype=float))))
        self.live_tensors, self.live_bytes = live_across_positions(problem, n)
        own = np.zeros(n)
        spans: dict[tuple[int, ...], float] = {}
        for size, nodes in problem.shared_memory or ():
            members = tuple(sorted(set(int(i) for i in nodes)))
            if len(members) == 1:
                own[members[0]] += size
            elif members:
                spans[members] = spans.get(members, 0.0) + float(size)
        # per shared tensor, the first member at or after each position: stage [a, b) touches it iff that is < b
        self.shared = [(size, np.append(members, n)[np.searchsorted(members, np.arange(n + 1))])
                       for members, size in spans.items()]
        self.own = np.concatenate(([0.0], np.cumsum(own)))
        self.activation = float(problem.activation_multiplier) * self.live_bytes
        self.memory_end = np.full(n, n) if self.cap is None else self.reach(self.cap)
        self.envelope = np.maximum.accumulate(self.memory_end)
        self.ceiling = float(self.prefix[-1])  # no stage costs more
        self.kept = KeptRanges(problem.kept_whole, n)

    def cost(self, a, b):
        return self.prefix[b] - self.prefix[a]

    def held(self, a, b):
        total = self.own[b] - self.own[a] + self.activation[a]
        for size, next_member in self.shared:
            total = total + size * (next_member[a] < b)
        return total

    def reach(self, cap: float) -> np.ndarray:
        """For each start a: the last end b with held(a, b) <= cap (a when node a alone does not fit)."""
        starts = np.arange(self.n)
        return _last_ok(lambda b: self.held(starts, b) <= cap, starts + 1, self.n)

    def bands(self, bound: float) -> tuple[list[int], list[int], float]:
        """[low[s], high[s]]: where cut s may be when every stage costs <= bound, by greedy on cost and the memory
        envelope from both ends; and the least bound at which the bands would widen."""
        n, k = self.n, self.stages
        high, low, widen = [0], [n], math.inf
        for s in range(1, k + 1):
            a = high[-1]
            by_cost = a + int(np.count_nonzero(self.prefix[a + 1:] - self.prefix[a] <= bound))
            limit = min(int(self.envelope[a]), n - k + s)
            if by_cost < limit:
                widen = min(widen, float(self.cost(a, by_cost + 1)))
            high.append(min(by_cost, limit))
        for s in range(k - 1, -1, -1):
            b = low[-1]
            by_cost = int(np.count_nonzero(self.prefix[b] - self.prefix[:b] > bound))
            by_memory = int(np.searchsorted(self.envelope, b))
            if by_cost > max(by_memory, s):
                widen = min(widen, float(self.cost(by_cost - 1, b)))
            low.append(max(by_cost, by_memory, s))
        return low[::-1], high, widen

    def cut_keys(self) -> tuple[np.ndarray, int]:
        """(crossing tensors, bytes) per position packed into one integer, ordered lexicographically when summed over
        K-1 cuts; Python ints where int64 could overflow. Also an infinity."""
        tensors, data, cuts = self.live_tensors, self.live_bytes, self.stages - 1
        scale = cuts * int(data.max()) + 1
        worst = cuts * (int(tensors.max()) * scale + int(data.max()))
        return tensors.astype(np.int64 if worst < 2**61 else object) * scale + data, 2 * worst + 1

    def solution(self, starts: Sequence[int], optimum: float) -> CutSolution:
        first = np.asarray(starts)
        last = np.append(first[1:], self.n)
        costs = self.cost(first, last)
        return CutSolution(starts=tuple(int(a) for a in starts), stage_costs=tuple(float(c) for c in costs),
                           bottleneck=float(costs.max()), optimum=float(optimum),
                           cut_tensors=tuple(int(t) for t in self.live_tensors[first[1:]]),
                           cut_bytes=tuple(int(d) for d in self.live_bytes[first[1:]]),
                           stage_memory=tuple(float(m) for m in self.held(first, last)))


def validated_size(problem: CutProblem) -> int:
    n, k = len(problem.weights), problem.n_stages
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"n_stages must be a positive integer, got {k!r}")
    if k > n:
        raise ValueError(f"n_stages={k} but the graph has only {n} nodes, and every stage needs at least one: use at "
                         f"most {n} stages")
    checked = [(f, getattr(problem, f)) for f in ("weights", "out_bytes", "tolerance", "activation_multiplier")]
    for name, values in checked + [("shared_memory sizes", [s for s, _ in problem.shared_memory or ()])]:
        values = np.asarray([] if values is None else values, dtype=float)
        if not np.all(np.isfinite(values) & (values >= 0)):
            raise ValueError(f"{name} must be finite and non-negative")
    if problem.memory_cap is not None and not problem.memory_cap >= 0:
        raise ValueError(f"memory_cap must be non-negative or None, got {problem.memory_cap!r}")
    for ranges in problem.kept_whole:
        if not ranges or not all(0 <= first <= last < n for first, last in ranges) or \
                max(first for first, _ in ranges) > min(last for _, last in ranges):
            raise ValueError(f"each kept_whole entry must be (first, last) ranges with 0 <= first <= last < {n} that "
                             f"share a node, got {list(ranges)}")
    return n


def live_across_positions(problem: CutProblem, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Tensors and bytes live across every position, from one difference array: O(N + E)."""
    per_node = np.fromiter(map(len, problem.consumers), dtype=np.int64, count=n)
    readers = np.fromiter(itertools.chain.from_iterable(problem.consumers), dtype=np.int64, count=int(per_node.sum()))
    producers = np.flatnonzero(per_node)
    offsets = (np.cumsum(per_node) - per_node)[producers]
    last_reader = np.maximum.reduceat(readers, offsets) if producers.size else producers
    size = np.asarray(problem.out_bytes, dtype=np.int64)[producers]
    tensors, data = np.zeros(n + 1, np.int64), np.zeros(n + 1, np.int64)
    np.add.at(tensors, producers + 1, 1)
    np.add.at(tensors, last_reader + 1, -1)
    np.add.at(data, producers + 1, size)
    np.add.at(data, last_reader + 1, -size)
    return np.cumsum(tensors), np.cumsum(data)


def _last_ok(ok, lo, hi) -> np.ndarray:
    """Per element: the last x in [lo, hi] with ok(x), lo - 1 if none; ok holds on a prefix. Vectorized bisection."""
    yes, no = np.broadcast_arrays(np.asarray(lo) - 1, np.asarray(hi) + 1)
    while (unsettled := no - yes > 1).any():
        middle = (yes + no) // 2
        good = ok(middle)
        yes, no = np.where(unsettled & good, middle, yes), np.where(unsettled & ~good, middle, no)
    return yes


def _smallest_bound(probe, bottom: float, ceiling: float) -> tuple[float, tuple[int, ...] | None]:
    """The least bound at which probe finds a plan, and the plan ((inf, None): none). probe(bound) gives (its plan's
    worst stage, plan) or (an attained value above bound that the answer cannot be below, None), so the bracket closes
    exactly. It gallops up from bottom first: probes near the answer are the cheap ones."""
    top, plan, step = math.inf, None, (ceiling - bottom) * 2.0**-12
    while bottom < top:
        # below top even when no float lies between bottom and top: probing top again would never end
        at = min(bottom + step, ceiling) if plan is None else min(bottom + (top - bottom) / 2, math.nextafter(top, 0))
        value, found = probe(at)
        if found is not None:
            top, plan = value, found
        elif at >= ceiling:
            return math.inf, None
        else:
            bottom, step = value, 2 * step
    return top, plan


def solve_cuts(problem: CutProblem) -> CutSolution:
    """B*: the relaxation's optimum, exact when splitting a stage never holds more, else a start for the exact search;
    then the fewest crossings within (1 + tolerance) B* among plans that keep every ``kept_whole`` entry (B* ignores
    them: the tolerance is what keeping them may cost; NoCutKeepsWhole where no plan within it keeps them all)."""
    chain = _Chain(problem)

    def relaxed(bound: float):
        _, high, widen = chain.bands(bound)
        if high[-1] < chain.n:
            return widen, None
        return float(chain.cost(np.array(high[:-1]), np.array(high[1:])).max()), tuple(high[:-1])

    optimum, _ = _smallest_bound(relaxed, 0.0, chain.ceiling)
    if chain.cap is not None and chain.activation.any() and not math.isinf(optimum):
        optimum, _ = _smallest_bound(lambda bound: _exact(chain, bound), optimum, chain.ceiling)
    if math.isinf(optimum):
        _raise_no_fit(chain)
    bound = (1.0 + problem.tolerance) * optimum
    plan = _fewest_crossings(chain, bound, chain.kept)
    if plan is None:
        _raise_cut_through_kept(chain, problem, bound, optimum)
    if problem.v_devices:  # Note [stages balanced as their device's sum]
        plan = balance_devices(plan, problem.v_devices, problem.weights, chain.cost, lambda a, b: (chain.memory_end[a]
                               >= b) & _keeps(chain.kept, a, b), chain.cut_keys()[0], problem.tolerance).starts
    return chain.solution(plan, optimum)


def _exact(chain: _Chain, bound: float, kept: KeptRanges | None = None):
    """A probe for _smallest_bound: the least bottleneck's plan by the exact layered search, keeping ``kept``."""
    low, high, missed = chain.bands(bound)
    if any(lo > hi for lo, hi in zip(low, high)):
        return missed, None
    layers, missed = _layers(chain, low, high, chain.memory_end, bound, missed, kept)
    if not layers[-1][chain.n]:
        return missed, None
    plan = _trace_back(chain.n, low, high, _admissible(chain, layers, chain.memory_end, bound, kept), chain.cost)
    return max(chain.solution(plan, 0.0).stage_costs), plan


def _raise_cut_through_kept(chain: _Chain, problem: CutProblem, bound: float, optimum: float):
    """NoCutKeepsWhole naming an entry the best plan that ignores them breaks, with the least bottleneck of a plan
    that keeps them all."""
    starts = _fewest_crossings(chain, bound)
    assert starts is not None, "the optimal plan is within its own bound"
    entry = chain.kept.broken(starts)
    least, _ = _smallest_bound(lambda at: _exact(chain, at, chain.kept), bound, chain.ceiling)
    raise NoCutKeepsWhole(f"no {chain.stages} stages within {bound:g} (the optimum {optimum:g} times 1 + tolerance) "
                          f"keep one of {list(problem.kept_whole[entry])} in one stage; the least bottleneck of a plan "
                          f"that keeps them all is {least:g}", entry, least, optimum)


def _layers(chain: _Chain, low, high, end, bound: float, missed: float = math.inf, kept: KeptRanges | None = None):
    """layers[s][p]: nodes [0, p) split into s stages, cut s in [low[s], high[s]], each stage [a, b) with b <= end[a],
    cost <= bound and keeping ``kept``; and the least missed stage cost (nothing changes below it)."""
    reach = np.zeros(chain.n + 1, dtype=bool)
    reach[0] = True
    layers = [reach]
    for s in range(1, len(low)):
        starts, first, last = _stage_intervals(reach, low, high, s, end, kept)
        band = slice(low[s], high[s] + 1)
        cost = chain.prefix[band] + _cover_min(-chain.prefix[starts], first, last, high[s] - low[s] + 1, 0, math.inf)
        hit = cost <= bound  # cost is inf where no start covers
        missed = min(missed, float(cost[~hit].min(initial=math.inf)))
        reach = np.zeros(chain.n + 1, dtype=bool)
        reach[band] = hit
        layers.append(reach)
    return layers, missed


def _admissible(chain: _Chain, layers, end, bound: float, kept: KeptRanges | None = None):
    return lambda s, a, b: layers[s - 1][a] & (end[a] >= b) & (chain.cost(a, b) <= bound) & _keeps(kept, a, b)


def _keeps(kept: KeptRanges | None, a, b):
    return True if not kept else kept.allows(a, b)


def _stage_intervals(reach, low, high, s, end, kept: KeptRanges | None = None):
    """The starts a reached in cut s-1's band and the ends (a, end[a]] each may close stage s at, clipped to cut s's
    band and counted from its first position; with ``kept``, a start's ends are the intervals it allows (the start
    repeated, in order)."""
    starts = low[s - 1] + np.flatnonzero(reach[low[s - 1]: high[s - 1] + 1])
    first, last = starts + 1, end[starts]
    if kept:
        owner, first, last = kept.ends(starts)
        starts, last = starts[owner], np.minimum(last, end[starts[owner]])
    first = np.maximum(first, low[s]) - low[s]
    last = np.minimum(last, high[s]) - low[s]
    ok = first <= last
    return starts[ok], first[ok], last[ok]


def _trace_back(n: int, low, high, admissible, price) -> tuple[int, ...]:
    """From position n back: stage s takes the cheapest start in cut s-1's band that admissible accepts."""
    plan, b = [], n
    for s in range(len(low) - 1, 0, -1):
        a = np.arange(low[s - 1], min(high[s - 1], b - 1) + 1)
        a = a[admissible(s, a, b)]
        b = int(a[np.argmin(price(a, b))])
        plan.append(b)
    return tuple(reversed(plan))


def _fewest_crossings(chain: _Chain, bound: float, kept: KeptRanges | None = None) -> tuple[int, ...] | None:
    """K stages, each costing <= bound, fitting memory and keeping ``kept``, with the least summed cut key: a shortest
    path through K layers (None: no such plan). The starts that may close at b are intervals covering b with prefix
    >= prefix[b] - bound."""
    n, k, (low, high, _) = chain.n, chain.stages, chain.bands(bound)
    keys, infinity = chain.cut_keys()
    totals = [np.zeros(1, dtype=keys.dtype)]  # totals[s][p - low[s]]: least key sum of s stages over [0, p)
    for s in range(1, k + 1):
        reached = np.zeros(n + 1, dtype=bool)
        reached[low[s - 1]: high[s - 1] + 1] = totals[-1] < infinity
        starts, first, last = _stage_intervals(reached, low, high, s, chain.memory_end, kept)
        band = np.arange(low[s], high[s] + 1)
        # the same subtraction as cost(a, b), so that no rounding separates the two
        need = _last_ok(lambda j: chain.cost(starts[j], band) > bound, np.zeros_like(band), len(starts) - 1) + 1
        best = _cover_min(totals[-1][starts - low[s - 1]], first, last, len(band), need, infinity)
        totals.append(np.minimum(best + keys[band], infinity))
    if not totals[k][0] < infinity:
        return None

    def admissible(s, a, b):
        return (totals[s - 1][a - low[s - 1]] == totals[s][b - low[s]] - keys[b]) & (chain.memory_end[a] >= b) \
            & (chain.cost(a, b) <= bound) & _keeps(kept, a, b)

    return _trace_back(n, low, high, admissible, chain.cost)


def _cover_min(values, first, last, size: int, need, infinity) -> np.ndarray:
    """For every b < size: the min of values[i] over intervals [first[i], last[i]] covering b with i >= need[b] (need:
    an array or one number). A merge sort tree: a segment tree over positions whose nodes keep their intervals sorted by
    index; a query takes the suffix from need[b] in each node on its leaf-to-root path. All nodes' suffix minima come
    from one cumulative minimum, each node lifted above the next."""
    count = len(values)
    if not count:
        return np.full(size, infinity, dtype=np.asarray(values).dtype)
    leaves = 1 << (size - 1).bit_length()
    nodes, owners = [], []
    owner, low, high = np.arange(count), first + leaves, last + 1 + leaves
    while owner.size:  # each interval's canonical nodes, bottom-up
        left, right = (low & 1).astype(bool), (high & 1).astype(bool)
        high = high - right
        nodes += [low[left], high[right]]
        owners += [owner[left], owner[right]]
        low, high = (low + left) >> 1, high >> 1
        keep = low < high
        low, high, owner = low[keep], high[keep], owner[keep]
    node, owner = np.concatenate(nodes), np.concatenate(owners)
    key = np.sort(node * (count + 1) + owner)  # unique: an interval is in a node at most once
    node, owner = key // (count + 1), key % (count + 1)
    distinct, dense = np.unique(values, return_inverse=True)
    lift = np.concatenate(([0], np.cumsum(node[1:] != node[:-1]))) * (count + 1)
    suffix = np.append(np.minimum.accumulate((dense[owner] + lift)[::-1])[::-1] - lift, len(distinct))
    path = (np.arange(size) + leaves) >> np.arange(leaves.bit_length())[:, None]
    where = np.searchsorted(key, path * (count + 1) + need)
    inside = where < key.size
    inside[inside] = node[where[inside]] == path[inside]
    best = suffix[np.where(inside, where, key.size)].min(axis=0)
    return np.append(distinct, infinity).astype(values.dtype)[best]


def _raise_no_fit(chain: _Chain):
    """NoFeasiblePlan naming the over-cap stages of the most memory-balanced plan: the same search on memory."""
    n, k, cap = chain.n, chain.stages, chain.cap
    low, high = list(range(k)) + [n], [0] + [n - k + s for s in range(1, k + 1)]

    def probe(limit: float):
        end = chain.reach(limit)
        layers, _ = _layers(chain, low, high, end, chain.ceiling)
        if not layers[k][n]:
            starts = np.flatnonzero(np.logical_or.reduce(layers[:k])[:n] & (end < n))
            return float(chain.held(starts, end[starts] + 1).min(initial=math.inf)), None
        plan = _trace_back(n, low, high, _admissible(chain, layers, end, chain.ceiling), chain.held)
        return float(max(chain.solution(plan, 0.0).stage_memory)), plan

    least_cap, plan = _smallest_bound(probe, 0.0, math.inf)
    held, ends = chain.solution(plan, 0.0).stage_memory, plan[1:] + (n,)
    over = "; ".join(f"stage {s} (nodes {plan[s]}..{ends[s] - 1}) needs {_bytes(held[s])} but the cap is "
                     f"{_bytes(cap)}: {_bytes(held[s] - cap)} short"
                     for s in range(k) if held[s] > cap)
    raise NoFeasiblePlan(f"no split into {k} stages fits memory_cap; in the most memory-balanced one, {over}. That "
                         f"split needs a cap of {_bytes(least_cap)}: raise the cap, add devices, or hold less per "
                         f"stage (fewer micro-batches in flight, smaller optimizer state)")


def _bytes(amount: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if amount >= size:
            return f"{amount / size:.1f} {unit} ({amount:,.0f} bytes)"
    return f"{amount:,.0f} bytes"
