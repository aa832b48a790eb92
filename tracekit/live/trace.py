"""A Chrome trace written while a run records: a recorder sink.

    from tracekit.live.trace import ChromeTraceSink
    rec = tracekit.Recorder("raw/run.npz", sinks=[ChromeTraceSink("raw/run.trace.json")])

Each flush (`tracekit.log.flush.FlushedRows`) becomes events appended to the file on the
recorder's dispatcher thread, so the engine loop never formats JSON or waits on disk.
Events are formatted column-wise by numpy string operations, never through per-row Python
containers, so the trace does not feed the garbage collector it measures. A killed run
leaves a file without its closing ``]``, which Perfetto and chrome://tracing open anyway
(`tracekit.render.perfetto.read_trace` reads it too).

Tracks, track names and slice arguments are those of the post-run trace (``tracekit
trace``, the layout in `tracekit.render.perfetto`): the engine loop (steps, with the loop
thread's segments nested), ``thread N`` / ``device N``, ``gc``, counters, and per request
one track ``req ID`` holding its ``ttft`` (arrival to first token, when the arrival was
recorded), its gaps and its ``evicted`` slices (``evicted_ms``), nested in the gap they
fall in. What needs the whole run is only in the post-run trace: a gap's cause (live, every
gap is named ``gap`` and has no ``parts``), the TTFT partition, overlap lanes for windows
that do not nest, and the shift that keeps an arrival before engine start at ``ts >= 0``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from tracekit.labels import DEFAULT_CAUSE_MAP, cause_of
from tracekit.log.flush import EVICT, READMIT, UNKNOWN_TICK, FlushedRows, columns
from tracekit.render import perfetto as pf


class ChromeTraceSink:
    """Write a Chrome trace (JSON Array Format) while a run records (see the module doc)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._fh: Any = None
        self._n = 0
        self._t0_tick = 0
        self._us_per_tick = 1e-3
        self._cause_map: dict[str, str] = dict(DEFAULT_CAUSE_MAP)
        self._labels: list[str] = []
        self._req_names: list[str] = []
        self._named: set[tuple[int, int]] = set()
        self._num_steps = 0  # step rows written: the next step's index
        # per request: arrival, the last emission (tick, step), an open eviction (tick)
        self._arrival_tick = np.zeros(0, dtype=np.int64)
        self._last_tick = np.zeros(0, dtype=np.int64)
        self._last_step = np.zeros(0, dtype=np.int64)
        self._has_last = np.zeros(0, dtype=bool)
        self._evict_tick = np.zeros(0, dtype=np.int64)
        self._has_evict = np.zeros(0, dtype=bool)

    def open(self, meta: Mapping[str, Any]) -> None:
        self._t0_tick = int(meta["t0_tick"])
        self._us_per_tick = float(meta["seconds_per_tick"]) * 1e6
        self._cause_map = dict(meta.get("cause_map", DEFAULT_CAUSE_MAP))
        self._fh = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
        self._fh.write("[\n")
        self._put([_dumps(e) for e in pf.header_events()])
        self._fh.flush()

    def write(self, chunk: Mapping[str, np.ndarray]) -> None:
        self._put(self.flush_events(chunk))
        self._fh.flush()

    def close(self, final: Mapping[str, Any]) -> None:
        if self._fh is None or self._fh.closed:
            return
        self._fh.write("\n]\n")
        self._fh.close()

    def _put(self, lines: list[str] | np.ndarray) -> None:
        if len(lines) == 0:
            return
        text = ",\n".join(lines.tolist() if isinstance(lines, np.ndarray) else lines)
        self._fh.write(text if self._n == 0 else ",\n" + text)
        self._n += len(lines)

    def _track(self, pid: int, tid: int, name: str, sort_index: int) -> list[str]:
        if (pid, tid) in self._named:
            return []
        self._named.add((pid, tid))
        return [_dumps(e) for e in pf.track_events(pid, tid, name, sort_index)]

    def _us(self, ticks: np.ndarray) -> np.ndarray:
        return np.round((ticks - self._t0_tick) * self._us_per_tick, 3)

    def _ms(self, ticks: np.ndarray) -> np.ndarray:
        return np.char.mod("%.6f", np.round(ticks * self._us_per_tick * 1e-3, 6))

    def _x(self, pid: int, tid: Any, a: np.ndarray, b: np.ndarray, rest: Any) -> np.ndarray:
        """Complete slices from tick `a` to tick `b`; `rest`: ``,"name":...,"args":{...}}``."""
        us_a = self._us(a)
        dur = np.round(self._us(b) - us_a, 3)
        return _cat(
            f'{{"ph":"X","pid":{pid},"tid":', tid, ',"ts":', _f3(us_a), ',"dur":', _f3(dur), rest
        )

    def flush_events(self, chunk: Mapping[str, np.ndarray]) -> np.ndarray:
        """One flush's events, one JSON text each, as a numpy string array."""
        rows = FlushedRows.of(chunk)
        self._labels = rows.strings("labels") or self._labels
        counter_names = rows.strings("counter_names")
        start = rows.scalar("request_ids_start", len(self._req_names))
        assert start is not None
        new = rows.strings("request_ids")
        self._req_names[start : start + len(new)] = new
        out: list[np.ndarray] = []
        meta: list[str] = []

        st = columns("steps", rows.table("steps"))
        n = len(st["t0_tick"])
        if n:
            index = np.arange(self._num_steps, self._num_steps + n)
            self._num_steps += n
            values = [index] + [st[c] for c in pf.STEP_ARGS[1:]]
            args = _args(pf.STEP_ARGS, [_i(v) for v in values])
            out.append(
                self._x(
                    pf.PID_ENGINE,
                    str(pf.TID_LOOP),
                    st["t0_tick"],
                    st["t1_tick"],
                    _cat(',"name":"step","args":', args, "}"),
                )
            )
        meta += self._segments(columns("segments", rows.table("segments")), out)
        g = columns("gc_pauses", rows.table("gc_pauses"))
        if len(g["t0_tick"]):
            out.append(
                self._x(
                    pf.PID_ENGINE,
                    str(pf.TID_GC),
                    g["t0_tick"],
                    g["t1_tick"],
                    _cat(',"name":"gc","args":{"generation":', _i(g["generation"]), "}}"),
                )
            )
        out += self._counters(columns("counters", rows.table("counters")), counter_names)
        self._arrivals(columns("requests", rows.table("requests")))
        meta += self._emissions(columns("emissions", rows.table("emissions")), out)
        meta += self._evictions(columns("events", rows.table("events")), out, rows)
        head = np.array(meta, dtype=str)
        return np.concatenate([head, *out]) if out else head

    def _segments(self, sg: dict[str, np.ndarray], out: list[np.ndarray]) -> list[str]:
        if not len(sg["step"]):
            return []
        th, dev = sg["thread"], sg["is_device"]
        # the loop thread's host segments nest inside its steps (context managers nest)
        off_loop = np.where(dev != 0, pf.TID_DEVICE, pf.TID_THREADS) + th
        tid = np.where((th == 0) & (dev == 0), pf.TID_LOOP, off_loop)
        meta: list[str] = []
        for h, d in np.unique(np.stack([th, dev], axis=1), axis=0).tolist():  # per thread
            t, name = pf.thread_track(int(d), int(h))
            if t != pf.TID_LOOP:
                meta += self._track(pf.PID_ENGINE, t, name, t)
        # per label: its slice name, and the args' tail (its cause, where it is not the name)
        names, tails = [], []
        for i, lb in enumerate(self._labels):
            name = lb or f"label {i}"
            cause = cause_of(lb, self._cause_map)
            names.append(json.dumps(name))
            tails.append("}}" if cause == name else f',"cause":{json.dumps(cause)}}}}}')
        lab = sg["label"]
        ok = (lab >= 0) & (lab < len(self._labels))
        j = np.where(ok, lab, 0)
        seg_name = np.where(ok, np.array(names or [""])[j], _cat('"label ', _i(lab), '"'))
        tail = np.where(ok, np.array(tails or ["}}"])[j], "}}")
        out.append(
            self._x(
                pf.PID_ENGINE,
                _i(tid),
                sg["t0_tick"],
                sg["t1_tick"],
                _cat(',"name":', seg_name, ',"args":{"step":', _i(sg["step"]), tail),
            )
        )
        return meta

    def _counters(self, ct: dict[str, np.ndarray], counter_names: list[str]) -> list[np.ndarray]:
        keep = np.isfinite(ct["value"])
        if not keep.any():
            return []
        n = ct["name"][keep].astype(np.int64)
        value, t = ct["value"][keep], ct["t_tick"][keep]
        cnames = np.array(
            [json.dumps(c or f"counter {i}") for i, c in enumerate(counter_names)] or [""]
        )
        ok = (n >= 0) & (n < len(counter_names))
        name = np.where(ok, cnames[np.where(ok, n, 0)], _cat('"counter ', _i(n), '"'))
        ts = np.round((t - self._t0_tick) * self._us_per_tick, 3)
        return [_cat(f'{{"ph":"C","pid":{pf.PID_ENGINE},"ts":', _f3(ts), ',"name":', name,
                     ',"args":{"value":', np.char.mod("%.17g", value), "}}")]  # fmt: skip

    def _grow(self, n: int) -> None:
        if n <= len(self._has_last):
            return
        m = max(n, 2 * len(self._has_last))
        for name, fill in (
            ("_arrival_tick", UNKNOWN_TICK),
            ("_last_tick", 0),
            ("_last_step", 0),
            ("_has_last", False),
            ("_evict_tick", 0),
            ("_has_evict", False),
        ):
            old = getattr(self, name)
            new = np.full(m, fill, dtype=old.dtype)
            new[: len(old)] = old
            setattr(self, name, new)

    def _arrivals(self, rq: dict[str, np.ndarray]) -> None:
        keep = (rq["request"] >= 0) & (rq["arrival_tick"] != UNKNOWN_TICK)
        if keep.any():
            r = rq["request"][keep]
            self._grow(int(r.max()) + 1)
            self._arrival_tick[r] = rq["arrival_tick"][keep]

    def _request_tracks(self, reqs: np.ndarray) -> list[str]:
        meta: list[str] = []
        for q in np.unique(reqs).tolist():
            tid = int(pf.request_tid(q))
            meta += self._track(pf.PID_REQUESTS, tid, pf.request_track_name(self._req_name(q)), q)
        return meta

    def _emissions(self, em: dict[str, np.ndarray], out: list[np.ndarray]) -> list[str]:
        """Per request, its ``ttft`` at its first emission and a gap to each later one."""
        keep = em["request"] >= 0
        if not keep.any():
            return []
        order = np.flatnonzero(keep)[np.argsort(em["request"][keep], kind="stable")]
        r, t, step = em["request"][order], em["t_tick"][order], em["step"][order]
        self._grow(int(r.max()) + 1)
        first = np.ones(len(r), dtype=bool)
        first[1:] = r[1:] != r[:-1]
        prev_t, prev_step = np.roll(t, 1), np.roll(step, 1)
        has_prev = np.ones(len(r), dtype=bool)
        prev_t[first], prev_step[first] = self._last_tick[r[first]], self._last_step[r[first]]
        has_prev[first] = self._has_last[r[first]]
        meta = self._request_tracks(r)
        last = np.ones(len(r), dtype=bool)
        last[:-1] = r[:-1] != r[1:]
        self._last_tick[r[last]], self._last_step[r[last]] = t[last], step[last]
        self._has_last[r[last]] = True
        # the first token: a ttft slice from the arrival, where it was recorded (and before)
        arr = self._arrival_tick[r]
        k = first & ~has_prev & (arr != UNKNOWN_TICK) & (arr <= t)
        if k.any():
            a, b = arr[k], t[k]
            out.append(
                self._x(
                    pf.PID_REQUESTS,
                    _i(pf.request_tid(r[k])),
                    a,
                    b,
                    _cat(',"name":"ttft","args":{"ttft_ms":', self._ms(b - a), "}}"),
                )
            )
        k = has_prev
        if k.any():
            a, b = prev_t[k], t[k]
            values = [self._ms(b - a), _i(prev_step[k]), _i(step[k])]
            args = _args([c for c in pf.GAP_ARGS if c != "parts"], values)
            out.append(
                self._x(
                    pf.PID_REQUESTS,
                    _i(pf.request_tid(r[k])),
                    a,
                    b,
                    _cat(f',"name":"{pf.LIVE_GAP_NAME}","args":', args, "}"),
                )
            )
        return meta

    def _evictions(
        self, ev: dict[str, np.ndarray], out: list[np.ndarray], rows: FlushedRows
    ) -> list[str]:
        """Per request, an ``evicted`` slice from each eviction to its readmission (on the
        run's last flush, one still open runs to the stop)."""
        keep = ev["request"] >= 0
        meta: list[str] = []
        if keep.any():
            order = np.flatnonzero(keep)[np.argsort(ev["request"][keep], kind="stable")]
            r, kind, t = ev["request"][order], ev["kind"][order], ev["t_tick"][order]
            self._grow(int(r.max()) + 1)
            first = np.ones(len(r), dtype=bool)
            first[1:] = r[1:] != r[:-1]
            prev_kind, prev_t = np.roll(kind, 1), np.roll(t, 1)
            prev_kind[first] = np.where(self._has_evict[r[first]], EVICT, -1)
            prev_t[first] = self._evict_tick[r[first]]
            last = np.ones(len(r), dtype=bool)
            last[:-1] = r[:-1] != r[1:]
            open_last = kind[last] == EVICT
            # an eviction already open stays open at its first tick (a repeat does not move it)
            keep_open = open_last & (prev_kind[last] == EVICT)
            self._evict_tick[r[last]] = np.where(keep_open, prev_t[last], t[last])
            self._has_evict[r[last]] = open_last
            k = (kind == READMIT) & (prev_kind == EVICT)  # each readmission closes one
            if k.any():
                meta += self._request_tracks(r[k])
                out.append(self._evicted(r[k], prev_t[k], t[k]))
        stop = rows.scalar("stop_tick")
        if stop is not None and self._has_evict.any():
            q = np.flatnonzero(self._has_evict)
            self._has_evict[q] = False
            meta += self._request_tracks(q)
            out.append(self._evicted(q, self._evict_tick[q], np.full(len(q), stop)))
        return meta

    def _evicted(self, r: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return self._x(
            pf.PID_REQUESTS,
            _i(pf.request_tid(r)),
            a,
            b,
            _cat(',"name":"evicted","args":{"evicted_ms":', self._ms(b - a), "}}"),
        )

    def _req_name(self, r: int) -> str:
        return self._req_names[r] if 0 <= r < len(self._req_names) else str(r)


def _args(names: Any, values: list[np.ndarray]) -> np.ndarray:
    """``{"a":v,"b":w}`` per row, from the arg names and their formatted columns."""
    acc: Any = "{"
    for j, (name, v) in enumerate(zip(names, values, strict=True)):
        acc = np.char.add(np.char.add(acc, f'{"," if j else ""}"{name}":'), v)
    return np.char.add(acc, "}")


def _dumps(ev: Mapping[str, Any]) -> str:
    return json.dumps(ev, separators=(",", ":"))


def _i(a: Any) -> np.ndarray:
    return np.asarray(a).astype(np.int64).astype(str)


def _f3(a: np.ndarray) -> np.ndarray:
    return np.char.mod("%.3f", a)


def _cat(*parts: Any) -> np.ndarray:
    """Element-wise concatenation of string arrays and plain strings."""
    acc: Any = parts[0]
    for p in parts[1:]:
        acc = np.char.add(acc, p)
    return np.asarray(acc)


__all__ = ["ChromeTraceSink"]
