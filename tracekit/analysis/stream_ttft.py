"""A long run's TTFT figures from its slices' own TTFT rows, in memory by 9 bytes a request.

`tracekit.attribution.ttft.ttft_figures` reads a run's TTFT partition whole: its parts,
context and phases are ~400 bytes a request, and gathered from the slices of a day of a
busy server (millions of requests) they were most of `analyze`'s peak, growing with the
run. Here each slice's rows are folded as they arrive (`TtftFold.add`): what needs no
threshold is summed at once (every label's time, the phases, the held context, the counts,
the reconciliation error), each request's TTFT is kept (8 bytes) for the exact
percentiles, and the rows the tail reads (its TTFT, parts, phases and primary cause) wait
in a temporary file (``TMPDIR``). Once the run's TTFT p90 is known (`figures`), the file is
read back a slice at a time for the tail's figures.

The figures equal `ttft_figures` of the gathered rows (`stream.gathered_ttft_rows`):
counts, percentiles and the maximum exactly, sums and shares to float rounding (they add
in another order); columns are aligned by label name, as the gathered rows align them.
"""

from __future__ import annotations

import math
import tempfile
from typing import IO, Any

import numpy as np

from tracekit.attribution.ttft import (
    CLEAN,
    PHASES,
    PRE_ENGINE_LABELS,
    TTFT_PERCENTILES,
    TTFT_STANDARD_LABELS,
    UNSPLIT_WORDS,
    TtftFigures,
    TtftPartition,
    unsplit_note,
)
from tracekit.labels import FRONTEND_OS_LABELS, OS_LABELS

#: the TTFT partition's label order (`tracekit.attribution.ttft.ttft_labels`)
TTFT_LABEL_GROUPS = (PRE_ENGINE_LABELS, FRONTEND_OS_LABELS, TTFT_STANDARD_LABELS, OS_LABELS)


def ordered(union: set[str], groups: tuple[tuple[str, ...], ...]) -> tuple[str, ...]:
    """`union` in the order of `groups`, then the rest sorted (how both partitions order
    their labels)."""
    known = [lb for g in groups for lb in g if lb in union]
    return (*known, *sorted(union - set(known)))


class TtftFold:
    """The TTFT figures of rows added a slice at a time (see the module's docstring)."""

    def __init__(self) -> None:
        self._spill: IO[bytes] | None = None
        self._pieces: list[tuple[int, tuple[str, ...], tuple[str, ...]]] = []
        self._ttft: list[np.ndarray] = []
        self._all: dict[str, float] = {}  # by label: parts summed over every request
        self._context: dict[str, float] = {}
        self._phases = np.zeros(len(PHASES))
        self._count: dict[str, int] = {}  # by cause name ("clean" too)
        self._total = 0.0
        self._notes: dict[str, None] = {}
        self._labels: set[str] = set()
        self._causes: set[str] = set()
        self.n = 0
        self.num_unsplit = 0
        self.any_split = False
        self.no_admission_said = False
        self.max_err = 0.0
        self._added = False

    def add(self, p: TtftPartition) -> None:
        """One slice's own TTFT rows."""
        n = len(p)
        self._added = True
        self._labels |= set(p.labels)
        self._causes |= set(p.causes)
        for note in p.notes:
            if UNSPLIT_WORDS in note:
                self.no_admission_said |= UNSPLIT_WORDS + "no admission event" in note
            else:
                self._notes.setdefault(note, None)
        if not n:
            return
        split = np.isfinite(p.admit_s)
        self.n += n
        self.num_unsplit += int((~split).sum())
        self.any_split |= bool(split.any())
        self.max_err = max(self.max_err, p.reconcile_max_err_ms)
        t = np.asarray(p.ttft_ms, dtype=np.float64)
        self._ttft.append(t.copy())
        self._total += float(t.sum())
        for lb, v in zip(p.labels, p.parts_ms.sum(axis=0).tolist(), strict=True):
            self._all[lb] = self._all.get(lb, 0.0) + v
        for lb, v in zip(p.labels, p.context_ms.sum(axis=0).tolist(), strict=True):
            self._context[lb] = self._context.get(lb, 0.0) + v
        self._phases += p.phases_ms.sum(axis=0)
        _add_counts(self._count, p.primary, p.causes)
        if self._spill is None:
            self._spill = tempfile.TemporaryFile()
        for a in (t, p.parts_ms, p.phases_ms, p.primary):
            np.ascontiguousarray(a, dtype=np.int64 if a is p.primary else np.float64).tofile(
                self._spill
            )
        self._pieces.append((n, tuple(p.labels), tuple(p.causes)))

    def values(self) -> np.ndarray:
        """Every request's TTFT (ms), in slice order."""
        return np.concatenate(self._ttft) if self._ttft else np.zeros(0)

    def figures(self, has_admissions: bool | None) -> TtftFigures | None:
        """`ttft_figures` of every row added (None: no slice gave a TTFT row);
        `has_admissions`: whether the run has any admission row (its unsplit note), None:
        as the slices' notes say."""
        if not self._added:
            return None
        labels = ordered(self._labels, TTFT_LABEL_GROUPS)
        causes = tuple(lb for lb in labels if lb in self._causes)
        t = self.values()
        pct = {k: float(np.percentile(t, q)) if len(t) else math.nan for k, q in TTFT_PERCENTILES}
        tail = self._tail(pct["p90"]) if len(t) else None
        notes = tuple(self._notes)
        if self.num_unsplit:
            if has_admissions is None:
                has_admissions = self.no_admission_said or self.any_split
            notes = (*notes, unsplit_note(self.num_unsplit, has_admissions))
        n_tail, tail_ms, tail_parts, tail_phases, tail_count = tail or (
            0, 0.0, {}, np.zeros(len(PHASES)), {})  # fmt: skip
        return TtftFigures(
            requests=self.n,
            unsplit=self.num_unsplit,
            p50_ms=pct["p50"],
            p90_ms=pct["p90"],
            p99_ms=pct["p99"],
            max_ms=float(t.max()) if len(t) else math.nan,
            tail_requests=n_tail,
            tail_share=_shares(tail_parts, tail_ms, labels),
            all_share=_shares(self._all, self._total, labels),
            tail_count=_named(tail_count, causes),
            all_count=_named(self._count, causes),
            phase_share=_shares(
                dict(zip(PHASES, self._phases.tolist(), strict=True)), self._total, PHASES
            ),  # fmt: skip
            tail_phase_share=_shares(
                dict(zip(PHASES, tail_phases.tolist(), strict=True)), tail_ms, PHASES
            ),  # fmt: skip
            held_context_ms={lb: v for lb in labels if (v := self._context.get(lb, 0.0))},
            reconcile_max_err_ms=self.max_err,
            notes=list(notes),
        )

    def _tail(self, p90: float) -> tuple[Any, ...]:
        """The requests at or above `p90`, read back a slice at a time: their number,
        time, parts by label, phases and counts by cause."""
        assert self._spill is not None
        self._spill.seek(0)
        n_tail, tail_ms = 0, 0.0
        parts: dict[str, float] = {}
        phases = np.zeros(len(PHASES))
        count: dict[str, int] = {}
        for n, p_labels, p_causes in self._pieces:
            t = np.fromfile(self._spill, dtype=np.float64, count=n)
            m = np.fromfile(self._spill, dtype=np.float64, count=n * len(p_labels))
            ph = np.fromfile(self._spill, dtype=np.float64, count=n * len(PHASES))
            prim = np.fromfile(self._spill, dtype=np.int64, count=n)
            tail = t >= p90
            if not tail.any():
                continue
            n_tail += int(tail.sum())
            tail_ms += float(t[tail].sum())
            rows = m.reshape(n, len(p_labels))[tail].sum(axis=0).tolist()
            for lb, v in zip(p_labels, rows, strict=True):
                parts[lb] = parts.get(lb, 0.0) + v
            phases += ph.reshape(n, len(PHASES))[tail].sum(axis=0)
            _add_counts(count, prim[tail], p_causes)
        return n_tail, tail_ms, parts, phases, count

    def close(self) -> None:
        """Remove the temporary file."""
        if self._spill is not None:
            self._spill.close()
            self._spill = None


def _add_counts(d: dict[str, int], primary: np.ndarray, causes: tuple[str, ...]) -> None:
    c = np.bincount(np.where(primary == CLEAN, len(causes), primary), minlength=len(causes) + 1)
    for name, v in zip((*causes, "clean"), c.tolist(), strict=True):
        if v:
            d[name] = d.get(name, 0) + v


def _named(d: dict[str, int], causes: tuple[str, ...]) -> dict[str, int]:
    """`ttft._count`'s dict: the causes in the run's order, then "clean"; none at 0."""
    return {name: d[name] for name in (*causes, "clean") if d.get(name)}


def _shares(by: dict[str, float], total: float, names: tuple[str, ...]) -> dict[str, float]:
    """`ttft._shares` of sums already made: each name's time over `total`."""
    if total <= 0:
        return {n: 0.0 for n in names}
    return {n: by.get(n, 0.0) / total for n in names}


__all__ = ["TTFT_LABEL_GROUPS", "TtftFold", "ordered"]
