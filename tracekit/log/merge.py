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
the run's clock), `deliveries` (each step's outputs, built and received),
``meta["processes"]`` (per process: identity, file, recovered or not, and the clock
offset, correction and uncertainty against the engine core) and ``meta["clock_pairs"]``
(each process against the engine core: one entry a process, so the merge and its output
stay linear in processes; two others' offset is the difference of theirs).

The merged log is validated before it is returned: a merge never writes (and `analyze
DIR` never analyses) a log that `tracekit check` would reject.
"""

from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tracekit.errors import LogError
from tracekit.log.archive import describe_non_regular
from tracekit.log.parts import PARTS_SUFFIX, merge_parts
from tracekit.log.rawlog import ClientEmissions, Deliveries, ProcSegments, RawLog, Requests
from tracekit.log.reader import load
from tracekit.log.validate import validate_log

FRONT_SEP = "\x1f"
SENT, ADDED, OUT, RECV = "serve.sent", "serve.added", "serve.out", "serve.recv"
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


def merge_dir(directory: str, **limits: Any) -> RawLog:
    """The run recorded in `directory` (see the module docstring), validated. `limits`:
    `load`'s bounds on reading each process log."""
    return merge_logs(process_logs(directory, **limits), path=directory)


def merge_logs(procs: list[ProcessLog], *, path: str = "<memory>") -> RawLog:
    cores = [p for p in procs if p.role == CORE]
    if len(cores) != 1:
        raise LogError(
            path,
            "engine_core",
            f"found {len(cores)} engine core logs; the merge needs exactly one "
            "(one engine core per server; data parallel runs are not merged)",
        )
    core = cores[0]
    others = [p for p in procs if p is not core]
    core_index = CoreIndex.of(core)
    fits = [_fit(core, p, core_index) for p in others]
    # one request identity: the client's name for every engine id the API server knew
    client_of: dict[str, str] = {}
    for p in others:
        if p.role == FRONTEND:
            for name in p.log.request_ids:
                client, sep, engine_id = name.partition(FRONT_SEP)
                if sep:
                    client_of[engine_id] = client
    engine_pos = {r: i for i, r in enumerate(core.log.request_ids)}
    req_ids, renamed = _unique_names([client_of.get(r, r) for r in core.log.request_ids])
    taken = set(req_ids)
    by_client: dict[str, int] = {}  # a client name (not an engine id) -> its merged index
    for i, r in enumerate(core.log.request_ids):
        by_client.setdefault(client_of.get(r, r), i)
    labels = list(core.log.labels)
    label_pos = {x: i for i, x in enumerate(labels)}

    def label_id(name: str) -> int:
        if name not in label_pos:
            label_pos[name] = len(labels)
            labels.append(name)
        return label_pos[name]

    extra_req: list[str] = []
    seg_rows: list[np.ndarray] = []
    ce_rows: list[np.ndarray] = []
    dl_rows: list[np.ndarray] = []
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
        # client-boundary emissions: the request's merged index (through its engine id when
        # the engine core knew it, else by its client name; a new name gets a new row)
        ridx = np.empty(len(lg.request_ids), dtype=np.int64)
        for i, full in enumerate(lg.request_ids):
            nm, sep, engine_id = full.partition(FRONT_SEP)
            j = engine_pos.get(engine_id) if sep else None
            if j is None:
                j = by_client.get(nm)
            if j is None:
                j = by_client[nm] = len(req_ids) + len(extra_req)
                new, k = nm, 1
                while new in taken:  # an engine id that happens to read like this name
                    k += 1
                    new = f"{nm}~{k}"
                    renamed += 1
                taken.add(new)
                extra_req.append(new)
            ridx[i] = j
        em = lg.emissions
        if len(em):
            t_sent = fit.apply(em.t_s)
            ready = _ready_times(lg, em.t_s)
            ce_rows.append(
                np.column_stack(
                    [ridx[em.request], t_sent, fit.apply(ready), em.num_tokens, np.full(len(em), k)]
                )
            )
        # deliveries: outputs built in a core step, received here
        f_t, f_v = _counter(lg, RECV)
        ci, fi = _match_sorted(core_index.out_v, f_v)
        if len(ci):
            st = core.log.steps
            c_t = core_index.out_t[ci]
            step = np.searchsorted(st.t_start_s, c_t, side="right") - 1
            dl_rows.append(np.column_stack([step, c_t, fit.apply(f_t[fi]), np.full(len(ci), k)]))
    log = core.log
    requests = log.requests
    if extra_req:
        n = len(extra_req)
        requests = Requests(
            arrival_s=np.concatenate([requests.arrival_s, np.full(n, np.nan)]),
            prompt_tokens=np.concatenate([requests.prompt_tokens, np.full(n, -1)]),
            max_new_tokens=np.concatenate([requests.max_new_tokens, np.full(n, -1)]),
            first_token_s=np.concatenate([requests.first_token_s, np.full(n, np.nan)]),
        )
    meta = dict(log.meta)
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
    meta["warnings"] = warnings
    merged = replace(
        log,
        requests=requests,
        request_ids=tuple(req_ids + extra_req),
        labels=tuple(labels),
        proc_segments=ProcSegments.from_columns(**_cols(seg_rows, ProcSegments)),
        client_emissions=ClientEmissions.from_columns(**_cols(ce_rows, ClientEmissions)),
        deliveries=Deliveries.from_columns(**_cols(dl_rows, Deliveries)),
        meta=meta,
        path=path,
        warnings=tuple(warnings),
    )
    # what the processes' logs say together must make a valid log (a tick far from the
    # others, ids that collide): refused here, never written or analysed
    return validate_log(merged)


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


def save_merged(directory: str, out: str, *, force: bool = False, **limits: Any) -> RawLog:
    """Merge `directory` into `out`. An existing `out` is refused unless `force` (it may be
    one of the directory's own logs, or a part of one); nothing is written unless the
    merged log is valid."""
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
    log = merge_dir(directory, **limits)
    log.save(out)
    return log.with_path(out)


def _inside_parts(directory: str, out: str) -> bool:
    """`out` would land inside one of `directory`'s parts folders."""
    d = os.path.realpath(directory)
    parent = os.path.realpath(os.path.dirname(os.path.abspath(out)))
    if not parent.startswith(d + os.sep):
        return False
    return any(x.endswith(PARTS_SUFFIX) for x in os.path.relpath(parent, d).split(os.sep))
