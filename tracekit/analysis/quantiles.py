"""Exact percentiles of values seen in pieces, in memory bounded by a histogram, not by the
values (docs/reports.md, "Reading a long run in slices").

numpy's linear percentile of n values needs, for each q, two order statistics (ranks
``floor(v)`` and ``floor(v) + 1`` of the virtual index ``v``) and the fraction between
them. `ExactQuantiles` finds them in two passes over the same values: the first counts
the values in 2^20 buckets of their float64 bit pattern (ordered like the values for the
non-negative numbers every figure here is: gap and TTFT times, shares); the second keeps
only the values of the buckets holding the ranks wanted, and sorts those. The result is
the value `np.percentile` (`np.median`) gives on all of them at once, bit for bit:
`percentiles` follows numpy's own arithmetic (tested against it on random arrays).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

#: the top 20 bits of a float64 (sign, exponent, 8 bits of mantissa): 1 Mi buckets
_SHIFT = np.uint64(44)
_NUM_BUCKETS = 1 << 20


def _buckets(values: np.ndarray) -> np.ndarray:
    """Each value's bucket; a non-negative float's bit pattern orders like the value."""
    v = np.ascontiguousarray(values, dtype=np.float64)
    if len(v) and not (v.min() >= 0.0):  # also NaN
        raise ValueError("exact quantiles take non-negative numbers only")
    v = v + 0.0  # -0.0 -> 0.0: one bit pattern for zero
    return (v.view(np.uint64) >> _SHIFT).astype(np.int64)


def virtual_ranks(n: int, qs: Sequence[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """numpy's linear method for `n` values and percentiles `qs` (0-100): the lower and upper
    ranks and the fraction between them, with numpy's own arithmetic (clamped at the ends as
    numpy clamps them)."""
    q = np.true_divide(np.asarray(qs, dtype=np.float64), 100)
    v = (n - 1) * q  # numpy's linear method
    prev = np.floor(v)
    nxt = prev + 1
    above = v >= n - 1
    prev[above] = n - 1
    nxt[above] = n - 1
    below = v < 0
    prev[below] = 0
    nxt[below] = 0
    # numpy takes gamma from the clamped index (-1 for "the last"): the same value once
    # both neighbours are the last one
    clamped_prev = np.where(above, -1.0, prev)
    gamma = v - clamped_prev
    return prev.astype(np.int64), nxt.astype(np.int64), gamma


def lerp(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> np.ndarray:
    """numpy's interpolation between neighbours (`numpy.lib._function_base_impl._lerp`)."""
    diff = b - a
    out = np.add(a, diff * t)
    np.subtract(b, diff * (1 - t), out=out, where=t >= 0.5)
    return out


_NONE = np.zeros(0, dtype=np.int64)


def bucket_counts(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """A piece's pass-1 counts, small: (its buckets, their counts, its largest value)."""
    if not len(values):
        return _NONE, _NONE, -math.inf
    b, c = np.unique(_buckets(values), return_counts=True)
    return b, c, float(np.max(values))


def kept_values(values: np.ndarray, keep_buckets: np.ndarray | None) -> tuple[np.ndarray, ...]:
    """A piece's pass-2 values in `keep_buckets`: (distinct values, their counts)."""
    if not len(values) or keep_buckets is None or not len(keep_buckets):
        return _NONE.astype(np.float64), _NONE
    v = np.asarray(values, dtype=np.float64) + 0.0
    return np.unique(v[np.isin(_buckets(v), keep_buckets)], return_counts=True)


class ExactQuantiles:
    """Percentiles (and the median) of a stream of non-negative values, exactly.

    Pass 1: `count` every piece. Then `wanted` says the ranks; pass 2: `keep` every piece
    again, in any order; then `percentiles` / `median`. Memory: the histogram (8 MiB) and
    the values of the few buckets that hold the wanted ranks."""

    def __init__(self, qs: Sequence[float] = ()) -> None:
        self.qs = tuple(float(q) for q in qs)
        self.counts = np.zeros(_NUM_BUCKETS, dtype=np.int64)
        self.n = 0
        self.max = -math.inf
        # pass 2's values of the wanted buckets, as (distinct values, their counts): a run
        # whose gaps repeat (a fixed step time) keeps each value once
        self._kept: list[tuple[np.ndarray, np.ndarray]] = []
        self._keep_buckets: np.ndarray | None = None
        self._first: np.ndarray | None = None  # rank of each kept bucket's first value

    def count(self, values: np.ndarray) -> None:
        """Pass 1: count a piece of the values."""
        if not len(values):
            return
        # counted over the piece's own span of buckets: a piece's values (a part's gaps)
        # span a few thousand of the 2^20, and a full-length count a piece (allocated,
        # zeroed, added) cost ~3 ms, most of a long run's index pass
        b = _buckets(values)
        lo = int(b.min())
        span = np.bincount(b - lo)
        self.counts[lo : lo + len(span)] += span
        self.n += len(values)
        self.max = max(self.max, float(np.max(values)))

    def count_weighted(self, values: np.ndarray, weights: np.ndarray) -> None:
        """Pass 1 for values each repeated `weights` times (whole numbers >= 1), without
        the repeated array: a client gap per token of its chunk."""
        if not len(values):
            return
        b = _buckets(values)
        lo = int(b.min())
        span = np.bincount(b - lo, weights=np.asarray(weights, dtype=np.float64))
        self.counts[lo : lo + len(span)] += span.astype(np.int64)
        self.n += int(np.sum(weights))
        self.max = max(self.max, float(np.max(values)))

    def keep_weighted(self, values: np.ndarray, weights: np.ndarray) -> None:
        """Pass 2 of `count_weighted`'s values, with the same weights."""
        if self._keep_buckets is None:
            self.wanted()
        assert self._keep_buckets is not None
        if len(values) and len(self._keep_buckets):
            v = np.asarray(values, dtype=np.float64) + 0.0  # -0.0 -> 0.0
            m = np.isin(_buckets(v), self._keep_buckets)
            u, inv = np.unique(v[m], return_inverse=True)
            w = np.asarray(weights, dtype=np.float64)[m]
            self.add_kept(u, np.bincount(inv, weights=w, minlength=len(u)).astype(np.int64))

    def values_at(self, ranks: np.ndarray) -> np.ndarray:
        """The values at `ranks` (0-based, in sorted order, repeats counted) of all values
        seen: ranks `wanted` said (the percentiles' neighbours, the median's)."""
        return self._value_at(np.asarray(ranks, dtype=np.int64))

    def _ranks(self) -> np.ndarray:
        ranks: list[int] = []
        if self.qs and self.n:
            lo, hi, _ = virtual_ranks(self.n, self.qs)
            ranks += [*lo.tolist(), *hi.tolist()]
        if self.n:  # the median's one or two middle values
            ranks += [(self.n - 1) // 2, self.n // 2]
        return np.array(sorted(set(ranks)), dtype=np.int64)

    def add_counts(self, buckets: np.ndarray = _NONE, counts: np.ndarray = _NONE,
                   vmax: float = -math.inf) -> None:  # fmt: skip
        """Pass 1 with the counting done elsewhere (`bucket_counts` of a piece)."""
        if len(buckets):
            np.add.at(self.counts, buckets, counts)
            self.n += int(counts.sum())
            self.max = max(self.max, vmax)

    def add_kept(self, values: np.ndarray = _NONE, counts: np.ndarray = _NONE) -> None:
        """Pass 2 with the keeping done elsewhere (`kept_values` of a piece)."""
        if len(values):
            self._kept.append((values, counts))
            if len(self._kept) > 64:
                self._kept = [self._folded()]

    @property
    def keep_buckets(self) -> np.ndarray:
        """The buckets pass 2 keeps (after `wanted`)."""
        assert self._keep_buckets is not None
        return self._keep_buckets

    def wanted(self) -> None:
        """Between the passes: which buckets pass 2 keeps."""
        cum = np.cumsum(self.counts)
        ranks = self._ranks()
        b = np.searchsorted(cum, ranks, side="right")  # the bucket holding each rank
        self._keep_buckets = np.unique(b)
        starts = cum - self.counts
        self._first = starts[self._keep_buckets]

    def keep(self, values: np.ndarray) -> None:
        """Pass 2: keep the values of the wanted buckets."""
        if self._keep_buckets is None:
            self.wanted()
        assert self._keep_buckets is not None
        if len(values) and len(self._keep_buckets):
            v = np.asarray(values, dtype=np.float64) + 0.0  # -0.0 -> 0.0
            self._kept.append(np.unique(v[np.isin(_buckets(v), self._keep_buckets)],
                                        return_counts=True))  # fmt: skip
            if len(self._kept) > 64:  # fold the pieces: memory by distinct values
                self._kept = [self._folded()]

    def _folded(self) -> tuple[np.ndarray, np.ndarray]:
        if not self._kept:
            return np.zeros(0), np.zeros(0, dtype=np.int64)
        vals = np.concatenate([v for v, _ in self._kept])
        counts = np.concatenate([c for _, c in self._kept])
        u, inv = np.unique(vals, return_inverse=True)
        return u, np.bincount(inv, weights=counts, minlength=len(u)).astype(np.int64)

    def _value_at(self, ranks: np.ndarray) -> np.ndarray:
        """The values at `ranks` (0-based, in sorted order) of all values seen."""
        assert self._keep_buckets is not None and self._first is not None
        vals, counts = self._folded()  # sorted distinct values of the wanted buckets
        vb = _buckets(vals)
        out = np.empty(len(ranks))
        cum = np.cumsum(self.counts)
        for i, r in enumerate(ranks.tolist()):
            b = int(np.searchsorted(cum, r, side="right"))
            j = int(np.searchsorted(self._keep_buckets, b))
            in_b = vb == b
            c = np.cumsum(counts[in_b])
            if not len(c) or c[-1] != self.counts[b]:
                raise RuntimeError("pass 2 did not see the values pass 1 counted")
            out[i] = vals[in_b][int(np.searchsorted(c, r - int(self._first[j]), side="right"))]
        return out

    def percentiles(self) -> list[float]:
        """`np.percentile(all values, qs)`; NaN for each with no values."""
        if not self.n:
            return [math.nan] * len(self.qs)
        lo, hi, gamma = virtual_ranks(self.n, self.qs)
        return [float(x) for x in lerp(self._value_at(lo), self._value_at(hi), gamma)]

    def median(self) -> float:
        """`np.median(all values)`; NaN with none."""
        if not self.n:
            return math.nan
        a, b = self._value_at(np.array([(self.n - 1) // 2, self.n // 2]))
        return float(np.mean(np.array([a, b]))) if self.n % 2 == 0 else float(a)


def _distinct(
    keys: np.ndarray, vals: np.ndarray, counts: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each distinct (key, value) once, with its counts added up, sorted by key then value."""
    o = np.lexsort((vals, keys))
    k, v, c = keys[o], vals[o], counts[o]
    new = np.ones(len(k), dtype=bool)
    new[1:] = (k[1:] != k[:-1]) | (v[1:] != v[:-1])
    at = np.flatnonzero(new)
    return k[at], v[at], np.add.reduceat(c, at) if len(at) else c[:0]


def _group_key(groups: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Each value's (group, histogram bucket) as one integer."""
    return (np.asarray(groups, dtype=np.int64) << 20) | _buckets(values)


class GroupQuantiles:
    """Exact percentiles of values in many groups (time buckets), each group's histogram
    sparse: memory by the distinct (group, histogram bucket) pairs seen, not by the values
    or the groups' number. The same two passes as `ExactQuantiles`: `count`, `wanted`,
    `keep`, then `percentiles(group)`."""

    def __init__(self, qs: Sequence[float]) -> None:
        self.qs = tuple(float(q) for q in qs)
        self._pieces: list[tuple[np.ndarray, np.ndarray]] = []  # (group << 20 | bucket, n)
        self._keys = np.zeros(0, dtype=np.int64)
        self._counts = np.zeros(0, dtype=np.int64)
        self._want: dict[int, list[tuple[int, int]]] = {}  # group: (rank, its key)
        self._keep = np.zeros(0, dtype=np.int64)
        self._kept: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._all: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @staticmethod
    def _key(groups: np.ndarray, values: np.ndarray) -> np.ndarray:
        return _group_key(groups, values)

    def count(self, groups: np.ndarray, values: np.ndarray) -> None:
        """Pass 1: count a piece of values, each in its group (a non-negative integer)."""
        if len(values):
            self.add_counts(*group_counts(groups, values))

    def add_counts(self, keys: np.ndarray, counts: np.ndarray) -> None:
        """Pass 1 with the counting done elsewhere (`group_counts` of a piece)."""
        if len(keys):
            self._pieces.append((keys, counts))
            if len(self._pieces) > 64:
                self._fold()

    def _fold(self) -> None:
        keys = np.concatenate([self._keys, *(k for k, _ in self._pieces)])
        counts = np.concatenate([self._counts, *(c for _, c in self._pieces)])
        self._keys, inv = np.unique(keys, return_inverse=True)
        self._counts = np.bincount(inv, weights=counts, minlength=len(self._keys)).astype(np.int64)
        self._pieces = []

    def n(self, group: int) -> int:
        """Values counted in `group` (after `wanted`)."""
        lo, hi = np.searchsorted(self._keys >> 20, [group, group + 1])
        return int(self._counts[lo:hi].sum())

    def wanted(self) -> None:
        """Between the passes: the histogram buckets each group's wanted ranks lie in."""
        self._fold()
        groups = self._keys >> 20
        keep: list[int] = []
        for g in np.unique(groups).tolist():
            lo, hi = np.searchsorted(groups, [g, g + 1])
            cum = np.cumsum(self._counts[lo:hi])
            a, b, _ = virtual_ranks(int(cum[-1]), self.qs)
            ranks = sorted(set(a.tolist()) | set(b.tolist()))
            at = np.searchsorted(cum, ranks, side="right")
            keys_at = self._keys[lo + at].tolist()
            self._want[g] = list(zip(ranks, keys_at, strict=True))
            keep += [k for _, k in self._want[g]]
        self._keep = np.unique(np.array(keep, dtype=np.int64))

    @property
    def keep_keys(self) -> np.ndarray:
        """The (group, bucket) keys pass 2 keeps (after `wanted`): for `group_kept`."""
        return self._keep

    def keep(self, groups: np.ndarray, values: np.ndarray) -> None:
        """Pass 2: keep the values of the wanted buckets (each distinct value once)."""
        self.add_kept(*group_kept(groups, values, self._keep))

    def add_kept(self, keys: np.ndarray, vals: np.ndarray, counts: np.ndarray) -> None:
        """Pass 2 with the keeping done elsewhere (`group_kept` of a piece)."""
        if len(keys):
            self._kept.append((keys, vals, counts))
            if len(self._kept) > 64:  # fold the pieces: memory by distinct values
                keys, vals, cnts = (np.concatenate(x) for x in zip(*self._kept, strict=True))
                self._kept = [_distinct(keys, vals, cnts)]

    def percentiles(self, group: int) -> list[float]:
        """numpy's linear percentiles of the group's values (NaN: none counted)."""
        want = self._want.get(group)
        if not want:
            return [math.nan] * len(self.qs)
        if self._all is None:  # the kept values, by key then value, once
            keys = np.concatenate([k for k, _, _ in self._kept]) if self._kept else _NONE
            vals = np.concatenate([v for _, v, _ in self._kept]) if self._kept else np.zeros(0)
            cnts = np.concatenate([c for _, _, c in self._kept]) if self._kept else _NONE
            o = np.lexsort((vals, keys))
            self._all = (keys[o], vals[o], cnts[o])
        keys, vals, cnts = self._all
        lo, hi = np.searchsorted(self._keys >> 20, [group, group + 1])
        first_rank = dict(zip(self._keys[lo:hi].tolist(),
                              (np.cumsum(self._counts[lo:hi]) - self._counts[lo:hi]).tolist(),
                              strict=True))  # fmt: skip
        at: dict[int, float] = {}
        for r, k in want:
            a0, a1 = np.searchsorted(keys, [k, k + 1])
            v, c = vals[a0:a1], cnts[a0:a1]
            # the same value may come from several pieces: counts add up in value order
            j = int(np.searchsorted(np.cumsum(c), r - first_rank[k], side="right"))
            at[r] = float(v[j])
        n = int(self._counts[lo:hi].sum())
        a, b, gamma = virtual_ranks(n, self.qs)
        va = np.array([at[r] for r in a.tolist()])
        vb = np.array([at[r] for r in b.tolist()])
        return [float(x) for x in lerp(va, vb, gamma)]


def group_counts(groups: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A piece's pass-1 counts for `GroupQuantiles.add_counts`, small: (its distinct
    (group, bucket) keys, their counts)."""
    if not len(values):
        return _NONE, _NONE
    g = np.asarray(groups, dtype=np.int64)
    if (g == g[0]).all():  # one group: a histogram, no sort
        c = np.bincount(_buckets(values))
        at = np.flatnonzero(c)
        return (int(g[0]) << 20) | at, c[at]
    return np.unique(_group_key(g, values), return_counts=True)


def group_kept(
    groups: np.ndarray, values: np.ndarray, keep_keys: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A piece's pass-2 values in the wanted buckets (`GroupQuantiles.keep_keys`), for
    `GroupQuantiles.add_kept`: (keys, distinct values, their counts)."""
    if not len(values):
        return _NONE, np.zeros(0), _NONE
    v = np.asarray(values, dtype=np.float64) + 0.0
    g = np.asarray(groups, dtype=np.int64)
    key = _group_key(g, v)
    if (g == g[0]).all():  # one group: its wanted buckets looked up in a table, no sort
        want = np.zeros(_NUM_BUCKETS, dtype=bool)
        mine = keep_keys[(keep_keys >> 20) == g[0]]
        want[mine & (_NUM_BUCKETS - 1)] = True
        on = want[key & (_NUM_BUCKETS - 1)]
    else:
        on = np.isin(key, keep_keys)
    if not on.any():
        return _NONE, np.zeros(0), _NONE
    return _distinct(key[on], v[on], np.ones(int(on.sum()), np.int64))
