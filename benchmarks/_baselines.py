"""The layer-granular split methods that benchmarks/partition.py compares autopipe against.

Each takes per-layer weights (a list of non-negative numbers, one per layer in
model order) and the number of stages K, and returns ``starts``: the index of
the first layer of each of the K stages (``starts[0] == 0``, strictly
increasing, so every stage is non-empty and contiguous).

- :func:`uniform`          the same number of layers per stage (Megatron-LM and
                           DeepSpeed ``partition_method="uniform"``);
- :func:`megatron`         Megatron-LM's rule for a transformer: the repeated
                           blocks split evenly, whatever comes before the first
                           block on the first stage, whatever follows the last
                           on the last;
- :func:`block_partition`  torchgpipe's ``balance_by_time``/``balance_by_size``
                           heuristic (Bárány and Grinberg, "Block partitions of
                           sequences", arXiv:1308.2452), as
                           ``torchgpipe.balance.blockpartition.solve`` does it;
- :func:`parameters`       DeepSpeed ``PipelineModule(partition_method="parameters")``:
                           ``partition_balanced`` over per-layer parameter counts;
- :func:`exact`            the least bottleneck over contiguous layer groups
                           (linear partitioning by dynamic programming).

Re-implemented from the descriptions and the original sources (read, not
copied; neither library is a dependency):

- torchgpipe: https://github.com/kakaobrain/torchgpipe/blob/master/torchgpipe/balance/blockpartition.py
  (``solve``) and torchgpipe/balance/utils.py (``balance_cost``: the balance is
  the lengths of the blocks ``solve`` returns);
- DeepSpeed: https://github.com/deepspeedai/DeepSpeed/blob/master/deepspeed/runtime/utils.py
  (``partition_uniform``, ``partition_balanced``) and
  deepspeed/runtime/pipe/module.py (``PipelineModule._partition_layers``:
  ``"parameters"`` balances ``_count_layer_params``, the trainable parameter
  count of each layer).
"""

from __future__ import annotations

import itertools
from typing import Sequence

__all__ = ["uniform", "megatron", "block_partition", "parameters", "exact", "starts_from_sizes"]


def starts_from_sizes(sizes: Sequence[int]) -> list[int]:
    """[3, 4, 2] layers per stage -> starts [0, 3, 7]."""
    starts, at = [], 0
    for size in sizes:
        starts.append(at)
        at += size
    return starts


def _check(n: int, k: int) -> None:
    if k < 1:
        raise ValueError(f"need at least one stage, got {k}")
    if n < k:
        raise ValueError(f"{n} layers cannot fill {k} non-empty stages")


# -- 1. equal layer counts ---------------------------------------------------------------


def uniform(weights: Sequence[float], k: int) -> list[int]:
    """The same number of layers per stage; the first ``n % k`` stages take one more
    (DeepSpeed ``partition_uniform``: ``parts[i + 1:] += 1`` for the first residual parts)."""
    n = len(weights)
    _check(n, k)
    chunk, residual = divmod(n, k)
    return starts_from_sizes([chunk + (1 if s < residual else 0) for s in range(k)])


def megatron(is_block: Sequence[bool], k: int) -> list[int]:
    """Megatron-LM's pipeline split: ``num_layers // K`` transformer blocks per stage (the
    first ``num_layers % K`` stages one more); the embedding (layers before the first block)
    rides on the first stage and the final norm and head (layers after the last block) on the
    last. A non-block layer between blocks stays with the block before it."""
    blocks = [i for i, b in enumerate(is_block) if b]
    _check(len(blocks), k)
    per_stage = uniform(blocks, k)  # starts, as indices into ``blocks``
    return [0] + [blocks[i] for i in per_stage[1:]]


# -- 2. torchgpipe's block partition -----------------------------------------------------


def block_partition(weights: Sequence[float], k: int, *, max_moves: int = 10_000_000) -> list[int]:
    """torchgpipe.balance.blockpartition.solve, then ``balance = [len(block) ...]``.

    The sequence is normalised to [0, 1] ((x - min) / (max - min)); starting from
    ``n // k`` elements per block (the last block takes the rest), while the largest block
    sum M exceeds the smallest m by more than 1 (one largest element, after
    normalising), move one element into a smallest block q from its neighbour h on the
    side of the largest block p (Bárány-Grinberg step 3); back to picking p when h was p.
    As in torchgpipe, ties are settled by ``max``/``min`` over (size, index) pairs (the
    largest block of highest index, the smallest of lowest index), not by picking the
    smallest block closest to p as the paper says.
    """
    n = len(weights)
    _check(n, k)
    low, span = min(weights), max(weights) - min(weights)
    normal = [0.0] * n if span == 0 else [(w - low) / span for w in weights]
    splits = [n // k * (x + 1) for x in range(k - 1)] + [n]

    def block(i: int) -> float:
        return sum(normal[(splits[i - 1] if i > 0 else 0): splits[i]])

    moves = 0
    while True:
        max_size, p = max((block(i), i) for i in range(k))
        while True:
            min_size, q = min((block(i), i) for i in range(k))
            if max_size <= min_size + 1:
                sizes = [b - a for a, b in zip([0] + splits[:-1], splits)]
                if any(s <= 0 for s in sizes):
                    raise ValueError(f"torchgpipe's block partition left an empty stage: balance {sizes}")
                return starts_from_sizes(sizes)
            if p < q:
                h = q - 1
                splits[h] -= 1   # the last element of B_{q-1} moves into B_q
            else:
                h = q + 1
                splits[q] += 1   # the first element of B_{q+1} moves into B_q
            moves += 1
            if moves > max_moves:
                raise RuntimeError("torchgpipe's block partition did not converge")
            if p == h:
                break


# -- 3. DeepSpeed's parameter-balanced split ---------------------------------------------


def parameters(param_counts: Sequence[float], k: int) -> list[int]:
    """DeepSpeed ``partition_balanced(weights=param_counts, num_parts=k)`` (the current
    dynamic program: among splits into k non-empty parts, the least (largest part - smallest
    part); on ties the later last boundary, since it updates on ``>=``). Fewer layers than
    parts falls back to ``partition_uniform``, as DeepSpeed does."""
    n = len(param_counts)
    _check(n, k)
    prefix = _prefix_sums(param_counts)
    inf = float("inf")
    dp_max = [[inf] * (k + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (k + 1) for _ in range(n + 1)]
    dp_cost = [[inf] * (k + 1) for _ in range(n + 1)]
    position = [[0] * (k + 1) for _ in range(n + 1)]
    dp_max[0][0] = 0.0
    dp_cost[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, k) + 1):
            for m in range(i):
                part = prefix[i] - prefix[m]
                max_sum = max(dp_max[m][j - 1], part)
                min_sum = min(dp_min[m][j - 1], part)
                cost = max_sum - min_sum
                if dp_cost[i][j] >= cost:
                    dp_cost[i][j] = cost
                    dp_max[i][j] = max_sum
                    dp_min[i][j] = min_sum
                    position[i][j] = m
    parts = [n]
    for j in range(k, 0, -1):
        parts.append(position[parts[-1]][j])
    parts.reverse()  # parts[0] == 0 ... parts[k] == n
    return parts[:-1]


# -- 4. the exact layer-granular optimum --------------------------------------------------


def exact(weights: Sequence[float], k: int) -> list[int]:
    """The least bottleneck (largest stage sum) over splits into k non-empty contiguous
    groups of layers: O(k n^2) dynamic program over prefixes. Among optimal splits it keeps
    the one whose cuts come earliest (strict improvement only)."""
    n = len(weights)
    _check(n, k)
    prefix = _prefix_sums(weights)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(k + 1)]
    arg = [[0] * (n + 1) for _ in range(k + 1)]
    best[0][0] = 0.0
    for j in range(1, k + 1):
        for e in range(j, n - (k - j) + 1):
            row, cell = best[j - 1], inf
            for s in range(j - 1, e):
                value = max(row[s], prefix[e] - prefix[s])
                if value < cell:
                    cell, arg[j][e] = value, s
            best[j][e] = cell
    starts, end = [], n
    for j in range(k, 0, -1):
        end = arg[j][end]
        starts.append(end)
    return starts[::-1]


def _prefix_sums(weights: Sequence[float]) -> list[float]:
    """prefix[i] = the sum of the first i weights (prefix[0] = 0.0)."""
    return [0.0, *itertools.accumulate(float(w) for w in weights)]
