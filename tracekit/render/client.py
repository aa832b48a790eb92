"""The client boundary of a merged server run, rendered: a terminal block and a
self-contained HTML section (plain tables, no script). Consumes `RunAnalysis.client` and
`RunAnalysis.spec` (`tracekit.analysis.results`); analyses nothing itself."""

from __future__ import annotations

import heapq
import html
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from tracekit.analysis.figures import RunAnalysis
from tracekit.analysis.results import ClientSummary, SpecAcceptance
from tracekit.log.rawlog import RawLog

#: How each ITL convention (`tracekit.analysis.results.ItlConventions`) is titled.
CONVENTIONS = {
    "per_chunk": "per chunk (client gap)",
    "per_token": "per token (chunk gap / its tokens)",
    "per_engine_step": "per engine step (engine gap)",
}


def _ms(x: float | None, nd: int = 2) -> str:
    return "-" if x is None or not math.isfinite(float(x)) else f"{float(x):.{nd}f}"


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(float(x)) else f"{100 * float(x):.1f}%"


def _shares(share: dict[str, float] | None) -> list[tuple[str, float]]:
    return [(lb, v) for lb, v in (share or {}).items() if v and v > 5e-4]


def client_text(c: ClientSummary | None) -> str:
    """Terminal block for one run's client boundary ('' when the run has none)."""
    if not c:
        return ""
    itl = c.itl_ms
    err = c.reconcile_max_err_ms if c.reconcile_max_err_ms is not None else 0
    lines = [
        f"Client boundary: {c.num_chunks} chunks, {c.num_gaps} gaps between chunks, "
        f"{_ms(itl.tokens_per_chunk_mean)} tokens per chunk; frontend share of gap time "
        f"{_pct(c.frontend_share)}; "
        f"reconcile max err {err:.1e} ms",
        f"{'ITL ms':<38}{'p50':>9}{'p90':>9}{'p99':>9}{'mean':>9}{'n':>7}",
    ]
    for key, v in itl.named():
        name = CONVENTIONS[key]
        lines.append(
            f"{name:<38}{_ms(v.p50_ms):>9}{_ms(v.p90_ms):>9}{_ms(v.p99_ms):>9}"
            f"{_ms(v.mean_ms):>9}{v.num_values:>7}"
        )
    spec = c.spec
    if spec:
        lines.append(
            f"speculative decoding: {spec.num_accepted_tokens:.0f} of "
            f"{spec.num_drafted_tokens:.0f} draft tokens accepted ({_pct(spec.acceptance)}), "
            f"{_ms(spec.tokens_per_emission)} tokens per engine emission; "
            f"{spec_positions_text(spec)}"
        )
    for share, title in ((c.tail_share, f"client tail (gaps >= p99 {_ms(c.p99_ms)} ms)"),
                         (c.all_share, "all client-gap time")):  # fmt: skip
        parts = ", ".join(f"{lb} {_pct(v)}" for lb, v in _shares(share))
        lines.append(f"{title}: {parts}")
    lines.append(ttft_text(c))
    lines += [f"unrecorded: {u['line']}" for u in c.unrecorded]
    return "\n".join(lines)


def ttft_text(c: ClientSummary) -> str:
    """The client-boundary TTFT beside the engine boundary's (same requests), one line."""
    parts = ", ".join(f"{lb} {_pct(v)}" for lb, v in _shares(c.ttft_share))
    return (
        f"TTFT ms, arrival to the first chunk's write (client boundary): p50 "
        f"{_ms(c.ttft_p50_ms)} p99 {_ms(c.ttft_p99_ms)}; to the first token (engine "
        f"boundary): p50 {_ms(c.ttft_engine_p50_ms)} p99 {_ms(c.ttft_engine_p99_ms)}; "
        f"client TTFT time: {parts or '-'}"
    )


def spec_positions_text(s: SpecAcceptance) -> str:
    """Mean accepted length and acceptance per draft position, one line (positions
    1-based, as vLLM's log prints them)."""
    per = ", ".join(f"{k + 1}: {_pct(r)}" for k, r in enumerate(s.acceptance_per_pos)) or "-"
    return (
        f"mean accepted length {_ms(s.mean_accepted_length_tokens)}, acceptance by position {per}"
    )


def spec_text(a: RunAnalysis) -> str:
    """One line for a run with speculative decoding: acceptance next to ITL."""
    s = a.spec
    assert s is not None, "spec_text: a run with speculative decoding"
    return (
        f"speculative decoding: {s.num_accepted_tokens:.0f} of {s.num_drafted_tokens:.0f} "
        f"draft tokens accepted ({_pct(s.acceptance)}), {_ms(s.tokens_per_emission)} tokens "
        f"per engine emission; ITL (per engine emission) p50 {_ms(a.itl_p50)} ms, "
        f"p99 {_ms(a.itl_p99)} ms; {spec_positions_text(s)}"
    )


def spec_positions_html(runs: Sequence[tuple[str, SpecAcceptance]]) -> str:
    """A table of acceptance by draft position, one row per run: drafts checked, mean
    accepted length, then per position the share of drafts with that position accepted
    (and the count)."""
    n_pos = max((len(s.acceptance_per_pos) for _, s in runs), default=0)
    if not n_pos:
        return ""
    head = "".join(f"<th>position {k + 1}</th>" for k in range(n_pos))
    rows = []
    for name, s in runs:
        rates, counts = s.acceptance_per_pos, s.num_accepted_per_pos
        cells = "".join(
            f"<td>{_pct(rates[k])} ({counts[k]:.0f})</td>" if k < len(rates) else "<td>-</td>"
            for k in range(n_pos)
        )
        rows.append(
            f"<tr><td>{html.escape(name)}</td><td>{_ms(s.num_drafts, 0)}</td>"
            f"<td>{_ms(s.mean_accepted_length_tokens)}</td>{cells}</tr>"
        )
    return (
        "<table class=spec-pos><tr><th>run</th><th>drafts</th><th>mean accepted length</th>"
        f"{head}</tr>{''.join(rows)}</table><p class=note>Per position K: the share of drafts "
        "whose K-th draft token was accepted (acceptance stops at the first rejection, so it "
        "can only fall with K); mean accepted length: 1 + accepted / drafts, the tokens one "
        "checked draft yielded.</p>"
    )


def spec_html(runs: Sequence[tuple[str, RunAnalysis]]) -> str:
    """Acceptance next to ITL for runs with speculative decoding but no client boundary
    (a run with one shows it in its client-boundary section)."""
    have = [(n, a, a.spec) for n, a in runs if a.spec and not a.client]
    if not have:
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(n)}</td><td>{_pct(s.acceptance)}</td>"
        f"<td>{s.num_accepted_tokens:.0f} / {s.num_drafted_tokens:.0f}</td>"
        f"<td>{_ms(s.mean_accepted_length_tokens)}</td>"
        f"<td>{_ms(s.tokens_per_emission)}</td><td>{_ms(a.itl_p50)}</td>"
        f"<td>{_ms(a.itl_p99)}</td></tr>"
        for n, a, s in have
    )
    return (
        "<h2>Speculative decoding</h2><p class=note>Draft tokens accepted, and ITL between "
        "engine emissions (each carries every token a step accepted).</p><table><tr>"
        "<th>run</th><th>acceptance</th><th>accepted / drafted</th><th>mean accepted length"
        "</th><th>tokens per emission"
        f"</th><th>ITL p50 ms</th><th>ITL p99 ms</th></tr>{rows}</table>"
        + spec_positions_html([(n, s) for n, _, s in have])
    )


def client_html(runs: Sequence[tuple[str, ClientSummary | None]]) -> str:
    """HTML section for the runs that have a client boundary ('' when none has)."""
    have = [(n, c) for n, c in runs if c]
    if not have:
        return ""
    e = html.escape
    out = [
        "<h2>Client boundary (streamed chunks)</h2><p class=note>Gaps between two chunks a "
        "client received, partitioned: the engine's causes until the chunk's last token left "
        "the engine, then the API server's (hop, output processing and detokenisation, "
        "frontend GC, the SSE write, other). ITL in three conventions side by side.</p>"
    ]
    for name, c in have:
        assert c is not None
        itl = c.itl_ms
        tail = c.tail_share or {}
        rows = "".join(
            f"<tr><td>{e(CONVENTIONS[k])}</td><td>{_ms(v.p50_ms)}</td><td>{_ms(v.p90_ms)}</td>"
            f"<td>{_ms(v.p99_ms)}</td><td>{_ms(v.mean_ms)}</td><td>{v.num_values}</td></tr>"
            for k, v in itl.named()
        )
        share = "".join(
            f"<tr><td>{e(lb)}</td><td>{_pct(c.all_share.get(lb))}</td>"
            f"<td>{_pct(tail.get(lb))}</td></tr>"
            for lb, _ in _shares(c.all_share)
        )
        spec = c.spec
        spec_p = (
            f"<p>Speculative decoding: acceptance {_pct(spec.acceptance)} "
            f"({spec.num_accepted_tokens:.0f} of {spec.num_drafted_tokens:.0f} draft tokens), "
            f"{_ms(spec.tokens_per_emission)} tokens per engine emission, mean accepted "
            f"length {_ms(spec.mean_accepted_length_tokens)}.</p>"
            + spec_positions_html([(name, spec)])
            if spec
            else ""
        )
        unrec = "".join(f"<li>{e(u['line'])}</li>" for u in c.unrecorded)
        unrec = (
            "<p class=note>Unrecorded: where a process recorded nothing, client-gap time is "
            f"<code>unrecorded:ROLE</code>, never another process's cause.</p><ul>{unrec}</ul>"
            if unrec
            else ""
        )
        out.append(
            f"<h3>{e(name)}</h3><p>{c.num_chunks} chunks, {_ms(itl.tokens_per_chunk_mean)} "
            f"tokens per chunk, frontend share of gap time {_pct(c.frontend_share)}.</p>"
            f"{spec_p}<table><tr><th>ITL ms</th><th>p50</th><th>p90</th><th>p99</th>"
            f"<th>mean</th><th>n</th></tr>{rows}</table>"
            f"<table><tr><th>label</th><th>all gap time</th><th>tail time</th></tr>{share}</table>"
            f"{_ttft_html(c)}{unrec}"
        )
    return "".join(out)


#: Perfetto pids of the other processes of a merged run: this base + their index in
#: ``meta["processes"]`` (the engine core is the trace's "engine" process).
PID_PROCESS_BASE = 100
#: Their threads: tids from here (clear of the request tracks' tids), 1000 per process.
TID_PROCESS_BASE = 1_000_000


def window_lanes(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int]:
    """(lane of each window [a, b), number of lanes): windows taken by start (longest first
    at a tie), each into the lowest lane whose last window has ended by its start, else a
    new lane. The same answer as `window_lanes_reference` in O(n log n) however many lanes
    there are: the lanes that have ended by a start are kept in a heap of free lane numbers,
    fed from a heap of (end, lane) of the busy ones. An end that is not a number never
    frees its lane (as in the reference, where ``nan <= a`` is false)."""
    lane_of = np.zeros(len(a), dtype=np.int64)
    ends = np.where(np.isnan(b), np.inf, b).tolist()
    starts = a.tolist()
    busy: list[tuple[float, int]] = []  # (end, lane) of each lane's last window
    free: list[int] = []  # lanes whose last window has ended
    n_lanes = 0
    for i in np.lexsort((-b, a)).tolist():
        x = starts[i]
        while busy and busy[0][0] <= x:
            heapq.heappush(free, heapq.heappop(busy)[1])
        if free:
            j = heapq.heappop(free)
        else:
            j, n_lanes = n_lanes, n_lanes + 1
        heapq.heappush(busy, (ends[i], j))
        lane_of[i] = j
    return lane_of, n_lanes


def window_lanes_reference(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, int]:
    """The slow, obvious `window_lanes` (O(n * lanes)): try every lane in order; for tests."""
    lane_end: list[float] = []
    lane_of = np.zeros(len(a), dtype=np.int64)
    for i in np.lexsort((-b, a)).tolist():
        j = next((q for q, e in enumerate(lane_end) if e <= a[i]), len(lane_end))
        if j == len(lane_end):
            lane_end.append(b[i])
        else:
            lane_end[j] = b[i]
        lane_of[i] = j
    return lane_of, len(lane_end)


def process_events(
    log: RawLog, window_s: tuple[float, float] | None = None
) -> list[dict[str, Any]]:
    """Chrome trace events for a merged server run: one process track per process other
    than the engine core (API server, workers), one thread per window label, the client
    chunks (instants, with request and tokens) and the arrival of each step's outputs.
    Times in µs on the run's clock; only what lies at or after the engine core's start."""
    procs = log.meta.get("processes") or []
    ps, ce, dl = log.proc_segments, log.client_emissions, log.deliveries
    names = log.request_names()
    out: list[dict[str, Any]] = []

    def keep(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        m = a >= 0
        if window_s is not None:
            m &= (b >= window_s[0]) & (a < window_s[1])  # [from, to), as every window
        return m

    for k, p in enumerate(procs):
        if k == 0 or not isinstance(p, dict):
            continue  # the engine core: the trace's engine process
        pid = PID_PROCESS_BASE + k
        ranks = ", ".join(
            f"{what} {p[key]}" for key, what in (("dp_rank", "dp rank"), ("tp_rank", "tp rank"))
            if isinstance(p.get(key), int)
        )  # fmt: skip
        name = f"{p.get('role', '?')} (pid {p.get('pid', '?')}{', ' + ranks if ranks else ''})"
        out.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}})
        out.append(
            {"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": 2 + k}}
        )
        mine = ps.process == k
        labels = sorted({int(x) for x in ps.label[mine]})
        tid = TID_PROCESS_BASE + 1000 * k  # Perfetto keys JSON threads by tid alone
        for lab in labels:
            m = mine & (ps.label == lab)
            a, b = ps.t_start_s[m], ps.t_end_s[m]
            sel = keep(a, b)
            a, b = a[sel], b[sel]
            # windows of one label can overlap (concurrent requests awaiting the tokenizer,
            # a GC inside a write): one track per lane, a lane never holds two that overlap
            lane_of, n_lanes = window_lanes(a, b)
            by_lane = np.argsort(lane_of, kind="stable")  # each lane's windows in log order
            cut = np.searchsorted(lane_of[by_lane], np.arange(n_lanes + 1))
            for j in range(max(n_lanes, 1)):
                tid += 1
                name = log.labels[lab] + (f" ({j + 1})" if j else "")
                out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                            "args": {"name": name}})  # fmt: skip
                if j >= n_lanes:
                    continue
                w = by_lane[cut[j] : cut[j + 1]]
                for t0, t1 in zip(a[w].tolist(), b[w].tolist(), strict=True):
                    out.append({"ph": "X", "pid": pid, "tid": tid, "name": log.labels[lab],
                                "ts": round(t0 * 1e6, 3),
                                "dur": round(max(t1 - t0, 0) * 1e6, 3)})  # fmt: skip
        m = ce.process == k
        if m.any():
            tid += 1
            out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                        "args": {"name": "client chunks written"}})  # fmt: skip
            sel = m & keep(ce.t_s, ce.t_s)
            for r, t, n in zip(ce.request[sel].tolist(), ce.t_s[sel].tolist(),
                               ce.num_tokens[sel].tolist(), strict=True):  # fmt: skip
                out.append({"ph": "i", "s": "t", "pid": pid, "tid": tid, "name": "chunk",
                            "ts": round(t * 1e6, 3),
                            "args": {"request": names[r], "tokens": n}})  # fmt: skip
        m = dl.process == k
        if m.any():
            tid += 1
            out.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name",
                        "args": {"name": "step outputs received"}})  # fmt: skip
            sel = m & keep(dl.t_recv_s, dl.t_recv_s)
            for s, t_out, t in zip(dl.step[sel].tolist(), dl.t_out_s[sel].tolist(),
                                   dl.t_recv_s[sel].tolist(), strict=True):  # fmt: skip
                out.append(
                    {
                        "ph": "i",
                        "s": "t",
                        "pid": pid,
                        "tid": tid,
                        "name": "outputs",
                        "ts": round(t * 1e6, 3),
                        "args": {"step": s, "hop_ms": round((t - t_out) * 1e3, 4)},
                    }
                )
    return out


def _ttft_html(c: ClientSummary) -> str:
    """TTFT at the client boundary beside the engine boundary's, and its shares by label."""
    e = html.escape
    share = "".join(
        f"<tr><td>{e(lb)}</td><td>{_pct(v)}</td></tr>" for lb, v in _shares(c.ttft_share)
    )
    return (
        "<table class=client-ttft><tr><th>TTFT ms</th><th>p50</th><th>p99</th></tr>"
        f"<tr><td>client boundary (arrival to the first chunk's write)</td>"
        f"<td>{_ms(c.ttft_p50_ms)}</td><td>{_ms(c.ttft_p99_ms)}</td></tr>"
        f"<tr><td>engine boundary (arrival to the first token)</td>"
        f"<td>{_ms(c.ttft_engine_p50_ms)}</td><td>{_ms(c.ttft_engine_p99_ms)}</td></tr></table>"
        "<p class=note>The client boundary's TTFT is what a streaming client measures (vllm "
        "bench serve, GuideLLM, AIPerf) less the socket hop after the write: the engine "
        "boundary's parts to the first token, then the API server's. Over the same requests."
        f"</p><table><tr><th>label</th><th>client TTFT time</th></tr>{share}</table>"
    )
