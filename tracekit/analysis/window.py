"""A time window of a run: which gaps and TTFTs the reading commands show (docs/reports.md,
"Windows: part of a long run").

The rule: partition the whole run, then select. A window ``[FROM, TO)`` (seconds from
engine start) selects the gaps whose later emission (`t1_s`) lies in it and the TTFTs whose
first token lies in it; each keeps the parts the whole run's partition gave it, so a
window's gaps are the whole run's gaps that end in it, part for part. ``--around worst`` /
``--around pNN`` centre a window of ``--width`` seconds on the end of one gap of the run.

Pure: text and partitions in, a `Window` and selections out. The CLI parses the options;
nothing here prints.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np

from tracekit.attribution.itl import Partition
from tracekit.attribution.ttft import TtftPartition
from tracekit.errors import UsageError
from tracekit.log.rawlog import RawLog

#: --width's default: seconds of run around the gap `--around` picks
DEFAULT_WIDTH_S = 2.0
_UNITS_S = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


@dataclass(frozen=True, slots=True)
class Window:
    """``[t0_s, t1_s)`` in seconds from engine start (either end may be infinite: open),
    and how it was asked for, in words (what the output prints)."""

    t0_s: float
    t1_s: float
    how: str

    def contains(self, t_s: np.ndarray) -> np.ndarray:
        """Which of the times lie in ``[t0_s, t1_s)``."""
        t = np.asarray(t_s, dtype=float)
        return (t >= self.t0_s) & (t < self.t1_s)

    def text(self) -> str:
        """``FROM..TO`` as `--window` takes it (an open end left empty)."""
        a = "" if math.isinf(self.t0_s) else f"{self.t0_s:.6g}"
        b = "" if math.isinf(self.t1_s) else f"{self.t1_s:.6g}"
        return f"{a}..{b}"

    def describe(self) -> str:
        """One line for the output: the window, how it was chosen, what it selects."""
        return (
            f"window {self.text()} s from engine start ({self.how}): the gaps ending in it "
            "and the TTFTs whose first token lands in it, partitioned as in the whole run"
        )

    def to_dict(self) -> dict[str, Any]:
        """The record's ``window``: from_s/to_s (None: open) and how it was chosen."""
        lo = None if math.isinf(self.t0_s) else self.t0_s
        hi = None if math.isinf(self.t1_s) else self.t1_s
        return {"from_s": lo, "to_s": hi, "how": self.how}


def parse_duration(text: str) -> float:
    """``90``, ``500ms``, ``30s``, ``1m``, ``0.5h``, ``1d`` -> seconds (> 0, finite); a bare
    number is seconds (the units of a Prometheus duration, but one number)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|[smhd]?)\s*", text)
    if m is None or not 0 < float(m.group(1)) * _UNITS_S[m.group(2) or "s"] < math.inf:
        raise UsageError(
            f"--by {text!r}: expected a positive duration: a number of seconds, or with ms, s, "
            "m, h or d (500ms, 30s, 1m, 0.5h, 1d)"
        )
    return float(m.group(1)) * _UNITS_S[m.group(2) or "s"]


def _time(text: str, whole: str, started_unix_s: float | None) -> float:
    """One end of a window: seconds from engine start, or a wall-clock time (ISO 8601,
    UTC unless it names its offset) on a run that records when it started."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(
            f"--window {whole!r}: {text!r} is neither seconds from engine start nor a "
            "wall-clock time (2026-12-05T00:10:00, UTC unless an offset is given)"
        ) from None
    if started_unix_s is None:
        raise UsageError(
            f"--window {whole!r}: {text!r} is a wall-clock time, but this run records no "
            "wall-clock start (meta started_unix_s); give seconds from engine start"
        )
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return when.timestamp() - started_unix_s


def parse_window(text: str, started_unix_s: float | None = None) -> Window:
    """``FROM..TO`` (``..30``, ``600..`` open at one end), each end seconds from engine
    start or a wall-clock time; ``FROM:TO`` (seconds only) is `trace`'s older spelling."""
    if ".." in text:
        a, _, b = text.partition("..")
    elif re.fullmatch(r"[^:]*:[^:]*", text):
        a, _, b = text.partition(":")
    else:
        raise UsageError(f"--window {text!r}: expected FROM..TO in seconds (e.g. 10..12.5)")
    lo = _time(a.strip(), text, started_unix_s) if a.strip() else -math.inf
    hi = _time(b.strip(), text, started_unix_s) if b.strip() else math.inf
    if not lo < hi:
        raise UsageError(
            f"--window {text!r}: FROM must be before TO (here {lo:.6g} s >= {hi:.6g} s from "
            "engine start)"
        )
    return Window(lo, hi, f"--window {text}")


def run_span_s(log: RawLog) -> tuple[float, float]:
    """First and last moment the run recorded (steps, emissions), seconds from start."""
    ts = [log.steps.t_start_s, log.steps.t_end_s, log.emissions.t_s]
    t = np.concatenate([np.asarray(a, dtype=float) for a in ts])
    t = t[np.isfinite(t)]
    return (float(t.min()), float(t.max())) if len(t) else (0.0, 0.0)


def check_inside(log: RawLog, win: Window) -> None:
    """A window that misses the run entirely is a mistake: say so, with the run's span."""
    lo, hi = run_span_s(log)
    if win.t0_s > hi or win.t1_s <= lo:
        raise UsageError(
            f"{log.path}: {win.how}: outside the run, which spans {lo:.3f}-{hi:.3f} s from "
            "engine start"
        )


def pick_gap(part: Partition, which: str) -> int:
    """The row of the gap `--around` centres on: ``worst`` is the longest gap; ``pNN``
    (``p99``, ``p99.9``) the shortest gap at or above the run's NN-th percentile (numpy's
    linear percentile) of ITL. Ties go to the gap that ends first."""
    if not len(part):
        raise UsageError(f"--around {which}: the run has no gaps to centre a window on")
    gap = part.gap_ms
    if which == "worst":
        cand = gap == gap.max()
    else:
        m = re.fullmatch(r"p([0-9]+(?:\.[0-9]+)?)", which)
        if m is None or not 0 <= float(m.group(1)) <= 100:
            raise UsageError(f"--around {which!r}: expected worst or pNN (p99, p99.9)")
        at = gap >= np.percentile(gap, float(m.group(1)))
        cand = at & (gap == gap[at].min())
    rows = np.flatnonzero(cand)
    return int(rows[np.argmin(part.t1_s[rows])])  # argmin: the first of equal ends


def around(part: Partition, which: str, width_s: float = DEFAULT_WIDTH_S) -> Window:
    """A window `width_s` wide centred on the end of the gap `pick_gap` picks (its end, so
    that the window selects it)."""
    if not width_s > 0:
        raise UsageError(f"--width {width_s:g}: must be a positive number of seconds")
    i = pick_gap(part, which)
    t = float(part.t1_s[i])
    how = f"--around {which}: a {part.gap_ms[i]:.1f} ms gap ending at {t:.3f} s, {width_s:g} s wide"
    return Window(t - width_s / 2, t + width_s / 2, how)


@dataclass(frozen=True, slots=True)
class WindowOptions:
    """What `--window`, `--around` and `--width` asked for, before a run is read (the same
    for every run of a command; picklable, so a process pool or Ray carries it)."""

    window: str | None = None
    around: str | None = None
    width_s: float = DEFAULT_WIDTH_S

    @property
    def is_whole_run(self) -> bool:
        return self.window is None and self.around is None

    def to_dict(self) -> dict[str, Any]:
        """As asked, for a record of many runs (each run's own window is its record's)."""
        return {"window": self.window, "around": self.around, "width_s": self.width_s}

    def describe(self) -> str:
        """One line for the output of many runs: the window each run shows."""
        how = (f"--window {self.window}" if self.window is not None
               else f"--around {self.around} --width {self.width_s:g}")  # fmt: skip
        return (
            f"each run's window ({how}): the gaps ending in it and the TTFTs whose first "
            "token lands in it, partitioned as in the whole run; per-run figures (requests, "
            "steps, GC, preemptions): the whole run"
        )

    def resolve(self, log: RawLog, part: Partition | None) -> Window | None:
        """The window these options pick in `log` (None: the whole run). `part`: the run's
        partition, which `--around` needs."""
        if self.window is not None and self.around is not None:
            raise UsageError("--window and --around both given: pick one")
        if self.window is not None:
            win = parse_window(self.window, _started(log))
            check_inside(log, win)
            return win
        if self.around is not None:
            if part is None:
                raise UsageError("--around needs the run's gaps")
            return around(part, self.around, self.width_s)
        return None


def _started(log: RawLog) -> float | None:
    v = log.meta.get("started_unix_s")
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else None


def select_gaps(part: Partition, win: Window | None) -> Partition:
    """The gaps that end in `win` (all of them for None), partitioned as in the whole run."""
    return part if win is None else part.take(win.contains(part.t1_s))


def select_ttfts(tp: TtftPartition, win: Window | None) -> TtftPartition:
    """The TTFTs whose first token lands in `win`, partitioned as in the whole run."""
    return tp if win is None else tp.take(win.contains(tp.first_token_s))


def trace_span_s(part: Partition, win: Window) -> tuple[float, float]:
    """What `trace --window` keeps: events overlapping the window, stretched back to the
    start of the earliest gap that ends in it (the gap's whole story)."""
    sel = win.contains(part.t1_s)
    lo = min(win.t0_s, float(part.t0_s[sel].min())) if sel.any() else win.t0_s
    return lo, win.t1_s


__all__ = [
    "DEFAULT_WIDTH_S",
    "Window",
    "WindowOptions",
    "around",
    "check_inside",
    "parse_duration",
    "parse_window",
    "pick_gap",
    "run_span_s",
    "select_gaps",
    "select_ttfts",
    "trace_span_s",
]
