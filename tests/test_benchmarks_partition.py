"""Smoke test of benchmarks/partition.py on tiny models (seconds), and the baselines against
the originals' own examples and brute force."""
import itertools
import random

import pytest
import torch

from benchmarks import _baselines
from benchmarks import partition as bench


@pytest.fixture(scope="module")
def tiny_gpt_rows():
    # A heavy tied head (vocab 1000 vs d=64) makes layer-granular splits uneven.
    case = bench.gpt_case(4, ks=(2, 4), d=64, heads=4, vocab=1000, seq=32, batch=4)
    model, inputs = case.build()
    return bench.measure_model(case.name, model, inputs, case.ks, chunks=8)


def test_table_has_every_method_at_every_k(tiny_gpt_rows):
    assert [(r.k, r.method) for r in tiny_gpt_rows] == [(k, m) for k in (2, 4) for m in bench.METHODS]
    assert all(r.plan is not None and r.error is None for r in tiny_gpt_rows)
    table = bench.format_table(tiny_gpt_rows)
    lines = table.splitlines()
    assert lines[0].split()[:3] == ["model", "K", "method"]
    assert len(lines) == 2 + len(tiny_gpt_rows)
    for method in bench.METHODS:
        assert method in table


def test_ours_is_at_least_as_balanced_as_every_baseline(tiny_gpt_rows):
    for k in (2, 4):
        rows = {r.method: r for r in tiny_gpt_rows if r.k == k}
        ours = rows.pop("autopipe")
        for method, row in rows.items():
            assert ours.imbalance <= row.imbalance, (k, method, ours.imbalance, row.imbalance)
        assert ours.plan_call_s > ours.split_s > 0


def test_rows_are_scored_alike(tiny_gpt_rows):
    for r in tiny_gpt_rows:
        plan = r.plan
        assert plan.n_stages == r.k
        assert plan.total_cost == pytest.approx(tiny_gpt_rows[0].plan.total_cost)  # same nodes, same weights
        assert r.over_bound >= 1.0 - 1e-9
        assert r.step == pytest.approx(plan.bottleneck * (8 + r.k - 1) / 8 / plan.total_cost)
        assert len(r.cut_tensors) == r.k - 1 and all(c >= 1 for c in r.cut_tensors)
    dp = next(r for r in tiny_gpt_rows if r.k == 4 and r.method == "layer DP")
    assert sum(dp.layers_per_stage) == 8  # wte, wpe, 4 blocks, ln_f, lm_head


def test_layers_look_through_containers():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = torch.nn.Conv2d(3, 4, 3)
            self.body = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 3), torch.nn.Conv2d(4, 4, 3))
            self.blocks = torch.nn.ModuleList(torch.nn.Conv2d(4, 4, 1) for _ in range(2))
            self.fc = torch.nn.Linear(4, 2)

        def forward(self, x):
            x = self.body(torch.relu(self.stem(x)))
            for b in self.blocks:
                x = b(x)
            return self.fc(x.mean((2, 3)))

    costed = bench.cost(bench.trace(Tiny(), (torch.randn(2, 3, 12, 12),)))
    layers = bench.layers_of(bench.node_view(costed, 2))
    assert layers.names == ["stem", "body.0", "body.1", "blocks.0", "blocks.1", "fc"]
    assert layers.params == [3 * 4 * 9 + 4, 4 * 4 * 9 + 4, 4 * 4 * 9 + 4, 16 + 4, 16 + 4, 8 + 2]


def test_synthetic_runs():
    result = bench.synthetic(n=2000, k=4, repeats=1)
    assert result["n"] == 2000 and result["seconds"] > 0 and result["over_bound"] >= 1.0


def test_block_partition_matches_torchgpipe():
    # torchgpipe's own tests (tests/test_balance.py): solve([1..6], 2) == [[1, 2, 3, 4], [5, 6]]
    assert _baselines.block_partition([1, 2, 3, 4, 5, 6], 2) == [0, 4]
    assert _baselines.block_partition([1, 2, 3, 4, 5, 6], 3) == [0, 3, 5]
    assert _baselines.block_partition([0, 0], 2) == [0, 1]
    with pytest.raises(ValueError):
        _baselines.block_partition([42], 2)


def _splits(n, k):
    for cuts in itertools.combinations(range(1, n), k - 1):
        yield [0, *cuts]


def _sums(w, starts):
    return [sum(w[a:b]) for a, b in zip(starts, list(starts[1:]) + [len(w)])]


def test_exact_and_parameters_against_brute_force():
    rng = random.Random(0)
    for _ in range(40):
        n, k = rng.randint(1, 9), rng.randint(1, 4)
        if n < k:
            continue
        w = [rng.randint(0, 20) for _ in range(n)]
        best = min(max(_sums(w, s)) for s in _splits(n, k))
        assert max(_sums(w, _baselines.exact(w, k))) == best
        spread = min(max(_sums(w, s)) - min(_sums(w, s)) for s in _splits(n, k))
        got = _sums(w, _baselines.parameters(w, k))
        assert len(got) == k and max(got) - min(got) == spread
    assert _baselines.uniform(list(range(10)), 4) == [0, 3, 6, 8]
    assert _baselines.megatron([False, True, True, True, True, False], 2) == [0, 3]
