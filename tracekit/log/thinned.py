"""What a slice of a long run keeps of the emissions before its own gaps (docs/reports.md,
"Reading a long run in slices").

A slice owns the gaps and TTFTs that end from the first emission of its first own part on;
it reads back to where they start: a request's previous emission, or its arrival (a TTFT
that queued for minutes). Of the emissions before its own, it needs each request's last
one (where its first own gap starts), its first (its first token), and a victim's first
after its readmission (whose re-prefill a step is, its eviction's debt). So each part
read before them keeps, per request, its first and last emission there (in time, then
row order), and every emission of a request evicted or readmitted in that part: a victim
readmitted in an earlier part emits first after it in the first of its later rows, which
a part keeps. A part whose rows all lie before the slice's own is cut the same whatever
the slice, so the cut is kept for the next slices (a few MB a run); reading every token
of those minutes again for every slice was half a day's reading time.

Rows written out of order (an event between two emissions of its request in time, but in
another part) could make a cut emission the one a victim needs: the slice then reads its
parts whole (`Thinned.kept`).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracekit.log.flush import TABLES
from tracekit.log.parts import part_number

__all__ = ["Cut", "Thinned", "forget_before", "part_key", "thin_part"]

_EMIT = {c: TABLES["emissions"].index(c) for c in ("request", "t_tick")}
_EV = {c: TABLES["events"].index(c) for c in ("request", "t_tick")}
#: the bytes of cut parts (every row before the slices reading them) kept for the next
#: slices of a run: ~1,000 parts of a busy server at batch 256 (a part's steps, segments
#: and two emissions a request are ~50 KB), the last ones cut
_KEPT_BYTES = 64 << 20


@dataclass(frozen=True)
class Cut:
    """A part as a slice keeps it: `part` with its emissions before `before_s` cut, the
    requests whose emissions were cut with the times of their first and last there, and
    its latest emission's time (-inf: none)."""

    part: dict[str, Any]
    request: np.ndarray
    first_s: np.ndarray
    last_s: np.ndarray
    latest_s: float


def thin_part(
    part: dict[str, Any], before_s: float, secs: Callable[[np.ndarray], np.ndarray]
) -> Cut:
    """`part` with its emissions before `before_s` cut to each request's first and last,
    but for the requests with an eviction or readmission row in it (see the module's
    docstring)."""
    none = np.zeros(0, dtype=np.int64)
    t_ = part["tables"]
    em = t_.get("emissions")
    if em is None or not len(em):
        return Cut(part, none, np.zeros(0), np.zeros(0), -np.inf)
    r, t = em[:, _EMIT["request"]], secs(em[:, _EMIT["t_tick"]])
    latest = float(t.max())
    ev = t_.get("events")
    victims = ev[:, _EV["request"]] if ev is not None and len(ev) else none
    cand = np.flatnonzero((t < before_s) & ~np.isin(r, victims))
    o = cand[np.lexsort((t[cand], r[cand]))]  # stable: ties in row order
    rs = r[o]
    edge = np.ones(len(o), dtype=bool)  # each request's first and last
    edge[1:-1] = (rs[1:-1] != rs[:-2]) | (rs[1:-1] != rs[2:])
    if edge.all():
        return Cut(part, none, np.zeros(0), np.zeros(0), latest)
    keep = np.ones(len(em), dtype=bool)
    keep[o[~edge]] = False
    head = np.ones(len(o), dtype=bool)
    head[1:] = rs[1:] != rs[:-1]
    tail = np.ones(len(o), dtype=bool)
    tail[:-1] = head[1:]
    cut_req = np.unique(rs[~edge])  # the requests with a row cut
    mine = np.isin(rs[head], cut_req)
    return Cut({**part, "tables": {**t_, "emissions": em[keep]}}, rs[head][mine],
               t[o[head]][mine], t[o[tail]][mine], latest)  # fmt: skip


class Thinned:
    """Consecutive parts as a slice whose own gaps end from `before_s` on keeps them (see
    the module's docstring): `add` each part as it is read, `kept` at the end."""

    def __init__(self, before_s: float, secs: Callable[[np.ndarray], np.ndarray]) -> None:
        self.before_s, self.secs = before_s, secs
        self.cuts: list[Cut] = []

    def add(self, key: tuple[Any, ...] | None, read: Callable[[], dict[str, Any]]) -> None:
        """The next part (`read()` reads it; `key` names it and its file's state, `part_key`)."""
        hit = None if key is None else _CUTS.get(key)
        if key is not None and hit is not None and hit.latest_s < self.before_s:
            _CUTS.move_to_end(key)
            self.cuts.append(hit)
            return
        cut = thin_part(read(), self.before_s, self.secs)
        self.cuts.append(cut)
        if key is not None and cut.latest_s < self.before_s and len(cut.request):
            _keep(key, cut)

    def kept(self) -> list[dict[str, Any]] | None:
        """The parts as cut; None where a cut emission may be one a victim needs (an event
        of its request in another part within the span its cut emissions lie in: rows
        written out of order), so the parts are to be read whole."""
        events = [c.part["tables"].get("events") for c in self.cuts]
        ev = [e for e in events if e is not None and len(e)]
        if ev and any(len(c.request) for c in self.cuts):
            rows = np.concatenate(ev)
            req, t = rows[:, _EV["request"]], self.secs(rows[:, _EV["t_tick"]])
            for c in self.cuts:
                k = np.flatnonzero(np.isin(req, c.request))
                if not len(k):
                    continue
                at = np.searchsorted(c.request, req[k])
                if ((t[k] >= c.first_s[at]) & (t[k] < c.last_s[at])).any():
                    return None
        return [c.part for c in self.cuts]


#: (part path, its file's inode, size and mtime, inflate limit) -> its `Cut`, where every
#: row was before the slice that cut it (so the same for any later slice): the last cut
_CUTS: OrderedDict[tuple[Any, ...], Cut] = OrderedDict()
_held = [0]  # their bytes


def _nbytes(cut: Cut) -> int:
    return sum(getattr(v, "nbytes", 0) for v in cut.part["tables"].values())


def _keep(key: tuple[Any, ...], cut: Cut) -> None:
    if key in _CUTS:
        _held[0] -= _nbytes(_CUTS.pop(key))
    _CUTS[key] = cut
    _held[0] += _nbytes(cut)
    while _held[0] > _KEPT_BYTES and len(_CUTS) > 1:
        _held[0] -= _nbytes(_CUTS.popitem(last=False)[1])


def part_key(path: str, max_inflate_mb: float | None) -> tuple[Any, ...] | None:
    """What names a part's file as read (a folder rewritten in place reads anew; None: no
    such file, which its reader says)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (path, st.st_ino, st.st_size, st.st_mtime_ns, max_inflate_mb)


def forget_before(path: str) -> None:
    """Let go of the kept cuts of the parts in `path`'s folder numbered before it: slices
    read a run forward, so a slice read from `path` tells the cuts no later slice reads (a
    slice read out of order decodes its parts again)."""
    folder, number = os.path.dirname(path), part_number(path)
    old = [k for k in _CUTS if os.path.dirname(k[0]) == folder and part_number(k[0]) < number]
    for k in old:
        _held[0] -= _nbytes(_CUTS.pop(k))
