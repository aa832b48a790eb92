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

`import tracekit` loads nothing but the errors and the version: every name above is
resolved on first use (PEP 562 `__getattr__`), so a process that only imports a small
module of the package (the vLLM plugin, inert until asked to record, reads
`tracekit.log.serve_contract`) pays for nothing else, and one that records loads only the
recorder.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from tracekit.errors import InternalError, LogError, ReconcileError, TracekitError, UsageError
from tracekit.version import __version__

if TYPE_CHECKING:  # the lazy names' types, for type checkers (resolved at run time below)
    from tracekit.capture.recorder import Recorder as Recorder
    from tracekit.log.rawlog import RawLog as RawLog
    from tracekit.log.reader import load as load

#: public name -> the module that defines it, imported on first use
_LAZY = {
    "Recorder": "tracekit.capture.recorder",
    "RawLog": "tracekit.log.rawlog",
    "load": "tracekit.log.reader",
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
    "ReconcileError",
    "TracekitError",
    "UsageError",
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
