"""The cut solver's keep-together constraints (``CutProblem.kept_whole``), as the stage ends each stage start may take
(numpy only, no graph knowledge): per entry, ranges of nodes sharing a node, of which one stage holds one whole."""
from __future__ import annotations

from typing import Sequence

import numpy as np


class KeptRanges:
    """Entries of (first, last) ranges that share a node p. Stage [a, b) holding p keeps the entry when it holds one of
    its ranges whole: a <= first and last < b, that is b > H(a), the least last of the ranges with first >= a."""

    def __init__(self, entries: Sequence[Sequence[tuple[int, int]]], n: int):
        self.n, self.entries = n, []
        for i, ranges in enumerate(entries):
            if any(first == last for first, last in ranges):
                continue  # a range of one node: every plan keeps it
            ranges = sorted(ranges)
            firsts = np.array([first for first, _ in ranges])
            least_last = np.minimum.accumulate(np.array([last for _, last in ranges])[::-1])[::-1]
            self.entries.append((max(firsts), firsts, np.append(least_last, n + 1), i))  # n + 1: no such range
        self.entries.sort(key=lambda entry: entry[0])

    def __bool__(self) -> bool:
        return bool(self.entries)

    def _least_last(self, entry, a: np.ndarray) -> np.ndarray:
        _, firsts, least_last, _ = entry
        return least_last[np.searchsorted(firsts, a, side="left")]

    def ends(self, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(owner, first, last): the ends b in [first, last] that the stage from starts[owner] may take, by owner then
        b. Walking the entries by p: b <= p leaves p to a later stage; b in (p, H(a)] is refused."""
        index, after = np.arange(len(starts)), starts + 1  # after: the least b not yet classified, per start
        owners, firsts, lasts = [], [], []
        for entry in self.entries:
            p = entry[0]
            holds = starts <= p
            emit = holds & (after <= p)
            owners.append(index[emit]), firsts.append(after[emit]), lasts.append(np.full(int(emit.sum()), p))
            after = np.where(holds, np.maximum(after, self._least_last(entry, starts) + 1), after)
        emit = after <= self.n
        owners.append(index[emit]), firsts.append(after[emit]), lasts.append(np.full(int(emit.sum()), self.n))
        owner = np.concatenate(owners)
        order = np.argsort(owner, kind="stable")
        return owner[order], np.concatenate(firsts)[order], np.concatenate(lasts)[order]

    def allows(self, a, b) -> np.ndarray:
        """Whether stage [a, b) keeps every entry whose shared node it holds (elementwise)."""
        a, b = np.broadcast_arrays(np.asarray(a), np.asarray(b))
        ok = np.ones(a.shape, dtype=bool)
        for entry in self.entries:
            p = entry[0]
            ok &= ~((a <= p) & (p < b) & (b <= self._least_last(entry, a)))
        return ok

    def broken(self, starts: Sequence[int]) -> int | None:
        """The index in ``entries`` of the first entry, by shared node, that the plan starting stages at ``starts``
        breaks; None if it keeps them all."""
        first = np.asarray(starts)
        last = np.append(first[1:], self.n)
        for entry in self.entries:
            s = int(np.searchsorted(first, entry[0], side="right")) - 1
            p = entry[0]
            if first[s] <= p < last[s] and last[s] <= self._least_last(entry, first[s]):
                return entry[3]
        return None
