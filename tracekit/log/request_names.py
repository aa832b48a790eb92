"""A run's request ids held compactly, for the readers of a long run (docs/reports.md,
"Reading a long run in slices").

A Python string a request (~66 bytes for ``req-123456``, 8 more in a list) was most of what
a day-long run's readers held per request. `RequestNames` holds the ids as one UTF-8 blob
and the int64 offset where each ends (the id's length and 8 bytes), and makes a `str` only
for the rows asked. The requests named only in removed parts (`Recorder(retain_s=)`,
docs/design.md "The run's log on disk") are ``(removed N)``, made when asked, never held.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import overload

import numpy as np

__all__ = ["Picked", "RequestNames", "Unnamed", "removed_name", "renumbered"]


def removed_name(i: int) -> str:
    """The name of request `i` where only a removed part named it."""
    return f"(removed {i})"


class RequestNames(Sequence[str]):
    """Request ids by index: ``(removed N)`` below `removed`, then the ids added (`extend`),
    in order. Appending only: a `head` shares the blob and stays valid."""

    __slots__ = ("_blob", "_ends", "_n", "removed")

    def __init__(
        self,
        removed: int = 0,
        names: Iterable[str] = (),
        *,
        shared: tuple[bytearray, np.ndarray, int] | None = None,
    ) -> None:
        """`shared`: another's blob, offsets and how many of its ids (`head`)."""
        self.removed = removed
        self._blob, self._ends, self._n = shared or (bytearray(), np.zeros(16, np.int64), 0)
        self.extend(names)

    def extend(self, names: Iterable[str]) -> None:
        """Add the ids that follow."""
        if isinstance(names, Unnamed):  # as many empty ids: no string made
            blob, lens = b"", np.zeros(len(names), dtype=np.int64)
        else:
            enc = [s.encode() for s in names]
            blob = b"".join(enc)
            lens = np.fromiter(map(len, enc), dtype=np.int64, count=len(enc))
        if not len(lens):
            return
        n = self._n + len(lens)
        if n > len(self._ends):  # a quarter more when full: requests come a part at a time
            buf = np.zeros(max(n, len(self._ends) + len(self._ends) // 4), dtype=np.int64)
            buf[: self._n] = self._ends[: self._n]
            self._ends = buf
        self._ends[self._n : n] = len(self._blob) + np.cumsum(lens)
        self._blob += blob
        self._n = n

    def __iadd__(self, names: Iterable[str]) -> RequestNames:
        self.extend(names)
        return self

    def __len__(self) -> int:
        return self.removed + self._n

    def name(self, i: int) -> str:
        """Request `i`'s id."""
        if not 0 <= i < len(self):
            raise IndexError(f"request {i} of {len(self)}")
        if i < self.removed:
            return removed_name(i)
        j = i - self.removed
        a = int(self._ends[j - 1]) if j else 0
        return self._blob[a : int(self._ends[j])].decode()

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[str, ...]: ...

    def __getitem__(self, i: int | slice) -> str | tuple[str, ...]:
        if isinstance(i, slice):
            return tuple(self.name(k) for k in range(*i.indices(len(self))))
        return self.name(i + len(self) if i < 0 else i)

    def __iter__(self) -> Iterator[str]:
        return (self.name(k) for k in range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # equal to a tuple of the same ids

    def __add__(self, other: Sequence[str]) -> tuple[str, ...]:
        return (*self, *other)

    def __radd__(self, other: Sequence[str]) -> tuple[str, ...]:
        return (*other, *self)

    def __repr__(self) -> str:
        return f"RequestNames({len(self)} ids, {self.removed} removed)"

    def head(self, n: int) -> RequestNames:
        """The first `n` ids (sharing this one's blob: no copy)."""
        n_named = max(0, min(n, len(self)) - self.removed)
        return RequestNames(min(self.removed, n), shared=(self._blob, self._ends, n_named))

    def take(self, rows: np.ndarray) -> np.ndarray:
        """The ids of `rows` (request indices) as an object array."""
        out = np.empty(len(rows), dtype=object)
        for k, r in enumerate(rows.tolist()):
            out[k] = self.name(r)
        return out

    def picked(self, rows: np.ndarray) -> Picked:
        """The ids of `rows` (request indices) as a sequence, each made when read."""
        return Picked(self, rows)

    @property
    def nbytes(self) -> int:
        """What the ids hold: the blob and the used offsets."""
        return len(self._blob) + 8 * self._n


class Picked(Sequence[str]):
    """The ids of some of a run's requests, ``names[rows[i]]`` at ``i`` (what a log that
    holds only some requests names them: `RequestNames.picked`)."""

    __slots__ = ("_names", "_rows")

    def __init__(self, names: Sequence[str], rows: np.ndarray) -> None:
        self._names, self._rows = names, rows

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[str, ...]: ...

    def __getitem__(self, i: int | slice) -> str | tuple[str, ...]:
        if isinstance(i, slice):
            return tuple(self._names[int(r)] for r in self._rows[i].tolist())
        return self._names[int(self._rows[i])]

    def __iter__(self) -> Iterator[str]:
        return (self._names[r] for r in self._rows.tolist())


class Unnamed(Sequence[str]):
    """`n` requests whose names a reader does not keep (each reads ``""``): what stands for
    a part's new ids where only their count matters (`tracekit.log.parts.merge_flushed`
    folds them)."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> tuple[str, ...]: ...

    def __getitem__(self, i: int | slice) -> str | tuple[str, ...]:
        if isinstance(i, slice):
            return ("",) * len(range(*i.indices(self.n)))
        if not -self.n <= i < self.n:
            raise IndexError(i)
        return ""

    def __iter__(self) -> Iterator[str]:
        return itertools.repeat("", self.n)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Unnamed):
            return other.n == self.n
        if not isinstance(other, Sequence) or isinstance(other, str | bytes):
            return NotImplemented
        return len(other) == self.n and all(x == "" for x in other)

    __hash__ = None  # type: ignore[assignment]  # equal to a tuple of as many ""


def renumbered(cols: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """The distinct values of `cols` in order (`u`), and each column as indices into `u`:
    through a table of the values' span where it is small (a part's requests are mostly
    recent ones), else by sorting."""
    if not cols or not sum(len(c) for c in cols):
        return np.zeros(0, dtype=np.int64), [c.copy() for c in cols]
    lo = min(int(c.min()) for c in cols if len(c))
    hi = max(int(c.max()) for c in cols if len(c))
    rows = sum(len(c) for c in cols)
    if hi - lo > 4 * rows:
        u = np.unique(np.concatenate(cols))
        return u, [np.searchsorted(u, c) for c in cols]
    seen = np.zeros(hi - lo + 1, dtype=bool)
    for c in cols:
        seen[c - lo] = True
    index = np.cumsum(seen) - 1
    return np.flatnonzero(seen) + lo, [index[c - lo] for c in cols]
