"""One run's analysis read in slices, in memory bounded by a slice, not by the run
(docs/reports.md, "Reading a long run in slices").

The figures are `tracekit.analysis.figures.analyze`'s, by the same rules: each slice of the
run (`tracekit.log.slices`) is partitioned as the whole run is (its graph baseline is the
whole run's, fitted once from every step's GC-free decode time), and each gap is counted
in the one slice its later emission lies in. Two passes over the parts:

1. the index pass: every part once; per step its decode time and shape (the baseline),
   per request its last emission tick (so every gap's length: the ITL percentiles, counted
   in `tracekit.analysis.quantiles.ExactQuantiles`), GC pauses, tokens, steps;
2. every slice partitioned: sums, counts and the histogram by cause, the TTFT partition
   of the requests whose first token lies in it; the gaps of the ITL p99's own histogram
   buckets are kept until p99 is known, to decide which are in the tail;
   the forward shares wait in a temporary file (8 bytes a gap, in ``TMPDIR``), read back in
   chunks for the two medians of the forward share (exact, as the percentiles), so no
   slice is partitioned twice.

Equal to the whole-run analysis: every count, percentile, maximum and histogram bin
exactly; sums and shares to float rounding (the sums add in another order); the TTFT
figures folded from the slices' own TTFT rows as they come (`stream_ttft.TtftFold`: 9
bytes a request in memory, the rest in a temporary file); the eviction summary, the
recompute tax and speculative decoding from the few rows the index pass keeps of each
part (`sparse_part`). Not computed here: the client boundary of a merged server run
(`tracekit.analysis.stream_client` reads it in slices after this) and tensor-parallel
ranks.
"""

from __future__ import annotations

import math
import tempfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np

from tracekit.allocator import give_back_freed_memory
from tracekit.analysis.evictions import RECOMPUTE_LABEL, eviction_summary
from tracekit.analysis.figures import (
    HIST_EDGES_MS,
    PERCENTILES,
    HistBin,
    RunAnalysis,
)
from tracekit.analysis.quantiles import ExactQuantiles
from tracekit.analysis.results import SpecAcceptance, spec_result
from tracekit.analysis.stream_ttft import TTFT_LABEL_GROUPS, TtftFold, ordered
from tracekit.analysis.unrecorded import unrecorded_report
from tracekit.attribution.client import stating_api_servers
from tracekit.attribution.itl import CLEAN, FIT_ALL_CAPTURED, Partition, partition
from tracekit.attribution.reprefill import stating_next_emissions
from tracekit.attribution.timeline import (
    GraphBaseline,
    PreparedRun,
    decode_net_ms,
    drift_corrected,
    fit_baseline_steps,
    has_os_evidence,
    host_classes,
    segment_causes,
)
from tracekit.attribution.ttft import (
    UNSPLIT_WORDS,
    TtftPartition,
    ttft_labels,
    ttft_partition,
    unsplit_note,
)
from tracekit.labels import OS_LABELS, RECOMPUTE_CLASS, partition_labels
from tracekit.log.flush import READMIT, TABLES
from tracekit.log.parts import DamagedPart, Retained, merge_flushed
from tracekit.log.rawlog import GRAPH_EAGER, RawLog
from tracekit.log.request_names import RequestNames, Unnamed
from tracekit.log.slices import NotSliceable, SlicedRun, grown

__all__ = ["NotSliceable", "analyze_sliced"]

_ST = {c: TABLES["steps"].index(c) for c in TABLES["steps"]}
_SG_DEVICE = TABLES["segments"].index("is_device")
_EM = {c: TABLES["emissions"].index(c) for c in TABLES["emissions"]}
_GC = {c: TABLES["gc_pauses"].index(c) for c in TABLES["gc_pauses"]}
_RQ = {c: TABLES["requests"].index(c) for c in TABLES["requests"]}
NEVER = np.iinfo(np.int64).max  # a request's first emission, before it has one
STEP_TABLES = frozenset({"steps", "segments", "gc_pauses", "os_samples"})
_QS = tuple(q for _, q in PERCENTILES)
#: emissions a slice reads by default: the whole-run partition holds ~340 bytes a gap, so
#: a slice ~150 MB (a busy server's ~10 s)
DEFAULT_SLICE_EMISSIONS = 400_000
#: values read back from a temporary file at once (8 MiB: a chunk and its temporaries were
#: ~100 MB of a long run's peak)
_SPILL_CHUNK = 1 << 20


@dataclass
class Index:
    """What the index pass gathers: per step, per request, per run."""

    decode_net: list[np.ndarray] = field(default_factory=list)
    decode_net_itl: list[np.ndarray] = field(default_factory=list)
    graph_size: list[np.ndarray] = field(default_factory=list)
    num_decode: list[np.ndarray] = field(default_factory=list)
    num_preempted: int = 0
    num_admissions: int = 0  # the run's admission rows (its TTFT note on unsplit requests)
    max_decode: int = 0
    first_step_tick: int | None = None
    gc: list[np.ndarray] = field(default_factory=list)
    tokens: int = 0
    device_windows: int = 0
    last_tick: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    gaps: ExactQuantiles = field(default_factory=lambda: ExactQuantiles(_QS))
    computed_tokens: int = 0
    #: per evicted request not yet emitting again: its earliest such eviction's tick
    pending: dict[int, int] = field(default_factory=dict)
    #: each part's rows the run's evictions and speculative figures read: its eviction
    #: tables, counters, `recompute` segments and the emissions of requests evicted so far
    sparse: list[dict[str, Any]] = field(default_factory=list)
    #: the longest gap (ms) and where it ends (s; the first of equal ones)
    worst: tuple[float, float] = (-math.inf, math.inf)
    span_ticks: tuple[int, int] | None = None  # the run's first and last recorded tick
    first_part: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    first_tick: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    arrival_tick: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    labels: set[str] = field(default_factory=set)  # the ITL partition's labels, whole run
    ttft_labels: set[str] = field(default_factory=set)
    has_os: bool = False
    #: for a window's log (`light=True`): each part's steps, requests and eviction rows
    light: list[LightPart] | None = None
    fit: str = FIT_ALL_CAPTURED  # the ITL baseline's fit
    baselines: tuple[GraphBaseline, GraphBaseline] | None = None  # `whole_baselines`
    extra: ExactQuantiles = field(default_factory=ExactQuantiles)  # `index_pass`'s extra_qs
    #: every gap's length (ms, float64) in the order counted, for `keep_gap_values` (a
    #: temporary file: read back, the parts are not decoded again)
    spill: Any = None
    #: the buffers the per-request columns are views of (`grow_requests`)
    room: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    #: every request's id as the whole run names it, compactly (`sparse_part` adds them)
    names: RequestNames = field(default_factory=RequestNames)

    def steps(self, name: str) -> np.ndarray:
        """The whole run's per-step column `name` (`decode_net`, `decode_net_itl`,
        `graph_size`, `num_decode`: gathered a part at a time), joined once and held joined:
        the parts' arrays and a copy per reader were each ~36 MB of a day's 4.5 M steps."""
        pieces = getattr(self, name)
        if len(pieces) != 1:
            empty = np.zeros(0, dtype=np.float64 if name.startswith("decode") else np.int64)
            pieces[:] = [np.concatenate(pieces) if pieces else empty]
        return pieces[0]

    def grow_requests(self, n: int) -> None:
        """The per-request columns lengthened to `n` requests (new ones: none seen yet)."""
        never = np.iinfo(np.int64).min
        for key, fill in (("last_tick", never), ("first_part", -1), ("first_tick", NEVER),
                          ("arrival_tick", never)):  # fmt: skip
            setattr(self, key, grown(self.room, key, getattr(self, key), n, fill))


#: the tables a window's log keeps of each part before the window's (`LightPart`)
LIGHT_TABLES = ("steps", "requests", "admissions", "events", "preemptions", "evictors")


@dataclass(frozen=True)
class LightPart:
    """What a window's log keeps of a part before the window's parts (`Index.light`): its
    `LIGHT_TABLES` zlib-compressed, its other fields, and its ids only counted (the
    index pass names them, `Index.names`). A day of a busy server's were 351 MB of rows
    (~95 MB compressed) and ~3 M ids as Python strings."""

    fields: dict[str, Any]
    packed: dict[str, tuple[bytes, tuple[int, ...], str]]  # table -> bytes, shape, dtype

    @classmethod
    def of(cls, part: dict[str, Any]) -> LightPart:
        t = part["tables"]
        packed = {k: (zlib.compress(t[k].tobytes(), 1), t[k].shape, t[k].dtype.str)
                  for k in LIGHT_TABLES if k in t}  # fmt: skip
        fields = {k: v for k, v in part.items() if k not in ("tables", "request_ids")}
        return cls({**fields, "request_ids": Unnamed(len(part["request_ids"]))}, packed)

    def part(self) -> dict[str, Any]:
        """The part with those tables (writable arrays) and its ids unnamed."""
        tables = {k: np.frombuffer(bytearray(zlib.decompress(b)), dtype=dt).reshape(shape)
                  for k, (b, shape, dt) in self.packed.items()}  # fmt: skip
        return {**self.fields, "tables": tables}


def sparse_part(ix: Index, part: dict[str, Any]) -> dict[str, Any]:
    """What of `part` the per-run eviction and speculative figures read (few rows): its
    eviction tables, counters, `recompute` segments and, of each readmitted victim, its
    first emission strictly after the readmission (where the victim's debt ends,
    `reprefill.next_emission`) and no other: a day of a busy server keeps a row an
    eviction, never the victims' tokens. The part's new request ids go to `ix.names` (the
    parts come in order), the part keeps their count (`Unnamed`)."""
    if not len(ix.names):  # the first part: those before it were named in removed parts
        ix.names = RequestNames(part["request_ids_start"])
    ix.names.extend(part["request_ids"])
    part = {**part, "request_ids": Unnamed(len(part["request_ids"]))}
    t = part["tables"]
    keep = {k: t[k] for k in ("events", "preemptions", "evictors", "counters") if k in t}
    ev = t.get("events")
    back = ev[ev[:, 1] == READMIT] if ev is not None and len(ev) else None
    em = t.get("emissions")
    reqs = set(ix.pending) | (set(back[:, 0].tolist()) if back is not None else set())
    if em is not None and len(em) and reqs:
        rows: list[int] = []
        r_col, t_col = em[:, _EM["request"]], em[:, _EM["t_tick"]]
        for r in reqs:
            new = [] if back is None else back[back[:, 0] == r, 2].tolist()
            ticks = sorted(([ix.pending.pop(r)] if r in ix.pending else []) + new)
            mine = np.flatnonzero(r_col == r)
            mine = mine[np.argsort(t_col[mine], kind="stable")]
            for tick in ticks:  # the first emission after each readmission
                after = mine[t_col[mine] > tick]
                if len(after):
                    rows.append(int(after[0]))
                else:  # not yet: in a later part
                    ix.pending[r] = min(ix.pending.get(r, tick), tick)
        keep["emissions"] = em[np.unique(np.array(rows, dtype=np.int64))]
    elif back is not None:
        for r, tick in zip(back[:, 0].tolist(), back[:, 2].tolist(), strict=True):
            ix.pending[r] = min(ix.pending.get(r, tick), tick)
    sg = t.get("segments")
    if sg is not None and len(sg) and RECOMPUTE_LABEL in part["labels"]:
        keep["segments"] = sg[sg[:, 1] == part["labels"].index(RECOMPUTE_LABEL)]
    return {**part, "tables": keep}


def index_pass(
    run: SlicedRun,
    fit: str,
    progress: Callable[[str], None],
    *,
    light: bool = False,
    extra_qs: tuple[float, ...] = (),
    spill: bool = False,
) -> Index:
    """Every part once (`SlicedRun.index`): what the slices and the per-run figures need.
    `light`: keep each part's steps, requests and eviction rows (a window's log);
    `extra_qs`: also count the gaps for these percentiles (`Index.extra`); `spill`: write
    every gap's length to a temporary file (`Index.spill`, for `keep_gap_values`)."""
    ix = Index(light=[] if light else None, fit=fit)
    ix.extra = ExactQuantiles(extra_qs)
    if spill:
        ix.spill = tempfile.TemporaryFile()
    n_paths = len(run.paths)

    def visit(i: int, part: dict[str, Any]) -> None:
        t = part["tables"]
        st = t.get("steps")
        if st is not None and len(st):
            ix.graph_size.append(st[:, _ST["graph_size"]].copy())
            ix.num_decode.append(st[:, _ST["num_decode"]].copy())
            ix.num_preempted += int(st[:, _ST["num_preempted"]].sum())
            ix.computed_tokens += int(st[:, _ST["num_prefill_tokens"]].sum())
            ix.computed_tokens += int(st[:, _ST["num_decode"]].sum())
            ix.max_decode = max(ix.max_decode, int(st[:, _ST["num_decode"]].max()))
            first = int(st[:, _ST["t0_tick"]].min())
            if ix.first_step_tick is None or first < ix.first_step_tick:
                ix.first_step_tick = first
            # GC-free decode time of this part's steps, from it and the parts beside it
            step_figures(ix, *step_mini(run, i), len(st))
        ix.device_windows += device_rows(part)
        gc = t.get("gc_pauses")
        if gc is not None and len(gc):
            ix.gc.append(gc.copy())
        adm = t.get("admissions")
        ix.num_admissions += 0 if adm is None else len(adm)
        em = t.get("emissions")
        ix.grow_requests(part["request_ids_start"] + len(part["request_ids"]))
        rq = t.get("requests")
        if rq is not None and len(rq):
            ix.arrival_tick[rq[:, _RQ["request"]]] = rq[:, _RQ["arrival_tick"]]
        ix.sparse.append(sparse_part(ix, part))
        if ix.light is not None:
            ix.light.append(LightPart.of(part))
        span_of(ix, t)
        if em is not None and len(em):
            ix.tokens += int(em[:, _EM["num_tokens"]].sum())
            r = em[:, _EM["request"]]
            new = ix.first_part[r] < 0
            ix.first_part[r[new]] = i
            np.minimum.at(ix.first_tick, r[new], em[new, _EM["t_tick"]])
            gap, t1 = gap_lengths(run, ix.last_tick, em)
            ix.gaps.count(gap)
            if ix.spill is not None:
                gap.astype(np.float64).tofile(ix.spill)
            if ix.extra.qs:
                ix.extra.count(gap)
            if len(gap) and gap.max() >= ix.worst[0]:
                at = gap == gap.max()
                end = float(t1[at].min())
                if gap.max() > ix.worst[0] or end < ix.worst[1]:
                    ix.worst = (float(gap.max()), end)
        if i % 200 == 0 or i == n_paths - 1:
            progress(f"index: part {i + 1} of {n_paths}")

    run.index(visit)
    return ix


def gap_lengths(
    run: SlicedRun, last_tick: np.ndarray, em: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The gaps (ms, as the partition computes them) that end at a part's emissions `em`,
    each after its request's previous emission (in this part, else `last_tick`, which this
    moves on to each request's last emission here), and where each ends (s)."""
    o = np.argsort(em[:, _EM["t_tick"]], kind="stable")
    r, tk = em[o, _EM["request"]], em[o, _EM["t_tick"]]
    o2 = np.argsort(r, kind="stable")
    rs, ts = r[o2], tk[o2]
    head = np.ones(len(rs), dtype=bool)
    head[1:] = rs[1:] != rs[:-1]
    prev = np.empty(len(ts), dtype=np.int64)
    prev[1:] = ts[:-1]
    prev[head] = last_tick[rs[head]]
    has = prev != np.iinfo(np.int64).min
    last_tick[rs] = ts  # the last of each request wins (sorted by time)
    t1 = run.secs(ts[has])
    return (t1 - run.secs(prev[has])) * 1e3, t1


def span_of(ix: Index, t: dict[str, np.ndarray]) -> None:
    """The run's first and last recorded moment (steps, emissions: `run_span_s`)."""
    ticks = []
    st, em = t.get("steps"), t.get("emissions")
    if st is not None and len(st):
        ticks += [st[:, _ST["t0_tick"]], st[:, _ST["t1_tick"]]]
    if em is not None and len(em):
        ticks.append(em[:, _EM["t_tick"]])
    if ticks:
        lo, hi = int(min(a.min() for a in ticks)), int(max(a.max() for a in ticks))
        old = ix.span_ticks
        ix.span_ticks = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))


def keep_gap_values(run: SlicedRun, ix: Index) -> None:
    """Between the index pass and the partitions: the gaps' lengths again (emissions only),
    keeping the values the ITL percentiles are (so the tail's threshold is known before
    any slice is partitioned)."""
    ix.gaps.wanted()
    if ix.spill is not None:  # the lengths the index pass wrote: no part decoded again
        with ix.spill as spill:
            spill.seek(0)
            while len(chunk := np.fromfile(spill, dtype=np.float64, count=_SPILL_CHUNK)):
                ix.gaps.keep(chunk)
        ix.spill = None
        return
    last = np.full(len(ix.last_tick), np.iinfo(np.int64).min)
    for i in range(len(run.parts)):
        em = run.read(i)["tables"].get("emissions")
        if em is not None and len(em):
            ix.gaps.keep(gap_lengths(run, last, em)[0])


def step_mini(run: SlicedRun, i: int) -> tuple[RawLog, int]:
    """Part `i`'s steps read with the parts beside it (`STEP_TABLES`): the part before it
    (a step's rows may be flushed a part from its windows') and, where it can be read, the
    part after it (a device window is written when it resolves: the step in flight at a
    flush has its window in the next part); and the steps that part after adds (0: none
    read). One that cannot be read is said by the index pass when it gets there."""
    b, after = i + 1, 0
    if b < len(run.paths) and run.paths[b] and run.follows(b):
        try:
            nxt = run.read_indexed(b)
        except DamagedPart:
            nxt = None
        if nxt is not None:
            st = nxt["tables"].get("steps")
            b, after = b + 1, 0 if st is None else len(st)
    return run.unnamed_log_of(max(0, i - 1), b, STEP_TABLES), after


def device_rows(part: dict[str, Any]) -> int:
    """A part's device windows (`segments` rows with `is_device` 1)."""
    sg = part["tables"].get("segments")
    return 0 if sg is None or not len(sg) else int((sg[:, _SG_DEVICE] == 1).sum())


def step_figures(ix: Index, mini: RawLog, after: int, n_steps: int) -> None:
    """From a part's steps read with the parts beside it (`step_mini`: its `n_steps`
    steps, then `after` steps of the part after it): their GC-free decode time
    (`decode_net_ms`: as recorded for the TTFT partition, drift-corrected for the ITL one,
    design.md rule 4), and the labels the partitions will have (`itl_labels`,
    `ttft_labels`), without preparing the whole timeline."""
    causes = segment_causes(mini)
    is_dev = mini.segments.is_device == 1
    if not ix.has_os and len(mini.os_samples):
        ix.has_os = has_os_evidence(mini)
    classes = host_classes(causes, is_dev)
    os_labels = set(OS_LABELS) if ix.has_os else set()
    ix.labels |= ({c for c, _ in classes} | set(causes[is_dev].tolist()) | os_labels) - {
        RECOMPUTE_CLASS  # a timeline class, never a label (`itl_labels`)
    }
    ix.ttft_labels |= set(ttft_labels(mini, has_os=ix.has_os))
    mine = slice(len(mini.steps) - after - n_steps, len(mini.steps) - after)
    net = decode_net_ms(mini, causes)
    ix.decode_net.append(net[mine].copy())
    corrected = drift_corrected(mini)
    if corrected is not mini:
        net = decode_net_ms(corrected, segment_causes(corrected))
    ix.decode_net_itl.append(net[mine].copy())


@dataclass
class _Sums:
    """Per-gap figures added up over the slices, by label and primary-cause name."""

    all_parts: dict[str, float] = field(default_factory=dict)
    tail_parts: dict[str, float] = field(default_factory=dict)
    context: dict[str, float] = field(default_factory=dict)
    all_count: dict[str, int] = field(default_factory=dict)
    tail_count: dict[str, int] = field(default_factory=dict)
    hist: dict[tuple[int, str], int] = field(default_factory=dict)
    labels: set[str] = field(default_factory=set)
    causes: set[str] = field(default_factory=set)
    gap_total: float = 0.0
    tail_total: float = 0.0
    n: int = 0
    n_tail: int = 0
    max_gap: float = -math.inf
    max_err: float = 0.0
    skipped: int = 0
    ttft: list[TtftPartition] = field(default_factory=list)
    ttft_ms: list[np.ndarray] = field(default_factory=list)


def _add(d: dict, key: Any, v: Any) -> None:
    d[key] = d.get(key, 0) + v


def _own_gaps(p: Partition, t_from: float, t_to: float) -> Partition:
    own = (p.t1_s >= t_from) & (p.t1_s < t_to)
    return p if own.all() else p.take(own)  # `_needed` leaves mostly own gaps: no copy


@dataclass(frozen=True)
class SliceTask:
    """One slice's work, with all a worker needs (picklable: a process pool or Ray runs it,
    reading the parts from the same folder): the parts to read ``[c, b)``, the times its
    own gaps end in, how a log read from part `c` starts, the whole run's baselines cut to
    its steps and the tail's threshold."""

    parts_dir: str
    max_inflate_mb: float | None
    c: int
    b: int
    t_from_s: float
    t_to_s: float
    retained: Retained | None
    base_itl: GraphBaseline
    base_ttft: GraphBaseline
    fit: str
    p99: float
    #: a merged server run's: (request, API server) of the requests whose first token the
    #: slice owns (their first chunk may lie in a later part: `stating_api_servers`)
    api_servers: tuple[tuple[int, int], ...] = ()
    #: the paths of parts ``[c, b)``, as the index pass listed them (`SlicedRun`'s `parts`)
    paths: tuple[str, ...] = ()
    #: what other parts carry to the slice's log (`SlicedRun.carried_into`)
    carried: dict[str, Any] | None = None


@dataclass
class SlicePart:
    """What a slice gives back: its sums, and the forward shares of its clean gaps and of
    its tail's gaps (for the medians: counted, then read back from the spill)."""

    sums: _Sums
    clean: np.ndarray
    tail: np.ndarray


def slice_tasks(run: SlicedRun, ix: Index, max_emissions: int, p99: float) -> list[SliceTask]:
    """The slices of a run (after its index pass) as tasks."""
    base_itl, base_ttft = whole_baselines(run, ix)
    step0, n = run.parts[0].first_step, len(run.parts)
    out = []
    for c, a, b in run.bounds(max_emissions):
        s0 = run.parts[c].first_step - step0
        s1 = run.parts[b - 1].first_step - step0 + run.parts[b - 1].num_steps
        out.append(SliceTask(
            run.parts_dir, run.max_inflate_mb, c, b,
            -np.inf if a == 0 else run.cut_s(a), np.inf if b == n else run.cut_s(b),
            run.retained(c), _cut(base_itl, s0, s1), _cut(base_ttft, s0, s1), ix.fit, p99,
            _api_servers(run, ix, a, b), tuple(run.paths[c:b]), run.carried_into(c, b),
        ))  # fmt: skip
    return out


def _api_servers(run: SlicedRun, ix: Index, a: int, b: int) -> tuple[tuple[int, int], ...]:
    """(request, API server) of the requests whose first emission is in parts ``[a, b)``
    and that have one (a merged server run's)."""
    api = run.api_server
    if not len(api):
        return ()
    fp = ix.first_part[: len(api)]
    r = np.flatnonzero((fp >= a) & (fp < b) & (api[: len(fp)] >= 0))
    return tuple(zip(r.tolist(), api[r].tolist(), strict=True))


class SliceRead(NamedTuple):
    """One slice read and partitioned (`slice_partition`). Its log holds only the requests
    its rows name, numbered 0, 1, ... in the run's order (`SlicedRun.local_log_of`): its
    partitions' ``request`` columns are those numbers; `numbers` gives each its number in
    the run, `names` the run's ids as far as the slice's parts name them."""

    log: RawLog
    prep: PreparedRun
    p: Partition
    numbers: np.ndarray
    names: RequestNames


def slice_partition(task: SliceTask) -> SliceRead:
    """One slice's log (the emissions its own gaps and TTFTs need), prepared with the whole
    run's baselines, and its own gaps partitioned."""
    run = SlicedRun(task.parts_dir, max_inflate_mb=task.max_inflate_mb,
                    parts=(task.c, task.paths))  # fmt: skip
    read = run.local_log_of(task.c, task.b, retained=task.retained, thin_before_s=task.t_from_s,
                            carried=task.carried)  # fmt: skip
    # whose re-prefill each step is needs every victim's emission: stated before the cut
    full = stating_next_emissions(read.log)
    full = stating_api_servers(full, _local_pairs(task.api_servers, read.numbers))
    log = replace(full, emissions=full.emissions.take(_needed(full, task.t_from_s)))
    prep = PreparedRun(log)
    prep.use_baseline(FIT_ALL_CAPTURED, task.base_ttft)
    prep.corrected().use_baseline(task.fit, task.base_itl)
    p = _own_gaps(partition(log, baseline_fit=task.fit, run=prep), task.t_from_s, task.t_to_s)
    return SliceRead(log, prep, p, read.numbers, read.names)


def _local_pairs(
    pairs: tuple[tuple[int, int], ...], numbers: np.ndarray
) -> tuple[tuple[int, int], ...]:
    """(request, API server) pairs of the run's requests as a slice's log numbers them
    (those it holds)."""
    if not pairs:
        return ()
    r = np.array([q for q, _ in pairs], dtype=np.int64)
    k = np.minimum(np.searchsorted(numbers, r), max(len(numbers) - 1, 0))
    held = (numbers[k] == r) if len(numbers) else np.zeros(len(r), dtype=bool)
    return tuple((int(k[i]), pairs[i][1]) for i in np.flatnonzero(held).tolist())


def run_slice(task: SliceTask) -> SlicePart:
    """Partition one slice (its own gaps and TTFTs, with the whole run's baselines) and
    add up what the run's figures need."""
    out = slice_sums(task, *slice_partition(task)[:3])
    # the slice's log and partition, freed in holes between what lives on (the run's index,
    # the kept cuts), which the analysis's allocator settings keep (`tracekit.allocator`)
    give_back_freed_memory()
    return out


def slice_sums(task: SliceTask, log: RawLog, prep: PreparedRun, p: Partition) -> SlicePart:
    """What the run's figures need of one slice partitioned (`slice_partition`): a caller
    that also writes the slice's gaps out partitions it once for both."""
    fwd = _fwd_share(p)
    clean = fwd[(p.primary == CLEAN) & (p.gap_ms > 0)]
    tail = fwd[(p.gap_ms >= task.p99) & (p.gap_ms > 0)]
    tp = ttft_partition(log, run=prep)
    own_t = (tp.first_token_s >= task.t_from_s) & (tp.first_token_s < task.t_to_s)
    s = _Sums()
    _add_gaps(s, p, task.p99)
    s.ttft.append(tp.take(own_t))
    return SlicePart(s, clean, tail)


def whole_baselines(run: SlicedRun, ix: Index) -> tuple[GraphBaseline, GraphBaseline]:
    """The whole run's graph baselines: the ITL partition's (fitted by `ix.fit`, on the
    drift-corrected decode times) and the TTFT partition's (design.md's fit), once."""
    if ix.baselines is None:
        net, net_itl = ix.steps("decode_net"), ix.steps("decode_net_itl")
        gs, nd = ix.steps("graph_size"), ix.steps("num_decode")
        ix.baselines = (fit_baseline_steps(gs, nd, net_itl, ix.fit),
                        fit_baseline_steps(gs, nd, net, FIT_ALL_CAPTURED))  # fmt: skip
    return ix.baselines


def _needed(log: RawLog, t_from_s: float) -> np.ndarray:
    """The emissions a slice's own gaps and TTFTs need: its own (from `t_from_s`) and, of
    each request with one, the emission before its first own one (where its first own gap
    starts). A request's earlier emissions make gaps the slice does not own: left out, the
    slice partitions a fraction of what it reads. (A request whose first emission lies
    before the slice keeps one there, so its first token is never taken for a later one.)"""
    em = log.emissions
    if not len(em) or not np.isfinite(t_from_s):
        return np.arange(len(em))
    o = np.lexsort((em.t_s, em.request))
    r, own = em.request[o], em.t_s[o] >= t_from_s
    prev_same = np.zeros(len(o), dtype=bool)
    prev_same[1:] = r[1:] == r[:-1]
    first_own = own & ~np.concatenate([[False], own[:-1] & prev_same[1:]])
    before = np.zeros(len(o), dtype=bool)
    before[:-1] = first_own[1:] & prev_same[1:]  # the row before a request's first own row
    return np.sort(o[own | before])


def _cut(base, a: int, b: int):
    return replace(base, eager_excess_frac=base.eager_excess_frac[a:b],
                   decode_net_ms=base.decode_net_ms[a:b])  # fmt: skip


def _fwd_share(p: Partition) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(p.gap_ms > 0, p.column("forward") / p.gap_ms, np.nan)


def _add_gaps(s: _Sums, p: Partition, p99: float) -> None:
    """Pass 2's sums over one slice's own gaps (counts by integer primary, named once)."""
    names = (*p.causes, "clean")
    prim = np.where(p.primary == CLEAN, len(p.causes), p.primary)  # index into names
    s.labels |= set(p.labels)
    s.causes |= set(p.causes)
    gap = p.gap_ms
    s.n += len(gap)
    if not len(gap):
        return
    s.gap_total += float(gap.sum())
    s.max_gap = max(s.max_gap, float(gap.max()))
    s.max_err = max(s.max_err, p.reconcile_max_err_ms)
    s.skipped += int(((p.step1 - p.step0 > 1) & (p.num_evictions == 0)).sum())
    for j, lb in enumerate(p.labels):
        _add(s.all_parts, lb, float(p.parts_ms[:, j].sum()))
        _add(s.context, lb, float(p.context_ms[:, j].sum()))
    _add_counts(s.all_count, prim, names)
    edges = np.array(HIST_EDGES_MS)
    which = np.searchsorted(edges, gap, side="right") - 1
    ok = (which >= 0) & (which < len(edges) - 1)
    grid = np.bincount(which[ok] * len(names) + prim[ok], minlength=(len(edges) - 1) * len(names))
    for k in np.flatnonzero(grid).tolist():
        _add(s.hist, (k // len(names), names[k % len(names)]), int(grid[k]))
    tail = gap >= p99
    if tail.any():
        s.n_tail += int(tail.sum())
        s.tail_total += float(gap[tail].sum())
        for j, lb in enumerate(p.labels):
            _add(s.tail_parts, lb, float(p.parts_ms[tail, j].sum()))
        _add_counts(s.tail_count, prim[tail], names)


def _add_counts(d: dict[str, int], prim: np.ndarray, names: tuple[str, ...]) -> None:
    c = np.bincount(prim, minlength=len(names))
    for k in np.flatnonzero(c).tolist():
        _add(d, names[k], int(c[k]))


def analyze_sliced(
    parts_dir: str,
    *,
    baseline_fit: str = FIT_ALL_CAPTURED,
    max_emissions: int = DEFAULT_SLICE_EMISSIONS,
    max_inflate_mb: float | None = None,
    progress: Callable[[str], None] | None = None,
    path: str | None = None,
    mapper: Callable[[Callable[[Any], Any], list[Any]], Iterable[Any]] | None = None,
    indexer: Callable[..., Index] | None = None,
) -> RunAnalysis:
    """`tracekit.analysis.figures.analyze` of a run's parts folder, read in slices of
    at most `max_emissions` emissions each (see the module's docstring). `mapper(fn,
    items)`: runs the slices (a process pool's or Ray's map, results in order; by default
    one after the other here): the result is the same. `indexer`: `index_pass`'s stand-in
    (`stream_index.index_pass_spread`: the parts read by the mapper's workers). Raises
    `NotSliceable` for a folder that must be read whole."""
    say = progress or (lambda _msg: None)
    run = SlicedRun(parts_dir, max_inflate_mb=max_inflate_mb)
    ix = (indexer or index_pass)(run, baseline_fit, say, spill=True)
    keep_gap_values(run, ix)
    pct = ix.gaps.percentiles()
    p99 = pct[2]
    tasks = slice_tasks(run, ix, max_emissions, p99)
    each = mapper or _in_process
    s = _Sums()
    fwd_clean, fwd_tail = ExactQuantiles(), ExactQuantiles()
    ttft = TtftFold()  # the TTFT rows: folded as they come, not gathered
    with tempfile.TemporaryFile() as clean, tempfile.TemporaryFile() as tail:
        for j, part in enumerate(each(run_slice, tasks)):  # in slice order: the sums' order
            _fold(s, part.sums)
            for piece in part.sums.ttft:
                ttft.add(piece)
            for q, values, spill in ((fwd_clean, part.clean, clean), (fwd_tail, part.tail, tail)):
                q.count(values)
                np.asarray(values, dtype=np.float64).tofile(spill)
            say(f"slice {j + 1} of {len(tasks)}")
        for q, spill in ((fwd_clean, clean), (fwd_tail, tail)):  # the medians' values
            if not q.n:
                continue
            q.wanted()
            spill.seek(0)
            while len(chunk := np.fromfile(spill, dtype=np.float64, count=_SPILL_CHUNK)):
                q.keep(chunk)
    try:
        return _result(run, ix, s, pct, path or parts_dir, fwd_clean, fwd_tail, ttft)
    finally:
        ttft.close()


def _in_process(fn: Callable[[Any], Any], items: list[Any]) -> Iterator[Any]:
    return (fn(x) for x in items)


def _fold(s: _Sums, part: _Sums) -> None:
    """Add one slice's sums to the run's (in slice order, so the floats add as they would
    in one process)."""
    for d in ("all_parts", "tail_parts", "context", "all_count", "tail_count", "hist"):
        for k, v in getattr(part, d).items():
            _add(getattr(s, d), k, v)
    s.labels |= part.labels
    s.causes |= part.causes
    s.gap_total += part.gap_total
    s.tail_total += part.tail_total
    s.n += part.n
    s.n_tail += part.n_tail
    s.max_gap = max(s.max_gap, part.max_gap)
    s.max_err = max(s.max_err, part.max_err)
    s.skipped += part.skipped


def _ttft_rows(pieces: list[TtftPartition], has_admissions: bool | None) -> TtftPartition | None:
    """The slices' own TTFT rows as one partition: columns aligned by label name; its note
    on unsplit requests counts the whole run's (`has_admissions`: whether the run has any
    admission row; None: as the slices' notes say)."""
    if not pieces:
        return None
    labels = ordered(set().union(*(set(p.labels) for p in pieces)), TTFT_LABEL_GROUPS)
    causes_all = set().union(*(set(p.causes) for p in pieces))
    causes = tuple(lb for lb in labels if lb in causes_all)
    cols: dict[str, list[np.ndarray]] = {k: [] for k in ("parts_ms", "context_ms", "primary")}
    for p in pieces:
        where = [labels.index(lb) for lb in p.labels]
        for k in ("parts_ms", "context_ms"):
            m = np.zeros((len(p), len(labels)))
            m[:, where] = getattr(p, k)
            cols[k].append(m)
        remap = np.array([causes.index(c) for c in p.causes] + [CLEAN], dtype=np.int64)
        cols["primary"].append(remap[p.primary])  # CLEAN (-1) indexes the last: CLEAN
    first = pieces[0]
    cat = {
        f: np.concatenate([getattr(p, f) for p in pieces])
        for f in ("request", "arrival_s", "admit_s", "first_token_s", "ttft_ms", "phases_ms")
    }
    notes = tuple(dict.fromkeys(n for p in pieces for n in p.notes if UNSPLIT_WORDS not in n))
    n_unsplit = int(np.isnan(cat["admit_s"]).sum())
    if n_unsplit:
        if has_admissions is None:
            has_admissions = any(
                UNSPLIT_WORDS + "no admission event" in n for p in pieces for n in p.notes
            ) or bool((~np.isnan(cat["admit_s"])).any())
        notes = (*notes, unsplit_note(n_unsplit, has_admissions))
    return replace(first, labels=labels, causes=causes, notes=notes, **cat,
                   **{k: np.concatenate(v) for k, v in cols.items()})  # fmt: skip


def gathered_ttft_rows(pieces: list[TtftPartition]) -> TtftPartition | None:
    """Slices' own TTFT rows as one partition, columns aligned by label name (None: no
    rows): the whole run's TTFT rows, for figures computed on them."""
    return _ttft_rows(pieces, None)


def _share(parts: dict[str, float], total: float, labels: tuple[str, ...]) -> dict[str, float]:
    if total <= 0:
        return {lb: 0.0 for lb in labels}
    return {lb: float(parts.get(lb, 0.0) / total) for lb in labels}


def _gc_figures(run: SlicedRun, ix: Index) -> tuple[dict[str, int], list[float], list[float]]:
    """`figures._gc_figures` from the GC rows the index pass kept."""
    rows = np.concatenate(ix.gc) if ix.gc else np.zeros((0, len(_GC)), dtype=np.int64)
    gen = rows[:, _GC["generation"]]
    gens = np.bincount(gen, minlength=3) if len(rows) else np.zeros(3, int)
    t0, t1 = run.secs(rows[:, _GC["t0_tick"]]), run.secs(rows[:, _GC["t1_tick"]])
    tick = ix.first_step_tick
    first = math.inf if tick is None else float(run.secs(np.array(tick)))
    g2 = gen == 2
    g2_ms, g2_end = (t1[g2] - t0[g2]) * 1e3, t1[g2]
    return (
        {str(g): int(c) for g, c in enumerate(gens)},
        [round(float(x), 1) for x in g2_ms[g2_end <= first]],
        [round(float(x), 1) for x in g2_ms[g2_end > first]],
    )


def run_fields(run: SlicedRun, ix: Index, path: str) -> dict[str, Any]:
    """The per-run figures of `RunAnalysis` (those a window does not cut), from the index
    pass and the run's eviction rows."""
    tail_log = run.log_of(len(run.parts) - 1, len(run.parts), tables=frozenset(), final=True)
    sparse = merge_flushed(run.meta, ix.sparse, path=path, retained=run.retained(0))
    evictions = eviction_summary(replace(sparse, request_ids=ix.names))
    if evictions is not None:  # the steps' computed tokens: counted in the index pass
        c = ix.computed_tokens
        evictions = replace(evictions, computed_tokens=c, recompute_tax=(
            evictions.recomputed_tokens / c if c else math.nan))  # fmt: skip
    base = whole_baselines(run, ix)[0]
    gs = ix.steps("graph_size")
    n_req = run.parts[-1].request_ids_start + len(run.read(len(run.parts) - 1)["request_ids"])
    wall_s = float(tail_log.wall_s)
    gc_counts, g2_startup, g2_serving = _gc_figures(run, ix)
    warnings = list(tail_log.warnings)
    if (gs == GRAPH_EAGER).any() and base.num_fit_steps == 0:
        warnings.append("eager steps but no captured steps to fit a baseline: graph excess "
                        "not measured")  # fmt: skip
    if not (isinstance(run.final, dict) and "processes" in run.final):
        # what the recording process left unrecorded (killed: no rows after its last
        # flush), as the whole-run analysis says it (a merged server run's processes are
        # said with its client boundary, `tracekit.analysis.stream_client`)
        warnings += [u["line"] for u in unrecorded_report(with_run_coverage(run, tail_log))]
    calibration = dict(tail_log.meta.get("device_calibration") or {})
    return {
        "path": path,
        "rung": tail_log.rung,
        "seed": tail_log.seed,
        "config": dict(tail_log.config),
        "requests": n_req,
        "tokens": ix.tokens,
        "wall_s": wall_s,
        "tok_per_s": ix.tokens / wall_s if wall_s > 0 else math.nan,
        "preemptions": ix.num_preempted,
        "eager_steps": int((gs == GRAPH_EAGER).sum()),
        "max_decode_B": ix.max_decode,
        "steps": len(gs),
        "gc_counts": gc_counts,
        "gen2_startup_ms": g2_startup,
        "gen2_serving_ms": g2_serving,
        "graph_baseline": {
            "slope_ms_per_row": base.slope_ms_per_row,
            "intercept_ms": base.intercept_ms,
            "num_fit_steps": base.num_fit_steps,
        },
        "device_windows": ix.device_windows,
        "device_clock_drift_ppm": float(tail_log.meta.get("device_clock_drift_ppm", math.nan)),
        "device_max_placement_err_ms": float(calibration.get("max_placement_err_ms", math.nan)),
        "warnings": warnings,
        "spec": _spec(run, ix, sparse),
        "recompute_tax": evictions.recompute_tax if evictions is not None else 0.0,
        "evictions": evictions,
    }


def with_run_coverage(run: SlicedRun, tail_log: RawLog) -> RawLog:
    """`tail_log` (the run's last part) with the span the whole run's rows cover: a
    process's log read from its last part starts there; a merged server run's last part
    carries every process's span (`tracekit.log.merged_tables`)."""
    if isinstance(tail_log.meta.get("processes"), list) or len(tail_log.coverage) != 1:
        return tail_log
    first = run.log_of(0, 1, tables=frozenset()).coverage
    return replace(tail_log, coverage=replace(tail_log.coverage, t_start_s=first.t_start_s))


def _spec(run: SlicedRun, ix: Index, sparse: RawLog) -> SpecAcceptance | None:
    """Speculative decoding from the run's counters, its tokens per emission over every
    emission (counted in the index pass: `sparse` keeps only the evicted requests')."""
    spec = spec_result(sparse)
    n = sum(e.num_emissions for e in run.parts)
    return None if spec is None else replace(
        spec, tokens_per_emission=ix.tokens / n if n else math.nan)  # fmt: skip


def _result(run: SlicedRun, ix: Index, s: _Sums, pct: list[float], path: str,
            fwd_clean: ExactQuantiles, fwd_tail: ExactQuantiles,
            tp: TtftFold) -> RunAnalysis:  # fmt: skip
    labels = tuple(partition_labels(s.labels)) if s.labels else ()
    causes = tuple(lb for lb in labels if lb in s.causes)
    names = (*causes, "clean")
    ttft = tp.values()
    edges = HIST_EDGES_MS
    return RunAnalysis(
        labels=labels,
        gaps=s.n,
        itl_p50=pct[0],
        itl_p90=pct[1],
        itl_p99=pct[2],
        itl_p999=pct[3],
        itl_max=s.max_gap if s.n else math.nan,
        ttft_p50=float(np.percentile(ttft, 50.0)) if len(ttft) else math.nan,
        ttft_p99=float(np.percentile(ttft, 99.0)) if len(ttft) else math.nan,
        tail_share=_share(s.tail_parts, s.tail_total, labels),
        all_share=_share(s.all_parts, s.gap_total, labels),
        tail_count={n: s.tail_count.get(n, 0) for n in names},
        all_count={n: s.all_count.get(n, 0) for n in names},
        fwd_share_clean_median=fwd_clean.median(),
        fwd_share_tail_median=fwd_tail.median(),
        evicted_context_ms={lb: float(s.context.get(lb, 0.0)) for lb in labels},
        reconcile_max_err_ms=s.max_err,
        skipped_steps_without_eviction=s.skipped,
        hist=[
            HistBin(
                lo_ms=float(edges[b]),
                hi_ms=float(edges[b + 1]),
                count=sum(s.hist.get((b, n), 0) for n in names),
                by_primary={n: s.hist.get((b, n), 0) for n in names},
            )  # fmt: skip
            for b in range(len(edges) - 1)
        ],
        ttft=tp.figures(ix.num_admissions > 0),
        **run_fields(run, ix, path),
    )
