"""tracekit: why was that token late?

The stable API (scripts written against these names keep working when modules move):

- `Recorder`: record what every engine step did into a raw log (`tracekit.capture`);
- `load` and `RawLog`: read one run's raw log, validated (`tracekit.log`);
- `open_run`: open a run in any form it takes on disk (a raw log, a killed recorder's
  parts, a multi-process server's directory), validated (`tracekit.analysis.run`);
- `partition`, `ttft_partition`, `client_partition`: every inter-token gap, every
  time-to-first-token and every client-side gap split exclusively by cause
  (`tracekit.attribution`);
- `analyze`, `compare`, `verdict`, `gap_records`: per-run figures, the fix ladder across
  runs and what it says (`tracekit.analysis`);
- the errors: `TracekitError` and its kinds.

`import tracekit` loads only what recording needs (an engine process imports it at
startup); the analysis names are resolved on first use (PEP 562 `__getattr__`).
"""

from __future__ import annotations

import importlib
from typing import Any

from tracekit.capture.recorder import Recorder
from tracekit.errors import InternalError, LogError, ReconcileError, TracekitError, UsageError
from tracekit.log.rawlog import RawLog
from tracekit.log.reader import load
from tracekit.version import __version__

#: public name -> the module that defines it, imported on first use
_LAZY = {
    "partition": "tracekit.attribution.itl",
    "Partition": "tracekit.attribution.itl",
    "ttft_partition": "tracekit.attribution.ttft",
    "TtftPartition": "tracekit.attribution.ttft",
    "client_partition": "tracekit.attribution.client",
    "analyze": "tracekit.analysis.figures",
    "RunAnalysis": "tracekit.analysis.figures",
    "gap_records": "tracekit.analysis.gaps",
    "compare": "tracekit.analysis.compare",
    "verdict": "tracekit.analysis.verdict",
    "open_run": "tracekit.analysis.run",
}

__all__ = [
    "InternalError",
    "LogError",
    "RawLog",
    "Recorder",
    "ReconcileError",
    "TracekitError",
    "UsageError",
    "load",
    "__version__",
    *_LAZY,
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # resolved once
        return value
    raise AttributeError(f"module 'tracekit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
