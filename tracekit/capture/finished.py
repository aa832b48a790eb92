"""The ids of the requests a recorder was told are finished (`Recorder.finish`), kept as
one 64-bit hash each, so that a later call naming one is refused without keeping the id.

    done = FinishedIds()
    done.add("req-7")
    "req-7" in done        # True: a call naming it now raises
    "req-8" in done        # False (a different id: wrong only on a hash collision)

The request book drops a finished request's id, name and dictionary entries (about 600
bytes); these 8 bytes stay, so a recorder that runs for days grows by 8 bytes a finished
request here (docs/capture.md, "Finished requests"). Recent hashes sit in a set; every
`MERGE_AT` of them are merged into one sorted int64 array (a linear merge of two sorted
runs), searched with `searchsorted`.
"""

from __future__ import annotations

import numpy as np

#: Hashes kept in the set before they are merged into the sorted array.
MERGE_AT = 16_384


class FinishedIds:
    """A set of request names by their 64-bit hash: `add`, `in`, `len`."""

    __slots__ = ("_recent", "_sorted", "_n")

    def __init__(self) -> None:
        self._recent: set[int] = set()
        self._sorted = np.empty(0, dtype=np.int64)
        self._n = 0

    def add(self, name: str) -> None:
        self._recent.add(hash(name))
        self._n += 1
        if len(self._recent) >= MERGE_AT:
            fresh = np.fromiter(self._recent, dtype=np.int64, count=len(self._recent))
            fresh.sort()
            # two sorted runs: numpy's stable sort (timsort) merges them in one pass
            self._sorted = np.sort(np.concatenate((self._sorted, fresh)), kind="stable")
            self._recent = set()

    def __contains__(self, name: object) -> bool:
        h = hash(name)
        if h in self._recent:
            return True
        old = self._sorted
        if not len(old):
            return False
        i = int(np.searchsorted(old, h))
        return i < len(old) and int(old[i]) == h

    def __len__(self) -> int:
        return self._n

    def __bool__(self) -> bool:
        return self._n > 0


__all__ = ["MERGE_AT", "FinishedIds"]
