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
from tracekit.analysis.run import open_run
from tracekit.analysis.whatif import WhatIf, whatif
from tracekit.attribution.itl import Partition, partition
from tracekit.attribution.timeline import PreparedRun
from tracekit.attribution.ttft import TtftPartition, ttft_partition
from tracekit.log.rawlog import RawLog


def analyze_path(path: str, **limits: Any) -> RunAnalysis:
    """`analyze`'s work on one run: every figure of design.md."""
    keep_freed_memory()  # once per process: ~40% of a run's analysis was page faults
    return analyze(open_run(path, **limits))


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
