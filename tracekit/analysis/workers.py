"""The per-run work of the commands, one function a run, given its path: what the CLI maps
over runs here, in a process pool (`--jobs`) or as Ray tasks (`--ray`,
`tracekit.analysis.cluster`). Each opens the run the one way (`open_run`), partitions it
once and returns what the command renders; each is a module-level function, so a pool or
Ray pickles it by name."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tracekit.allocator import keep_freed_memory
from tracekit.analysis.figures import RunAnalysis, analyze
from tracekit.analysis.gaps import itl_series, worst_stalls
from tracekit.analysis.overtime import Bucket, over_time, report_buckets
from tracekit.analysis.run import open_run
from tracekit.analysis.whatif import WhatIf, whatif
from tracekit.analysis.window import Window, WindowOptions, select_gaps
from tracekit.attribution.itl import Partition, partition
from tracekit.attribution.timeline import PreparedRun
from tracekit.attribution.ttft import TtftPartition, ttft_partition
from tracekit.log.rawlog import RawLog


def analyze_path(path: str, view: WindowOptions | None = None, **limits: Any) -> RunAnalysis:
    """`analyze`'s work on one run: every figure of design.md (of the window `view` asks
    for, if any: docs/reports.md, "Windows")."""
    keep_freed_memory()  # once per process: ~40% of a run's analysis was page faults
    if view is None or view.is_whole_run:
        return analyze(open_run(path, **limits))
    log, part, tpart = partitions(path, **limits)
    return analyze(log, part, tpart, window=view.resolve(log, part))


def over_time_path(
    path: str, width_s: float, view: WindowOptions | None = None, **limits: Any
) -> list[Bucket]:
    """`analyze --by`'s work on one run: its buckets of `width_s` seconds."""
    keep_freed_memory()
    log = open_run(path, **limits)
    part = partition(log)
    return over_time(log, part, width_s, view.resolve(log, part) if view else None)


def partitions(path: str, **limits: Any) -> tuple[RawLog, Partition, TtftPartition]:
    """A run, its ITL partition and its TTFT partition, from one prepared timeline."""
    log = open_run(path, **limits)
    prep = PreparedRun(log)
    return log, partition(log, run=prep), ttft_partition(log, run=prep)


def whatif_path(
    path: str,
    names: Sequence[str] | None = None,
    view: WindowOptions | None = None,
    **limits: Any,
) -> WhatIf:
    """`whatif`'s work on one run: every removal (or those named), by both models, for the
    window `view` asks for, if any."""
    keep_freed_memory()
    log, part, tpart = partitions(path, **limits)
    return whatif(log, part, tpart, names, window=_resolve(view, log, part))


def analyze_whatif_path(
    path: str, view: WindowOptions | None = None, **limits: Any
) -> tuple[RunAnalysis, WhatIf]:
    """`compare`'s work on one run: its figures and its what-if, from one partition (of the
    run's own window `view` asks for, if any)."""
    keep_freed_memory()
    log, part, tpart = partitions(path, **limits)
    win = _resolve(view, log, part)
    return analyze(log, part, tpart, window=win), whatif(log, part, tpart, window=win)


def report_path(
    path: str, n_worst: int, view: WindowOptions | None = None, **limits: Any
) -> tuple[dict[str, Any], WhatIf]:
    """`report`'s work on one run, all from one partition: the page's view of it (the
    fields of `tracekit.render.html.ReportRun`: figures, worst stalls, ITL series, the
    tail over time) and its what-if, of the window `view` asks for, if any."""
    keep_freed_memory()
    log, part, tpart = partitions(path, **limits)
    win = _resolve(view, log, part)
    page = {
        "analysis": analyze(log, part, tpart, window=win),
        "worst_stalls": worst_stalls(log, select_gaps(part, win), n_worst),
        "series": itl_series(log, part, window=win),
        "buckets": report_buckets(log, part, win),
    }
    return page, whatif(log, part, tpart, window=win)


def _resolve(view: WindowOptions | None, log: RawLog, part: Partition) -> Window | None:
    return view.resolve(log, part) if view is not None else None
