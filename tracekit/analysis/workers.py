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
from tracekit.analysis.overtime import Bucket, over_time
from tracekit.analysis.run import open_run
from tracekit.analysis.whatif import WhatIf, whatif
from tracekit.analysis.window import WindowOptions
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


def whatif_path(path: str, names: Sequence[str] | None = None, **limits: Any) -> WhatIf:
    """`whatif`'s work on one run: every removal (or those named), by both models."""
    keep_freed_memory()
    log, part, tpart = partitions(path, **limits)
    return whatif(log, part, tpart, names)


def analyze_whatif_path(path: str, **limits: Any) -> tuple[RunAnalysis, WhatIf]:
    """`compare`'s work on one run: its figures and its what-if, from one partition."""
    keep_freed_memory()
    log, part, tpart = partitions(path, **limits)
    return analyze(log, part, tpart), whatif(log, part, tpart)
