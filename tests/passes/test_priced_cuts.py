"""passes/priced_cuts.py: the cut solver with crossings priced, against exhaustive search over every split (integer
costs and prices, so both sides compute every stage cost exactly); and the price moving a cut out of a wide value."""
import itertools
import math

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from autopipe.passes.cut_solver import CutProblem, NoCutKeepsWhole, solve_cuts
from autopipe.passes.priced_cuts import solve_priced_cuts
from test_cut_solver import live_across




def priced_plans(problem: CutProblem, price: float):
    """Every plan: (priced bottleneck, (tensors, bytes) summed over cuts, starts, keeps every kept_whole entry)."""
    n = len(problem.weights)
    plans = []
    for cuts in itertools.combinations(range(1, n), problem.n_stages - 1):
        starts = (0,) + cuts
        costs = [sum(problem.weights[a:b]) + price * (live_across(problem, a)[1] + live_across(problem, b)[1])
                 for a, b in zip(starts, cuts + (n,))]
        crossing = [live_across(problem, c) for c in cuts]
        keeps = all(any(not any(first < c <= last for c in cuts) for first, last in ranges)
                    for ranges in problem.kept_whole)
        plans.append((max(costs), (sum(t for t, _ in crossing), sum(d for _, d in crossing)), starts, keeps))
    return plans


@st.composite
def priced_problems(draw):
    n = draw(st.integers(1, 9))
    weights = [float(w) for w in draw(st.lists(st.sampled_from([0, 1, 2, 3, 5, 8, 13, 40]), min_size=n, max_size=n))]
    consumers = [sorted(draw(st.sets(st.integers(i + 1, n - 1)))) if i < n - 1 else [] for i in range(n)]
    kept = []
    for _ in range(draw(st.integers(0, 2))):
        p = draw(st.integers(0, n - 1))
        kept.append([(draw(st.integers(0, p)), draw(st.integers(p, n - 1))) for _ in range(draw(st.integers(1, 2)))])
    problem = CutProblem(weights=weights, out_bytes=draw(st.lists(st.integers(0, 16), min_size=n, max_size=n)),
                         consumers=consumers, n_stages=draw(st.integers(1, min(n, 5))),
                         tolerance=draw(st.sampled_from([0.0, 0.03, 0.25])), kept_whole=kept)
    return problem, float(draw(st.sampled_from([0, 1, 2, 5])))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(priced_problems())
def test_matches_exhaustive_search(case):
    """The least priced bottleneck of the plans that keep every entry, and at it the fewest crossings; NoCutKeepsWhole
    where that bottleneck is beyond the tolerance of the optimum of all plans (Note [a priced tolerance])."""
    problem, price = case
    plans = priced_plans(problem, price)
    optimum = min(bottleneck for bottleneck, *_ in plans)
    least = min((bottleneck for bottleneck, _, _, keeps in plans if keeps), default=math.inf)
    if least > (1 + problem.tolerance) * optimum:
        with pytest.raises(NoCutKeepsWhole) as info:
            solve_priced_cuts(problem, price)
        assert info.value.optimum == optimum and info.value.least_bottleneck == least
        return
    solution = solve_priced_cuts(problem, price)
    assert solution.optimum == optimum and solution.bottleneck == least
    assert (sum(solution.cut_tensors), sum(solution.cut_bytes)) == min(
        crossing for bottleneck, crossing, _, keeps in plans if keeps and bottleneck == least)
    if price == 0 and not problem.kept_whole:  # unpriced: solve_cuts' optimum
        assert solution.optimum == solve_cuts(problem).optimum


def test_a_priced_cut_leaves_the_wide_value():
    """A chain whose balanced cut carries a wide value (9 bytes against 1): unpriced, the balance cuts there; priced at
    a byte a unit, the cut moves to a narrow value, a worse balance (3 | 9) but a faster largest stage (10, not 15)."""
    problem = CutProblem(weights=[3.0, 3.0, 3.0, 3.0], out_bytes=[1, 9, 1, 1], consumers=[[1], [2], [3], []],
                         n_stages=2, tolerance=0.0)
    assert solve_cuts(problem).cut_bytes == (9,) and solve_cuts(problem).bottleneck == 6
    priced = solve_priced_cuts(problem, 1.0)
    assert priced.cut_bytes == (1,) and priced.bottleneck == 9 + 1 and priced.optimum == 10


def test_a_memory_cap_is_refused():
    problem = CutProblem(weights=[1.0, 1.0], out_bytes=[1, 1], consumers=[[1], []], n_stages=2, memory_cap=10.0)
    with pytest.raises(ValueError, match="memory_cap"):
        solve_priced_cuts(problem, 1.0)
