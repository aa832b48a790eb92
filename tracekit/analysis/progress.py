"""How far a long run's slice readers are, on a terminal: one line, overwritten.

    with progress_on(sys.stderr):        # the CLI, reading one run on a terminal
        analyze_sliced(..., progress=reporter("raw/run.npz"))

A run read in slices (docs/reports.md, "Reading a long run in slices") takes minutes for a
day of a busy server; its readers say where they are (``index: part 123 of 52628``,
``slice 12 of 400``) through a `progress` callback. `reporter` gives one that writes
``tracekit: RUN: WHAT`` over the previous line, at most every `EVERY_S` seconds, while
`progress_on` is open, and None otherwise (a pipe, a log file, a worker process, several
runs under the CLI's own bar): nothing is written there.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import TextIO

#: the shortest time between two lines (seconds)
EVERY_S = 0.5
_STREAMS: list[TextIO] = []  # where progress goes while `progress_on` is open


@contextlib.contextmanager
def progress_on(stream: TextIO | None) -> Iterator[None]:
    """While open, `reporter` writes to `stream` (None: nowhere); the line is cleared at
    the end."""
    if stream is None:
        yield
        return
    _STREAMS.append(stream)
    try:
        yield
    finally:
        _STREAMS.remove(stream)
        stream.write("\r\x1b[K")
        stream.flush()


def reporter(run: str) -> Callable[[str], None] | None:
    """A `progress` callback for the readers of `run` (None where no `progress_on` is
    open)."""
    if not _STREAMS:
        return None
    stream = _STREAMS[-1]
    last = [-EVERY_S]

    def say(what: str) -> None:
        now = time.monotonic()
        if now - last[0] >= EVERY_S:
            last[0] = now
            stream.write(f"\r\x1b[Ktracekit: {run}: {what}")
            stream.flush()

    return say
