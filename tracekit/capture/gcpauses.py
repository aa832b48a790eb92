"""The interpreter's garbage collections, timed: one `gc_pauses` row per collection.

`GcPauses.on_gc` goes into `gc.callbacks` while a run records (installed at start,
removed at stop, `Recorder(gc=True)`). A collection under way is an open window: a flush
announces its start tick (`open_tick`), and signals landing in it wait for its end
(`tracekit.capture.signals`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tracekit.capture import signals
from tracekit.capture.buffers import RowBuffers


class GcPauses:
    """Collections of one recorder's run: their start tick, then a row at their end."""

    __slots__ = ("_clock", "_rows", "_t0_tick")

    def __init__(self, clock: Callable[[], int], rows: RowBuffers) -> None:
        self._clock = clock
        self._rows = rows
        self._t0_tick = 0  # the start of the collection under way (or the last one)

    def on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            signals.IN_GC[0] = True  # first, before any call: see tracekit.capture.signals
            self._t0_tick = self._clock()
        else:
            try:
                t1 = self._clock()
                rows = self._rows
                with rows.lock:
                    rows.tables["gc_pauses"].extend((self._t0_tick, t1, info.get("generation", -1)))
            finally:
                signals.IN_GC[0] = False

    def open_tick(self) -> int | None:
        """The start of a collection under way (on another thread), or None."""
        return self._t0_tick if signals.IN_GC[0] else None


signals.defer_in(GcPauses.on_gc.__code__)
