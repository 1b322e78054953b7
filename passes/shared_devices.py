"""Two stages a device in a V, balanced as the device's sum (numpy and heapq, no graph knowledge):
``balance_devices(starts, n_devices, ...) -> DeviceCut``. zbv and DualPipeV lay 2K stages out in a V: device d holds
stages d and 2K-1-d, runs both stages' tasks, and so takes their sum of a step, not the larger.

Note [stages balanced as their device's sum]: the cut solvers balance each stage. Where one node outweighs a stage's
share (a 32k-token LM head at 2K stages), the stage holding it sets the bottleneck and the rest come out small; in a V
its device also holds the first stage, and carries most of the step (benchmarks/results/cut.txt, zbv). In a V,
device d's stages are [l_d, l_{d+1}) and [r_{d+1}, r_d) with l_0 = 0, r_0 = N and nested pairs l_d < l_{d+1}, r_{d+1}
< r_d, so the device sums are the differences of z_d = P[l_d] - P[r_d] (P the prefix sums), and device K-1 holds
[l_{K-1}, r_{K-1}) whole, the middle cut anywhere in it. The least largest sum is found by bisection over a bound B:
pairs are reached device by device, keeping per l the least r (an interval inside another leaves no device more
work), each (l', r') from the reached pair of least remaining work P[r] - P[l] among those with l < l' that can still
reach it, a heap whose entries once unable stay so as l' grows. Then, as the solvers spend their tolerance, each cut
moves to where the fewest then smallest tensors cross while both its devices stay within (1 + tolerance) of that
bound. Keeping the least r per l can miss a plan whose stages would otherwise come out empty; where the search does
worse than the stage-balanced cut it started from, or breaks what a stage must keep, that cut is kept."""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

Costs = Callable[[np.ndarray, np.ndarray], np.ndarray]  # stage [a, b)'s cost, elementwise
Fits = Callable[[np.ndarray, np.ndarray], np.ndarray]   # whether stage [a, b) may be (memory, kept ranges)


@dataclass(frozen=True)
class DeviceCut:
    starts: tuple[int, ...]          # stage s covers nodes [starts[s], starts[s+1])
    device_costs: tuple[float, ...]  # per device, the sum of its two stages' costs


def v_holders(n_devices: int) -> tuple[int, ...]:
    """The device of each of a V's 2K stages: d and 2K-1-d on device d."""
    return tuple(min(s, 2 * n_devices - 1 - s) for s in range(2 * n_devices))


def balance_devices(starts: Sequence[int], n_devices: int, weights: Sequence[float], cost: Costs, fits: Fits,
                    keys: np.ndarray, tolerance: float) -> DeviceCut:
    """From the stage-balanced cut ``starts`` of 2K stages (each non-empty and fitting), the V cut of least largest
    device sum of ``weights`` (Note [stages balanced as their device's sum]), then its cuts moved to the least ``keys``
    with every device within (1 + ``tolerance``) of it, by the stages' ``cost`` (the weights', or with crossings
    priced) and where ``fits`` allows."""
    n, K = len(weights), n_devices
    if len(starts) != 2 * K:
        raise ValueError(f"a V of {K} devices has {2 * K} stages, the cut has {len(starts)}")
    prefix = np.concatenate(([0.0], np.cumsum(np.asarray(weights, dtype=float))))
    holders = v_holders(K)
    start = [int(a) for a in starts]
    worst = max(_device_costs(start, holders, n, cost))
    low, high, found = float(prefix[-1]) / K, worst, None  # no device below the mean; to a ten-millionth of it
    while high - low > 1e-7 * max(high, 1e-300):
        middle = (low + high) / 2
        plan = _v_plan(prefix, K, middle)
        if plan is None:
            low = middle
        else:
            high, found = middle, plan
    plan = start
    if found is not None:  # the middle cut, inside device K-1's interval, where its two stages fit and least crosses
        inner, outer = found[K - 1], found[K + 1] if K + 1 < 2 * K else n
        p = np.arange(inner + 1, outer)
        ok = np.flatnonzero(fits(np.full_like(p, inner), p) & fits(p, np.full_like(p, outer)))
        found[K] = int(p[ok[np.argmin(keys[p[ok]])]]) if ok.size else found[K]
        if _fits(found, n, fits) and max(_device_costs(found, holders, n, cost)) <= worst:
            plan = found
    bound = (1.0 + tolerance) * max(_device_costs(plan, holders, n, cost))
    while any(_fewer_crossing(plan, i, holders, n, cost, fits, keys, bound) for i in range(1, len(plan))):
        pass
    return DeviceCut(tuple(plan), tuple(_device_costs(plan, holders, n, cost)))


def _v_plan(prefix: np.ndarray, K: int, bound: float) -> list[int] | None:
    """A V cut (its 2K stage starts) whose every device sums to at most ``bound``, or None where the search finds
    none (Note [stages balanced as their device's sum])."""
    n = len(prefix) - 1
    P = prefix.tolist()
    layers: list[dict[int, tuple[int, int]]] = [{0: (n, -1)}]  # per device: l -> (its least r, the l before)
    for d in range(1, K):
        need = 2 * (K - d)  # stages d .. 2K-1-d lie in [l_d, r_d), a node each at least
        entries = sorted((left, r) for left, (r, _) in layers[-1].items())
        reached: dict[int, tuple[int, int]] = {}
        heap: list[tuple[float, int, int]] = []  # (remaining work, l, r) of the pairs before
        k = 0
        for lp in range(d, n - need + 1):
            while k < len(entries) and entries[k][0] < lp:
                left, r = entries[k]
                heapq.heappush(heap, (P[r] - P[left], left, r))
                k += 1
            # a pair that can reach no l' here reaches none further: its device with one node on the right is over
            # the bound, or too few nodes are left inside
            while heap and (P[lp] - P[heap[0][1]] + P[heap[0][2]] - P[heap[0][2] - 1] > bound
                            or heap[0][2] < lp + need + 1):
                heapq.heappop(heap)
            if heap:
                remaining, left, r = heap[0]
                rp = max(int(np.searchsorted(prefix, P[lp] + remaining - bound, side="left")), lp + need)
                if rp < r:
                    reached[lp] = (rp, left)
        if not reached:
            return None
        layers.append(reached)
    last = next((left for left, (r, _) in sorted(layers[-1].items()) if P[r] - P[left] <= bound and r - left >= 2),
                None)
    if last is None:
        return None
    lefts, rights, left = [], [], last
    for layer in reversed(layers[1:]):
        r, before = layer[left]
        lefts.append(left)
        rights.append(r)
        left = before
    lefts = [0] + lefts[::-1]  # l_0 .. l_{K-1}
    return lefts + [lefts[-1] + 1] + rights  # rights: r_{K-1} .. r_1, the starts of stages K+1 .. 2K-1


def _device_costs(plan: list[int], holders: Sequence[int], n: int, cost: Costs) -> list[float]:
    first = np.asarray(plan)
    sums = [0.0] * (max(holders) + 1)
    for s, c in enumerate(cost(first, np.append(first[1:], n))):
        sums[holders[s]] += float(c)
    return sums


def _fits(plan: list[int], n: int, fits: Fits) -> bool:
    first = np.asarray(plan)
    return bool(np.all(np.diff(np.append(first, n)) > 0) and np.all(fits(first, np.append(first[1:], n))))


def _fewer_crossing(plan: list[int], i: int, holders: Sequence[int], n: int, cost: Costs, fits: Fits,
                    keys: np.ndarray, bound: float) -> bool:
    """Cut i (between stages i - 1 and i) moved in place to its least key among the positions where both stages fit
    and both their devices stay within ``bound``; whether it moved."""
    a, end = plan[i - 1], plan[i + 1] if i + 1 < len(plan) else n
    p = np.arange(a + 1, end)
    left, right = holders[i - 1], holders[i]
    sums = _device_costs(plan, holders, n, cost)
    # each stage's cost at each position, against its cost now
    before = cost(np.full_like(p, a), p) - float(cost(np.array([a]), np.array([plan[i]]))[0])
    after = cost(p, np.full_like(p, end)) - float(cost(np.array([plan[i]]), np.array([end]))[0])
    if left == right:
        within = sums[left] + before + after <= bound
    else:
        within = (sums[left] + before <= bound) & (sums[right] + after <= bound)
    within &= fits(np.full_like(p, a), p) & fits(p, np.full_like(p, end))
    if not within.any():
        return False
    candidates = np.flatnonzero(within)
    best = int(p[candidates[np.argmin(keys[p[candidates]])]])
    if not keys[best] < keys[plan[i]]:
        return False
    plan[i] = best
    return True
