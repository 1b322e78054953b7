"""Property tests of the exact cut solver (passes/cut_solver.py).

Small graphs are checked against exhaustive search over every split; medium ones against a
plain O(K N^2) dynamic program; costs are integer-valued so that both sides compute every stage cost exactly and ties at the tolerance bound are real ties.
"""

import dataclasses
import itertools
import math
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

try:
    from autopipe.passes.cut_solver import CutProblem, CutSolution, NoCutKeepsWhole, NoFeasiblePlan, solve_cuts
except ImportError:  # running from a checkout without installing
    from passes.cut_solver import CutProblem, CutSolution, NoCutKeepsWhole, NoFeasiblePlan, solve_cuts


# ---- an independent reading of the model -------------------------------------------------


def live_across(problem: CutProblem, position: int) -> tuple[int, int]:
    """(tensors, bytes) produced before ``position`` and read at or after it."""
    tensors = data = 0
    for i, readers in enumerate(problem.consumers):
        if i < position and any(j >= position for j in readers):
            tensors, data = tensors + 1, data + problem.out_bytes[i]
    return tensors, data


def stage_numbers(problem: CutProblem, a: int, b: int) -> tuple[float, float]:
    """(cost, memory) of stage [a, b), straight from the CutProblem field comments."""
    cost = sum(problem.weights[a:b])
    memory = problem.activation_multiplier * live_across(problem, a)[1]
    for size, nodes in problem.shared_memory or ():
        if any(a <= i < b for i in nodes):
            memory += size
    return cost, memory


def fits(problem: CutProblem, memory: float) -> bool:
    return problem.memory_cap is None or memory <= problem.memory_cap


def exhaustive(problem: CutProblem):
    """Every plan that fits memory: (bottleneck, (tensors, bytes) summed over cuts, starts)."""
    n = len(problem.weights)
    plans = []
    for cuts in itertools.combinations(range(1, n), problem.n_stages - 1):
        starts = (0,) + cuts
        numbers = [stage_numbers(problem, a, b) for a, b in zip(starts, cuts + (n,))]
        if all(fits(problem, memory) for _, memory in numbers):
            crossing = [live_across(problem, c) for c in cuts]
            plans.append((max(cost for cost, _ in numbers),
                          (sum(t for t, _ in crossing), sum(d for _, d in crossing)), starts))
    return plans


def check_reported_numbers(problem: CutProblem, solution: CutSolution):
    """The plan is K non-empty contiguous stages over 0..N-1 and every number reported is right."""
    n, k = len(problem.weights), problem.n_stages
    starts = solution.starts
    assert len(starts) == k and starts[0] == 0 and all(a < b for a, b in zip(starts, starts[1:] + (n,)))
    numbers = [stage_numbers(problem, a, b) for a, b in zip(starts, starts[1:] + (n,))]
    assert list(solution.stage_costs) == [cost for cost, _ in numbers]
    assert list(solution.stage_memory) == [memory for _, memory in numbers]
    assert solution.bottleneck == max(solution.stage_costs)
    assert [live_across(problem, c) for c in starts[1:]] == list(zip(solution.cut_tensors, solution.cut_bytes))
    assert all(fits(problem, memory) for memory in solution.stage_memory)
    assert solution.optimum <= solution.bottleneck <= (1 + problem.tolerance) * solution.optimum


# ---- random problems ----------------------------------------------------------------------


def own(node_memory) -> list:
    """Memory held by one node each, as shared tensors of one member."""
    return [(m, [i]) for i, m in enumerate(node_memory)]


@st.composite
def problems(draw, max_nodes: int) -> CutProblem:
    n = draw(st.integers(1, max_nodes))
    weights = [float(w) for w in draw(st.lists(st.sampled_from([0, 0, 1, 2, 3, 5, 8, 13, 40]), min_size=n, max_size=n))]
    if draw(st.booleans()):
        weights[draw(st.integers(0, n - 1))] = 1e6  # one node heavier than all the rest
    out_bytes = draw(st.lists(st.integers(0, 64), min_size=n, max_size=n))
    if max_nodes <= 12:  # any forward edges, long skips included
        consumers = [sorted(draw(st.sets(st.integers(i + 1, n - 1)))) if i < n - 1 else [] for i in range(n)]
    else:  # a chain with skips of heavy-tailed length, like real graphs
        consumers = []
        for i in range(n):
            reads = {i + 1} if i + 1 < n and draw(st.integers(0, 9)) else set()
            reads |= {j for j in draw(st.sets(st.integers(i + 1, i + 1 + 2 ** draw(st.integers(0, 5))), max_size=2)) if j < n}
            consumers.append(sorted(reads))
    memory = {}
    if draw(st.booleans()):
        node_memory = [float(m) for m in draw(st.lists(st.integers(0, 20), min_size=n, max_size=n))]
        shared = [(float(draw(st.integers(0, 30))), draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=4)))
                  for _ in range(draw(st.integers(0, 2)))]
        memory = dict(shared_memory=own(node_memory) + shared,
                      activation_multiplier=draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
                      memory_cap=float(draw(st.integers(0, 40 + 10 * n))))
    return CutProblem(
        weights=weights,
        out_bytes=out_bytes,
        consumers=consumers,
        n_stages=draw(st.integers(1, min(n, 8))),
        tolerance=draw(st.sampled_from([0.0, 0.03, 0.1, 0.5]) | st.floats(0, 1)),
        **memory,
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_nodes=10))
def test_matches_exhaustive_search(problem):
    plans = exhaustive(problem)
    if not plans:
        with pytest.raises(NoFeasiblePlan):
            solve_cuts(problem)
        return
    solution = solve_cuts(problem)
    optimum = min(bottleneck for bottleneck, _, _ in plans)
    assert solution.optimum == optimum
    balanced = [crossing for bottleneck, crossing, _ in plans if bottleneck <= (1 + problem.tolerance) * optimum]
    assert (sum(solution.cut_tensors), sum(solution.cut_bytes)) == min(balanced)
    check_reported_numbers(problem, solution)


def dynamic_program(problem: CutProblem):
    """(optimum, least (tensors, bytes)) by the textbook O(K N^2) recurrences; None: nothing fits."""
    n, k = len(problem.weights), problem.n_stages
    stage = {(a, b): stage_numbers(problem, a, b) for a in range(n) for b in range(a + 1, n + 1)}
    crossing = [live_across(problem, p) if 0 < p < n else (0, 0) for p in range(n + 1)]
    allowed = {ab for ab, (_, memory) in stage.items() if fits(problem, memory)}
    worst = [[math.inf] * (n + 1) for _ in range(k + 1)]
    worst[0][0] = -math.inf
    for s in range(1, k + 1):
        for a, b in allowed:
            worst[s][b] = min(worst[s][b], max(worst[s - 1][a], stage[a, b][0]))
    optimum = worst[k][n]
    if math.isinf(optimum):
        return None
    bound = (1 + problem.tolerance) * optimum
    least = [[None] * (n + 1) for _ in range(k + 1)]
    least[0][0] = (0, 0)
    for s in range(1, k + 1):
        for a, b in sorted(allowed):
            if least[s - 1][a] is not None and stage[a, b][0] <= bound:
                total = (least[s - 1][a][0] + crossing[b][0], least[s - 1][a][1] + crossing[b][1])
                least[s][b] = total if least[s][b] is None else min(least[s][b], total)
    return optimum, least[k][n]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems(max_nodes=40))
def test_matches_dynamic_program_on_longer_chains(problem):
    expected = dynamic_program(problem)
    if expected is None:
        with pytest.raises(NoFeasiblePlan):
            solve_cuts(problem)
        return
    solution = solve_cuts(problem)
    assert (solution.optimum, (sum(solution.cut_tensors), sum(solution.cut_bytes))) == expected
    check_reported_numbers(problem, solution)


# ---- ranges kept in one stage ----------------------------------------------------------------


@st.composite
def kept_problems(draw) -> CutProblem:
    """Small problems with kept_whole entries: each a few ranges around one node."""
    problem = draw(problems(max_nodes=10))
    n, entries = len(problem.weights), []
    for _ in range(draw(st.integers(1, 3))):
        p = draw(st.integers(0, n - 1))
        entries.append([(draw(st.integers(0, p)), draw(st.integers(p, n - 1))) for _ in range(draw(st.integers(1, 3)))])
    return dataclasses.replace(problem, kept_whole=entries)


def keeps(problem: CutProblem, starts) -> bool:
    """Every entry has a range no cut falls inside."""
    return all(any(not any(first < c <= last for c in starts[1:]) for first, last in ranges)
               for ranges in problem.kept_whole)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kept_problems())
def test_kept_ranges_match_exhaustive_search(problem):
    """The fewest crossings among plans that keep every entry, within the tolerance of the optimum of all plans; or,
    where none is, NoCutKeepsWhole with the least bottleneck of a plan that keeps them."""
    plans = exhaustive(problem)
    if not plans:
        with pytest.raises(NoFeasiblePlan):
            solve_cuts(problem)
        return
    optimum = min(bottleneck for bottleneck, _, _ in plans)
    kept = [(bottleneck, crossing) for bottleneck, crossing, starts in plans if keeps(problem, starts)]
    balanced = [crossing for bottleneck, crossing in kept if bottleneck <= (1 + problem.tolerance) * optimum]
    if not balanced:
        with pytest.raises(NoCutKeepsWhole) as info:
            solve_cuts(problem)
        assert info.value.optimum == optimum
        assert info.value.least_bottleneck == min((bottleneck for bottleneck, _ in kept), default=math.inf)
        assert 0 <= info.value.entry < len(problem.kept_whole)
        return
    solution = solve_cuts(problem)
    assert keeps(problem, solution.starts) and solution.optimum == optimum
    assert (sum(solution.cut_tensors), sum(solution.cut_bytes)) == min(balanced)
    check_reported_numbers(problem, solution)


def test_a_kept_range_no_balanced_plan_holds_names_the_least_bottleneck_that_does():
    # eight equal nodes in four stages: the optimum is 2, but one stage must hold nodes 0..4 or 3..7
    problem = chain_problem(8, n_stages=4, kept_whole=[[(2, 2), (2, 6)], [(0, 4), (3, 7)]])
    with pytest.raises(NoCutKeepsWhole) as caught:
        solve_cuts(problem)
    assert (caught.value.entry, caught.value.optimum, caught.value.least_bottleneck) == (1, 2.0, 5.0)
    solution = solve_cuts(dataclasses.replace(problem, tolerance=1.5))
    assert solution.bottleneck == 5.0 and keeps(problem, solution.starts)


def test_kept_ranges_must_share_a_node():
    with pytest.raises(ValueError, match="share a node"):
        solve_cuts(chain_problem(6, n_stages=2, kept_whole=[[(0, 1), (3, 4)]]))


# ---- errors ----------------------------------------------------------------------------------


def chain_problem(n: int, **fields) -> CutProblem:
    return CutProblem(weights=[1.0] * n, out_bytes=[4] * n,
                      consumers=[[i + 1] if i + 1 < n else [] for i in range(n)], **fields)


def test_no_feasible_plan_names_the_stage_and_the_shortfall():
    gib = 2**30
    problem = chain_problem(6, n_stages=2, shared_memory=own([0.5 * gib] * 5 + [3.2 * gib]), memory_cap=2.0 * gib)
    with pytest.raises(NoFeasiblePlan) as caught:
        solve_cuts(problem)
    message = str(caught.value)
    # the most memory-balanced split keeps node 5 alone: 3.2 GiB against a 2 GiB cap
    assert "stage 1 (nodes 5..5) needs 3.2 GiB" in message
    assert "the cap is 2.0 GiB" in message
    assert f"1.2 GiB ({round(1.2 * gib):,} bytes) short" in message
    assert isinstance(caught.value, ValueError)


def test_no_feasible_plan_lists_every_stage_over_the_cap():
    problem = chain_problem(4, n_stages=2, shared_memory=own([5.0, 1.0, 1.0, 5.0]), memory_cap=4.0)
    with pytest.raises(NoFeasiblePlan) as caught:
        solve_cuts(problem)
    message = str(caught.value)
    # every split leaves one stage at >= 6 bytes; the balanced one is [0, 2) | [2, 4)
    assert "stage 0 (nodes 0..1) needs 6 bytes but the cap is 4 bytes: 2 bytes short" in message
    assert "stage 1 (nodes 2..3) needs 6 bytes" in message


def test_activation_memory_counts_against_the_cap():
    # cutting before node 2 receives 100 bytes, 2x that is held: only the cut before node 1 fits
    problem = CutProblem(weights=[1.0, 1.0, 1.0], out_bytes=[1, 100, 1], consumers=[[1, 2], [2], []],
                         n_stages=2, activation_multiplier=2.0, memory_cap=150.0)
    assert solve_cuts(problem).starts == (0, 1)
    with pytest.raises(NoFeasiblePlan, match="short"):
        solve_cuts(CutProblem(**{**problem.__dict__, "memory_cap": 1.0}))


def test_only_plan_is_one_the_relaxation_rules_out_at_lower_bounds():
    # cutting before node 1 is cheapest but its second stage holds 39 + 48 + 3 * 12 > 116 bytes;
    # cutting before node 2 (cost 16 + 10 = 26) is the only plan that fits, and the search
    # has to widen the positions it looks at to find it rather than give up
    problem = CutProblem(weights=[16.0, 10.0, 11.0], out_bytes=[12, 5, 17], consumers=[[1, 2], [2], []],
                         n_stages=2, shared_memory=own([16.0, 39.0, 48.0]), activation_multiplier=3.0,
                         memory_cap=116.0)
    solution = solve_cuts(problem)
    assert solution.starts == (0, 2) and solution.optimum == 26.0
    check_reported_numbers(problem, solution)


def test_activation_memory_can_force_a_costlier_split():
    # the cheaper splits (bottleneck 16 or 27) start a stage where 90 bytes arrive and hold too
    # much with them; the search must climb past them to the split with bottleneck 28
    problem = CutProblem(weights=[11.0, 16.0, 12.0, 0.0], out_bytes=[57, 90, 1, 58],
                         consumers=[[1], [2, 3], [3], []], n_stages=3, shared_memory=own([32.0, 29.0, 31.0, 9.0]),
                         activation_multiplier=1.0, memory_cap=118.0)
    solution = solve_cuts(problem)
    assert solution.starts == (0, 1, 3) and solution.optimum == 28.0
    check_reported_numbers(problem, solution)


def test_more_stages_than_nodes_is_a_clear_error():
    with pytest.raises(ValueError, match=r"n_stages=4 but the graph has only 3 nodes.*at most 3"):
        solve_cuts(chain_problem(3, n_stages=4))
    with pytest.raises(ValueError, match="positive integer"):
        solve_cuts(chain_problem(3, n_stages=0))


def test_bytes_beyond_float_precision_still_decide_ties():
    # cutting before node 2 or node 3 balances equally (cut 5 is forced); either way node 0's
    # tensor crosses too, and the other crossing tensor is 1 byte smaller for the cut before 3.
    # Keys this large do not fit an int64, so this also runs the exact Python-int fallback.
    huge = 2**58
    problem = CutProblem(weights=[1.0, 1.0, 0.0, 1.0, 1.0, 2.0], out_bytes=[1, huge + 1, huge, 1, 1, 1],
                         consumers=[[1, 5], [2], [3], [4], [5], []], n_stages=3, tolerance=0.0)
    solution = solve_cuts(problem)
    assert solution.starts == (0, 3, 5)
    assert solution.cut_bytes == (huge + 1, 2) and solution.cut_tensors == (2, 2)


def test_stage_costs_one_float_apart_end_the_search():
    # stage costs 1e6 (nodes 0..0) and 999999.9999999999 (prefix sums, nodes 4..4) are adjacent floats: the
    # bisection once probed the upper one forever
    problem = CutProblem(**{**chain_problem(5, n_stages=3).__dict__, "weights": [1e6, 0.1, 0.7, 3.0, 1e6]})
    solution = solve_cuts(problem)
    assert solution.optimum == 1e6 and len(solution.starts) == 3


# ---- scale -----------------------------------------------------------------------------------


def synthetic_graph(n: int, seed: int = 0) -> dict:
    """A chain plus about n random skips with heavy-tailed lengths (E ~ 2N)."""
    rng = np.random.default_rng(seed)
    weights = rng.exponential(1.0, n)
    weights[rng.random(n) < 0.1] = 0.0
    consumers = [[i + 1] for i in range(n - 1)] + [[]]
    sources = rng.integers(0, n - 1, n)
    targets = sources + 2 + (rng.pareto(1.2, n) * 3).astype(np.int64)
    for i, j in zip(sources.tolist(), targets.tolist()):
        if j < n:
            consumers[i].append(j)
    return dict(weights=weights.tolist(), out_bytes=rng.integers(1, 2**20, n).tolist(),
                consumers=[sorted(set(c)) for c in consumers])


def test_hundred_thousand_nodes():
    n = 100_000
    graph = synthetic_graph(n)
    memory = np.random.default_rng(1).integers(0, 2**20, n).astype(float).tolist()
    cap = sum(memory) / 8 * 1.3
    variants = {
        "weights only": {},
        "memory cap + activations": dict(activation_multiplier=4.0, memory_cap=cap,
                                         shared_memory=own(memory) + [(5e6, [3, n - 5])]),
    }
    for name, fields in variants.items():
        problem = CutProblem(n_stages=8, **graph, **fields)
        began = time.perf_counter()
        solution = solve_cuts(problem)
        elapsed = time.perf_counter() - began
        print(f"N={n} K=8 {name}: {elapsed * 1e3:.0f} ms, bottleneck {solution.bottleneck:.1f} "
              f"(optimum {solution.optimum:.1f}), {sum(solution.cut_tensors)} tensors cross")
        assert len(solution.starts) == 8 and solution.starts[0] == 0
        assert solution.optimum <= solution.bottleneck <= 1.03 * solution.optimum
        assert solution.optimum >= sum(graph["weights"]) / 8
