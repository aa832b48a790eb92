"""Rows a part carries back: what a slice of a run that ends before the part needs of it.

A row is written when its window ends: a segment of another thread than the loop's (a
tokenizer thread's, say) that was open at a flush lies in a later part than the flush's,
and so do its closing OS sample and a window resolved late (a device window whose step
was flushed before it). A slice of the run that ends at that flush owns gaps the window
overlaps, and the whole run partitions them with it (docs/partition.md: another thread's
segment, and its OS interval from the sample at its start to the one at its end, OS rule
7). A slice that starts after such a segment began needs the sample at its start, which
lies in an earlier part. So the index pass keeps, of every part, the rows that began
before the part before it was flushed, with the samples that open and close those
segments (`open_rows`, then `IndexBook`'s `carried_back`): few (a window open at a flush
a thread); a slice of parts ``[c, b)`` adds those of later parts that began before its
last part was flushed, and the opening samples before part `c` of the segments it holds
(`CarriedRows.into`). docs/reports.md, "Reading a long run in slices", says so.

The loop thread's segments of a step still running at a flush are not carried: they belong
to a step that the part holds, after every gap a slice ending before it owns.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracekit.log.flush import TABLES
from tracekit.log.rawlog import OS_SEGMENT_END, OS_SEGMENT_START

_SEG = {c: TABLES["segments"].index(c) for c in ("step", "t0_tick", "t1_tick", "thread")}
_GC_T0 = TABLES["gc_pauses"].index("t0_tick")
_OS = {c: TABLES["os_samples"].index(c) for c in ("thread", "kind", "t_tick")}
#: the tables a part carries back
CARRIED_TABLES = ("segments", "gc_pauses", "os_samples")


def _rows(part: dict[str, Any], name: str) -> np.ndarray:
    a = part["tables"].get(name)
    return np.zeros((0, len(TABLES[name])), np.int64) if a is None else a


def _keys(rows: np.ndarray, thread: int, tick: int) -> list[tuple[int, int]]:
    return list(zip(rows[:, thread].tolist(), rows[:, tick].tolist(), strict=True))


def open_rows(part: dict[str, Any]) -> dict[str, np.ndarray]:
    """A parsed part's rows that may have begun before the part before it was flushed:
    its segments of no step of its own (`step` -1, or a step an earlier part holds), its GC
    pauses and its segment-end OS samples; and ``starts``, its segment-start OS samples
    that open no segment it holds (a segment still open at its flush). Small:
    `IndexBook` keeps of them only what a later slice may need."""
    first = part.get("first_step")
    sg = _rows(part, "segments")
    mine = sg[:, _SEG["step"]] >= (first if first is not None else np.iinfo(np.int64).max)
    os_ = _rows(part, "os_samples")
    kind = os_[:, _OS["kind"]]
    starts = os_[kind == OS_SEGMENT_START]
    if len(starts):
        opened = set(_keys(sg, _SEG["thread"], _SEG["t0_tick"]))
        held = [k in opened for k in _keys(starts, _OS["thread"], _OS["t_tick"])]
        starts = starts[~np.array(held, dtype=bool)]
    return {
        "segments": sg[~mine],
        "gc_pauses": _rows(part, "gc_pauses"),
        "os_samples": os_[kind == OS_SEGMENT_END],
        "starts": starts,
    }


def _closing(os_: np.ndarray, sg: np.ndarray) -> np.ndarray:
    """The OS samples of `os_` that close a segment of `sg` (its thread, at its end tick:
    a thread's segment takes its end sample's tick as its end)."""
    if not len(os_) or not len(sg):
        return os_[:0]
    ends = set(_keys(sg, _SEG["thread"], _SEG["t1_tick"]))
    return os_[np.array([k in ends for k in _keys(os_, _OS["thread"], _OS["t_tick"])], bool)]


class OpenStarts:
    """The segment-start OS samples whose segment has not closed in the parts seen (by
    thread and tick, with the part holding each): the index pass's, part by part."""

    def __init__(self) -> None:
        self.rows: dict[tuple[int, int], tuple[int, np.ndarray]] = {}

    def carried_back(
        self, i: int, rows: dict[str, np.ndarray], before_tick: int
    ) -> dict[str, np.ndarray] | None:
        """Of part `i`'s `open_rows`, those that began before `before_tick` (the flush of
        the part before it), with the samples that close them and those that opened them
        (``starts``, their parts ``start_parts``); None: none did. Then part `i`'s own
        open starts are kept for the parts after it."""
        sg = rows["segments"]
        sg = sg[sg[:, _SEG["t0_tick"]] < before_tick]
        gc = rows["gc_pauses"]
        gc = gc[gc[:, _GC_T0] < before_tick]
        out = None
        if len(sg) or len(gc):
            opened = [self.rows.pop(k, None) for k in _keys(sg, _SEG["thread"], _SEG["t0_tick"])]
            found = [x for x in opened if x is not None]
            width = len(TABLES["os_samples"])
            out = {
                "segments": sg,
                "gc_pauses": gc,
                "os_samples": _closing(rows["os_samples"], sg),
                "starts": np.array([r for _, r in found], np.int64).reshape(-1, width),
                "start_parts": np.array([p for p, _ in found], np.int64),
            }
        starts = rows["starts"]
        for k, row in zip(_keys(starts, _OS["thread"], _OS["t_tick"]), starts, strict=True):
            self.rows[k] = (i, row)
        return out


@dataclass
class CarriedRows:
    """Every part's carried-back rows (`OpenStarts.carried_back`), by part, in order."""

    parts: list[int] = field(default_factory=list)
    rows: list[dict[str, np.ndarray]] = field(default_factory=list)
    labels: list[tuple[str, ...]] = field(default_factory=list)  # each part's vocabulary
    #: each part's earliest start of a row it carries, and earliest part holding an
    #: opening sample of a segment it carries (the part itself: none)
    starts: list[int] = field(default_factory=list)
    opened_in: list[int] = field(default_factory=list)
    #: those three lists as arrays, made once for every slice's `into` (a day's run asks
    #: thousands of times), again after an `add`
    _columns: tuple[np.ndarray, ...] | None = field(default=None, repr=False)

    def add(self, i: int, rows: dict[str, np.ndarray], labels: Any) -> None:
        self._columns = None
        self.parts.append(i)
        self.rows.append(rows)
        self.labels.append(tuple(labels))
        t0 = [*rows["segments"][:, _SEG["t0_tick"]].tolist(),
              *rows["gc_pauses"][:, _GC_T0].tolist()]  # fmt: skip
        self.starts.append(min(t0))
        self.opened_in.append(int(rows["start_parts"].min(initial=i)))

    def into(self, c: int, b: int, flushed_tick: int, first_step: int) -> dict[str, Any] | None:
        """What a log of parts ``[c, b)`` adds to its last part (its last part flushed at
        `flushed_tick`, part `b`'s first step `first_step`): the rows of parts `b`.. that
        began before that flush, of no step after the log's, with their closing samples;
        and the samples before part `c` that open segments of those rows or of parts
        ``[c, b)`` (None: nothing)."""
        if not self.parts:
            return None
        if self._columns is None:
            self._columns = tuple(np.asarray(x, np.int64)
                                  for x in (self.parts, self.starts, self.opened_in))  # fmt: skip
        parts, starts, opened = self._columns
        inside = (parts >= c) & (parts < b) & (opened < c)
        later = (parts >= b) & (starts < flushed_tick)
        picked = np.flatnonzero(inside | later).tolist()
        if not picked:
            return None
        out: dict[str, list[np.ndarray]] = {k: [] for k in CARRIED_TABLES}
        for k in picked:
            rows = self.rows[k]
            out["os_samples"].append(rows["starts"][rows["start_parts"] < c])
            if self.parts[k] < b:
                continue
            sg = rows["segments"]
            sg = sg[(sg[:, _SEG["t0_tick"]] < flushed_tick) & (sg[:, _SEG["step"]] < first_step)]
            gc = rows["gc_pauses"]
            out["segments"].append(sg)
            out["gc_pauses"].append(gc[gc[:, _GC_T0] < flushed_tick])
            out["os_samples"].append(_closing(rows["os_samples"], sg))
        tables = {k: np.concatenate(v) if v else np.zeros((0, len(TABLES[k])), np.int64)
                  for k, v in out.items()}  # fmt: skip
        if not any(len(v) for v in tables.values()):
            return None
        return {"tables": tables, "labels": max((self.labels[k] for k in picked), key=len)}


def with_carried(part: dict[str, Any], carried: dict[str, Any] | None) -> dict[str, Any]:
    """`part` (a log's last) with the rows `CarriedRows.into` gave it appended (the whole
    run holds them elsewhere in its rows; readers order a thread's samples and windows by
    time), and the longer vocabulary of the two (labels only grow)."""
    if carried is None:
        return part
    tables = dict(part["tables"])
    for k, rows in carried["tables"].items():
        if len(rows):
            have = tables.get(k)
            tables[k] = rows if have is None else np.concatenate([have, rows.astype(have.dtype)])
    labels = part["labels"]
    if len(carried["labels"]) > len(labels):
        labels = list(carried["labels"])
    return {**part, "tables": tables, "labels": labels}
