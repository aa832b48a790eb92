"""The ids of the requests a recorder was told are finished (`Recorder.finish`), kept as
one 64-bit hash each, so that a later call naming one is refused without keeping the id.

    done = FinishedIds()
    done.add("req-7")
    "req-7" in done        # True: a call naming it now raises
    "req-8" in done        # False (a different id: wrong only on a hash collision)

The request book drops a finished request's id, name and dictionary entries; its hash
stays here, in open-addressing tables of int64 slots (linear probing, 0 marks a free
slot). A table is never resized: once it is half full the next one, twice as large, takes
the new hashes, and a lookup probes every table (about log2(n / 16,384) of them). So no
call ever rehashes or merges what is there already: the engine thread never stalls on a
growing set (a sorted array merged every 16,384 finishes took 12 ms at 1.3 million ids,
a day of a busy server, and 25 ms at 9 million). Memory: 16 to 32 bytes a hash (the
tables are half full, the newest between empty and half), mapped zeroed.
"""

from __future__ import annotations

import mmap

#: Slots of the first table (its half holds 16,384 hashes).
FIRST_SLOTS = 1 << 15

_NO_HUGE_PAGES = getattr(mmap, "MADV_NOHUGEPAGE", None)


def _slots(n: int) -> memoryview:
    """A table of `n` free int64 slots, read and written as Python ints: an anonymous
    mapping, whose pages the OS zeroes when first touched (no time spent here), in small
    pages: a transparent huge page is zeroed whole at its first touch, 2 MB at once (4.5 ms
    an add measured here, on the first adds into a 16 MB table)."""
    m = mmap.mmap(-1, 8 * n)
    if _NO_HUGE_PAGES is not None:
        try:
            m.madvise(_NO_HUGE_PAGES)
        except OSError:  # a kernel without transparent huge pages: nothing to refuse
            pass
    return memoryview(m).cast("q")


class FinishedIds:
    """A set of request names by their 64-bit hash: `add`, `in`, `len`."""

    __slots__ = ("_tables", "_used", "_n")

    def __init__(self) -> None:
        self._tables: list[memoryview] = []
        self._used = 0  # hashes in the newest table
        self._n = 0

    @staticmethod
    def _key(name: str) -> int:
        return hash(name) or 1  # 0 marks a free slot

    def add(self, name: str) -> None:
        """Add a name not added before (the book adds each finished id once)."""
        h = self._key(name)
        if not self._tables or 2 * (self._used + 1) > len(self._tables[-1]):
            size = 2 * len(self._tables[-1]) if self._tables else FIRST_SLOTS
            self._tables.append(_slots(size))
            self._used = 0
        t = self._tables[-1]
        mask = len(t) - 1
        i = h & mask
        while t[i]:
            if t[i] == h:
                return  # the same hash: kept once
            i = (i + 1) & mask
        t[i] = h
        self._used += 1
        self._n += 1

    def __contains__(self, name: object) -> bool:
        h = self._key(name)  # type: ignore[arg-type]
        for t in self._tables:
            mask = len(t) - 1
            i = h & mask
            v = t[i]
            while v:
                if v == h:
                    return True
                i = (i + 1) & mask
                v = t[i]
        return False

    def __len__(self) -> int:
        return self._n

    @property
    def nbytes(self) -> int:
        """The tables' size (mapped memory: not in `tracemalloc`'s count)."""
        return sum(t.nbytes for t in self._tables)

    def __bool__(self) -> bool:
        return self._n > 0


__all__ = ["FIRST_SLOTS", "FinishedIds"]
