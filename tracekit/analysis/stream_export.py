"""A long run's gaps table for `tracekit export`, read in slices, in bounded memory
(docs/reports.md, "Reading a long run in slices"; the table: `tracekit.analysis.export`).

The run is analysed as `analyze` reads a long run (`tracekit.analysis.stream.analyze_sliced`:
its runs row). The first time each slice is partitioned there, its own gaps (each gap in
the one slice its later emission lies in, partitioned as in the whole run) are spilled to
a folder as flat binary columns: requests, ends, steps (renumbered as the whole run
numbers them), primary causes as codes and the parts by the slice's labels. The whole
run's table lists gaps by request, then time (`tracekit.attribution.itl`'s order); a
request's gaps lie in consecutive slices, each slice's sorted so. `SpilledGaps.blocks`
then reads the spill back in blocks of consecutive requests, each block's rows from every
slice in slice order, stably sorted by request: the whole run's rows, in its order, in
pieces of about one slice each (the parts as a slice's partition gives them: the whole
run's to float rounding, `tracekit.analysis.stream`). Memory: one slice, or one block,
plus per request its name and gap count; never the run's gaps.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tracekit.allocator import give_back_freed_memory
from tracekit.analysis.figures import RunAnalysis
from tracekit.analysis.stream import (
    DEFAULT_SLICE_EMISSIONS,
    SlicePart,
    SliceRead,
    SliceTask,
    analyze_sliced,
    slice_partition,
    slice_sums,
)
from tracekit.log.request_names import RequestNames
from tracekit.log.slices import SlicedRun

__all__ = ["GapRows", "SpilledGaps", "spill_gaps_sliced", "sliced_config"]

#: the spilled columns: name -> dtype (``parts`` is a row-major matrix, the slice's labels)
_COLUMNS = {
    "request": np.int64,
    "t0_s": np.float64,
    "t1_s": np.float64,
    "gap_ms": np.float64,
    "step0": np.int64,
    "step1": np.int64,
    "primary": np.int32,
}


@dataclass(frozen=True)
class GapRows:
    """Consecutive rows of a run's gaps table: each gap's request (its name), ends (s from
    engine start), length, steps, primary cause (a code into `SpilledGaps.primaries`) and
    parts (ms, one column per label of `SpilledGaps.labels`)."""

    request: np.ndarray  # object: names
    t0_s: np.ndarray
    t1_s: np.ndarray
    gap_ms: np.ndarray
    step0: np.ndarray
    step1: np.ndarray
    primary: np.ndarray  # int32 codes
    parts_ms: np.ndarray  # (rows, labels)

    def __len__(self) -> int:
        return len(self.request)


@dataclass
class _Piece:
    """One slice's spilled gaps: where they lie, how many, and how they are keyed."""

    stem: str
    rows: int
    labels: tuple[str, ...]
    uniq: np.ndarray  # the slice's requests, sorted
    starts: np.ndarray  # the row each of them starts at


@dataclass
class SpilledGaps:
    """A run's gaps spilled slice by slice (see the module's docstring), and its figures."""

    folder: str
    analysis: RunAnalysis | None = None
    #: per request, as the whole run names it (compactly)
    names: RequestNames = field(default_factory=RequestNames)
    causes: set[str] = field(default_factory=set)  # every slice's causes
    pieces: dict[tuple[int, int], _Piece] = field(default_factory=dict)
    #: per primary cause's name, its code and where it first appears (request, slice, row)
    primary_codes: dict[str, int] = field(default_factory=dict)
    first_seen: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    per_request: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    block_rows: int = DEFAULT_SLICE_EMISSIONS

    @property
    def rows(self) -> int:
        return sum(p.rows for p in self.pieces.values())

    @property
    def labels(self) -> tuple[str, ...]:
        """The table's part columns: the whole run's labels (`RunAnalysis.labels`)."""
        assert self.analysis is not None
        return tuple(self.analysis.labels)

    @property
    def primaries(self) -> tuple[str, ...]:
        """The primary causes in the order they first appear in the whole run's table (so
        a dictionary-encoded column is the whole run's, dictionary and all)."""
        order = sorted(self.first_seen, key=self.first_seen.__getitem__)
        names = {c: n for n, c in self.primary_codes.items()}
        return tuple(names[c] for c in order)

    def add(self, task: SliceTask, read: SliceRead, step_offset: int) -> None:
        """Spill one slice's own gaps (once a slice; its partition sorted by request, then
        time), its requests numbered as the run numbers them."""
        key = (task.c, task.b)
        if key in self.pieces:
            return
        k = len(self.pieces)
        p, ids = read.p, read.names
        req = read.numbers[p.request]
        if not k and task.retained is not None:  # the run's first parts were removed
            self.names = RequestNames(task.retained.num_requests)
        # the requests named before the slice's first part (`(removed N)` in its log) were
        # named in parts an earlier slice read: their names are known already
        assert task.retained is None or task.retained.num_requests <= len(self.names) or not k
        if len(ids) > len(self.names):  # the slice names every request before its end
            self.names.extend(ids[len(self.names) :])
        self.causes |= set(p.causes)
        names = (*p.causes, "clean")
        codes = np.array([self.primary_codes.setdefault(n, len(self.primary_codes))
                          for n in names], dtype=np.int32)  # fmt: skip
        prim = codes[p.primary]  # CLEAN (-1) indexes "clean"
        uniq, starts = np.unique(req, return_index=True)
        for c, row in zip(*np.unique(prim, return_index=True), strict=True):
            seen = (int(req[row]), k, int(row))
            self.first_seen[int(c)] = min(self.first_seen.get(int(c), seen), seen)
        step = {s: np.where(getattr(p, s) >= 0, getattr(p, s) + step_offset, getattr(p, s))
                for s in ("step0", "step1")}  # fmt: skip
        stem = os.path.join(self.folder, f"slice-{k:06d}")
        cols = {"request": req, "t0_s": p.t0_s, "t1_s": p.t1_s, "gap_ms": p.gap_ms,
                **step, "primary": prim}  # fmt: skip
        for name, dtype in _COLUMNS.items():
            np.ascontiguousarray(cols[name], dtype=dtype).tofile(f"{stem}.{name}")
        np.ascontiguousarray(p.parts_ms, dtype=np.float64).tofile(f"{stem}.parts")
        n_req = max(len(self.names), int(req.max()) + 1 if len(p) else 0)
        if n_req > len(self.per_request):
            grow = np.zeros(n_req - len(self.per_request), dtype=np.int64)
            self.per_request = np.concatenate([self.per_request, grow])
        np.add.at(self.per_request, req, 1)
        self.pieces[key] = _Piece(stem, len(p), tuple(p.labels), uniq, starts)

    def blocks(self) -> Iterator[GapRows]:
        """The whole run's gaps table in its order, in blocks of consecutive requests of
        about `block_rows` rows (a request's gaps are never split)."""
        pieces = [self.pieces[k] for k in sorted(self.pieces, key=lambda k: k[1])]
        labels = self.labels
        remap = np.zeros(max(self.primary_codes.values(), default=-1) + 1, dtype=np.int32)
        for i, name in enumerate(self.primaries):
            remap[self.primary_codes[name]] = i
        cum = np.cumsum(self.per_request)
        r0, n_req = 0, len(cum)
        while r0 < n_req:
            before = int(cum[r0 - 1]) if r0 else 0
            r1 = max(r0 + 1, int(np.searchsorted(cum, before + self.block_rows, side="right")))
            r1 = min(r1, n_req)
            if cum[r1 - 1] > before:
                yield _block(pieces, r0, r1, labels, remap, self.names)
            r0 = r1

    def empty(self) -> GapRows:
        """No rows (a run without gaps): the table's columns, empty."""
        z, f = np.zeros(0, dtype=np.int64), np.zeros(0)
        return GapRows(np.zeros(0, dtype=object), f, f, f, z, z, np.zeros(0, np.int32),
                       np.zeros((0, len(self.labels))))  # fmt: skip


def _block(
    pieces: list[_Piece], r0: int, r1: int, labels: tuple[str, ...], remap: np.ndarray,
    names: RequestNames,
) -> GapRows:  # fmt: skip
    """The rows of requests ``[r0, r1)``: from each slice in slice order, then stably
    sorted by request (each request's gaps in time order: the whole run's order)."""
    got: dict[str, list[np.ndarray]] = {k: [] for k in (*_COLUMNS, "parts")}
    for pc in pieces:
        lo, hi = (_row_of(pc, r) for r in (r0, r1))
        if hi <= lo:
            continue
        for name, dtype in _COLUMNS.items():
            got[name].append(_read(f"{pc.stem}.{name}", dtype, lo, hi))
        width = len(pc.labels)
        own = _read(f"{pc.stem}.parts", np.float64, lo * width, hi * width).reshape(-1, width)
        parts = np.zeros((hi - lo, len(labels)))
        parts[:, [labels.index(lb) for lb in pc.labels]] = own
        got["parts"].append(parts)
    cat = {k: np.concatenate(v) for k, v in got.items()}
    o = np.argsort(cat["request"], kind="stable")
    return GapRows(
        request=names.take(cat["request"][o]),
        t0_s=cat["t0_s"][o],
        t1_s=cat["t1_s"][o],
        gap_ms=cat["gap_ms"][o],
        step0=cat["step0"][o],
        step1=cat["step1"][o],
        primary=remap[cat["primary"][o]],
        parts_ms=cat["parts"][o],
    )


def _row_of(pc: _Piece, r: int) -> int:
    """The first row of a slice's spill whose request is `r` or later."""
    i = int(np.searchsorted(pc.uniq, r))
    return int(pc.starts[i]) if i < len(pc.uniq) else pc.rows


def _read(path: str, dtype: Any, lo: int, hi: int) -> np.ndarray:
    """Items ``[lo, hi)`` of a flat binary file of `dtype` (read, never mapped)."""
    size = np.dtype(dtype).itemsize
    with open(path, "rb") as fh:
        return np.fromfile(fh, dtype=dtype, count=hi - lo, offset=lo * size)


def spill_gaps_sliced(
    parts_dir: str,
    folder: str,
    *,
    path: str,
    max_emissions: int = DEFAULT_SLICE_EMISSIONS,
    max_inflate_mb: float | None = None,
) -> SpilledGaps:
    """Analyse the run in `parts_dir` in slices (`analyze_sliced`: its figures, named
    `path`) and spill its gaps into `folder` (an empty folder the caller removes). Raises
    `NotSliceable` (before any gap is spilled) for a folder that must be read whole."""
    spill = SpilledGaps(folder, block_rows=max_emissions)

    def each(fn: Any, tasks: list[SliceTask]) -> Iterable[SlicePart]:
        base = tasks[0].retained.first_step if tasks and tasks[0].retained else 0
        for t in tasks:  # one slice at a time: partitioned once for the sums and the spill
            read = slice_partition(t)
            spill.add(t, read, (t.retained.first_step if t.retained else 0) - base)
            sums = slice_sums(t, read.log, read.prep, read.p)
            del read  # before the next slice's is read (else two slices' logs at once)
            give_back_freed_memory()  # (kept by the analysis's allocator, as `run_slice`'s)
            yield sums

    spill.analysis = analyze_sliced(parts_dir, path=path, max_emissions=max_emissions,
                                    max_inflate_mb=max_inflate_mb, mapper=each)  # fmt: skip
    return spill


def sliced_config(parts_dir: str, max_inflate_mb: float | None = None) -> dict[str, Any]:
    """A parts folder's run config as the whole-run reader gives it (what its clean stop
    wrote, else its last part's), without reading its rows into one log."""
    run = SlicedRun(parts_dir, max_inflate_mb=max_inflate_mb)
    if run.final is not None and "config" in run.final:
        return dict(run.final["config"])
    if run.paths:
        return dict(run.read(len(run.paths) - 1)["config"])
    return dict(run.meta.get("config", {}))
