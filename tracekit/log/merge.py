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
    starts it (the n-th forward window of each, in order, from the engine core's first
    step), and the rank whose outputs the engine core waits for ends it before that wait
    returns; another rank may end it later, but it entered the window's last collective
    before then (`tracekit.log.clocks.worker_bounds`).

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
DIR` never analyses) a log that `tracekit check` would reject. The cause rule that charges
a tensor-parallel step's wait to its slowest rank is not the log's: `merge_server` hands
the processes and their clock fits on, and `tracekit.attribution.tp.charge_tp_waits`
applies it (`tracekit.analysis.run` opens a server's run with it).

The modules it stands on: `tracekit.log.processes` (finding and checking the process
logs), `tracekit.log.clocks` (one clock), `tracekit.log.request_identity` (one request
identity) and `tracekit.log.serve_contract` (the names the processes' logs share).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from tracekit.errors import LogError
from tracekit.log.clocks import ClockFit, CoreIndex, fit_process, match_sorted
from tracekit.log.osintervals import side_thread_intervals
from tracekit.log.processes import ProcessLog, counter, dp_rank, process_logs, tp_rank
from tracekit.log.rawlog import (
    ClientEmissions,
    Coverage,
    Deliveries,
    ProcOs,
    ProcSegments,
    RawLog,
    warnings_of,
)
from tracekit.log.request_identity import RequestJoin, join_requests
from tracekit.log.serve_contract import ADDED, CORE, FRONTEND, RECV, WORKER
from tracekit.log.validate import validate_log


@dataclass(frozen=True)
class ServerMerge:
    """A server's run merged from its processes' logs (`merge_server`), with what a cause
    rule over the processes needs: the engine core whose run it is, the other processes
    merged into it and each one's clock fit (in the order of ``meta["processes"]`` after
    the engine core). `log` is not yet validated."""

    log: RawLog
    core: ProcessLog
    others: list[ProcessLog]
    fits: list[ClockFit]


def merge_dir(directory: str, *, engine: int | None = None, **limits: Any) -> RawLog:
    """The run recorded in `directory` (see the module docstring), validated; `engine`: the
    data parallel rank whose run to build when the server ran several engine cores.
    `limits`: `load`'s bounds on reading each process log. No cause rule is applied
    (`tracekit.analysis.run.merge_run` applies the tensor-parallel one)."""
    return merge_logs(process_logs(directory, **limits), path=directory, engine=engine)


def merge_logs(
    procs: list[ProcessLog], *, path: str = "<memory>", engine: int | None = None
) -> RawLog:
    """`merge_server`'s run, validated: what the processes' logs say together must make a
    valid log (a tick far from the others, ids that collide): refused here, never written
    or analysed."""
    return validate_log(merge_server(procs, path=path, engine=engine).log)


def _pick_core(
    procs: list[ProcessLog], path: str, engine: int | None
) -> tuple[ProcessLog, list[ProcessLog]]:
    """The engine core whose run this is (`engine`: its data-parallel rank; needed where
    there are several), and all the engine cores, by rank."""
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
    return cores[ranks.index(engine) if engine is not None else 0], cores


@dataclass(frozen=True)
class MergedLabels:
    """The merged run's labels (the core's first, then each new one as the other processes
    are met: each one's labels, then ``gc`` if it paused) and, per other process, its
    label ids in them and its ``gc`` label's (None: it never paused)."""

    labels: list[str]
    of: list[np.ndarray]
    gc: list[int | None]


def merged_labels(core: ProcessLog, others: list[ProcessLog]) -> MergedLabels:
    """`MergedLabels` of a merge (from the processes' vocabularies and whether they paused:
    a skeleton log, `tracekit.log.merge_stream`, has both)."""
    labels = list(core.log.labels)
    label_pos = {x: i for i, x in enumerate(labels)}

    def label_id(name: str) -> int:
        if name not in label_pos:
            label_pos[name] = len(labels)
            labels.append(name)
        return label_pos[name]

    of, gc = [], []
    for p in others:
        of.append(np.array([label_id(x) for x in p.log.labels], dtype=np.int64))
        gc.append(label_id("gc") if len(p.log.gc_pauses) else None)
    return MergedLabels(labels, of, gc)


def segment_rows(k: int, segments: Any, lab: np.ndarray, fit: ClockFit) -> np.ndarray:
    """``proc_segments`` rows (process, label, start, end) of process `k`'s `segments`
    (`lab`: its label ids in the run's labels), on the run's clock."""
    return np.column_stack(
        [
            np.full(len(segments), k),
            lab[segments.label] if len(lab) else segments.label,
            fit.apply(segments.t_start_s),
            fit.apply(segments.t_end_s),
        ]
    )


def gc_rows(k: int, gc_pauses: Any, gc_label: int | None, fit: ClockFit) -> np.ndarray:
    """``proc_segments`` rows of process `k`'s GC pauses (label ``gc``)."""
    return np.column_stack(
        [
            np.full(len(gc_pauses), k),
            np.full(len(gc_pauses), -1 if gc_label is None else gc_label),
            fit.apply(gc_pauses.t_start_s),
            fit.apply(gc_pauses.t_end_s),
        ]
    )


def _merged_rows(
    core: ProcessLog,
    others: list[ProcessLog],
    fits: list[ClockFit],
    ident: RequestJoin,
    core_index: CoreIndex,
    ml: MergedLabels,
) -> dict[str, list[np.ndarray]]:
    """Each other process's segments and GC pauses, and a frontend's OS samples, chunks
    written to clients and deliveries, on the engine core's clock."""
    out: dict[str, list[np.ndarray]] = {"seg": [], "ce": [], "dl": [], "os": []}
    for k, (p, fit) in enumerate(zip(others, fits, strict=True), start=1):
        lg = p.log
        if len(lg.segments):
            out["seg"].append(segment_rows(k, lg.segments, ml.of[k - 1], fit))
        if len(lg.gc_pauses):
            out["seg"].append(gc_rows(k, lg.gc_pauses, ml.gc[k - 1], fit))
        if p.role == FRONTEND:
            osr = os_rows(k, lg, fit, event_loop_thread(np.bincount(lg.segments.thread)))
            out["os"].append(osr)
            out["ce"].append(client_rows(k, lg, fit, ident.index[k - 1], sse_windows(lg)))
            out["dl"].append(delivery_rows(k, lg, fit, core, core_index))
    return out


def event_loop_thread(thread_counts: np.ndarray) -> int:
    """An API server's event loop: the thread that recorded most of its segments (-1: it
    recorded none), from the count of segments per thread."""
    return int(thread_counts.argmax()) if len(thread_counts) and thread_counts.sum() else -1


def os_rows(k: int, lg: RawLog, fit: ClockFit, thread: int) -> np.ndarray:
    """``proc_os`` rows of an API server (process `k`): the OS intervals of its event loop
    `thread`, on the run's clock, and whether each lies inside its segments."""
    osi, inside = side_thread_intervals(lg, thread)
    cols = [np.full(len(osi), k), fit.apply(osi.t0_s), fit.apply(osi.t1_s)]
    return np.column_stack([*cols, osi.runqueue_s, osi.offcpu_s, inside])


def client_rows(
    k: int, lg: RawLog, fit: ClockFit, ridx: np.ndarray, sse: tuple[np.ndarray, np.ndarray]
) -> np.ndarray:
    """``client_emissions`` rows of an API server (process `k`): each chunk it wrote, its
    request's merged index (`ridx`: per request of its log; another engine core's: left
    out), write and ready times (`sse`: its ``sse_write`` windows, `sse_windows`)."""
    em = lg.emissions
    t_sent = fit.apply(em.t_s)
    ready = ready_times(sse, em.t_s)
    rows = np.column_stack(
        [ridx[em.request], t_sent, fit.apply(ready), em.num_tokens, np.full(len(em), k)]
    )
    return rows[rows[:, 0] >= 0]


def delivery_rows(
    k: int, lg: RawLog, fit: ClockFit, core: ProcessLog, core_index: CoreIndex
) -> np.ndarray:
    """``deliveries`` rows: outputs built in a core step, received by API server `k`."""
    f_t, f_v = counter(lg, RECV)
    ci, fi = match_sorted(core_index.out_v, f_v)
    st = core.log.steps
    c_t = core_index.out_t[ci]
    step = np.searchsorted(st.t_start_s, c_t, side="right") - 1
    return np.column_stack([step, c_t, fit.apply(f_t[fi]), np.full(len(ci), k)])


def _merge_warnings(
    log: RawLog,
    renamed: int,
    procs: list[ProcessLog],
    others: list[ProcessLog],
    fits: list[ClockFit],
    missing: list[dict[str, Any]],
) -> list[str]:
    """The core's warnings, then renamed requests, recovered processes (and what reading
    the other processes' parts found: a part damaged or missing ends that process's rows
    there), clock fits that violate causality, and processes the log names but the merge
    did not find."""
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
    for p in others:  # what reading a killed process's parts found (a damaged part, ...)
        noted = p.log.meta.get("warnings") if p.recovered else None
        if isinstance(noted, list):
            warnings += [f"{os.path.basename(p.path)}: {w}" for w in noted]
    for p, fit in zip(others, fits, strict=True):
        if fit.violations:
            warnings.append(
                f"{os.path.basename(p.path)}: {fit.violations} of {fit.pairs} paired stamps "
                f"violate causality with the clock used ({fit.method})"
            )
    warnings += [missing_line(m) for m in missing]
    return warnings


@dataclass(frozen=True)
class MergePlan:
    """What a merge knows before it moves a row: the processes, their clock fits, the
    request join, the run's labels, meta and coverage (`plan_server`). It reads of each
    process only what fits and the join need (paired stamps, windows, request ids, GC
    pauses, vocabularies): a skeleton of each log serves as well as the whole log
    (`tracekit.log.merge_stream`)."""

    core: ProcessLog
    others: list[ProcessLog]
    fits: list[ClockFit]
    ident: RequestJoin
    core_index: CoreIndex
    labels: MergedLabels
    meta: dict[str, Any]
    warnings: list[str]
    coverage: Coverage


def plan_server(
    procs: list[ProcessLog], *, path: str = "<memory>", engine: int | None = None
) -> MergePlan:
    """`MergePlan` of a server's processes (see `merge_server`)."""
    core, cores = _pick_core(procs, path, engine)
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
    fits = [fit_process(core, p, core_index) for p in others]
    ident = join_requests(core, others, fits, elsewhere)
    meta = dict(core.log.meta)
    missing = missing_processes(core, others)
    if missing:
        meta["missing_processes"] = missing
    meta["process"] = {k: v for k, v in core.identity.items()}
    meta["processes"] = [{**core.identity, "path": core.path, "recovered": core.recovered}] + [
        {**p.identity, "path": p.path, "recovered": p.recovered, "clock_fit": f.as_meta()}
        for p, f in zip(others, fits, strict=True)
    ]
    meta["clock_pairs"] = clock_pairs(core, others, fits)
    meta["merged_from"] = os.path.abspath(path) if path != "<memory>" else path
    meta["interrupted"] = any(p.recovered for p in procs)
    warnings = _merge_warnings(core.log, ident.renamed, procs, others, fits, missing)
    meta["warnings"] = warnings
    return MergePlan(core, others, fits, ident, core_index, merged_labels(core, others), meta,
                     warnings, merged_coverage(core, others, fits))  # fmt: skip


def merge_server(
    procs: list[ProcessLog], *, path: str = "<memory>", engine: int | None = None
) -> ServerMerge:
    """One run from the logs of a server's processes, not yet validated (`merge_logs`
    validates it). A data-parallel server has one engine core per DP rank, each with its
    own steps and workers: its run is that engine core's (`engine`: the DP rank), with its
    workers, the API servers, and the requests that engine core served (the others' are
    left out, never charged to its steps)."""
    plan = plan_server(procs, path=path, engine=engine)
    rows = _merged_rows(plan.core, plan.others, plan.fits, plan.ident, plan.core_index,
                        plan.labels)  # fmt: skip
    merged = replace(
        plan.core.log,
        coverage=plan.coverage,
        requests=plan.ident.requests,
        request_ids=tuple(plan.ident.names),
        labels=tuple(plan.labels.labels),
        proc_segments=ProcSegments.from_columns(**_cols(rows["seg"], ProcSegments)),
        client_emissions=ClientEmissions.from_columns(**_cols(rows["ce"], ClientEmissions)),
        deliveries=Deliveries.from_columns(**_cols(rows["dl"], Deliveries)),
        proc_os=ProcOs.from_columns(**_cols(rows["os"], ProcOs)),
        meta=plan.meta,
        path=path,
        # as the merged run reads once saved (in one file or in parts), each line once
        warnings=tuple(dict.fromkeys(warnings_of(plan.meta))),
    )
    return ServerMerge(merged, plan.core, plan.others, plan.fits)


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
    _, added = counter(core.log, ADDED)
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


def sse_windows(lg: RawLog) -> tuple[np.ndarray, np.ndarray]:
    """An API server's ``sse_write`` windows: (ends, starts), in order of their ends."""
    if "sse_write" not in lg.labels:
        return np.zeros(0), np.zeros(0)
    m = lg.segments.label == lg.labels.index("sse_write")
    ends, starts = lg.segments.t_end_s[m], lg.segments.t_start_s[m]
    order = np.argsort(ends, kind="stable")
    return ends[order], starts[order]


def ready_times(sse: tuple[np.ndarray, np.ndarray], t_sent: np.ndarray) -> np.ndarray:
    """When each chunk was ready: the start of the ``sse_write`` window (`sse_windows`)
    that ends at its write (recorded together); the write itself where there is none."""
    ready = np.asarray(t_sent, dtype=np.float64).copy()
    ends, starts = sse
    if not len(ends):
        return ready
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
