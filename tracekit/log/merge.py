"""One run from the logs of many processes (a multi-process server recorded per process).

A directory holds one log per process: ``ROLE-PID.npz`` after a clean stop, or the parts
``ROLE-PID.npz.parts/`` of a process that was killed (read here in place, never removed).
Each log says who wrote it in ``config["process"]`` (``role``, ``pid``, ``host``, ``name``,
``boot_id``, ``clock``). `merge_dir` joins them into one `RawLog`:

- **One clock.** The engine core's clock is the run's clock (seconds from its start).
  Every recorder reads ``perf_counter_ns`` and stamps its start tick (``meta["t0_tick"]``),
  so a process's times move by the difference of start ticks (`offset_s`) when the two
  clocks are one: same host, same boot id, ``perf_counter`` implemented by
  ``CLOCK_MONOTONIC`` (Linux keeps one CLOCK_MONOTONIC per boot for every process). That is
  then *checked* with paired stamps, events whose order causality fixes:

  - API server -> engine core: a request is sent (``serve.sent``) before the engine core
    adds it (``serve.added``): the API server's clock is at most ``added - sent`` ahead;
  - engine core -> API server: a step's outputs are built (``serve.out``, vLLM's
    ``EngineCoreOutputs.timestamp`` as the pair's key) before they arrive (``serve.recv``):
    at least ``out - recv`` ahead;
  - engine core -> worker: the engine core asks for the forward pass before the worker
    starts it, and the worker ends it before the engine core's wait returns (the n-th
    forward window of each, in order, from the engine core's first step).

  Each pair bounds the remaining correction ``theta`` (``lo <= theta <= hi``); on one clock
  0 must lie in every bound (`violations` counts pairs where it does not) and the reported
  uncertainty is 0. For processes on different hosts (or clocks that are not one),
  ``theta(t) = a + b t`` is *estimated* from the same bounds: the tightest lower and upper
  bound per time bin (the fastest round trips), their midpoints fitted by least squares;
  the uncertainty is half the widest bin's bound plus the fit's largest residual.
- **One request identity.** The engine core knows vLLM's internal ids (``cmpl-..-0-1a2b3c4d``,
  ``1_cmpl-..-0-1a2b3c4d`` for the second sibling of ``n > 1``); the API server records each
  request as ``CLIENT_ID<US>ENGINE_ID``. The run names requests by CLIENT_ID (what the
  client sees: ``cmpl-..-0``, ``cmpl-..-0#1``).

The merged run keeps the engine core's tables as they are (steps, segments, emissions at
the engine boundary, evictions, requests) and adds the client boundary: `client_emissions`
(each SSE chunk written), `proc_segments` (API server and worker windows and GC pauses, on
the run's clock), `deliveries` (each step's outputs, built and received), `proc_os` (what
the OS did to each API server's event loop between its samples, on the run's clock),
``meta["processes"]`` (per process: identity, file, recovered or not, and the clock
offset, correction and uncertainty against the engine core) and ``meta["clock_pairs"]``
(each process against the engine core: one entry a process, so the merge and its output
stay linear in processes; two others' offset is the difference of theirs).

The merged log is validated before it is returned: a merge never writes (and `analyze
DIR` never analyses) a log that `tracekit check` would reject.
"""

from __future__ import annotations

import bisect
import math
import os
import stat
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tracekit.errors import LogError
from tracekit.log.archive import describe_non_regular
from tracekit.log.osintervals import OsIntervals, side_thread_intervals, thread_os_intervals
from tracekit.log.parts import PARTS_SUFFIX, merge_parts
from tracekit.log.rawlog import (
    ClientEmissions,
    Coverage,
    Deliveries,
    ProcOs,
    ProcSegments,
    RawLog,
    Requests,
)
from tracekit.log.reader import load
from tracekit.log.validate import validate_log

FRONT_SEP = "\x1f"
SENT, ADDED, OUT, RECV = "serve.sent", "serve.added", "serve.out", "serve.recv"
HANDLER = "serve.handler"
CORE, FRONTEND, WORKER = "engine_core", "api_server", "worker"
SHARED_CLOCK = "clock_gettime(CLOCK_MONOTONIC)"
#: Paired-stamp bounds may miss 0 by float rounding of the tick conversions.
CAUSALITY_TOL_S = 1e-7


@dataclass(frozen=True)
class ProcessLog:
    path: str
    log: RawLog
    identity: dict[str, Any]
    recovered: bool

    @property
    def role(self) -> str:
        return str(self.identity.get("role", "?"))

    @property
    def t0_s(self) -> float:
        """The recorder's start on its own clock, seconds."""
        return int(self.log.meta.get("t0_tick", 0)) * float(
            self.log.meta.get("seconds_per_tick", 1e-9)
        )


@dataclass(frozen=True)
class ClockFit:
    """How one process's times map onto the run's clock: ``t_run = t + offset_s +
    correction_s + drift * t`` (t: seconds from that process's recorder start)."""

    offset_s: float  # difference of recorder start ticks (exact on one clock)
    correction_s: float  # theta at the process's start: 0 on one clock
    drift: float  # d theta / dt (0 on one clock)
    uncertainty_s: float
    bound_s: tuple[float, float]  # the tightest [lo, hi] the paired stamps allow
    pairs: int
    violations: int  # pairs whose bound excludes the correction used
    method: str

    def apply(self, t: np.ndarray) -> np.ndarray:
        t = np.asarray(t, dtype=np.float64)
        return t + self.offset_s + self.correction_s + self.drift * t

    def as_meta(self) -> dict[str, Any]:
        return {
            "offset_s": self.offset_s,
            "correction_s": self.correction_s,
            "drift_ppm": self.drift * 1e6,
            "uncertainty_s": self.uncertainty_s,
            "bound_s": list(self.bound_s),
            "pairs": self.pairs,
            "violations": self.violations,
            "method": self.method,
        }


# -- reading a directory ------------------------------------------------------------------


def _entries(directory: str) -> tuple[list[str], list[str]]:
    """(whole logs, parts folders) of `directory`, by name (never a glob pattern built from
    its path, which may hold ``[`` or ``*``). A ``.npz`` that is not a regular file (a FIFO,
    a device) is refused before a byte is read; a ``.parts`` that is not a folder is
    skipped."""
    done, parts = [], []
    try:
        names = sorted(os.listdir(directory))
    except OSError as e:
        raise LogError(directory, "directory", f"cannot be listed ({e.strerror})") from None
    for n in names:
        p = os.path.join(directory, n)
        if n.endswith(".npz"):
            try:
                mode = os.stat(p).st_mode
            except OSError as e:
                raise LogError(p, "file", f"cannot be read ({e.strerror})") from None
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                raise LogError(p, "file", f"is {describe_non_regular(mode)}, not a regular file")
            done.append(p)
        elif n.endswith(PARTS_SUFFIX) and os.path.isdir(p):
            parts.append(p)
    return done, parts


def process_logs(directory: str, **limits: Any) -> list[ProcessLog]:
    """Every process log in `directory`: a whole ``.npz``, else its parts (read in place).
    `limits`: `load`'s bounds on reading (``max_inflate_mb``, ``max_label_chars``)."""
    if not os.path.isdir(directory):
        raise LogError(directory, "directory", "does not exist or is not a directory")
    done, parts = _entries(directory)
    out = []
    for p in done:
        out.append(_process_log(p, load(p, **limits), recovered=False))
    have = set(done)
    for d in parts:
        if d[: -len(PARTS_SUFFIX)] in have:
            continue  # stopped cleanly after all (the .npz is the whole run)
        log = merge_parts(d, max_inflate_mb=limits.get("max_inflate_mb"))
        out.append(_process_log(d, log, recovered=True))
    if not out:
        raise LogError(
            directory, "directory", "holds no process logs (ROLE-PID.npz or ROLE-PID.npz.parts/)"
        )
    return out


def _process_log(path: str, log: RawLog, recovered: bool) -> ProcessLog:
    ident = log.config.get("process")
    if not isinstance(ident, dict) or ident.get("role") not in (CORE, FRONTEND, WORKER):
        raise LogError(
            path,
            "config.process.role",
            f"missing or not one of {CORE}, {FRONTEND}, {WORKER}: not a per-process log "
            "(record the server with TRACEKIT_VLLM_DIR set, see docs/adapters.md)",
        )
    pid = ident.get("pid", 0)
    if isinstance(pid, bool) or not isinstance(pid, int) or not 0 <= pid < 2**63:
        raise LogError(path, "config.process.pid", f"{str(pid)[:40]!r} is not a process id")
    for k in ("boot_id", "clock", "host", "name"):
        if not isinstance(ident.get(k, ""), str):
            raise LogError(path, f"config.process.{k}", "not a string")
    t0 = log.meta.get("t0_tick")
    if t0 is None:
        raise LogError(path, "meta.t0_tick", "missing: the merge needs each recorder's start tick")
    if isinstance(t0, bool) or not isinstance(t0, int) or not abs(t0) < 2**63:
        raise LogError(path, "meta.t0_tick", f"{str(t0)[:40]!r} is not an integer tick")
    spt = log.meta.get("seconds_per_tick", 1e-9)
    if (
        isinstance(spt, bool)
        or not isinstance(spt, (int, float))
        or not math.isfinite(spt)
        or not 0 < spt < 1e3
    ):
        raise LogError(
            path, "meta.seconds_per_tick", f"{str(spt)[:40]!r} is not a positive number of seconds"
        )
    return ProcessLog(path, log, dict(ident), recovered)


def is_process_dir(path: str) -> bool:
    """True for a directory of per-process logs (what `merge_dir` reads)."""
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "meta.json")):
        return False
    try:
        names = os.listdir(path)
    except OSError:
        return False
    return any(n.endswith((".npz", PARTS_SUFFIX)) for n in names)


# -- clocks -------------------------------------------------------------------------------


def one_clock(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two processes read one clock: same host boot, perf_counter on CLOCK_MONOTONIC."""
    return bool(
        a.get("boot_id")
        and a.get("boot_id") == b.get("boot_id")
        and a.get("clock") == SHARED_CLOCK
        and b.get("clock") == SHARED_CLOCK
    )


def _counter(log: RawLog, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(times, values) of one counter of a log (empty if it never fired)."""
    if name not in log.counter_names:
        return np.zeros(0), np.zeros(0)
    m = log.counters.name == log.counter_names.index(name)
    return log.counters.t_s[m], log.counters.value[m]


@dataclass(frozen=True)
class CoreIndex:
    """What every other process's clock fit reads from the engine core, computed once per
    merge (so the merge is linear in the number of processes, not in processes x core rows):
    its built outputs sorted by key, its added requests by engine id, its steps' forward
    windows."""

    out_t: np.ndarray  # ``serve.out`` times, in the order of `out_v`
    out_v: np.ndarray  # ``serve.out`` keys, sorted
    added: dict[str, float]  # engine id -> ``serve.added`` time
    forward: np.ndarray  # (n, 2): per step, its forward windows' [first start, last end]

    @classmethod
    def of(cls, core: ProcessLog) -> CoreIndex:
        c_t, c_v = _counter(core.log, OUT)
        o = np.argsort(c_v, kind="stable")
        a_t, a_v = _counter(core.log, ADDED)
        ids = core.log.request_ids
        added = {}
        for t, v in zip(a_t.tolist(), a_v.tolist(), strict=True):
            if 0 <= v < len(ids) and v == int(v):
                added[ids[int(v)]] = t
        fwd = _windows(core.log, ("prefill", "decode", "verify"), steps_only=True)
        return cls(c_t[o], c_v[o], added, fwd)


def _match_sorted(keys: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices (into sorted `keys`, into `values`) of the values found among the keys: the
    first of equal keys, each value once (as `np.intersect1d` pairs them)."""
    if not len(keys) or not len(values):
        z = np.zeros(0, dtype=np.int64)
        return z, z
    uv, first = np.unique(values, return_index=True)
    k = np.searchsorted(keys, uv, side="left")
    ok = k < len(keys)
    ok[ok] = keys[k[ok]] == uv[ok]
    return k[ok], first[ok]


def frontend_bounds(core: ProcessLog, fe: ProcessLog, offset_s: float,
                    index: CoreIndex | None = None):  # fmt: skip
    """Paired-stamp bounds on the API server's correction, at the API server's times:
    (t_lo, lo, t_hi, hi) with ``theta >= lo`` at t_lo and ``theta <= hi`` at t_hi."""
    ix = index or CoreIndex.of(core)
    # outputs built (core) -> received (frontend), keyed by vLLM's outputs timestamp
    f_t, f_v = _counter(fe.log, RECV)
    ci, fi = _match_sorted(ix.out_v, f_v)
    t_lo = f_t[fi]
    lo = ix.out_t[ci] - (f_t[fi] + offset_s)
    # request sent (frontend) -> added (core), keyed by the engine id
    s_t, s_v = _counter(fe.log, SENT)
    names = fe.log.request_ids
    t_hi, hi = [], []
    for t, v in zip(s_t.tolist(), s_v.tolist(), strict=True):
        if not (0 <= v < len(names) and v == int(v)):
            continue  # not a request index of this log: no pair
        engine_id = names[int(v)].split(FRONT_SEP, 1)[-1]
        ta = ix.added.get(engine_id)
        if ta is not None:
            t_hi.append(t)
            hi.append(ta - (t + offset_s))
    return t_lo, lo, np.asarray(t_hi, dtype=np.float64), np.asarray(hi, dtype=np.float64)


def _windows(log: RawLog, labels: tuple[str, ...], steps_only: bool) -> np.ndarray:
    """Per step (engine core) the [first start, last end] of its `labels` windows, or for
    a worker each execute window (``prepare`` + ``forward``) in order: (n, 2)."""
    ids = [log.labels.index(x) for x in labels if x in log.labels]
    seg = log.segments
    m = np.isin(seg.label, ids)
    if steps_only:
        m &= seg.step >= 0
        st = seg.step[m]
        if not len(st):
            return np.zeros((0, 2))
        uniq, inv = np.unique(st, return_inverse=True)
        a = np.full(len(uniq), np.inf)
        b = np.full(len(uniq), -np.inf)
        np.minimum.at(a, inv, seg.t_start_s[m])
        np.maximum.at(b, inv, seg.t_end_s[m])
        return np.column_stack([a, b])
    return np.column_stack([seg.t_start_s[m], seg.t_end_s[m]])


def worker_bounds(core: ProcessLog, wk: ProcessLog, offset_s: float,
                  index: CoreIndex | None = None):  # fmt: skip
    """Paired-stamp bounds on a worker's correction: the engine core's n-th forward window
    (from ``execute_model`` to its wait returning) contains the worker's n-th."""
    c = (index or CoreIndex.of(core)).forward
    w_prep = _windows(wk.log, ("prepare",), steps_only=False)
    w_fwd = _windows(wk.log, ("forward",), steps_only=False)
    if not len(c) or not len(w_fwd):
        return (np.zeros(0),) * 4
    # a worker window is (prepare start or forward start, forward end); prepare precedes
    # its forward, so pair each forward with the last prepare that ended at its start
    starts = w_fwd[:, 0].copy()
    if len(w_prep):
        k = np.searchsorted(w_prep[:, 1], w_fwd[:, 0], side="right") - 1
        ok = (k >= 0) & (np.abs(w_prep[np.clip(k, 0, None), 1] - w_fwd[:, 0]) < 1e-9)
        starts[ok] = w_prep[k[ok], 0]
    w = np.column_stack([starts, w_fwd[:, 1]])
    # serving windows only: from the engine core's first step (startup runs come before)
    w = w[w[:, 0] + offset_s >= c[0, 0] - 1e-3]
    n = min(len(c), len(w))
    c, w = c[:n], w[:n]
    lo = c[:, 0] - (w[:, 0] + offset_s)  # the worker started after the core asked
    hi = c[:, 1] - (w[:, 1] + offset_s)  # and ended before the core's wait returned
    return w[:, 0], lo, w[:, 1], hi


def fit_clock(t_lo, lo, t_hi, hi, *, offset_s: float, shared: bool) -> ClockFit:
    """The correction for one process from its paired-stamp bounds (see the module doc)."""
    t_lo, lo, t_hi, hi = (np.asarray(x, dtype=np.float64) for x in (t_lo, lo, t_hi, hi))
    pairs = len(lo) + len(hi)
    bound = (float(lo.max()) if len(lo) else -np.inf, float(hi.min()) if len(hi) else np.inf)
    if shared:
        viol = int(np.sum(lo > CAUSALITY_TOL_S) + np.sum(hi < -CAUSALITY_TOL_S))
        return ClockFit(
            offset_s, 0.0, 0.0, 0.0, bound, pairs, viol, "one clock (same boot, CLOCK_MONOTONIC)"
        )
    if not len(lo) or not len(hi):
        raise LogError(
            "<merge>", "clock", "processes on different clocks need paired stamps both ways"
        )
    a, b, unc = estimate_offset(t_lo, lo, t_hi, hi)
    theta_lo = a + b * t_lo
    theta_hi = a + b * t_hi
    viol = int(np.sum(lo > theta_lo + unc) + np.sum(hi < theta_hi - unc))
    return ClockFit(offset_s, a, b, unc, bound, pairs, viol, "estimated from paired stamps")


def estimate_offset(t_lo, lo, t_hi, hi, *, bins: int = 8) -> tuple[float, float, float]:
    """``theta(t) = a + b t`` from bounds ``lo_i <= theta(t_lo_i)``, ``theta(t_hi_j) <= hi_j``:
    per time bin the tightest bounds, their midpoints fitted by least squares. Returns (a,
    b, uncertainty): half the widest bin's bound plus the largest fit residual."""
    t_all = np.concatenate([t_lo, t_hi])
    edges = np.unique(np.quantile(t_all, np.linspace(0, 1, bins + 1)))
    mids, ts, half = [], [], []
    for i in range(len(edges) - 1):
        last = i == len(edges) - 2
        ml = (t_lo >= edges[i]) & ((t_lo <= edges[i + 1]) if last else (t_lo < edges[i + 1]))
        mh = (t_hi >= edges[i]) & ((t_hi <= edges[i + 1]) if last else (t_hi < edges[i + 1]))
        if not ml.any() or not mh.any():
            continue
        lo_b, hi_b = lo[ml].max(), hi[mh].min()
        mids.append((lo_b + hi_b) / 2)
        half.append(abs(hi_b - lo_b) / 2)
        ts.append((edges[i] + edges[i + 1]) / 2)
    if not mids:  # bounds never share a bin: one constant from the tightest of each
        m = (lo.max() + hi.min()) / 2
        return float(m), 0.0, float(abs(hi.min() - lo.max()) / 2)
    tv, mv = np.asarray(ts), np.asarray(mids)
    if len(tv) >= 2:
        b, a = np.polyfit(tv, mv, 1)
    else:
        a, b = float(mv[0]), 0.0
    resid = float(np.max(np.abs(mv - (a + b * tv))))
    return float(a), float(b), float(max(half) + resid)


# -- the merge ----------------------------------------------------------------------------


def merge_dir(directory: str, *, engine: int | None = None, **limits: Any) -> RawLog:
    """The run recorded in `directory` (see the module docstring), validated; `engine`: the
    data parallel rank whose run to build when the server ran several engine cores.
    `limits`: `load`'s bounds on reading each process log."""
    return merge_logs(process_logs(directory, **limits), path=directory, engine=engine)


def dp_rank(p: ProcessLog) -> int | None:
    """The data-parallel rank a process recorded (engine cores and workers), else None."""
    r = p.identity.get("dp_rank")
    return int(r) if isinstance(r, int) and not isinstance(r, bool) else None


def merge_logs(
    procs: list[ProcessLog], *, path: str = "<memory>", engine: int | None = None
) -> RawLog:
    """One run from the logs of a server's processes. A data-parallel server has one
    engine core per DP rank, each with its own steps and workers: its run is that engine
    core's (`engine`: the DP rank), with its workers, the API servers, and the requests
    that engine core served (the others' are left out, never charged to its steps)."""
    cores = sorted((p for p in procs if p.role == CORE), key=lambda p: (dp_rank(p) or 0, p.path))
    if not cores:
        raise LogError(path, "engine_core", "found no engine core log; the merge needs one")
    ranks = [dp_rank(p) if dp_rank(p) is not None else i for i, p in enumerate(cores)]
    if engine is None and len(cores) > 1:
        raise LogError(
            path,
            "engine_core",
            f"found {len(cores)} engine cores (data parallel, ranks "
            f"{', '.join(map(str, ranks))}): each has its own steps; merge one engine's run "
            "with --engine RANK (tracekit merge DIR --engine 0 -o RUN0.npz)",
        )
    if engine is not None and engine not in ranks:
        raise LogError(
            path, "engine", f"no engine core with data-parallel rank {engine} (ranks there: "
            f"{', '.join(map(str, ranks))})"
        )  # fmt: skip
    core = cores[ranks.index(engine) if engine is not None else 0]
    mine = dp_rank(core)
    elsewhere: set[str] = set()  # engine ids another engine core served
    for c in cores:
        if c is not core:
            elsewhere.update(c.log.request_ids)
    others = [
        p
        for p in procs
        if p.role != CORE
        and not (p.role == WORKER and len(cores) > 1 and dp_rank(p) not in (None, mine))
    ]
    core_index = CoreIndex.of(core)
    fits = [_fit(core, p, core_index) for p in others]
    ident = join_requests(core, others, fits, elsewhere)
    req_ids = ident.names
    renamed = ident.renamed
    labels = list(core.log.labels)
    label_pos = {x: i for i, x in enumerate(labels)}

    def label_id(name: str) -> int:
        if name not in label_pos:
            label_pos[name] = len(labels)
            labels.append(name)
        return label_pos[name]

    seg_rows: list[np.ndarray] = []
    ce_rows: list[np.ndarray] = []
    dl_rows: list[np.ndarray] = []
    os_rows: list[np.ndarray] = []
    processes = [{**core.identity, "path": core.path, "recovered": core.recovered}]
    for k, (p, fit) in enumerate(zip(others, fits, strict=True), start=1):
        processes.append(
            {**p.identity, "path": p.path, "recovered": p.recovered, "clock_fit": fit.as_meta()}
        )
        lg = p.log
        lab = np.array([label_id(x) for x in lg.labels], dtype=np.int64)
        if len(lg.segments):
            seg_rows.append(
                np.column_stack(
                    [
                        np.full(len(lg.segments), k),
                        lab[lg.segments.label] if len(lab) else lg.segments.label,
                        fit.apply(lg.segments.t_start_s),
                        fit.apply(lg.segments.t_end_s),
                    ]
                )
            )
        if len(lg.gc_pauses):
            seg_rows.append(
                np.column_stack(
                    [
                        np.full(len(lg.gc_pauses), k),
                        np.full(len(lg.gc_pauses), label_id("gc")),
                        fit.apply(lg.gc_pauses.t_start_s),
                        fit.apply(lg.gc_pauses.t_end_s),
                    ]
                )
            )
        if p.role != FRONTEND:
            continue
        osi, inside = _frontend_os(lg)
        if len(osi):
            cols = [np.full(len(osi), k), fit.apply(osi.t0_s), fit.apply(osi.t1_s)]
            os_rows.append(np.column_stack([*cols, osi.runqueue_s, osi.offcpu_s, inside]))
        # client-boundary emissions: the request's merged index
        ridx = ident.index[k - 1]
        em = lg.emissions
        if len(em):
            t_sent = fit.apply(em.t_s)
            ready = _ready_times(lg, em.t_s)
            rows = np.column_stack(
                [ridx[em.request], t_sent, fit.apply(ready), em.num_tokens, np.full(len(em), k)]
            )
            ce_rows.append(rows[rows[:, 0] >= 0])  # another engine core's requests: not here
        # deliveries: outputs built in a core step, received here
        f_t, f_v = _counter(lg, RECV)
        ci, fi = _match_sorted(core_index.out_v, f_v)
        if len(ci):
            st = core.log.steps
            c_t = core_index.out_t[ci]
            step = np.searchsorted(st.t_start_s, c_t, side="right") - 1
            dl_rows.append(np.column_stack([step, c_t, fit.apply(f_t[fi]), np.full(len(ci), k)]))
    log = core.log
    requests = ident.requests
    segments = log.segments
    tp = tp_waits(core, others, fits)
    tp_report: dict[str, Any] = {}
    if tp:
        segments, tp_report = carve_tp_waits(log, tp, label_id)
    meta = dict(log.meta)
    if tp_report:
        meta["tensor_parallel"] = tp_report
    missing = missing_processes(core, others)
    if missing:
        meta["missing_processes"] = missing
    meta["process"] = {k: v for k, v in core.identity.items()}
    meta["processes"] = processes
    meta["clock_pairs"] = clock_pairs(core, others, fits)
    meta["merged_from"] = os.path.abspath(path) if path != "<memory>" else path
    meta["interrupted"] = any(p.recovered for p in procs)
    warnings = list(log.warnings)
    if renamed:
        warnings.append(
            f"{renamed} request name(s) were taken by another request (two engine ids with one "
            "client name, or a name that reads like an engine id): the later ones get ~2, ~3, ..."
        )
    for p in procs:
        if p.recovered:
            warnings.append(
                f"{os.path.basename(p.path)}: recovered from parts (the process was killed); "
                "rows after its last flush are lost"
            )
    for p, fit in zip(others, fits, strict=True):
        if fit.violations:
            warnings.append(
                f"{os.path.basename(p.path)}: {fit.violations} of {fit.pairs} paired stamps "
                f"violate causality with the clock used ({fit.method})"
            )
    warnings += [missing_line(m) for m in missing]
    meta["warnings"] = warnings
    merged = replace(
        log,
        coverage=merged_coverage(core, others, fits),
        requests=requests,
        segments=segments,
        request_ids=tuple(req_ids),
        labels=tuple(labels),
        proc_segments=ProcSegments.from_columns(**_cols(seg_rows, ProcSegments)),
        client_emissions=ClientEmissions.from_columns(**_cols(ce_rows, ClientEmissions)),
        deliveries=Deliveries.from_columns(**_cols(dl_rows, Deliveries)),
        proc_os=ProcOs.from_columns(**_cols(os_rows, ProcOs)),
        meta=meta,
        path=path,
        warnings=tuple(warnings),
    )
    # what the processes' logs say together must make a valid log (a tick far from the
    # others, ids that collide): refused here, never written or analysed
    return validate_log(merged)


def merged_coverage(core: ProcessLog, others: list[ProcessLog], fits: list[ClockFit]) -> Coverage:
    """Each process's span on the run's clock (the `coverage` row of its own log moved by
    its clock fit), indexed as ``meta["processes"]`` (the engine core first). A process
    whose log has no coverage (written before schema v4) has no row: its span is unknown."""
    rows: list[tuple[int, float, float, int]] = []
    for k, (p, fit) in enumerate(zip([core, *others], [None, *fits], strict=True)):
        cov = p.log.coverage
        if not len(cov):
            continue
        a, b = float(cov.t_start_s[0]), float(cov.t_end_s[0])
        if fit is not None:
            a, b = (float(x) for x in fit.apply(np.array([a, b])))
        rows.append((k, a, b, int(cov.is_clean_stop[0])))
    return Coverage.from_columns(
        process=[r[0] for r in rows],
        t_start_s=[r[1] for r in rows],
        t_end_s=[r[2] for r in rows],
        is_clean_stop=[r[3] for r in rows],
    )


def missing_line(m: dict[str, Any]) -> str:
    """One missing process in words (a warning of the merged run)."""
    rank = f" (tp_rank {m['tp_rank']})" if "tp_rank" in m else ""
    return (
        f"{m.get('role', '?')}{rank} missing, not assumed idle: {m.get('why', '?')} "
        f"(named by {m.get('named_by', '?')})"
    )


def missing_processes(core: ProcessLog, others: list[ProcessLog]) -> list[dict[str, Any]]:
    """Processes the run's logs name but that left no log at all: each with its role, what
    names it and why it is believed missing. Checked: the API server (an engine core that
    added requests got them from one), and the tensor-parallel ranks of the engine core's
    workers (its ``config.process.tp_size``, else the ranks its workers name)."""
    out: list[dict[str, Any]] = []
    name = f"{CORE}-{core.identity.get('pid', '?')}"
    _, added = _counter(core.log, ADDED)
    if len(added) and not any(p.role == FRONTEND for p in others):
        out.append({
            "role": FRONTEND,
            "named_by": name,
            "why": f"the engine core added {len(added)} request(s) (counter {ADDED}), which "
            "reach it only through an API server, and no api_server log is in the directory",
        })  # fmt: skip
    workers = [p for p in others if p.role == WORKER]
    have = {r for p in workers if (r := tp_rank(p)) is not None}
    size = core.identity.get("tp_size")
    if isinstance(size, int) and not isinstance(size, bool) and 0 < size <= 4096:
        want, by = set(range(size)), f"{name} (config.process.tp_size = {size})"
    else:
        want, by = set(range(max(have) + 1)) if have else set(), "the other ranks' workers"
    for r in sorted(want - have):
        out.append({
            "role": WORKER,
            "tp_rank": r,
            "named_by": by,
            "why": f"no worker log with tp_rank {r}"
            + (": its waits at collectives are not charged to it (the engine core's "
               "forward windows keep their labels)" if len(want) > 1 else ""),
        })  # fmt: skip
    return out


def _unique_names(names: list[str]) -> tuple[list[str], int]:
    """`names` with each repeat renamed ``NAME~2``, ``NAME~3``, ... (never a name already
    used), and how many were renamed."""
    taken = set(names)
    seen: set[str] = set()
    out, renamed = [], 0
    for nm in names:
        if nm in seen:
            k = 1
            new = nm
            while new in taken:
                k += 1
                new = f"{nm}~{k}"
            taken.add(new)
            renamed += 1
            nm = new
        seen.add(nm)
        out.append(nm)
    return out, renamed


#: What a tensor-parallel rank did while the others waited for it at a collective, first
#: match wins: its GC, a stall injected by a test, its own segments (by recorded label),
#: and ``other`` where it recorded nothing.
RANK_PRECEDENCE = ("gc", "injected", "prefill", "prepare", "forward", "sample", "draft")


def _frontend_os(lg: RawLog) -> tuple[OsIntervals, np.ndarray]:
    """An API server's OS intervals, of the thread that recorded most of its segments (its
    event loop's), on its own clock, and which lie inside its segments
    (`side_thread_intervals`): ``proc_os``."""
    th = lg.segments.thread
    return side_thread_intervals(lg, int(np.bincount(th).argmax()) if len(th) else -1)


def tp_rank(p: ProcessLog) -> int | None:
    r = p.identity.get("tp_rank")
    return int(r) if isinstance(r, int) and not isinstance(r, bool) else None


def tp_waits(
    core: ProcessLog, others: list[ProcessLog], fits: list[ClockFit]
) -> list[tuple[int, float, float, str]]:
    """A tensor-parallel step's wait on its slowest rank, as (rank, start, end, cause) on
    the run's clock. At each collective (the n-th ``collective`` window of every rank is
    one call) the ranks that entered first wait from the first entry until the last rank
    enters: the last rank was late by that much. Its lateness goes first to the stalls it
    had since it last left a collective within the same forward call (`STALLS`: its GC
    pauses, a test's injected stall; at most their length, in that order), the rest to
    what it was doing during the wait (its recorded segments by `RANK_PRECEDENCE`, else
    ``other``), less the shares of it the rank's own OS counters give to ``os_runqueue``
    and ``os_blocked`` (`_RankOs`). The pieces are laid out in that order from the first
    entry. Ranks that recorded no collective (one worker, no tensor parallelism):
    nothing."""
    ranks: dict[int, tuple[ProcessLog, ClockFit]] = {}
    for p, fit in zip(others, fits, strict=True):
        r = tp_rank(p)
        if p.role == WORKER and r is not None and r not in ranks:
            ranks[r] = (p, fit)
    if len(ranks) < 2:
        return []
    calls: dict[int, np.ndarray] = {}
    for r, (p, fit) in ranks.items():
        w = _windows(p.log, ("collective",), steps_only=False)
        w = np.column_stack([fit.apply(w[:, 0]), fit.apply(w[:, 1])]) if len(w) else w
        calls[r] = w[np.argsort(w[:, 0], kind="stable")] if len(w) else np.zeros((0, 2))
    os_shares = {r: _RankOs.of(p, fit, calls[r]) for r, (p, fit) in ranks.items()}
    n = min(len(c) for c in calls.values())
    if n == 0:
        return []
    order = sorted(ranks)
    mat = np.stack([calls[r][:n, 0] for r in order])  # (ranks, collectives): entries
    first, last_i, last = mat.min(axis=0), mat.argmax(axis=0), mat.max(axis=0)
    out: list[tuple[int, float, float, str]] = []
    timelines = {r: _rank_timeline(*ranks[r]) for r in order}
    starts = {r: [w[0] for w in tl] for r, tl in timelines.items()}
    longest = {r: max((w[1] - w[0] for w in tl), default=0.0) for r, tl in timelines.items()}
    calls_started = {r: [w[0] for w in tl if w[3] == "prepare" or w[3] == "forward"]
                     for r, tl in timelines.items()}  # fmt: skip
    for c in np.flatnonzero(last > first).tolist():
        r = order[int(last_i[c])]
        lo, hi = float(first[c]), float(last[c])
        # since the rank last left a collective, within the forward call it is in
        prev = float(calls[r][c - 1, 1]) if c > 0 else -np.inf
        k = bisect.bisect_right(calls_started[r], hi) - 1
        since = max(prev, calls_started[r][k] if k >= 0 else -np.inf)
        since = min(since, lo)

        def near(a: float, b: float, r: int = r) -> list[tuple[float, float, int, str]]:
            # only the windows that can overlap [a, b]: linear in the run's collectives
            i0 = bisect.bisect_left(starts[r], a - longest[r])
            i1 = bisect.bisect_left(starts[r], b)
            return timelines[r][i0:i1]

        stall: dict[str, float] = {}
        for a, b, cause in _owned(near(since, hi), since, hi):
            if cause in STALLS:
                stall[cause] = stall.get(cause, 0.0) + (b - a)
        left, t = hi - lo, lo
        for cause in STALLS:
            take = min(stall.get(cause, 0.0), left)
            if take > 0:
                out.append((r, t, t + take, cause))
                t, left = t + take, left - take
        if left > 0:  # the rest: what it was doing meanwhile, in proportion
            rest = [x for x in _owned(near(lo, hi), lo, hi) if x[2] not in STALLS]
            rest = rest or [(lo, hi, "other")]
            # what the OS took of each piece, from the rank's own counters
            pieces = [x for a, b, cause in rest for x in os_shares[r].split(a, b, cause)]
            total = sum(d for d, _ in pieces)
            for d, cause in pieces if total > 0 else [(1.0, "other")]:
                d = left * d / total if total > 0 else left
                out.append((r, t, t + d, cause))
                t += d
    return out


@dataclass(frozen=True)
class _RankOs:
    """A tensor-parallel rank's OS intervals on the run's clock (the samples of the thread
    that entered its collectives) and, per interval, the shares of its time outside its
    waits that the OS took: run-queue wait and other off-CPU time (docs/partition.md, OS
    rules 1-2, with the rank's collectives and stalls as its explicit waits)."""

    t0: np.ndarray
    t1: np.ndarray
    runqueue: np.ndarray  # fraction of each interval's time outside its waits
    blocked: np.ndarray

    @classmethod
    def of(cls, p: ProcessLog, fit: ClockFit, calls: np.ndarray) -> _RankOs:
        lg = p.log
        col = lg.labels.index("collective") if "collective" in lg.labels else -1
        threads = lg.segments.thread[lg.segments.label == col]
        z = np.zeros(0)
        if not len(threads) or not len(lg.os_samples):
            return cls(z, z, z, z)
        osi = thread_os_intervals(lg, int(np.bincount(threads).argmax()))
        if not len(osi):
            return cls(z, z, z, z)
        t0, t1 = fit.apply(osi.t0_s), fit.apply(osi.t1_s)
        # the rank's waits: its collectives and its stalls (GC, an injected stall)
        gc = lg.gc_pauses
        waits = [calls, np.column_stack([fit.apply(gc.t_start_s), fit.apply(gc.t_end_s)])]
        for name in (x for x in STALLS if x != "gc"):  # recorded as segments
            w = _windows(lg, (name,), steps_only=False)
            if len(w):
                waits.append(np.column_stack([fit.apply(w[:, 0]), fit.apply(w[:, 1])]))
        w_in = _covered(np.concatenate(waits), t0, t1)
        free = t1 - t0 - w_in
        with np.errstate(divide="ignore", invalid="ignore"):
            rq = np.where(free > 0, np.minimum(osi.runqueue_s, free) / free, 0.0)
            bl = np.where(free > 0, np.maximum(osi.offcpu_s - w_in, 0.0) / free, 0.0)
        return cls(t0, t1, rq, np.minimum(bl, 1.0 - rq))

    def split(self, a: float, b: float, cause: str) -> list[tuple[float, str]]:
        """[a, b], owned by `cause`, as (length, cause) pieces: what each OS interval over
        it says the OS took (``os_runqueue``, ``os_blocked``), the rest `cause`'s."""
        own, rq, bl = b - a, 0.0, 0.0
        i0 = int(np.searchsorted(self.t1, a, side="right"))
        for i in range(i0, len(self.t0)):
            if self.t0[i] >= b:
                break
            d = min(b, float(self.t1[i])) - max(a, float(self.t0[i]))
            if d > 0:
                rq += d * float(self.runqueue[i])
                bl += d * float(self.blocked[i])
        own -= rq + bl
        return [(x, c) for x, c in ((own, cause), (rq, "os_runqueue"), (bl, "os_blocked"))
                if x > 0]  # fmt: skip


def _covered(windows: np.ndarray, t0: np.ndarray, t1: np.ndarray) -> np.ndarray:
    """Per interval [t0, t1], the time the union of `windows` (rows [start, end]) covers."""
    if not len(windows):
        return np.zeros(len(t0))
    w = windows[np.argsort(windows[:, 0], kind="stable")]
    # their union, as disjoint sorted spans
    starts, ends = [float(w[0, 0])], [float(w[0, 1])]
    for a, b in w[1:].tolist():
        if a <= ends[-1]:
            ends[-1] = max(ends[-1], b)
        else:
            starts.append(a)
            ends.append(b)
    s, e = np.array(starts), np.array(ends)
    cum = np.concatenate([[0.0], np.cumsum(e - s)])  # covered time before each span

    def before(t: np.ndarray) -> np.ndarray:
        k = np.searchsorted(s, t, side="right")  # spans starting at or before t
        j = np.maximum(k - 1, 0)  # the last of them
        return np.where(k > 0, cum[j] + np.clip(t - s[j], 0.0, e[j] - s[j]), 0.0)

    return before(t1) - before(t0)


#: A rank's stalls: what a rank had that the others did not (its lateness goes to them
#: first).
STALLS = ("gc", "injected")


def _rank_timeline(p: ProcessLog, fit: ClockFit) -> list[tuple[float, float, int, str]]:
    """One rank's windows on the run's clock as (start, end, precedence index), the
    precedence of `RANK_PRECEDENCE` (GC pauses first); labels not named there after them."""
    lg = p.log
    rows: list[tuple[float, float, int, str]] = []
    gc = lg.gc_pauses
    for a, b in zip(fit.apply(gc.t_start_s).tolist(), fit.apply(gc.t_end_s).tolist(), strict=True):
        rows.append((a, b, 0, "gc"))
    sg = lg.segments
    names = list(lg.labels)
    for lab, a, b in zip(sg.label.tolist(), fit.apply(sg.t_start_s).tolist(),
                         fit.apply(sg.t_end_s).tolist(), strict=True):  # fmt: skip
        name = names[lab] if 0 <= lab < len(names) else "?"
        if name == "collective":
            continue  # waiting itself is not what it was doing
        rank = RANK_PRECEDENCE.index(name) if name in RANK_PRECEDENCE else len(RANK_PRECEDENCE)
        rows.append((a, b, rank, name))
    rows.sort()
    return rows


def _owned(timeline: list[tuple[float, float, int, str]], lo: float, hi: float):
    """[lo, hi] cut where the timeline's windows start and end, each piece named by the
    first window (by precedence) covering it, else ``other``; adjacent equal pieces
    joined."""
    inside = [w for w in timeline if w[0] < hi and w[1] > lo]
    cuts = sorted({lo, hi, *(t for a, b, _, _ in inside for t in (a, b) if lo < t < hi)})
    pieces: list[tuple[float, float, str]] = []
    for a, b in zip(cuts[:-1], cuts[1:], strict=False):
        mid = (a + b) / 2
        owners = [(k, name) for s, e, k, name in inside if s <= mid < e]
        name = min(owners)[1] if owners else "other"
        if pieces and pieces[-1][2] == name and pieces[-1][1] == a:
            pieces[-1] = (pieces[-1][0], b, name)
        else:
            pieces.append((a, b, name))
    return pieces


#: Engine-core windows that a wait on a tensor-parallel rank is carved out of (the
#: engine core waited there for the workers' forward pass).
FORWARD_LABELS = ("prefill", "decode", "verify")


def tp_label(rank: int, cause: str) -> str:
    """The partition label of time a step waited on tensor-parallel rank `rank`'s `cause`."""
    return f"rank{rank}:{cause}"


def carve_tp_waits(log: RawLog, waits, label_id) -> tuple[Any, dict[str, Any]]:
    """The engine core's segments with each wait on a rank (`tp_waits`) carved out of the
    step's forward windows it lies in and recorded as its own segment ``rankR:CAUSE`` of
    that step: exclusive (the forward windows are split around it), and only where the
    engine core waited (outside a forward window, a wait did not hold the step)."""
    from tracekit.log.rawlog import Segments

    sg = log.segments
    fwd_ids = {log.labels.index(x) for x in FORWARD_LABELS if x in log.labels}
    cols = {k: v.tolist() for k, v in sg.columns().items()}
    fwd = [i for i, lab in enumerate(cols["label"]) if lab in fwd_ids and cols["step"][i] >= 0]
    fwd.sort(key=lambda i: cols["t_start_s"][i])
    starts = np.array([cols["t_start_s"][i] for i in fwd])
    # per forward window, the wait pieces inside it
    cut: dict[int, list[tuple[float, float, str]]] = {}
    per_rank: dict[str, float] = {}
    for r, a, b, cause in waits:
        j = int(np.searchsorted(starts, a, side="right")) - 1
        # a piece may span adjacent forward windows (prefill then decode of one step)
        while 0 <= j < len(fwd):
            i = fwd[j]
            s0, s1 = cols["t_start_s"][i], cols["t_end_s"][i]
            if s0 >= b:
                break
            lo, hi = max(a, s0), min(b, s1)
            if hi > lo:
                cut.setdefault(i, []).append((lo, hi, tp_label(r, cause)))
                per_rank[tp_label(r, cause)] = per_rank.get(tp_label(r, cause), 0.0) + hi - lo
            j += 1
    out: dict[str, list[Any]] = {k: [] for k in cols}
    for i in range(len(sg)):
        pieces = cut.get(i)
        if not pieces:
            for col in cols:
                out[col].append(cols[col][i])
            continue
        pieces.sort()
        cur = cols["t_start_s"][i]
        for lo, hi, name in pieces:
            lo = max(lo, cur)
            if hi <= lo:
                continue
            if lo > cur:
                _append(out, cols, i, cur, lo, cols["label"][i])
            _append(out, cols, i, lo, hi, label_id(name))
            cur = hi
        if cols["t_end_s"][i] > cur:
            _append(out, cols, i, cur, cols["t_end_s"][i], cols["label"][i])
    report = {
        "ranks": sorted({int(r) for r, *_ in waits}),
        "waits": len(waits),
        "charged_s": dict(sorted(per_rank.items())),
    }
    return Segments.from_columns(**out), report


def _append(out: dict[str, list[Any]], cols: dict[str, list[Any]], i: int, a: float,
            b: float, label: int) -> None:  # fmt: skip
    for col in cols:
        out[col].append(cols[col][i])
    out["label"][-1], out["t_start_s"][-1], out["t_end_s"][-1] = label, a, b


@dataclass(frozen=True)
class RequestJoin:
    """The run's requests: the engine core's, each named as its client knew it, with its
    stages on the run's clock; `index[k]` maps the (k+1)-th other process's request rows
    to the run's (an API server's only; -1 elsewhere)."""

    names: list[str]
    requests: Requests
    index: list[np.ndarray]
    renamed: int = 0  # requests whose client id another request had: named ~2, ~3, ...


def join_requests(
    core: ProcessLog,
    others: list[ProcessLog],
    fits: list[ClockFit],
    elsewhere: set[str] | frozenset[str] = frozenset(),
) -> RequestJoin:
    """One request identity over every API server (see the module docstring).

    Each API server records a request as ``CLIENT<US>ENGINE``; the engine id is unique in
    the run (vLLM adds a random suffix), the client id need not be (a client may send one
    ``X-Request-Id`` twice). Requests are joined by engine id; the run names each by its
    client id, and a client id used by several requests gets ``~2``, ``~3``, ... on the
    later ones, in order of arrival. Arrival is the API server's (the first byte of the
    HTTP request), with `handler_s` (its handler ran, counter ``serve.handler``) and
    `engine_s` (the engine core added it, counter ``serve.added``)."""
    core_ids = list(core.log.request_ids)
    core_index = {r: i for i, r in enumerate(core_ids)}
    rq = core.log.requests
    n_core = len(core_ids)
    arrival = rq.arrival_s.astype(np.float64).copy()
    handler = np.full(n_core, np.nan)
    engine = np.full(n_core, np.nan)
    a_t, a_v = _counter(core.log, ADDED)
    ok = (a_v >= 0) & (a_v < n_core)
    engine[a_v[ok].astype(np.int64)] = a_t[ok]
    client = list(core_ids)
    extra: list[tuple[str, float, float]] = []  # requests the engine core never recorded
    index: list[np.ndarray] = []
    known = np.zeros(n_core, dtype=bool)
    for p, fit in zip(others, fits, strict=True):
        lg = p.log
        ridx = np.full(len(lg.request_ids), -1, dtype=np.int64)
        index.append(ridx)
        if p.role != FRONTEND:
            continue
        h_t, h_v = _counter(lg, HANDLER)
        h_of = {int(v): float(t) for t, v in zip(fit.apply(h_t), h_v, strict=True)}
        arr = fit.apply(lg.requests.arrival_s) if len(lg.requests) else np.zeros(0)
        for i, name in enumerate(lg.request_ids):
            cl, sep, engine_id = name.partition(FRONT_SEP)
            a = float(arr[i]) if i < len(arr) else float("nan")
            h = h_of.get(i, float("nan"))
            j = core_index.get(engine_id) if sep else None
            if j is None and engine_id in elsewhere:
                continue  # another engine core served it: not this run's (index -1)
            if j is None:
                ridx[i] = n_core + len(extra)
                extra.append((cl, a, h))
                continue
            ridx[i] = j
            client[j] = cl
            known[j] = True
            if np.isfinite(a):
                arrival[j] = a
            handler[j] = h
    n = n_core + len(extra)
    if extra:
        client += [e[0] for e in extra]
        arrival = np.concatenate([arrival, [e[1] for e in extra]])
        handler = np.concatenate([handler, [e[2] for e in extra]])
        engine = np.concatenate([engine, np.full(len(extra), np.nan)])
    # a stage before the HTTP arrival means the handler or core stamp belongs elsewhere:
    # keep only what follows arrival
    handler[~(handler >= arrival)] = np.nan
    fe = np.concatenate([known, np.ones(len(extra), dtype=bool)])
    engine[~fe | ~(engine >= arrival)] = np.nan
    names = distinct_names(client, arrival)
    pad = len(extra)
    requests = Requests(
        arrival_s=arrival,
        prompt_tokens=np.concatenate([rq.prompt_tokens, np.full(pad, -1)]),
        max_new_tokens=np.concatenate([rq.max_new_tokens, np.full(pad, -1)]),
        first_token_s=np.concatenate([rq.first_token_s, np.full(pad, np.nan)]),
        handler_s=handler,
        engine_s=engine,
    )
    assert len(names) == n
    renamed = sum(1 for a, b in zip(names, client, strict=True) if a != b)
    return RequestJoin(names, requests, index, renamed)


#: Joins a repeated client id to the number of its use (``cmpl-x-0~2``: the second).
REPEAT_SEP = "~"


def distinct_names(names: list[str], arrival: np.ndarray) -> list[str]:
    """`names` with every repeat but the earliest arrival's suffixed ``~K`` (K >= 2)."""
    out = list(names)
    groups: dict[str, list[int]] = {}
    for i, nm in enumerate(names):
        groups.setdefault(nm, []).append(i)
    taken = set(names)
    for nm, rows in groups.items():
        if len(rows) < 2:
            continue
        key = np.nan_to_num(arrival[rows], nan=np.inf)
        order = [rows[j] for j in np.argsort(key, kind="stable")]
        k = 2
        for i in order[1:]:
            while f"{nm}{REPEAT_SEP}{k}" in taken:
                k += 1
            out[i] = f"{nm}{REPEAT_SEP}{k}"
            taken.add(out[i])
            k += 1
    return out


def clock_pairs(core: ProcessLog, others: list[ProcessLog], fits: list[ClockFit]) -> list:
    """Each other process against the engine core: how far its clock is from the core's at
    the run's start (``t_core = t_other + offset_s``, seconds since each recorder started)
    and the uncertainty. One entry a process (the merge stays linear in processes): the
    offset between two other processes is the difference of theirs, its uncertainty the
    sum."""

    def name(p: ProcessLog) -> str:
        return f"{p.role}-{p.identity.get('pid', '?')}"

    return [
        {"a": name(core), "b": name(p), "offset_s": f.offset_s + f.correction_s,
         "drift_ppm": f.drift * 1e6, "uncertainty_s": f.uncertainty_s, "method": f.method}
        for p, f in zip(others, fits, strict=True)
    ]  # fmt: skip


def _ready_times(lg: RawLog, t_sent: np.ndarray) -> np.ndarray:
    """When each chunk was ready: the start of the ``sse_write`` window that ends at its
    write (recorded together); the write itself where there is none."""
    ready = np.asarray(t_sent, dtype=np.float64).copy()
    if "sse_write" not in lg.labels:
        return ready
    m = lg.segments.label == lg.labels.index("sse_write")
    ends, starts = lg.segments.t_end_s[m], lg.segments.t_start_s[m]
    order = np.argsort(ends, kind="stable")
    ends, starts = ends[order], starts[order]
    k = np.searchsorted(ends, t_sent)
    ok = k < len(ends)
    hit = ok.copy()
    hit[ok] = ends[k[ok]] == t_sent[ok]
    ready[hit] = starts[k[hit]]
    return ready


def _cols(rows: list[np.ndarray], cls: Any) -> dict[str, np.ndarray]:
    names = list(cls.DTYPES)
    if not rows:
        return {k: np.zeros(0) for k in names}
    a = np.concatenate(rows)
    return {k: a[:, i] for i, k in enumerate(names)}


def _fit(core: ProcessLog, p: ProcessLog, index: CoreIndex) -> ClockFit:
    offset_s = p.t0_s - core.t0_s
    shared = one_clock(core.identity, p.identity)
    if p.role == FRONTEND:
        bounds = frontend_bounds(core, p, offset_s, index)
    else:
        bounds = worker_bounds(core, p, offset_s, index)
    if not shared and not (len(bounds[1]) and len(bounds[3])):
        # nothing to estimate from: the start ticks are all there is; say so
        return ClockFit(offset_s, 0.0, 0.0, float("inf"), (-np.inf, np.inf), 0, 0,
                        "unknown: different clocks and no paired stamps")  # fmt: skip
    return fit_clock(*bounds, offset_s=offset_s, shared=shared)


def save_merged(
    directory: str, out: str, *, force: bool = False, engine: int | None = None, **limits: Any
) -> RawLog:
    """Merge `directory` into `out`. An existing `out` is refused unless `force` (it may be
    one of the directory's own logs, or a part of one); nothing is written unless the
    merged log is valid. `engine`: the data parallel rank whose run to merge."""
    if os.path.lexists(out) and not force:
        raise LogError(
            out, "output", "already exists (it may be one of the logs being merged); write "
            "elsewhere with -o NEW.npz, or pass --force to replace it",
        )  # fmt: skip
    if _inside_parts(directory, out):
        raise LogError(
            out, "output", f"is inside a parts folder of {directory}: the next read of that "
            "folder would take it for a part; write it elsewhere",
        )  # fmt: skip
    log = merge_dir(directory, engine=engine, **limits)
    log.save(out)
    return log.with_path(out)


def _inside_parts(directory: str, out: str) -> bool:
    """`out` would land inside one of `directory`'s parts folders."""
    d = os.path.realpath(directory)
    parent = os.path.realpath(os.path.dirname(os.path.abspath(out)))
    if not parent.startswith(d + os.sep):
        return False
    return any(x.endswith(PARTS_SUFFIX) for x in os.path.relpath(parent, d).split(os.sep))
