"""tracekit: why was that token late?

Record what every engine step did (`Recorder`), save one raw log per run (`RawLog`),
partition every inter-token gap exclusively by cause (`partition`), and report per run
and across runs (`analyze`, the `tracekit` CLI).
"""

from tracekit.capture.recorder import Recorder
from tracekit.errors import InternalError, LogError, ReconcileError, TracekitError, UsageError
from tracekit.log.rawlog import RawLog
from tracekit.log.reader import load

__version__ = "0.1.0"

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
]
