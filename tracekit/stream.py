"""Crash-safe capture storage: numbered `.npz` parts while a run records, one `.npz` after.

While a run records to ``OUT.npz``, its completed events go to ``OUT.npz.parts/``:

- ``meta.json``: written at start (schema, clock, start tick, pid, config so far);
- ``part-000001.npz``, ``part-000002.npz``, ...: each chunk of flat int64 rows the recorder
  buffered since the last flush, written to a temporary name and renamed into place, so a
  part is either whole or absent, whatever kills the process.

`merge_parts` turns a parts folder into a `RawLog` (seconds from engine start, evictions
paired with their readmissions, first token per request), and `recover` writes it as the
one `.npz` a clean stop would have written. A `kill -9` loses at most the events recorded
since the last flush (the recorder flushes at a bounded interval).
"""

from __future__ import annotations

import glob
import json
import os
import queue
import shutil
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import LogError
from .labels import DEFAULT_CAUSE_MAP
from .rawlog import (
    MODE_UNKNOWN,
    Admissions,
    Counters,
    Emissions,
    Evictions,
    GcPauses,
    PrefillChunks,
    RawLog,
    Requests,
    Segments,
    Steps,
    Waits,
)

# Row layouts of the recorder's flat buffers (all int64 ticks and ids, counters float64).
STEP_COLS = ("t0", "t1", "num_decode", "num_prefill_tokens", "graph_size", "preempted", "swapped")
SEG_COLS = ("step", "label", "t0", "t1", "thread", "is_device")
GC_COLS = ("t0", "t1", "generation")
EMIT_COLS = ("request", "t", "step", "num_tokens", "device_step")
EVENT_COLS = ("request", "kind", "t", "mode")  # kind 0 evict, 1 readmit
REQ_COLS = ("request", "arrival", "prompt_tokens", "max_new_tokens")
COUNTER_COLS = ("name", "t", "value")
ADMIT_COLS = ("request", "t")  # the first time the scheduler took the request
PREFILL_COLS = ("step", "request", "num_tokens")  # a prompt chunk computed in a step
WAIT_COLS = ("step", "request", "reason")  # why a waiting request was not admitted
TABLE_COLS = {
    "steps": STEP_COLS,
    "segments": SEG_COLS,
    "gc_pauses": GC_COLS,
    "emissions": EMIT_COLS,
    "events": EVENT_COLS,
    "requests": REQ_COLS,
    "counters": COUNTER_COLS,
    "admissions": ADMIT_COLS,
    "prefill_chunks": PREFILL_COLS,
    "waits": WAIT_COLS,
}
#: Tables added after the first parts format: a part written before them lacks them.
OPTIONAL_PART_TABLES = frozenset({"admissions", "prefill_chunks", "waits"})
EVICT, READMIT = 0, 1
UNKNOWN_TICK = np.iinfo(np.int64).min  # an arrival that was not recorded

PARTS_SUFFIX = ".parts"


def parts_dir_for(out: str) -> str:
    return out + PARTS_SUFFIX


class PartWriter:
    """Writes parts on a background thread, so a flush never blocks the engine loop on disk."""

    def __init__(self, parts_dir: str, meta: dict[str, Any]) -> None:
        self.dir = parts_dir
        if os.path.isdir(parts_dir):
            shutil.rmtree(parts_dir)
        os.makedirs(parts_dir)
        _atomic_write(os.path.join(parts_dir, "meta.json"), json.dumps(meta).encode())
        self._q: queue.Queue[tuple[int, dict[str, np.ndarray]] | None] = queue.Queue()
        self._n = 0
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tracekit-writer", daemon=True)
        self._thread.start()

    def submit(self, arrays: dict[str, np.ndarray]) -> None:
        self._n += 1
        self._q.put((self._n, arrays))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            n, arrays = item
            try:
                path = os.path.join(self.dir, f"part-{n:06d}.npz")
                tmp = path + ".tmp"
                with open(tmp, "wb") as fh:
                    np.savez(fh, **arrays)  # type: ignore[arg-type]  # stub: kwargs could be allow_pickle
                    fh.flush()
                    os.fsync(fh.fileno())
                os.replace(tmp, path)
            except BaseException as e:  # keep going: later parts may still be written
                self._error = e

    def close(self) -> None:
        self._q.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


def _atomic_write(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


def merge_parts(parts_dir: str, *, final: dict[str, Any] | None = None) -> RawLog:
    """Read a parts folder into one `RawLog`. `final` overrides meta known only at stop."""
    meta_path = os.path.join(parts_dir, "meta.json")
    try:
        with open(meta_path, "rb") as fh:
            meta = json.loads(fh.read())
    except (OSError, ValueError, RecursionError) as e:
        raise LogError(parts_dir, "meta.json", f"unreadable ({e})") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("t0_tick"), int):
        raise LogError(parts_dir, "meta.json", "not a recorder's meta (no integer t0_tick)")
    chunks: dict[str, list[np.ndarray]] = {k: [] for k in TABLE_COLS}
    labels: list[str] = []
    request_ids: list[str] = []
    counter_names: list[str] = []
    config = dict(meta.get("config", {}))
    last_tick = meta["t0_tick"]
    wall_ticks = None
    clean_stop = False
    warnings: list[str] = []
    paths = sorted(glob.glob(os.path.join(parts_dir, "part-*.npz")))
    for i, p in enumerate(paths):
        try:  # read the whole part before using any of it
            part = _read_part(p)
        except Exception as e:
            # Damaged on disk (a kill cannot do this: parts are renamed into place whole).
            # Later parts refer to its steps and requests by index, so the run ends here.
            warnings.append(
                f"{os.path.basename(p)} is unreadable ({type(e).__name__}: {str(e)[:100]}); "
                f"the run ends at the flush before it ({len(paths) - i} part(s) left out, "
                "still on disk)"
            )
            break
        for k, rows in part["tables"].items():
            chunks[k].append(rows)
        labels, counter_names = part["labels"], part["counter_names"]
        start, new_ids = part["request_ids_start"], part["request_ids"]
        request_ids[start : start + len(new_ids)] = new_ids
        config = part["config"]
        last_tick = max(last_tick, part["flush_tick"])
        if part["stop_tick"] is not None:
            clean_stop = True
            wall_ticks = part["stop_tick"] - meta["t0_tick"]
    if final:
        config = dict(final.get("config", config))
    t0 = int(meta["t0_tick"])
    scale = float(meta.get("seconds_per_tick", 1e-9))

    def table(k: str, dtype: Any = np.int64) -> np.ndarray:
        cols = TABLE_COLS[k]
        if not chunks[k]:
            return np.zeros((0, len(cols)), dtype=dtype)
        return np.concatenate(chunks[k]).astype(dtype, copy=False)

    def secs(ticks: np.ndarray) -> np.ndarray:
        return (ticks - t0).astype(np.float64) * scale

    st = table("steps")
    steps = Steps(
        t_start_s=secs(st[:, 0]),
        t_end_s=secs(st[:, 1]),
        num_decode=st[:, 2].copy(),
        num_prefill_tokens=st[:, 3].copy(),
        graph_size=st[:, 4].copy(),
        num_preempted=st[:, 5].copy(),
        num_swapped_in=st[:, 6].copy(),
    )
    sg = table("segments")
    segments = Segments(
        step=sg[:, 0].copy(),
        label=sg[:, 1].copy(),
        t_start_s=secs(sg[:, 2]),
        t_end_s=secs(sg[:, 3]),
        thread=sg[:, 4].copy(),
        is_device=sg[:, 5].astype(np.int8),
    )
    g = table("gc_pauses")
    gcs = GcPauses(t_start_s=secs(g[:, 0]), t_end_s=secs(g[:, 1]), generation=g[:, 2].copy())
    em = table("emissions")
    emissions = Emissions(
        request=em[:, 0].copy(),
        t_s=secs(em[:, 1]),
        step=em[:, 2].copy(),
        num_tokens=em[:, 3].copy(),
        device_step=em[:, 4].copy(),
    )
    n_req = len(request_ids)
    rq = table("requests")
    arrival = np.full(n_req, np.nan)
    prompt = np.full(n_req, -1, dtype=np.int64)
    max_new = np.full(n_req, -1, dtype=np.int64)
    if len(rq):
        known = rq[:, 1] != UNKNOWN_TICK
        arrival[rq[known, 0]] = secs(rq[known, 1])
        prompt[rq[:, 0]] = rq[:, 2]
        max_new[rq[:, 0]] = rq[:, 3]
    first = np.full(n_req, np.nan)
    if len(em):
        order = np.lexsort((emissions.t_s, emissions.request))
        r = emissions.request[order]
        head = np.ones(len(r), dtype=bool)
        head[1:] = r[1:] != r[:-1]
        first[r[head]] = emissions.t_s[order][head]
    evictions = _pair_evictions(table("events"), secs)
    ct = table("counters", np.float64)
    counters = Counters(
        name=ct[:, 0].astype(np.int64), t_s=(ct[:, 1] - t0) * scale, value=ct[:, 2].copy()
    )
    admissions, prefill_chunks, waits = _ttft_tables(
        table("admissions"), table("prefill_chunks"), table("waits"), secs
    )
    if wall_ticks is None:  # an interrupted run: its wall time is what was flushed
        wall_ticks = last_tick - t0
    out_meta = {k: v for k, v in meta.items() if k not in ("config", "cause_map", "schema")}
    out_meta["interrupted"] = final is None and not clean_stop
    if warnings:
        out_meta["warnings"] = list(out_meta.get("warnings", [])) + warnings
    if final:
        out_meta.update({k: v for k, v in final.items() if k not in ("config",)})
    return RawLog(
        steps=steps,
        segments=segments,
        gc_pauses=gcs,
        emissions=emissions,
        evictions=evictions,
        requests=Requests(
            arrival_s=arrival, prompt_tokens=prompt, max_new_tokens=max_new, first_token_s=first
        ),
        counters=counters,
        admissions=admissions,
        prefill_chunks=prefill_chunks,
        waits=waits,
        labels=tuple(labels),
        request_ids=tuple(request_ids),
        counter_names=tuple(counter_names),
        cause_map=meta.get("cause_map", dict(DEFAULT_CAUSE_MAP)),
        config=config,
        wall_s=wall_ticks * scale,
        meta=out_meta,
        path=parts_dir,
        warnings=tuple(warnings),
    )


def _read_part(path: str) -> dict[str, Any]:
    """One part's rows and vocabularies; raises on anything damaged or missing."""
    with np.load(path, allow_pickle=False) as z:
        tables = {}
        for k, cols in TABLE_COLS.items():
            if k in OPTIONAL_PART_TABLES and k not in z.files:
                continue
            a = z[k]
            if a.size % len(cols):
                raise ValueError(f"{k}: {a.size} values for rows of {len(cols)}")
            if a.size:
                tables[k] = a.reshape(-1, len(cols))
        return {
            "tables": tables,
            "labels": [str(x) for x in z["labels"]],
            "counter_names": [str(x) for x in z["counter_names"]],
            "request_ids_start": int(z["request_ids_start"]),
            "request_ids": [str(x) for x in z["request_ids"]],
            "config": json.loads(str(z["config"])),
            "flush_tick": int(z["flush_tick"]),
            "stop_tick": int(z["stop_tick"]) if "stop_tick" in z.files else None,
        }


def _ttft_tables(
    ad: np.ndarray, pf: np.ndarray, wt: np.ndarray, secs: Callable[[np.ndarray], np.ndarray]
) -> tuple[Admissions, PrefillChunks, Waits]:
    """The TTFT tables from their rows. A request admitted twice keeps its first admission
    (the first time the scheduler took it is what the row means)."""
    if len(ad):
        order = np.lexsort((ad[:, 1], ad[:, 0]))
        ad = ad[order]
        head = np.ones(len(ad), dtype=bool)
        head[1:] = ad[1:, 0] != ad[:-1, 0]
        ad = ad[head]
    admissions = Admissions(request=ad[:, 0].copy(), t_s=secs(ad[:, 1]))
    prefill = PrefillChunks(
        step=pf[:, 0].copy(), request=pf[:, 1].copy(), num_tokens=pf[:, 2].copy()
    )
    waits = Waits(step=wt[:, 0].copy(), request=wt[:, 1].copy(), reason=wt[:, 2].copy())
    return admissions, prefill, waits


def _pair_evictions(ev: np.ndarray, secs: Callable[[np.ndarray], np.ndarray]) -> Evictions:
    """Pair each eviction with the next readmission of the same request (NaN: none)."""
    if len(ev) == 0:
        return Evictions.empty()
    order = np.lexsort((np.arange(len(ev)), ev[:, 2], ev[:, 0]))
    ev = ev[order]
    req, kind, t, mode = ev[:, 0], ev[:, 1], ev[:, 2], ev[:, 3]
    rows: list[tuple[int, int, float, int]] = []
    open_at: dict[int, tuple[int, int]] = {}
    for i in range(len(ev)):  # per eviction event, not per token: a few hundred per run
        r = int(req[i])
        if kind[i] == EVICT:
            if r in open_at:  # evicted again without a readmission: close the first at NaN
                t_ev, m = open_at.pop(r)
                rows.append((r, t_ev, UNKNOWN_TICK, m))
            open_at[r] = (int(t[i]), int(mode[i]))
        elif r in open_at:
            t_ev, m = open_at.pop(r)
            rows.append((r, t_ev, int(t[i]), m))
    for r, (t_ev, m) in open_at.items():
        rows.append((r, t_ev, UNKNOWN_TICK, m))
    a = np.array(rows, dtype=np.int64).reshape(-1, 4)
    a = a[np.lexsort((a[:, 1], a[:, 0]))]
    readmit = secs(a[:, 2])
    readmit[a[:, 2] == UNKNOWN_TICK] = np.nan
    mode_col = a[:, 3].copy()
    mode_col[mode_col < MODE_UNKNOWN] = MODE_UNKNOWN
    return Evictions(
        request=a[:, 0].copy(), t_evict_s=secs(a[:, 1]), t_readmit_s=readmit, mode=mode_col
    )


def recover(parts_dir: str, out: str | None = None, *, remove_parts: bool = False) -> str:
    """Merge an interrupted run's parts into the one `.npz` a clean stop writes."""
    parts_dir = parts_dir.rstrip("/")
    if out is None:
        out = (
            parts_dir[: -len(PARTS_SUFFIX)]
            if parts_dir.endswith(PARTS_SUFFIX)
            else parts_dir + ".npz"
        )
    log = merge_parts(parts_dir)
    log.save(out)
    if remove_parts:
        shutil.rmtree(parts_dir, ignore_errors=True)
    return out
