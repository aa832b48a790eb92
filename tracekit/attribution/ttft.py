"""The exclusive partition of every request's time to first token by cause (docs/ttft.md).

A request's TTFT window is ``[arrival, first token]`` (`Requests.arrival_s`,
`Requests.first_token_s`). Its *phases*, from recorded events only:

- ``evicted``: eviction to readmission (`Evictions`) inside the window;
- ``queued``: arrival to its admission (`Admissions`: the first time the scheduler took it),
  less evicted time;
- ``prefilling``: admission to the first token, less evicted time;
- ``unsplit``: a request with no admission row (version-1 and published logs, engines that
  do not call `Recorder.admit`): the window less evicted time, phases unknown.

Every millisecond of the window goes to exactly one label. Precedence, highest first
(docs/ttft.md numbers these rules; this is the one place the code applies them):

0. in a server run, before the engine core had the request: from arrival (the first byte
   of the HTTP request) to the server's handler starting is ``http``, from there to the
   engine core adding it is ``frontend`` (`Requests.handler_s`, `Requests.engine_s`; a
   stage not recorded lasts 0), less what the OS took of the event loop of the API server
   that served it (``proc_os``: ``frontend_os_runqueue``, ``frontend_os_blocked``, the
   client boundary's rule). The rules below apply from the engine core's add on. This
   time counts in the ``queued`` phase (the request was not admitted yet);
1. evicted time is ``preempt``; what the engine ran meanwhile is *context*, never added
   (partitioned like live time, uncovered time as ``residual``, so it sums to the evicted
   time, as in the ITL partition);
2. GC pauses (their union) are ``gc``;
3. queued time inside a step window where the scheduler stated why it did not admit the
   request (`Waits`) is ``wait_<reason>``; what the engine ran meanwhile is context. A
   wait row of step s covers ``[start of s, start of the next step)`` (the time until the
   scheduler decides again; the last step: its end);
4. the rest goes to the host segments' causes, with ITL's precedence
   (`tracekit.labels.precedence`) where they overlap: ``decode`` is others' decoding,
   split into ``graph`` (the ITL rule 4 excess of an eager step) and ``decode_other``;
   ``prefill`` time splits into ``prefill_own`` and ``prefill_other``: in the prefilling
   phase, a step's prefill time inside the window times the request's share of the
   step's prefill tokens (`PrefillChunks`) is its own (at most all of the phase's prefill
   time); all other prefill time is others'. Unsplit requests keep ``prefill``;
5. whatever no segment or pause covers is ``residual``;
6. where the log has OS intervals (the loop thread's, another thread's), each instant's
   ``os_runqueue`` and ``os_blocked`` shares (the ITL partition's,
   `tracekit.attribution.timeline.os_shares`) are taken from whichever of rules 2, 4 and
   5 owns it; evicted (1), held (3) and pre-engine (0) time give none; prefill splits
   into own and other after its share.

Device windows (CUDA events) are not charged: TTFT uses the host rules only, as a gap with
an eviction does. The primary cause of a TTFT is its largest part other than
``prefill_own`` and ``residual``, if it is >= 1 ms and >= 25% of the TTFT.

`ttft_partition` is vectorised (cumulative sums over the elementary timeline of
`tracekit.attribution.timeline`, the ITL partition's); `ttft_partition_reference`
(`tracekit.attribution.reference`) computes the same with plain loops, one request and one
elementary interval at a time. Tests check that they agree.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import numpy as np

from tracekit.attribution import itl
from tracekit.attribution.client import (
    FRONTEND_OS_LABELS,
    frontend_os_between,
    request_api_servers,
)
from tracekit.attribution.itl import RECONCILE_TOL_MS, evicted_windows, has_reprefill
from tracekit.attribution.reprefill import cuts_of, own_shares, reprefills
from tracekit.attribution.timeline import (
    PreparedRun,
    Timeline,
    compensated_cumsum,
    has_os_evidence,
    os_class_integrals,
    prepared,
    segment_causes,
)
from tracekit.errors import ReconcileError
from tracekit.labels import OS_BLOCKED, OS_LABELS, OS_RUNQUEUE, RECOMPUTE_CLASS
from tracekit.log.rawlog import WAIT_REASONS, RawLog

#: The phases of a TTFT window, in display order (they sum to the TTFT).
PHASES: tuple[str, ...] = ("queued", "prefilling", "evicted", "unsplit")
#: The label of queued time held for each stated reason (`Waits.reason` indexes it).
WAIT_REASON_LABELS: tuple[str, ...] = tuple(f"wait_{r}" for r in WAIT_REASONS)
#: The labels every TTFT partition reports, in display order, even when zero.
TTFT_STANDARD_LABELS: tuple[str, ...] = (
    "preempt",
    "gc",
    *WAIT_REASON_LABELS,
    "tok",
    "prefill_other",
    "decode_other",
    "graph",
    "prefill_own",
    "prefill",
    "residual",
)
#: A server run's parts before the engine had the request (rule 0, docs/ttft.md): ``http``
#: from the first byte of the HTTP request to its handler starting (reading and parsing the
#: request, waiting for the server's event loop), ``frontend`` from there to the engine core
#: adding it (tokenisation, input processing, the hop to the engine core).
PRE_ENGINE_LABELS: tuple[str, ...] = ("http", "frontend")
#: Parts that are not causes of a late first token: the request's own prefill, and time no
#: instrument covered.
TTFT_NON_CAUSES = frozenset({"prefill_own", "residual"})
CLEAN = -1


#: `TtftPartition`'s per-request columns: what `TtftPartition.take` selects rows of
_TTFT_COLUMNS = ("request", "arrival_s", "admit_s", "first_token_s", "ttft_ms", "parts_ms",
                 "context_ms", "phases_ms", "reprefill_own_ms", "reprefill_other_ms",
                 "primary")  # fmt: skip


@dataclass(frozen=True)
class TtftPartition:
    """Every TTFT of a run, partitioned. Rows are requests with an arrival and a first token,
    in request order."""

    labels: tuple[str, ...]  # columns of parts_ms / context_ms
    request: np.ndarray  # request index (into RawLog.requests)
    arrival_s: np.ndarray  # engine clock seconds
    admit_s: np.ndarray  # first admission; NaN: not recorded (the request is unsplit)
    first_token_s: np.ndarray
    ttft_ms: np.ndarray  # (first_token_s - arrival_s) * 1e3
    parts_ms: np.ndarray  # (requests, labels): exclusive, sums to ttft_ms
    context_ms: np.ndarray  # (requests, labels): what ran while evicted or held for a reason
    phases_ms: np.ndarray  # (requests, PHASES): sums to ttft_ms
    # re-prefill time (docs/ttft.md, rule 4): the request's own, inside `preempt`, and
    # others', inside `prefill_other` (`prefill` for a request without an admission)
    reprefill_own_ms: np.ndarray
    reprefill_other_ms: np.ndarray
    primary: np.ndarray  # index into `causes`, or CLEAN (-1)
    causes: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())  # what this log does not let the partition split

    def __len__(self) -> int:
        return len(self.ttft_ms)

    def take(self, rows: np.ndarray) -> TtftPartition:
        """The requests at `rows` (indices or a boolean mask), each partitioned as here."""
        return replace(self, **{f: getattr(self, f)[rows] for f in _TTFT_COLUMNS})

    @property
    def is_split(self) -> np.ndarray:
        return np.isfinite(self.admit_s)

    @property
    def reconcile_max_err_ms(self) -> float:
        if not len(self):
            return 0.0
        return float(
            max(
                np.abs(self.ttft_ms - self.parts_ms.sum(axis=1)).max(),
                np.abs(self.ttft_ms - self.phases_ms.sum(axis=1)).max(),
            )
        )

    def column(self, label: str) -> np.ndarray:
        return self.parts_ms[:, self.labels.index(label)]

    def phase(self, name: str) -> np.ndarray:
        return self.phases_ms[:, PHASES.index(name)]

    def primary_names(self) -> np.ndarray:
        names = np.array(list(self.causes) + ["clean"], dtype=object)
        return names[self.primary]


# -- shared pieces ------------------------------------------------------------------------


def ttft_labels(
    log: RawLog, has_os: bool | None = None, run: PreparedRun | None = None
) -> tuple[str, ...]:
    """The standard TTFT labels, then `OS_LABELS` where the log has OS intervals (`has_os`:
    whether it has, if known), then any other host cause of the log (sorted); a server
    run that stamped the stages before the engine had its requests starts with
    `PRE_ENGINE_LABELS`, then `FRONTEND_OS_LABELS` where it has the API servers' OS
    intervals. `run`: the log's `PreparedRun`, if prepared (its segment causes are used)."""
    seg_causes = segment_causes(log) if run is None else run.causes
    causes = set(seg_causes[log.segments.is_device != 1].tolist())
    extra = causes - {"gc", "preempt", "tok", "prefill", "decode", RECOMPUTE_CLASS}
    extra -= set(TTFT_STANDARD_LABELS)
    extra -= set(PRE_ENGINE_LABELS) | set(OS_LABELS)
    extra -= set(FRONTEND_OS_LABELS)
    rq = log.requests
    pre = PRE_ENGINE_LABELS if (np.isfinite(rq.handler_s) | np.isfinite(rq.engine_s)).any() else ()
    if pre and len(log.proc_os):
        pre += FRONTEND_OS_LABELS
    if has_os is None:
        has_os = has_os_evidence(log)
    os_labels = OS_LABELS if has_os else ()
    return pre + TTFT_STANDARD_LABELS + os_labels + tuple(sorted(extra))


def pre_engine_windows(
    log: RawLog, req: np.ndarray, a: np.ndarray, f: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """(handler, engine) per TTFT row: when the server's handler started and when the
    engine core added the request, each clipped into ``[previous stage, first token]``; a
    stage not recorded takes the previous stage's time (so it lasts 0)."""
    rq = log.requests
    h = rq.handler_s[req] if len(req) else np.zeros(0)
    e = rq.engine_s[req] if len(req) else np.zeros(0)
    h = np.clip(np.where(np.isfinite(h), h, a), a, f)
    e = np.clip(np.where(np.isfinite(e), e, h), h, f)
    return h, e


def ttft_windows(log: RawLog) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(request, arrival, admission or NaN, first token) of every request with a TTFT."""
    rq = log.requests
    a, f = rq.arrival_s, rq.first_token_s
    # a first token before arrival (rejected at load in a log with admissions): left out
    idx = np.flatnonzero(np.isfinite(a) & np.isfinite(f) & (f >= a))
    adm = np.full(len(rq), np.nan)
    ad = log.admissions
    if len(ad):
        # the first admission of each request (validation rejects a second one)
        o = np.lexsort((-ad.t_s, ad.request))  # per request latest first: the first wins
        adm[ad.request[o]] = ad.t_s[o]
    return idx, a[idx], adm[idx], f[idx]


def wait_windows(log: RawLog) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Each wait row as (request, start, end, reason): the stating step's start to the next
    step's start in time order (the last step: its end)."""
    st, wt = log.steps, log.waits
    z = np.zeros(0)
    if len(wt) == 0 or len(st) == 0:
        return z.astype(np.int64), z, z, z.astype(np.int64)
    o = np.lexsort((np.arange(len(st)), st.t_start_s))
    nxt_sorted = np.append(st.t_start_s[o][1:], np.nan)
    end = np.empty(len(st))
    end[o] = nxt_sorted
    last = np.isnan(end)
    end[last] = np.maximum(st.t_end_s[last], st.t_start_s[last])
    return wt.request.copy(), st.t_start_s[wt.step], end[wt.step], wt.reason.copy()


def prefill_shares(log: RawLog) -> np.ndarray:
    """Each prefill row's share of its step's prefill tokens (0 where the step has none)."""
    pf = log.prefill_chunks
    total = np.zeros(max(len(log.steps), 1))
    np.add.at(total, pf.step, pf.num_tokens.astype(np.float64))
    tot = total[pf.step] if len(pf) else np.zeros(0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(tot > 0, pf.num_tokens / np.where(tot > 0, tot, 1.0), 0.0)


def primary_of(parts_ms: np.ndarray, ttft_ms: np.ndarray, labels: tuple[str, ...]):
    """Primary cause per request: index into the returned causes, or CLEAN (the ITL rule,
    design.md, over the TTFT labels that are causes)."""
    return itl.primary_of(parts_ms, ttft_ms, labels, TTFT_NON_CAUSES)


def ttft_notes(log: RawLog, is_split: np.ndarray) -> tuple[str, ...]:
    rq = log.requests
    n_reversed = int((rq.first_token_s < rq.arrival_s).sum())
    out: tuple[str, ...] = ()
    if n_reversed:
        out = (
            f"{n_reversed} request(s) left out: first token before arrival (the engine "
            "recorded the arrival late)",
        )
    n_unsplit = int((~is_split).sum())
    if n_unsplit == 0:
        return out
    return (*out, unsplit_note(n_unsplit, len(log.admissions) > 0))


#: What every note on unsplit requests says (`unsplit_note`).
UNSPLIT_WORDS = "request(s) unsplit: "


def unsplit_note(n_unsplit: int, has_admissions: bool) -> str:
    """The note on the `n_unsplit` requests without an admission row, saying why (the log
    has admissions, or none at all)."""
    why = (
        "no admission event was recorded for them"
        if has_admissions
        else "the log has no admission events (a version-1 or published-layout log, or an "
        "engine that does not call Recorder.admit)"
    )
    return (
        f"{n_unsplit} {UNSPLIT_WORDS}{why}; their queued and prefilling phases, wait "
        "reasons and own/other prefill cannot be told apart (phase 'unsplit', label 'prefill')"
    )


def check_ttft_reconciled(p: TtftPartition, path: str = "") -> TtftPartition:
    """Raise `ReconcileError` if any request's parts or phases do not sum to its TTFT."""
    if len(p) == 0:
        return p
    for what, m in (("parts", p.parts_ms), ("phases", p.phases_ms)):
        err = np.abs(p.ttft_ms - m.sum(axis=1))
        i = int(np.argmax(err))
        neg = float(m.min())
        if err[i] > RECONCILE_TOL_MS or neg < -RECONCILE_TOL_MS:
            names = p.labels if what == "parts" else PHASES
            shown = dict(zip(names, m[i].round(6).tolist(), strict=True))
            raise ReconcileError(
                f"{path}: TTFT of request {int(p.request[i])} is {p.ttft_ms[i]!r} ms but its "
                f"{what} sum to {m[i].sum()!r} ms ({shown}; most negative {neg!r} ms)"
            )
    return p


# -- the vectorised partitioner -----------------------------------------------------------


@dataclass(frozen=True)
class _Kernel:
    """The TTFT partition's view of the run's host timeline: "how much of each label lies
    in [x, y]" (class integrals mapped onto the labels by `to_labels`: decode ->
    decode_other, graph-rate -> +graph -decode_other; prefill stays `prefill` until rule 4
    splits it), what the OS shares take there, and the prefill time the OS left."""

    run: PreparedRun
    tl: Timeline
    labels: tuple[str, ...]
    col: dict[str, int]
    to_labels: np.ndarray
    prefill_cls: int | None
    # the OS shares of each instant (docs/ttft.md, "OS evidence"), as the ITL partition's;
    # None without OS evidence
    run_rate: np.ndarray | None
    blk_rate: np.ndarray | None

    @classmethod
    def of(cls, run: PreparedRun, labels: tuple[str, ...]) -> _Kernel:
        col = {lb: i for i, lb in enumerate(labels)}
        tl = run.timeline()
        classes, n_cls = run.classes, len(run.classes)
        to_labels = np.zeros((n_cls + 2, len(labels)))
        for c, (name, _) in enumerate(classes):
            to_labels[c, col["decode_other" if name == "decode" else name]] = 1.0
        to_labels[n_cls, col["residual"]] = 1.0
        to_labels[n_cls + 1, col["graph"]] += 1.0
        to_labels[n_cls + 1, col["decode_other"]] -= 1.0
        prefill_cls = next((i for i, (c, _) in enumerate(classes) if c == "prefill"), None)
        run_rate, blk_rate = run.os_shares(tl) if run.has_os else (None, None)
        return cls(run, tl, labels, col, to_labels, prefill_cls, run_rate, blk_rate)

    @property
    def n_cls(self) -> int:
        return len(self.run.classes)

    def over(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Label ms of the host rules (2, 4, 5) in each [x, y]."""
        h0, l0 = self.tl.class_integrals(self.n_cls, x)
        h1, l1 = self.tl.class_integrals(self.n_cls, y)
        return (((h1 - h0) + (l1 - l0)) @ self.to_labels) * 1e3

    def os_loss(self, x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per row, what the OS shares take from each label in [x, y]."""
        assert self.run_rate is not None and self.blk_rate is not None  # rule 6 runs with OS
        out = []
        for name, w in (("run", self.run_rate), ("blk", self.blk_rate)):
            h0, l0 = os_class_integrals(self.tl, self.n_cls, name, w, x)
            h1, l1 = os_class_integrals(self.tl, self.n_cls, name, w, y)
            out.append((((h1 - h0) + (l1 - l0)) @ self.to_labels) * 1e3)
        return out[0], out[1]

    def prefill_at(self, times: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Cumulative prefill time up to `times`, less what the OS took of it."""
        tl = self.tl
        if self.prefill_cls is None:
            return np.zeros(len(times)), np.zeros(len(times))
        if self.run_rate is None or self.blk_rate is None:
            return tl.integrals(self.prefill_cls, times)
        k = np.searchsorted(tl.bounds, times, side="right")
        kept = (tl.owner == self.prefill_cls) * (1.0 - self.run_rate - self.blk_rate)
        return tl.weighted("prefill_kept", kept, times, k)

    def prefill_between(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        if self.prefill_cls is None or len(x) == 0:
            return np.zeros(len(x))
        h0, l0 = self.prefill_at(x)
        h1, l1 = self.prefill_at(y)
        return ((h1 - h0) + (l1 - l0)) * 1e3


@dataclass(frozen=True)
class _Windows:
    """Every TTFT window (rows in request order): arrival `a`, the server's handler
    starting, the engine core's add `e`, admission `adm` (NaN: unsplit), first token `f`."""

    req: np.ndarray
    a: np.ndarray
    handler: np.ndarray
    e: np.ndarray
    adm: np.ndarray
    f: np.ndarray
    split: np.ndarray  # whether the request has an admission
    row_of: np.ndarray  # per request of the log: its row, -1 for none

    def __len__(self) -> int:
        return len(self.req)

    @classmethod
    def of(cls, log: RawLog) -> _Windows:
        req, a, adm, f = ttft_windows(log)
        row_of = np.full(len(log.requests), -1, dtype=np.int64)
        row_of[req] = np.arange(len(req))
        handler, e = pre_engine_windows(log, req, a, f)
        return cls(req, a, handler, e, adm, f, np.isfinite(adm), row_of)


@dataclass(frozen=True)
class _Held:
    """Windows of the TTFT rows (`row`) taken out of the live time: [x0, x1]."""

    row: np.ndarray
    x0: np.ndarray
    x1: np.ndarray


def ttft_partition(
    log: RawLog, *, check: bool = True, run: PreparedRun | None = None
) -> TtftPartition:
    """Partition every request's TTFT (vectorised). Raises `ReconcileError` if it does not sum.

    `run`: the log's `PreparedRun`, if the caller partitions it more than once (one prepared
    from other tables is not used)."""
    run = prepared(log, run)
    labels = ttft_labels(log, has_os=run.has_os, run=run)
    # re-prefill time is one more column, last, until its windows' own and others' shares
    # are known (`_reprefill_rule`)
    k = _Kernel.of(run, labels + ((RECOMPUTE_CLASS,) if has_reprefill(run) else ()))
    w = _Windows.of(log)
    ttft_ms = (w.f - w.a) * 1e3
    # 0. before the engine had the request: http, then frontend; the rules below apply
    # from the engine core's add on
    parts = _pre_engine_rule(log, k, w)
    context = np.zeros_like(parts)
    # 1. evicted windows of each request, clipped to its TTFT window: preempt
    evicted = _evicted_rule(log, k, w, parts, context)
    # 3. queued time inside a stated wait window: wait_<reason> (gc keeps its time)
    held = _held_rule(log, k, w, parts, context)
    # 6. the OS shares of the time rules 2, 4 and 5 own
    if k.run_rate is not None and len(w):
        _os_rule(k, w, parts, evicted, held)
    # 4. a re-prefill: the request's own is preempt, others' is their prefill
    rp = _reprefill_rule(log, k, w, parts, context, (evicted, held))
    if len(k.labels) > len(labels):
        parts, context = parts[:, : len(labels)], context[:, : len(labels)]
    # 4. prefill: own share in the prefilling phase, the rest is others'
    _prefill_rule(log, k, w, parts, context, evicted)
    phases = _phases(w, ttft_ms, evicted)

    primary, prim_causes = primary_of(parts, ttft_ms, labels)
    p = TtftPartition(
        labels=labels,
        request=w.req,
        arrival_s=w.a,
        admit_s=w.adm,
        first_token_s=w.f,
        ttft_ms=ttft_ms,
        parts_ms=parts,
        context_ms=context,
        phases_ms=phases,
        reprefill_own_ms=rp[0],
        reprefill_other_ms=rp[1],
        primary=primary,
        causes=prim_causes,
        notes=ttft_notes(log, w.split),
    )
    return check_ttft_reconciled(p, log.path) if check else p


def _pre_engine_rule(log: RawLog, k: _Kernel, w: _Windows) -> np.ndarray:
    """Rule 0 (the parts from the engine core's add on are the host rules', to be refined
    by the rules below): arrival to the handler is `http`, from there to the engine core's
    add `frontend`, less what the OS took of the API server's event loop meanwhile."""
    n, col = len(w), k.col
    a, handler_s, e, f = w.a, w.handler, w.e, w.f
    parts = k.over(e, f) if n else np.zeros((0, len(k.labels)))
    if "http" in col and n:
        parts[:, col["http"]] += (handler_s - a) * 1e3
        parts[:, col["frontend"]] += (e - handler_s) * 1e3
    if FRONTEND_OS_LABELS[0] in col and n:
        # what the OS took of the API server's event loop meanwhile (rule 0)
        proc = request_api_servers(log)[w.req]
        for lb, lo, hi in (("http", a, handler_s), ("frontend", handler_s, e)):
            rq_s, bl_s = frontend_os_between(log, proc, lo, hi)
            parts[:, col[lb]] -= (rq_s + bl_s) * 1e3
            parts[:, col[FRONTEND_OS_LABELS[0]]] += rq_s * 1e3
            parts[:, col[FRONTEND_OS_LABELS[1]]] += bl_s * 1e3
    return parts


def _evicted_rule(
    log: RawLog, k: _Kernel, w: _Windows, parts: np.ndarray, context: np.ndarray
) -> _Held:
    """Rule 1: each request's evicted windows inside [engine core's add, first token] are
    `preempt`; what the engine ran meanwhile moves to the context. Returns the windows."""
    e_req, e_a, e_b = evicted_windows(log)
    e_row = w.row_of[e_req] if len(e_req) else e_req
    keep = e_row >= 0
    e_row, e_a, e_b = e_row[keep], e_a[keep], e_b[keep]
    w0, w1 = np.maximum(e_a, w.e[e_row]), np.minimum(e_b, w.f[e_row])
    keep = w1 > w0
    e_row, w0, w1 = e_row[keep], w0[keep], w1[keep]
    if len(e_row):
        ran = k.over(w0, w1)
        np.subtract.at(parts, e_row, ran)
        # all of it is context, `residual` included (time no engine activity covered while
        # the request was evicted), so the context sums to the evicted time, as in ITL
        np.add.at(context, e_row, ran)
        np.add.at(parts[:, k.col["preempt"]], e_row, (w1 - w0) * 1e3)
    return _Held(e_row, w0, w1)


def _held_rule(
    log: RawLog, k: _Kernel, w: _Windows, parts: np.ndarray, context: np.ndarray
) -> _Held:
    """Rule 3: queued time inside a wait window whose step stated why it did not admit the
    request is `wait_<reason>` (a GC pause there keeps its `gc` part); what the engine ran
    meanwhile moves to the context. Returns the held windows."""
    col = k.col
    q_req, q0, q1, q_reason = wait_windows(log)
    q_row = w.row_of[q_req] if len(q_req) else q_req
    keep = q_row >= 0
    q_row, q0, q1, q_reason = q_row[keep], q0[keep], q1[keep], q_reason[keep]
    keep = w.split[q_row]
    q_row, q0, q1, q_reason = q_row[keep], q0[keep], q1[keep], q_reason[keep]
    p0, p1 = np.maximum(q0, w.e[q_row]), np.minimum(q1, w.adm[q_row])
    keep = p1 > p0
    q_row, p0, p1, q_reason = q_row[keep], p0[keep], p1[keep], q_reason[keep]
    if len(q_row):
        ran = k.over(p0, p1)
        gc_ms = ran[:, col["gc"]].copy()
        ran[:, col["gc"]] = 0.0
        np.subtract.at(parts, q_row, ran)
        # context: what ran while it was held, `residual` included (gc is not held time:
        # it keeps its part), so the context sums to the held time
        np.add.at(context, q_row, ran)
        wait_col = np.array([col[WAIT_REASON_LABELS[r]] for r in q_reason.tolist()], dtype=np.int64)
        np.add.at(parts, (q_row, wait_col), (p1 - p0) * 1e3 - gc_ms)
    return _Held(q_row, p0, p1)


def _os_rule(k: _Kernel, w: _Windows, parts: np.ndarray, evicted: _Held, held: _Held) -> None:
    """Rule 6: the OS shares of the time rules 2, 4 and 5 own move to `os_runqueue` and
    `os_blocked`: not of evicted time (preempt), not of held time (wait_<reason>; a GC
    pause in it keeps its part and gives its share)."""
    col = k.col
    loss_run, loss_blk = k.os_loss(w.e, w.f)
    if len(evicted.row):
        ev_run, ev_blk = k.os_loss(evicted.x0, evicted.x1)
        np.subtract.at(loss_run, evicted.row, ev_run)
        np.subtract.at(loss_blk, evicted.row, ev_blk)
    if len(held.row):
        hd_run, hd_blk = k.os_loss(held.x0, held.x1)
        hd_run[:, col["gc"]] = 0.0
        hd_blk[:, col["gc"]] = 0.0
        np.subtract.at(loss_run, held.row, hd_run)
        np.subtract.at(loss_blk, held.row, hd_blk)
    parts -= loss_run + loss_blk
    parts[:, col[OS_RUNQUEUE]] += loss_run.sum(axis=1)
    parts[:, col[OS_BLOCKED]] += loss_blk.sum(axis=1)


def _reprefill_rule(
    log: RawLog, k: _Kernel, w: _Windows, parts: np.ndarray, context: np.ndarray, cut
) -> tuple[np.ndarray, np.ndarray]:
    """The re-prefill column (last in `k.labels`, if any) of each window: the share that is
    its own request's re-prefill (over its live time: from the engine core's add to the
    first token, less its evicted and held windows, `cut`) goes to `preempt`, the rest to
    `prefill` (others' prefill: rule 4's split makes it `prefill_other`); in the context
    all of it is others' prefill. Returns each window's own and others' re-prefill ms."""
    n = len(w)
    own, other = np.zeros(n), np.zeros(n)
    if k.labels[-1] != RECOMPUTE_CLASS:
        return own, other
    h = parts[:, -1]
    rows = np.flatnonzero(h != 0.0)
    evicted, held = cut
    cuts = cuts_of(
        np.concatenate([evicted.row, held.row]),
        np.concatenate([evicted.x0, held.x0]),
        np.concatenate([evicted.x1, held.x1]),
    )
    f = own_shares(reprefills(log), w.req, w.e, w.f, rows, cuts)
    own[rows], other[rows] = h[rows] * f, h[rows] * (1.0 - f)
    parts[:, k.col["preempt"]] += own
    parts[:, k.col["prefill"]] += other
    context[:, k.col["prefill"]] += context[:, -1]
    return own, other


def _prefill_rule(
    log: RawLog, k: _Kernel, w: _Windows, parts: np.ndarray, context: np.ndarray, evicted: _Held
) -> None:
    """Rule 4's prefill split (of the prefill time the OS left): a split request's own share
    of the prefill in its prefilling phase is `prefill_own`, at most all of the phase's
    prefill time; the rest is `prefill_other`. Prefill in the context (it ran while the
    request was held or evicted) was others'. Unsplit requests keep `prefill`."""
    col, split, adm, f = k.col, w.split, w.adm, w.f
    e_row, w0, w1 = evicted.row, evicted.x0, evicted.x1
    own = _own_prefill(log, w.row_of, adm, f, split, e_row, w0, w1, k.run.causes, k.prefill_at)
    # the phase's prefill time: prefill between admission and first token, less evicted
    live_prefill = np.zeros(len(w))
    live_prefill[split] = k.prefill_between(adm[split], f[split])
    if len(e_row):
        m = split[e_row]
        x0 = np.maximum(w0[m], adm[e_row[m]])
        x1 = np.maximum(np.minimum(w1[m], f[e_row[m]]), x0)
        np.subtract.at(live_prefill, e_row[m], k.prefill_between(x0, x1))
    own = np.minimum(own, np.maximum(live_prefill, 0.0))
    pcol = parts[:, col["prefill"]].copy()
    parts[split, col["prefill_own"]] = own[split]
    parts[split, col["prefill_other"]] = pcol[split] - own[split]
    parts[split, col["prefill"]] = 0.0
    # context uses the same names: prefill that ran while held or evicted was others'
    context[:, col["prefill_other"]] += context[:, col["prefill"]]
    context[:, col["prefill"]] = 0.0


def _phases(w: _Windows, ttft_ms: np.ndarray, evicted: _Held) -> np.ndarray:
    """Each window's phases (`PHASES`): evicted time; queued (arrival to admission) and
    prefilling (admission to first token) less the evicted time in each; unsplit (the
    window less evicted time) where there is no admission."""
    n, split, a, adm, f = len(w), w.split, w.a, w.adm, w.f
    e_row, w0, w1 = evicted.row, evicted.x0, evicted.x1
    phases = np.zeros((n, len(PHASES)))
    evicted_ms = np.bincount(e_row, (w1 - w0) * 1e3, minlength=n)[:n]
    phases[:, PHASES.index("evicted")] = evicted_ms
    queued = np.zeros(n)
    queued_ev: np.ndarray = np.zeros(n)
    if len(e_row):
        qe = np.maximum(np.minimum(w1, adm[e_row]) - w0, 0.0)
        qe[~split[e_row]] = 0.0
        queued_ev = np.bincount(e_row, qe * 1e3, minlength=n)[:n].astype(np.float64)
    queued[split] = (adm[split] - a[split]) * 1e3 - queued_ev[split]
    phases[:, PHASES.index("queued")] = queued
    phases[split, PHASES.index("prefilling")] = (f[split] - adm[split]) * 1e3 - (
        evicted_ms[split] - queued_ev[split]
    )
    phases[~split, PHASES.index("unsplit")] = ttft_ms[~split] - evicted_ms[~split]
    return phases


def _rank_keys(
    group: np.ndarray, t: np.ndarray, u: np.ndarray, side: Literal["left", "right"]
) -> np.ndarray:
    """Integer keys that sort as (group, time): ``group * (len(u) + 1) + rank``, the rank
    being ``np.searchsorted(u, t, side)`` (u: the sorted times of the data). Comparing a
    query's key with the data's keys compares times within the query's group only."""
    return group.astype(np.int64) * (len(u) + 1) + np.searchsorted(u, t, side=side)


def _expand(first: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(query index, data index) of every pair: query i with data first[i] .. + count[i]."""
    count = np.maximum(count, 0)
    qi = np.repeat(np.arange(len(first)), count)
    start = np.cumsum(count) - count  # where each query's pairs begin
    di = np.repeat(first, count) + (np.arange(count.sum()) - np.repeat(start, count))
    return qi, di


def _meeting(owner, x0, x1, e_row, w0, w1) -> tuple[np.ndarray, np.ndarray]:
    """(query, eviction) pairs where the query window [x0, x1] of TTFT row `owner` meets one
    of that row's evicted windows (sorted by row then start, disjoint per row: as
    `evicted_windows` gives them)."""
    u = np.unique(np.concatenate([w0, w1]))
    first = np.searchsorted(
        _rank_keys(e_row, w1, u, "left"), _rank_keys(owner, x0, u, "right"), side="left"
    )  # the row's first eviction ending after x0
    last = np.searchsorted(
        _rank_keys(e_row, w0, u, "left"), _rank_keys(owner, x1, u, "left"), side="left"
    )  # past the row's last eviction starting before x1
    return _expand(first, last - first)


#: `_own_prefill` joins a step's prefill rows with its prefill segments piece by piece while
#: the pieces number at most this many times the rows and segments.
_JOIN_FACTOR = 8


def _own_prefill(log, row_of, adm, f, split, e_row, w0, w1, causes, prefill_at):
    """Per TTFT row: sum over its prefill rows of the step's share times the prefill time of
    that step's prefill segments inside [admission, first token], less evicted time.

    A step of P prefill rows and S prefill segments joined row by segment makes P x S
    pieces; that join is kept only for steps where P x S <= _JOIN_FACTOR x (P + S) (one
    segment, or up to 16 of each: what engines record), so its memory stays a fixed multiple
    of the input. In the
    other steps each row gets its share of H(first token) - H(admission), with H(t) the
    prefill time of the step's segments before t summed over the segments: with F(t) the
    cumulative prefill time (`prefill_at`),

        H(t) = sum_{s1 <= t} F(s1) - sum_{s0 <= t} F(s0) + F(t) * (#{s0 <= t} - #{s1 <= t})

    over the step's segments [s0, s1), each segment giving F(min(s1, t)) - F(min(s0, t)).
    F is taken relative to its value at the step's first segment start and summed with
    compensation. Both give the same time; the join also the same rounding as summing the
    pieces one by one (the reference does). Cost: O((P + S) log S) time and O(P + S)
    memory, plus one pair per (row or piece, eviction of its request that it meets)."""
    n = len(adm)
    own = np.zeros(n)
    pf, sg = log.prefill_chunks, log.segments
    if len(pf) == 0:
        return own
    share = prefill_shares(log)
    rows = row_of[pf.request]
    keep = rows >= 0
    keep[keep] = split[rows[keep]]
    pseg = np.flatnonzero((causes == "prefill") & (sg.is_device != 1) & (sg.step >= 0))
    if not keep.any() or len(pseg) == 0:
        return own
    # the steps with prefill segments, each a group; a prefill row of another step gets 0
    pseg = pseg[np.argsort(sg.step[pseg], kind="stable")]
    seg_steps, seg_group = np.unique(sg.step[pseg], return_inverse=True)
    pf_idx = np.flatnonzero(keep)  # prefill rows, in row order (the order of the sums)
    row_group = np.searchsorted(seg_steps, pf.step[pf_idx])
    has = row_group < len(seg_steps)
    has[has] = seg_steps[row_group[has]] == pf.step[pf_idx][has]
    pf_idx, row_group = pf_idx[has], row_group[has]
    if len(pf_idx) == 0:
        return own
    rows, share = rows[pf_idx], share[pf_idx]
    if len(e_row):
        oe = np.lexsort((w0, e_row))
        e_row, w0, w1 = e_row[oe], w0[oe], w1[oe]
    n_seg = np.bincount(seg_group, minlength=len(seg_steps))
    c = _PrefillRows(sg, pseg, seg_steps, seg_group, n_seg, pf_idx, rows, share, row_group,
                     adm, f, e_row, w0, w1)  # fmt: skip
    n_row = np.bincount(row_group, minlength=len(seg_steps))
    joined = (n_seg * n_row <= _JOIN_FACTOR * (n_seg + n_row))[row_group]
    pieces = [  # (prefill row, its share of prefill time in ms, its TTFT row) of each piece
        step(c, j, prefill_at)
        for step, j in ((_joined_prefill, np.flatnonzero(joined)),
                        (_summed_prefill, np.flatnonzero(~joined)))
        if len(j)
    ]  # fmt: skip
    # summed per TTFT row in prefill-row order (each prefill row's pieces in segment order)
    o = np.argsort(np.concatenate([x for x, _, _ in pieces]), kind="stable")
    np.add.at(own, np.concatenate([x for _, _, x in pieces])[o],
              np.concatenate([x for _, x, _ in pieces])[o])  # fmt: skip
    return own


@dataclass(frozen=True)
class _PrefillRows:
    """`_own_prefill`'s inputs: the host prefill segments `pseg` (by step), grouped by step
    (`seg_steps`, each segment's group, segments per group); the prefill rows `pf_idx` of
    split requests in such steps, with their TTFT rows, shares and groups; the TTFT windows
    [adm, f]; the evicted windows sorted by row then start."""

    sg: Any
    pseg: np.ndarray
    seg_steps: np.ndarray
    seg_group: np.ndarray
    n_seg: np.ndarray
    pf_idx: np.ndarray
    rows: np.ndarray
    share: np.ndarray
    row_group: np.ndarray
    adm: np.ndarray
    f: np.ndarray
    e_row: np.ndarray
    w0: np.ndarray
    w1: np.ndarray


def _prefill_ms(prefill_at, x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The prefill time the OS left in each [x, y], ms."""
    h0, l0 = prefill_at(x)
    h1, l1 = prefill_at(y)
    return ((h1 - h0) + (l1 - l0)) * 1e3


def _joined_prefill(c: _PrefillRows, j: np.ndarray, prefill_at):
    """Prefill rows `j` in steps with a small join: one piece per (row, segment), evicted
    time taken off each."""
    seg_steps, seg_group, n_seg, row_group = c.seg_steps, c.seg_group, c.n_seg, c.row_group
    pseg, pf_idx, rows, share, sg, adm, f = c.pseg, c.pf_idx, c.rows, c.share, c.sg, c.adm, c.f
    e_row, w0, w1 = c.e_row, c.w0, c.w1
    g_first = np.searchsorted(seg_group, np.arange(len(seg_steps)), side="left")
    ri, si = _expand(g_first[row_group[j]], n_seg[row_group[j]])
    si = pseg[si]
    r = rows[j][ri]
    x0 = np.maximum(sg.t_start_s[si], adm[r])
    x1 = np.minimum(sg.t_end_s[si], f[r])
    ok = x1 > x0
    ri, r, x0, x1 = ri[ok], r[ok], x0[ok], x1[ok]
    val = _prefill_ms(prefill_at, x0, x1)
    if len(e_row) and len(ri):
        pi, ei = _meeting(r, x0, x1, e_row, w0, w1)
        y0 = np.maximum(x0[pi], w0[ei])
        y1 = np.maximum(np.minimum(x1[pi], w1[ei]), y0)
        np.subtract.at(val, pi, _prefill_ms(prefill_at, y0, y1))
    return pf_idx[j][ri], share[j][ri] * val, r


def _summed_prefill(c: _PrefillRows, j: np.ndarray, prefill_at):
    """Prefill rows `j` in the other steps: H(first token) - H(admission) per row."""
    seg_group, row_group = c.seg_group, c.row_group
    pseg, pf_idx, rows, share, sg, adm, f = c.pseg, c.pf_idx, c.rows, c.share, c.sg, c.adm, c.f
    e_row, w0, w1 = c.e_row, c.w0, c.w1
    # groups renumbered over these steps only
    big = np.unique(row_group[j])
    m = np.isin(seg_group, big)
    gseg = np.searchsorted(big, seg_group[m])
    s0, s1 = sg.t_start_s[pseg[m]], sg.t_end_s[pseg[m]]
    rg, r = np.searchsorted(big, row_group[j]), rows[j]
    u = np.unique(np.concatenate([s0, s1]))
    o0, o1 = np.lexsort((s0, gseg)), np.lexsort((s1, gseg))
    key0 = _rank_keys(gseg[o0], s0[o0], u, "right")
    key1 = _rank_keys(gseg[o1], s1[o1], u, "right")
    g_lo = np.searchsorted(gseg[o0], np.arange(len(big)), side="left")
    span_lo = s0[o0][g_lo]  # the step's first segment start: F is measured from here
    span_hi = np.full(len(big), -np.inf)
    np.maximum.at(span_hi, gseg, s1)
    ref_hi, ref_lo = prefill_at(span_lo)

    def rel(t: np.ndarray, g: np.ndarray) -> np.ndarray:
        hi, lo = prefill_at(t)  # F(t) - F(span_lo of g), to full precision
        return (hi - ref_hi[g]) + (lo - ref_lo[g])

    c0_hi, c0_lo = compensated_cumsum(rel(s0[o0], gseg[o0]))
    c1_hi, c1_lo = compensated_cumsum(rel(s1[o1], gseg[o1]))

    def h(g: np.ndarray, t: np.ndarray) -> np.ndarray:
        """H of group g at t (s): the prefill time of its segments before t."""
        k = _rank_keys(g, t, u, "right")
        k0 = np.searchsorted(key0, k, side="right")
        k1 = np.searchsorted(key1, k, side="right")
        b = g_lo[g]
        a1 = (c1_hi[k1] - c1_hi[b]) + (c1_lo[k1] - c1_lo[b])
        a0 = (c0_hi[k0] - c0_hi[b]) + (c0_lo[k0] - c0_lo[b])
        open_ = k0 - k1  # segments started by t and not yet ended
        return (a1 - a0) + np.where(open_ != 0, rel(t, g) * open_, 0.0)

    def held(g: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Group g's prefill time inside [x, y], ms (0 where y <= x)."""
        out = np.zeros(len(x))
        ok = y > x
        if ok.any():
            out[ok] = (h(g[ok], y[ok]) - h(g[ok], x[ok])) * 1e3
        return out

    val = held(rg, adm[r], f[r])
    if len(e_row):
        lo = np.maximum(adm[r], span_lo[rg])
        hi = np.minimum(f[r], span_hi[rg])
        pi, ei = _meeting(r, lo, hi, e_row, w0, w1)
        y0 = np.maximum(adm[r[pi]], w0[ei])
        y1 = np.minimum(f[r[pi]], w1[ei])
        np.subtract.at(val, pi, held(rg[pi], y0, y1))
    return pf_idx[j], share[j] * val, r


# -- per-run figures ------------------------------------------------------------------------

#: TTFT percentiles a run reports, ms.
TTFT_PERCENTILES = (("p50", 50.0), ("p90", 90.0), ("p99", 99.0))


@dataclass(frozen=True)
class TtftFigures:
    """One run's TTFT figures. Times in ms; shares are fractions of summed TTFT."""

    requests: int  # requests with an arrival and a first token
    unsplit: int  # of them, without an admission row (phases unknown)
    p50_ms: float
    p90_ms: float
    p99_ms: float
    max_ms: float
    tail_requests: int  # requests at or above the run's TTFT p90
    tail_share: dict[str, float]  # per label: label time in tail TTFTs / tail TTFT time
    all_share: dict[str, float]  # the same over all TTFTs
    tail_count: dict[str, int]  # tail requests by primary cause, "clean" included
    all_count: dict[str, int]  # all requests by primary cause
    phase_share: dict[str, float]  # per phase: phase time / TTFT time, all requests
    tail_phase_share: dict[str, float]  # the same over tail requests
    held_context_ms: dict[str, float]  # what ran while requests were evicted or held
    reconcile_max_err_ms: float  # max over requests of |TTFT - sum(parts)|, phases too
    notes: list[str]

    def to_dict(self) -> dict:
        return asdict(self)


def _shares(m: np.ndarray, total_ms: np.ndarray, names) -> dict[str, float]:
    t = float(total_ms.sum())
    if t <= 0:
        return {n: 0.0 for n in names}
    return {n: float(v) for n, v in zip(names, m.sum(axis=0) / t, strict=True)}


def _count(primary: np.ndarray, causes: tuple[str, ...]) -> dict[str, int]:
    c = np.bincount(np.where(primary == CLEAN, len(causes), primary), minlength=len(causes) + 1)
    return {name: int(v) for name, v in zip((*causes, "clean"), c, strict=True) if v}


def ttft_figures(p: TtftPartition) -> TtftFigures:
    """The per-run TTFT figures of docs/ttft.md from a partition. The tail is the requests
    at or above the run's TTFT p90 (numpy's default linear percentile)."""
    t = p.ttft_ms
    pct = {k: float(np.percentile(t, q)) if len(t) else float("nan") for k, q in TTFT_PERCENTILES}
    tail = t >= pct["p90"] if len(t) else np.zeros(0, dtype=bool)
    return TtftFigures(
        requests=len(p),
        unsplit=int((~p.is_split).sum()),
        p50_ms=pct["p50"],
        p90_ms=pct["p90"],
        p99_ms=pct["p99"],
        max_ms=float(t.max()) if len(t) else float("nan"),
        tail_requests=int(tail.sum()),
        tail_share=_shares(p.parts_ms[tail], t[tail], p.labels),
        all_share=_shares(p.parts_ms, t, p.labels),
        tail_count=_count(p.primary[tail], p.causes),
        all_count=_count(p.primary, p.causes),
        phase_share=_shares(p.phases_ms, t, PHASES),
        tail_phase_share=_shares(p.phases_ms[tail], t[tail], PHASES),
        held_context_ms={
            lb: float(v) for lb, v in zip(p.labels, p.context_ms.sum(axis=0), strict=True) if v
        },
        reconcile_max_err_ms=p.reconcile_max_err_ms,
        notes=list(p.notes),
    )


__all__ = [
    "PHASES",
    "TTFT_STANDARD_LABELS",
    "TtftFigures",
    "TtftPartition",
    "check_ttft_reconciled",
    "ttft_figures",
    "ttft_partition",
]
