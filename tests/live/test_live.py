"""Live mode (`tracekit.live`): the per-cause metrics and spans a sink exports while the
engine runs agree with the offline partition of the same run's raw log.

A hand-built run on a fake clock checks the settlement rules (hold, late windows, the
graph/forward split settled at close) against values derived from design.md by hand; a
demo engine run checks agreement with `tracekit analyze` / `tracekit gaps` through a real
HTTP scrape and the OpenTelemetry SDK's in-memory exporter.
"""

from __future__ import annotations

import json
import logging
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("opentelemetry.sdk")

import tracekit  # noqa: E402
from tracekit.attribution.itl import partition  # noqa: E402
from tracekit.attribution.ttft import ttft_partition  # noqa: E402
from tracekit.capture.recorder import active_recorders  # noqa: E402
from tracekit.live import LiveMetrics, attach  # noqa: E402
from tracekit.live.settler import Settler  # noqa: E402
from tracekit.log.flush import TABLES as TABLE_COLS  # noqa: E402


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    assert not active_recorders(), "a Recorder was left running"


class FakeClock:
    """Integer milliseconds, set by the test."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


def _wait_idle(live: LiveMetrics) -> None:
    """Until the sink's worker has partitioned every queued chunk (no time asserted)."""
    for _ in range(2000):
        if live.snapshot()["backlog"] == 0:
            return
        time.sleep(0.005)
    raise AssertionError("the live worker never caught up")


# The hand-built run (ticks are ms; seconds_per_tick = 1e-3; flush every 1000 ms):
# one request "a" (arrival 0, 25 tokens); step k (k = 0..24) starts at 100k, runs a decode
# segment [100k + 2, 100k + 2 + d_k] and emits at its end e_k = 100k + 2 + d_k, where
# d_k = 8 ms (k < 10, captured size 1), 12 ms (10 <= k < 15, eager), 4 ms (k >= 15,
# captured size 1). A tokenizer call on another thread covers [150, 950]; it is recorded
# (add_segment) only after step 10, i.e. after the first flush (step 10 ends at 1014).
D = [8] * 10 + [12] * 5 + [4] * 10
TOK = (150, 950)


def _hand_run(live: LiveMetrics, *, check_between=None) -> tracekit.RawLog:
    clk = FakeClock()
    rec = tracekit.Recorder(
        None, clock=clk, seconds_per_tick=1e-3, flush_interval_s=1.0, gc=False,
        handle_signals=False,
    )  # fmt: skip
    attach(rec, live)
    with rec:
        rec.request("a", max_new_tokens=25, arrival_tick=0)
        for k, d in enumerate(D):
            clk.now = 100 * k
            with rec.step():
                clk.now = 100 * k + 2
                with rec.segment("decode"):
                    clk.now = 100 * k + 2 + d
                rec.emit(["a"])
                rec.step_info(num_decode=1, graph_size=0 if 10 <= k < 15 else 1)
            if k == 10:
                clk.now = 1050
                rec.add_segment("tok", *TOK)
            if k == 21 and check_between is not None:  # the second flush was at step 21's end
                check_between()
        clk.now = 2500
    return rec.log()


# The same run as the chunks a recorder flushing at 1014 (step 10's end), 2106 (step 21's
# end) and at its stop (2500) hands its sinks: each row goes in the first chunk flushed at
# or after the tick it was completed (a segment or step at its end, an emission at its
# time; the tok window at 1050). Fed straight to a sink, so the batches settled are these
# whatever a recorder's dispatch does.
META = {"t0_tick": 0, "seconds_per_tick": 1e-3, "started_unix_s": 0.0, "cause_map": {}}


def _chunk(
    rows: list[tuple[str, tuple]], flush_tick: int, *, stop: bool = False, labels=("decode", "tok")
) -> dict:
    c: dict = {}
    for k in TABLE_COLS:
        sel = [r for t, r in rows if t == k]
        c[k] = np.array(sel, dtype=np.float64 if k == "counters" else np.int64).reshape(-1)
    c["labels"] = np.array(list(labels))
    c["counter_names"] = np.array([], dtype=str)
    c["request_ids"] = (
        np.array(["a"]) if any(t == "requests" for t, _ in rows) else np.array([], dtype=str)
    )
    c["request_ids_start"] = np.array(0)
    c["config"] = np.array("{}")
    c["flush_tick"] = np.array(flush_tick)
    c["t0_tick"] = np.array(0)
    c["seconds_per_tick"] = np.array(1e-3)
    if stop:
        c["stop_tick"] = np.array(flush_tick)
    return c


def _split(done: list[tuple[int, str, tuple]], flushes: list[int], **kw) -> list[dict]:
    """Rows (completed at tick, table, row) cut into the chunks of `flushes` (the last is
    the stop)."""
    out, prev = [], -1
    for i, f in enumerate(flushes):
        rows = [(k, r) for t, k, r in done if prev < t <= f]
        out.append(_chunk(rows, f, stop=i == len(flushes) - 1, **kw))
        prev = f
    return out


def _hand_chunks(**kw) -> list[dict]:
    done = [(0, "requests", (0, 0, -1, 25))]
    for k, d in enumerate(D):
        e = 100 * k + 2 + d
        graph = 0 if 10 <= k < 15 else 1
        done.append((e, "segments", (k, 0, 100 * k + 2, e, 0, 0)))  # decode (label 0)
        done.append((e, "emissions", (0, e, k, 1, k)))
        done.append((e, "steps", (100 * k, e, 1, 0, graph, 0, 0)))
    done.append((1050, "segments", (-1, 1, *TOK, 1, 0)))  # tok (label 1), another thread
    return _split(done, [1014, 2106, 2500], **kw)


def _replay(live, chunks: list[dict], between=None) -> None:
    """open / write each chunk / close, as a recorder's dispatcher does; `between` runs
    once the worker has partitioned the second chunk."""
    live.open(META)
    for i, c in enumerate(chunks):
        live.write(c)
        if i == 1 and between is not None:
            _wait_idle(live)
            between()
    live.close({})


def test_hand_built_run_settles_every_gap_exactly():
    live = LiveMetrics(hold_s=1.2)
    log = _hand_run(live)
    s = live.snapshot()
    # 25 emissions of one request: 24 gaps, gap k = e_k - e_{k-1} = 100 + d_k - d_{k-1}
    assert s["gaps"] == 24
    gap_total = sum(100 + D[k] - D[k - 1] for k in range(1, 25))
    # the first flush is at 1014, W = 1014 - 1200 < 0: nothing settled before the tok
    # window arrived (in the second chunk), so nothing is late
    assert s["late_rows"] == 0 and s["truncated_gaps"] == 0 and s["errors"] == 0
    # tok owns all of [150, 950] (inside the gaps, which span [e_0, e_24] = [10, 2406]),
    # over decode (precedence): 800 ms
    assert s["cause_ms"]["tok"] == pytest.approx(800, abs=1e-9)
    # decode in gaps: sum over k = 1..24 of d_k = 9*8 + 5*12 + 10*4 = 172 ms, minus the
    # decode of steps 2..9 (inside [150, 950], owned by tok): 8 * 8 = 64 -> 108 ms
    # graph (rule 4): captured steps all at size 1 -> a flat line at their mean decode,
    # (10*8 + 10*4) / 20 = 6 ms; eager excess fraction (12 - 6) / 12 = 1/2, on 5 eager
    # steps of 12 ms wholly inside their gaps -> 30 ms; forward = 108 - 30 = 78 ms
    assert s["cause_ms"]["graph"] == pytest.approx(30, abs=1e-9)
    assert s["cause_ms"]["forward"] == pytest.approx(78, abs=1e-9)
    # the rest is residual: gap time - tok - decode
    assert s["cause_ms"]["residual"] == pytest.approx(gap_total - 800 - 108, abs=1e-9)
    assert s["cause_ms"]["prefill"] == s["cause_ms"]["gc"] == s["cause_ms"]["preempt"] == 0
    # TTFT: first emission e_0 = 10 ms after the arrival at 0
    assert s["ttft_n"] == 1 and s["ttft_window_p50_ms"] == pytest.approx(10)
    # and the offline partition of the same run says the same
    p = partition(log)
    for j, lb in enumerate(p.labels):
        assert s["cause_ms"][lb] == pytest.approx(p.parts_ms[:, j].sum(), abs=1e-9), lb
    assert s["final"]


def test_tail_counts_follow_the_sliding_p99_batch_by_batch():
    # one request emits at T (ms; each emission a step of its own at T): gaps 10, 20, ...,
    # 100 ms. Tok windows (recorded before the emission closing their gap): [70, 90] in
    # gap 4 [60, 100] (20 of 40 ms: tok), [300, 310] in gap 8 [280, 360] (10 of 80 ms,
    # under 25%: clean), [460, 520] in gap 10 [450, 550] (60 of 100 ms: tok).
    T = [0, 10, 30, 60, 100, 150, 210, 280, 360, 450, 550]
    tok = {100: (70, 90), 360: (300, 310), 550: (460, 520)}
    done = [(0, "requests", (0, 0, -1, -1))]
    for k, t in enumerate(T):
        if t in tok:
            done.append((t, "segments", (-1, 1, *tok[t], 1, 0)))
        done.append((t, "emissions", (0, t, k, 1, k)))
        done.append((t, "steps", (t, t, 1, 0, 1, 0, 0)))
    live = LiveMetrics(hold_s=0.0)
    # a recorder flushing every 100 ms at a step's end: 100, 210, 360, 550; stop at 600
    _replay(live, _split(done, [100, 210, 360, 550, 600]))
    s = live.snapshot()
    # flushes (every 100 ms, at a step's end) at 100, 210, 360, 550; with hold 0 each
    # settles the gaps closed by then, and the window holds every gap so far (linear p99):
    #   at 100: gaps 10..40      p99 = 30 + 0.97 * 10 = 39.7  -> tail: gap 4 (40, tok)
    #   at 210: + 50, 60         p99 = 50 + 0.95 * 10 = 59.5  -> tail: gap 6 (60, clean)
    #   at 360: + 70, 80         p99 = 70 + 0.93 * 10 = 79.3  -> tail: gap 8 (80, clean)
    #   at 550: + 90, 100        p99 = 90 + 0.91 * 10 = 99.1  -> tail: gap 10 (100, tok)
    assert s["gaps"] == 10
    # every primary cause's count is there from the start, at 0 unless counted
    assert {k: v for k, v in s["tail_count"].items() if v} == {"tok": 2, "clean": 2}
    assert s["tail_count"]["gc"] == 0
    assert s["itl_window_p99_ms"] == pytest.approx(99.1)
    assert sum(s["tail_ms"].values()) == pytest.approx(40 + 60 + 80 + 100)
    assert s["tail_ms"]["tok"] == pytest.approx(20 + 10 + 60)


def test_ttft_partitioner_hook_sees_each_wait_whole():
    seen = []

    def ttft_parts(window, requests):
        # a stand-in for the TTFT partition: all of each wait as one label, from the
        # window's requests table; and the window's rows reach back to the arrival
        rq = window.requests
        seen.append((requests.tolist(), float(window.segments.t_start_s.min())))
        wait_ms = (rq.first_token_s[requests] - rq.arrival_s[requests]) * 1e3
        return ("queue",), wait_ms.reshape(-1, 1)

    live = LiveMetrics(hold_s=1.2, ttft_partitioner=ttft_parts)
    _hand_run(live)
    # request "a" (index 0) arrived at 0 and emitted first at e_0 = 10 ms; the window
    # holds step 0's decode segment [2, 10] (it starts 2 ms after the arrival)
    assert seen == [([0], pytest.approx(0.002))]
    s = live.snapshot()
    assert s["ttft_cause_ms"] == {"queue": pytest.approx(10.0)}


@pytest.mark.parametrize("refit_s", [0.0, 10.0])  # re-evaluated at every settlement, or added up
def test_running_graph_fit_moves_then_settles_at_close(refit_s):
    seen = {}
    live = LiveMetrics(hold_s=0.5, refit_s=refit_s)

    def between():
        _wait_idle(live)
        seen.update(live.snapshot())

    _replay(live, _hand_chunks(), between)
    # second flush at step 21's end (2106): W = 2106 - 500 = 1606, so gaps up to e_16 = 1606
    # and steps 0..16 (ended by 1606) are settled: captured ones 0..9 at 8 ms and 15, 16 at
    # 4 ms -> mean (80 + 8) / 12 = 22/3 ms; eager fraction (12 - 22/3) / 12 on the 5 eager
    # steps' 12 ms -> graph so far = 5 * (12 - 22/3) = 70/3 ms
    assert seen["cause_ms"]["graph"] == pytest.approx(70 / 3, abs=1e-9)
    assert not seen["final"]
    # graph + forward never depends on the fit: the settled gaps' decode time, steps 1..16
    # (9*8 + 5*12 + 2*4 = 140 ms) minus what tok owns of it live: steps 6..9 (32 ms; steps
    # 2..5 were settled at the first flush, before the late tok window arrived) -> 108 ms
    assert seen["cause_ms"]["graph"] + seen["cause_ms"]["forward"] == pytest.approx(108)
    s = live.snapshot()
    assert s["final"] and s["cause_ms"]["graph"] == pytest.approx(30, abs=1e-9)


def test_a_window_open_across_flushes_holds_its_gaps_back():
    # one request "a" (arrival 0, 20 tokens): step k runs [100k, 100k + 10] with a 10 ms
    # decode and emits at 100k + 10; flushes every 300 ms at a step's end; hold 0. A tok
    # window on another thread opens at 150 and closes at 950: it is open at the flushes
    # at 310, 610 and 910, so its row comes three flushes late. The flushes say so
    # (open_tick), so no gap it overlaps is settled before its row is in: nothing is late
    clk = FakeClock()
    rec = tracekit.Recorder(
        None, clock=clk, seconds_per_tick=1e-3, flush_interval_s=0.3, gc=False,
        handle_signals=False,
    )  # fmt: skip
    live = attach(rec, LiveMetrics(hold_s=0.0))
    opened, release = threading.Event(), threading.Event()

    def tokenizer():
        with rec.segment("tok"):
            opened.set()
            release.wait()

    side = threading.Thread(target=tokenizer)
    with rec:
        rec.request("a", max_new_tokens=20, arrival_tick=0)
        for k in range(20):
            if k == 2:
                clk.now = 150
                side.start()
                opened.wait()
            if k == 10:  # after step 9 (and the flush at its end, 910)
                clk.now = 950
                release.set()
                side.join()
            clk.now = 100 * k
            with rec.step():
                with rec.segment("decode"):
                    clk.now = 100 * k + 10
                rec.emit(["a"])
                rec.step_info(num_decode=1, graph_size=1)
        clk.now = 2000
    s = live.snapshot()
    assert s["late_rows"] == 0 and s["final"] and s["gaps"] == 19
    # tok owns all of [150, 950] (inside the gaps [10, 1910]), over decode (precedence)
    assert s["cause_ms"]["tok"] == pytest.approx(800, abs=1e-9)
    p = partition(rec.log())
    for j, lb in enumerate(p.labels):
        assert s["cause_ms"][lb] == pytest.approx(p.parts_ms[:, j].sum(), abs=1e-9), lb


def test_a_window_open_longer_than_hold_is_late_and_counted(caplog):
    live = LiveMetrics(hold_s=0.5)
    with caplog.at_level(logging.WARNING, logger="tracekit.live"):
        _replay(live, _hand_chunks())
    s = live.snapshot()
    # first flush at 1014: W = 514, the gaps closing at e_1..e_5 = 110..510 are settled
    # without the tok window [150, 950] (it arrives in the next chunk): its part in
    # [150, 510] (360 ms) is missing live; the rest (440 ms) is in later gaps
    assert s["late_rows"] == 1
    assert s["cause_ms"]["tok"] == pytest.approx(800 - 360, abs=1e-9)
    assert s["gaps"] == 24  # the count itself is never affected
    assert sum("late" in r.getMessage() or "after the gaps" in r.getMessage()
               for r in caplog.records) == 1  # fmt: skip


def test_a_failing_export_is_logged_once_and_recording_goes_on(caplog, monkeypatch):
    def broken(self, *a, **kw):
        raise RuntimeError("exporter down")

    monkeypatch.setattr(Settler, "_settle_window", broken)
    live = LiveMetrics(hold_s=0.0)
    with caplog.at_level(logging.ERROR, logger="tracekit.live"):
        _replay(live, _hand_chunks())
    errors = [r for r in caplog.records if r.name == "tracekit.live"]
    assert len(errors) == 1 and "exporter down" in errors[0].getMessage()
    # each of the 3 chunks' settlements failed, and close retried the unfinished final one:
    # 4 failures, one log line
    assert live.snapshot()["errors"] == 4
    # and through a recorder, the run is recorded whole
    with caplog.at_level(logging.ERROR, logger="tracekit.live"):
        log = _hand_run(LiveMetrics(hold_s=0.0))
    assert len(partition(log)) == 24


def test_a_stuck_exporter_never_blocks_the_recording(monkeypatch):
    release = threading.Event()
    settle_window = Settler._settle_window

    def stuck(self, *a, **kw):
        release.wait()  # a settlement that hangs until released
        return settle_window(self, *a, **kw)

    monkeypatch.setattr(Settler, "_settle_window", stuck)
    live = LiveMetrics(hold_s=0.0, close_timeout_s=0.1)
    log = _hand_run(live)  # every step, flush and the stop return while the worker hangs
    assert len(partition(log)) == 24
    assert live.snapshot()["gaps"] == 0 and not live.snapshot()["final"]
    release.set()
    _wait_idle(live)
    for _ in range(2000):  # the queued chunks, then the close, once released
        if live.snapshot()["final"]:
            break
        time.sleep(0.005)
    assert live.snapshot()["final"] and live.snapshot()["gaps"] == 24


def test_a_sink_that_raises_never_stops_the_recorder(caplog):
    class Raises:
        def open(self, meta):
            pass

        def write(self, chunk):
            raise OSError("disk full")

        def close(self, final):
            raise OSError("disk full")

    with caplog.at_level(logging.WARNING, logger="tracekit"):
        log = _hand_run(Raises())  # type: ignore[arg-type]
    assert len(partition(log)) == 24
    assert len([r for r in caplog.records if "disk full" in r.getMessage()]) == 1


def test_without_the_extra_a_sink_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'tracekit\[live\]'"):
        LiveMetrics()


def test_importing_tracekit_imports_no_live_dependency():
    code = (
        "import sys, tracekit, tracekit.analysis.figures, tracekit.cli, tracekit.live\n"
        "import demo_engine.cli\n"
        "live = ('prometheus_client', 'opentelemetry')\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in live]\n"
        "print(bad)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- a demo engine run, scraped over HTTP --------------------------------------------------


#: The constant labels every series carries (run, engine, model, process): dropped from
#: the keys below, checked by `_scrape` to be there.
CONST = ("run", "engine", "model", "process")


def _le(x: float) -> str:
    return "+Inf" if x == float("inf") else repr(float(x))


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        body = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        for smp in fam.samples:
            if not smp.name.startswith("tracekit_"):
                continue
            assert set(CONST) <= set(smp.labels), smp
            labels = {k: v for k, v in smp.labels.items() if k not in CONST}
            out[(smp.name, tuple(sorted(labels.items())))] = smp.value
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_demo_run_metrics_agree_with_analyze_over_http(tmp_path):
    from click.testing import CliRunner

    from demo_engine.cli import demo
    from tracekit.cli import main as tracekit_cli

    port = _free_port()
    during: list[dict] = []
    stalled: list[socket.socket] = []
    done = threading.Event()

    def scraper():
        while not done.is_set():
            try:
                during.append(_scrape(port))
                if len(stalled) < 3:  # a scraper that connects, half-asks, and never reads
                    c = socket.create_connection(("127.0.0.1", port))
                    c.sendall(b"GET /metr")
                    stalled.append(c)
            except Exception:  # not listening yet (URLError), or a cut connection
                pass
            done.wait(0.2)

    t = threading.Thread(target=scraper, daemon=True)
    t.start()
    try:
        res = CliRunner().invoke(
            demo,
            ["run", "--rung", "baseline", "--seed", "1", "--duration", "5", "--rate", "6",
             "--out", str(tmp_path), "--quiet", "--metrics-port", str(port)],
        )  # fmt: skip
    finally:
        done.set()
        t.join()
    assert res.exit_code == 0, res.output
    assert during, "no scrape succeeded while the engine ran"
    after = _scrape(port)  # the server outlives the run (this process)
    for c in stalled:
        c.close()

    path = str(tmp_path / "baseline__s1.npz")
    r = CliRunner().invoke(tracekit_cli, ["analyze", path, "--format", "jsonl"])
    assert r.exit_code == 0, r.output
    a = json.loads(r.output.splitlines()[0])
    r = CliRunner().invoke(tracekit_cli, ["gaps", path])
    assert r.exit_code == 0, r.output
    recs = [json.loads(x) for x in r.output.splitlines() if x.strip()]

    assert after[("tracekit_live_final", ())] == 1.0
    assert after[("tracekit_live_late_rows_total", ())] == 0
    assert after[("tracekit_live_errors_total", ())] == 0
    assert after[("tracekit_gaps_total", ())] == a["gaps"] == len(recs) > 0
    # the counter holds decode (graph + forward, settled for good); the gauge splits it
    for lb in a["labels"]:
        offline_s = sum(g["parts"][lb] for g in recs) / 1e3
        if lb in ("graph", "forward"):
            live_s = after[("tracekit_gap_decode_split_seconds", (("cause", lb),))]
        else:
            live_s = after[("tracekit_gap_cause_seconds_total", (("cause", lb),))]
        assert live_s == pytest.approx(offline_s, rel=1e-9, abs=1e-12), lb
    decode_s = sum(g["parts"]["graph"] + g["parts"]["forward"] for g in recs) / 1e3
    live_decode = after[("tracekit_gap_cause_seconds_total", (("cause", "decode"),))]
    assert live_decode == pytest.approx(decode_s, rel=1e-9)
    # histogram buckets: le="X" counts the gaps <= X seconds (Prometheus' rule), to 10 s
    les = sorted(float(dict(k[1])["le"]) for k in after if k[0] == "tracekit_gap_seconds_bucket")
    assert les[-2] >= 10 and les[-1] == float("inf")
    for le in les:
        want = sum(g["gap_ms"] / 1e3 <= le for g in recs)
        assert after[("tracekit_gap_seconds_bucket", (("le", _le(le)),))] == want, le
    assert after[("tracekit_gap_seconds_count", ())] == a["gaps"]
    # TTFT: every request with a first token, and (all in the window) the same p50/p99
    # (a request that arrived but had no first token by the stop has no TTFT either way)
    assert after[("tracekit_ttft_seconds_count", ())] == a["ttft"]["requests"]
    assert after[("tracekit_ttft_window_p50_seconds", ())] == pytest.approx(a["ttft_p50"] / 1e3)
    assert after[("tracekit_ttft_window_p99_seconds", ())] == pytest.approx(a["ttft_p99"] / 1e3)
    # scrapes during the run saw a count that only grows toward the final one, and (a 5 s
    # run, flushed every 1 s, held 2 s) some saw it part way
    seen = [d.get(("tracekit_gaps_total", ()), 0.0) for d in during] + [a["gaps"]]
    assert all(x <= y for x, y in zip(seen, seen[1:], strict=False))
    assert any(0 < x < a["gaps"] for x in seen)


def test_ladder_runs_serve_metrics_on_the_given_port(tmp_path):
    from click.testing import CliRunner

    from demo_engine.cli import demo

    port = _free_port()
    scrapes: list[dict] = []
    done = threading.Event()

    def scraper():
        while not done.is_set():
            try:
                scrapes.append(_scrape(port))
            except Exception:  # not listening yet, or the run's process going away
                pass
            done.wait(0.1)

    t = threading.Thread(target=scraper, daemon=True)
    t.start()
    try:
        res = CliRunner().invoke(
            demo,
            ["ladder", "--rungs", "baseline", "--seeds", "1", "--duration", "3", "--rate", "4",
             "--out", str(tmp_path), "--metrics-port", str(port)],
        )  # fmt: skip
    finally:
        done.set()
        t.join()
    assert res.exit_code == 0, res.output
    # the run (a subprocess) served its metrics while it went
    assert any(("tracekit_gaps_total", ()) in s for s in scrapes)


def test_spans_above_the_slo_match_tracekit_gaps_min_ms(tmp_path):
    from click.testing import CliRunner
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from demo_engine.config import EngineConfig, WorkloadConfig
    from demo_engine.engine import Engine
    from demo_engine.tokenizer import train_tokenizer
    from demo_engine.workload import TraceRequest, make_trace
    from tracekit.cli import main as tracekit_cli

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    slo_ms = 25.0
    live = LiveMetrics(slo_ms=slo_ms, tracer_provider=provider, hold_s=0.1)
    # batches above the largest captured size (eager steps) and long prefill chunks (gaps
    # above the SLO), all in a few seconds
    cfg = EngineConfig(
        vocab_size=512, num_kv_blocks=200, max_num_seqs=8, max_num_batched_tokens=512,
        max_prompt_tokens=128, max_new_tokens=64, num_startup_objects=2_000,
        captured_graph_sizes=(1, 2, 4),
    )  # fmt: skip
    tok = train_tokenizer(512, WorkloadConfig())
    tr = make_trace(0, 60.0, WorkloadConfig(rate_req_s=50.0, doc_frac=0.0))
    trace = [TraceRequest(i, 0.02 * i, t.text[:300], 30, False) for i, t in enumerate(tr[:12])]

    class Stalling(Engine):
        """Two 30 ms stalls (a `tok` window between steps), so gaps above the SLO exist
        whatever the machine's speed."""

        num_steps = 0

        def step(self):
            self.num_steps += 1
            if self.num_steps in (20, 40):
                with self.rec.segment("tok"):
                    time.sleep(0.03)
            return super().step()

    path = tmp_path / "run.npz"
    rec = tracekit.Recorder(path, flush_interval_s=0.1)
    attach(rec, live)
    with rec:
        eng = Stalling(cfg, rec, tok)
        try:
            eng.startup()
            eng.serve(trace, 60.0, is_drain=True)
        finally:
            eng.close()
    r = CliRunner().invoke(tracekit_cli, ["gaps", str(path), "--min-ms", str(slo_ms)])
    assert r.exit_code == 0, r.output
    want = [json.loads(x) for x in r.output.splitlines() if x.strip()]
    spans = exporter.get_finished_spans()
    assert len(want) > 0 and len(spans) == len(want) == live.snapshot()["spans"]
    st = tracekit.load(path).steps
    key = lambda rid, t0: (rid, round(t0, 9))  # noqa: E731
    by_key = {key(g["request"], g["t0_s"]): g for g in want}
    for sp in spans:
        at = sp.attributes
        g = by_key[key(at["tracekit.request_id"], at["tracekit.t0_s"])]
        assert at["tracekit.gap_ms"] == pytest.approx(g["gap_ms"], abs=1e-9)
        assert (at["tracekit.step0"], at["tracekit.step1"]) == (g["step0"], g["step1"])
        # the steps it spans: every step of the log overlapping [t0, t1]
        want_steps = np.flatnonzero((st.t_start_s < g["t1_s"]) & (st.t_end_s > g["t0_s"]))
        assert at["tracekit.num_steps"] == len(want_steps) <= 64
        assert list(at["tracekit.steps"]) == want_steps.tolist()
        for lb, v in g["parts"].items():
            got = at[f"tracekit.part.{lb}_ms"]
            if lb in ("graph", "forward"):  # split with the fit so far; their sum is exact
                continue
            assert got == pytest.approx(v, abs=1e-9), lb
        both = at["tracekit.part.graph_ms"] + at["tracekit.part.forward_ms"]
        assert both == pytest.approx(g["parts"]["graph"] + g["parts"]["forward"], abs=1e-9)
    # one trace per request: a request's gap spans share a trace id, no two requests do
    traces: dict[str, set[int]] = {}
    for sp in spans:
        traces.setdefault(sp.attributes["tracekit.request_id"], set()).add(sp.context.trace_id)
    assert all(len(v) == 1 for v in traces.values())
    assert len(set.union(*traces.values())) == len(traces)
    # exemplars in an OpenMetrics scrape: on the gap buckets, naming spans the exporter holds
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    body = openmetrics(live.registry).decode()
    ex = [
        smp
        for f in text_string_to_metric_families(body)
        if f.name == "tracekit_gap_seconds"
        for smp in f.samples
        if smp.exemplar is not None
    ]
    ids = {(f"{sp.context.trace_id:032x}", f"{sp.context.span_id:016x}"): sp for sp in spans}
    assert ex
    for smp in ex:
        sp = ids[(smp.exemplar.labels["trace_id"], smp.exemplar.labels["span_id"])]
        assert smp.exemplar.value == pytest.approx(sp.attributes["tracekit.gap_ms"] / 1e3)
        le = float(smp.labels["le"])  # the bucket the gap falls in: <= le, > the one below
        assert smp.exemplar.value <= le


def test_spans_are_on_the_wall_clock_whatever_the_recorder_counts():
    # the hand-built run on a fake clock: 2.5 s of engine time pass in far less wall time;
    # every gap (~100 ms) is above a 50 ms SLO, and its span lies within the wall time the
    # run took (engine time mapped onto the wall clock at each flush), not 2.5 s ahead
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    live = LiveMetrics(hold_s=1.2, slo_ms=50.0, tracer_provider=provider)
    before = time.time()
    _hand_run(live)
    after = time.time()
    spans = exporter.get_finished_spans()
    assert len(spans) == 24
    for sp in spans:
        assert before <= sp.start_time / 1e9 <= sp.end_time / 1e9 <= after


# -- property: random runs, live == offline -------------------------------------------------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_step = st.fixed_dictionaries(
    {
        "gap": st.integers(0, 30),  # idle ms before the step
        "prefill": st.integers(0, 15),  # ms, 0: none
        "decode": st.integers(1, 20),
        "eager": st.booleans(),
        "size": st.sampled_from([1, 2, 4]),
        "emit": st.sets(st.integers(0, 2)),  # which requests emit (unless evicted)
        "evict": st.one_of(st.none(), st.integers(0, 2)),
        # the eviction's cause (recompute mode): reason and computed tokens lost
        "cause": st.one_of(
            st.none(),
            st.tuples(st.sampled_from(("kv_full", "priority", "other")), st.integers(0, 500)),
        ),
        "readmit": st.booleans(),
        # ms of re-prefill (a `recompute` segment) after a recompute victim's readmission
        "recompute": st.integers(0, 10),
        "tok_back": st.one_of(st.none(), st.integers(1, 40)),  # side-thread window ending now
        "gc": st.one_of(st.none(), st.integers(1, 5)),
    }
)


class NsClock:
    """Integer nanoseconds in `t` (what `FakeDeviceTimer` reads), set by the test."""

    def __init__(self) -> None:
        self.t = 0

    def __call__(self) -> int:
        return self.t


def _random_run(steps, *, device: bool, os_evidence: bool = False, at_start=None):
    """Record `steps` (see `_step`) with a live sink; returns (log, sink snapshot).
    `at_start` (a list) receives the sink's snapshot once the recorder has opened it.
    Times in ms; with `device`, decode launches device work on a fake stream (5 ms per
    launch, resolved 3 ms after it ends: its window reaches the sink a flush or more
    later) and the step's decode time is the device's."""
    from tracekit.capture.device import FakeDeviceTimer

    clk = NsClock()
    ms = 1_000_000
    timer = FakeDeviceTimer(clk, exec_ms=5.0, resolve_delay_ms=3.0) if device else None
    rec = tracekit.Recorder(
        None, clock=clk, seconds_per_tick=1e-9, flush_interval_s=0.05, gc=False,
        handle_signals=False, device_timer=timer, os_evidence=os_evidence,
    )  # fmt: skip
    live = attach(rec, LiveMetrics(hold_s=0.2))
    evicted: set[int] = set()
    recompute: set[int] = set()  # evicted in recompute mode
    with rec:
        if at_start is not None:
            at_start.append(live.snapshot())
        for r in range(3):
            rec.request(r, arrival_tick=0)
        for s in steps:
            clk.t += s["gap"] * ms
            with rec.step():
                if s["evict"] is not None and s["evict"] not in evicted:
                    if s.get("cause") is None:
                        rec.evict(s["evict"])
                    else:
                        rec.evict(s["evict"], mode="recompute", reason=s["cause"][0],
                                  by=[(s["evict"] + 1) % 3],
                                  num_computed_tokens_lost=s["cause"][1])  # fmt: skip
                        recompute.add(s["evict"])
                    evicted.add(s["evict"])
                elif s["readmit"] and evicted:
                    r = min(evicted)
                    rec.readmit(r)
                    evicted.discard(r)
                    if r in recompute and s.get("recompute"):  # its re-prefill
                        with rec.segment("recompute"):
                            clk.t += s["recompute"] * ms
                    recompute.discard(r)
                if s["prefill"]:
                    with rec.segment("prefill"):
                        clk.t += s["prefill"] * ms
                with rec.segment("decode", device=device):
                    if s["gc"]:  # a collection inside the decode
                        rec._on_gc("start", {})
                        clk.t += s["gc"] * ms
                        rec._on_gc("stop", {"generation": 0})
                    clk.t += s["decode"] * ms
                if device:
                    clk.t += 2 * ms  # the host waits on the device a little
                    with rec.segment("sync"):
                        clk.t += 1 * ms
                rec.emit(sorted(s["emit"] - evicted))
                rec.step_info(graph_size=0 if s["eager"] else s["size"])
            if s["tok_back"] is not None:  # recorded now, started up to 40 ms ago
                rec.add_segment("tok", clk.t - s["tok_back"] * ms, clk.t)
            clk.t += 1 * ms
    return rec.log(), live.snapshot()


def _assert_live_equals_offline(log, snap):
    from tracekit.analysis.figures import analyze

    p = partition(log)
    assert snap["late_rows"] == 0 and snap["errors"] == 0 and snap["final"]
    assert snap["truncated_gaps"] == 0
    assert snap["gaps"] == len(p)
    for j, lb in enumerate(p.labels):
        off = float(p.parts_ms[:, j].sum())
        assert snap["cause_ms"].get(lb, 0.0) == pytest.approx(off, rel=1e-9, abs=1e-9), lb
    assert snap["hist"].tolist() == [h.count for h in analyze(log, p).hist]
    # TTFT by cause, the OS labels included where the run has OS evidence; graph and
    # decode_other as their sum (exported as decode): the split depends on the whole run's
    # graph fit, and each TTFT window is partitioned on its own (docs/live.md)
    tp = ttft_partition(log)
    assert snap["ttft_n"] == len(tp)
    got = snap["ttft_cause_ms"]
    for j, lb in enumerate(tp.labels):
        if lb not in ("graph", "decode_other"):
            off = float(tp.parts_ms[:, j].sum())
            assert got.get(lb, 0.0) == pytest.approx(off, rel=1e-9, abs=1e-9), lb
    off = float(tp.column("graph").sum() + tp.column("decode_other").sum())
    dec = got.get("graph", 0.0) + got.get("decode_other", 0.0)
    assert dec == pytest.approx(off, rel=1e-9, abs=1e-9)
    # who evicted whom: the counters equal the offline summary
    from tracekit.analysis.evictions import eviction_summary

    e = eviction_summary(log)
    by = {} if e is None else e.by_reason
    assert {k: n for k, n in snap["evictions_by_reason"].items() if n} == {
        k: n for k, n in by.items() if n
    }
    assert snap["recomputed_tokens"] == (0 if e is None else e.recomputed_tokens)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(_step, min_size=2, max_size=40))
def test_random_runs_live_totals_equal_the_offline_partition(steps):
    """Any run whose windows stay open less than hold_s: every live total equals the
    offline partition's, flushes every 50 ms notwithstanding."""
    _assert_live_equals_offline(*_random_run(steps, device=False))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(_step, min_size=2, max_size=30))
def test_random_runs_with_device_windows_resolved_late_still_agree(steps):
    """Device windows (rule 6) reach the sink after their step's chunk; held past them,
    the totals still equal the offline partition's."""
    log, snap = _random_run(steps, device=True)
    assert (log.segments.is_device == 1).any()
    _assert_live_equals_offline(log, snap)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OS evidence: Linux only")
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(_step, min_size=2, max_size=30))
def test_random_runs_with_os_evidence_agree(steps):
    """With OS samples (the real thread's counters against the fake clock: os_runqueue and
    os_blocked in every window), the live totals still equal the offline partition's."""
    first: list = []
    log, snap = _random_run(steps, device=False, os_evidence=True, at_start=first)
    assert len(log.os_samples) == 2 * len(log.steps)
    p = partition(log)
    assert "os_blocked" in p.labels
    assert "os_blocked" in ttft_partition(log).labels
    _assert_live_equals_offline(log, snap)
    # every series the run ever has was there, at 0, before its first gap settled (a
    # counter series first scraped above 0 loses that value to Prometheus' `increase()`)
    for k in ("cause_ms", "tail_ms", "tail_count", "ttft_cause_ms"):
        assert set(snap[k]) <= set(first[0][k]), k
        assert all(v == 0 for v in first[0][k].values()), k


# -- flushes cut anywhere: hand-built runs with OS samples -------------------------------
#
# A run of steps on the loop thread (thread 0, sampled at each step's start and end) and
# `tok` windows on a tokenizer thread (thread 1, sampled at each window's start and end,
# docs/partition.md OS rule 7), some spanning several steps, cut into flushes at any step
# end or idle point: each row goes in the first flush at or after the tick it was
# completed (a window at its end, a sample at its tick, an emission at its time, the TTFT
# rows at their step's end), and a flush names the earliest start of a window still open
# (`open_tick`). Whatever the cuts and the hold, the settled totals equal the offline
# partitions of the whole run.

_os_step = st.fixed_dictionaries(
    {
        "idle": st.integers(0, 6),  # ms between the previous step's end and this start
        "decode": st.integers(1, 8),
        "sync": st.integers(0, 3),  # ms the loop waits on the device (0: no such window)
        "emit": st.sets(st.integers(0, 2)),
        "cpu": st.floats(0.0, 1.0),  # share of each OS interval on the CPU ...
        "runq": st.floats(0.0, 1.0),  # ... and of the rest, runnable
        # a tokenizer-thread window: start after the step's start (ms), length, CPU share
        "tok": st.one_of(
            st.none(), st.tuples(st.integers(0, 6), st.integers(1, 25), st.floats(0, 1))
        ),
    }
)


def _os_run(steps: list[dict]) -> tracekit.RawLog:
    """`steps` as a hand-built log (ms); every request arrives at 0 and is admitted, its
    prompt prefilled, in step 0."""
    from logbuilder import LogBuilder

    b = LogBuilder(num_requests=3)
    t = cpu = runq = 0.0
    side_cpu, side_free = 0.0, 0.0  # the tokenizer thread's CPU total; its next free tick

    def sample(t_at, width, s, kind):
        nonlocal cpu, runq
        cpu += width * s["cpu"]
        runq += (width - width * s["cpu"]) * s["runq"]
        b.os_sample(t_at, cpu, runq, kind=kind)

    for k, s in enumerate(steps):
        if k:
            sample(t + s["idle"], s["idle"], s, 0)  # the interval between two steps
        else:
            b.os_sample(t, 0.0, 0.0, kind=0)
        t0 = t = t + s["idle"]
        if k == 0:
            for r in range(3):
                b.admit(r, t)
                b.prefill(0, r, 10)
            b.seg(0, "prefill", t, t + 3)
            t += 3
        b.seg(k, "decode", t, t + s["decode"])
        t += s["decode"]
        if s["sync"]:
            b.seg(k, "sync", t, t + s["sync"])
            t += s["sync"]
        for r in sorted(s["emit"]):
            b.emit(r, t, k)
        b.step(t0, t, n_prefill=30 if k == 0 else 0)
        sample(t, t - t0, s, 1)
        if s["tok"] is not None:
            back, width, share = s["tok"]
            a = max(t0 + back, side_free)
            b.os_sample(a, side_cpu, 0.0, kind=2, thread=1)
            side_cpu += width * share
            b.os_sample(a + width, side_cpu, 0.0, kind=3, thread=1)
            b.seg(-1, "tok", a, a + width, thread=1)
            side_free = a + width
    return b.build(wall_ms=max(t, side_free))


def _ns(s: np.ndarray) -> np.ndarray:
    return np.round(np.asarray(s, dtype=np.float64) * 1e9).astype(np.int64)


def _flushes(log: tracekit.RawLog, cuts: list[int]) -> list[dict]:
    """The chunks a recorder (nanosecond ticks from 0) flushing at `cuts` then stopping
    hands its sinks: each row in the first flush at or after the tick it was completed."""
    st_, sg, em, os_ = log.steps, log.segments, log.emissions, log.os_samples
    s1 = _ns(st_.t_end_s)
    a, b = _ns(sg.t_start_s), _ns(sg.t_end_s)
    rq = log.requests
    tables = {
        "steps": (s1, [_ns(st_.t_start_s), s1, st_.num_decode, st_.num_prefill_tokens,
                       st_.graph_size, st_.num_preempted, st_.num_swapped_in]),
        "segments": (b, [sg.step, sg.label, a, b, sg.thread, sg.is_device]),
        "emissions": (_ns(em.t_s), [em.request, _ns(em.t_s), em.step, em.num_tokens,
                                    em.device_step]),
        "requests": (np.zeros(len(rq), dtype=np.int64), [np.arange(len(rq)), _ns(rq.arrival_s),
                                                         rq.prompt_tokens, rq.max_new_tokens]),
        "admissions": (_ns(log.admissions.t_s), [log.admissions.request,
                                                 _ns(log.admissions.t_s)]),
        "prefill_chunks": (s1[log.prefill_chunks.step], [log.prefill_chunks.step,
                           log.prefill_chunks.request, log.prefill_chunks.num_tokens]),
        "os_samples": (_ns(os_.t_s), [os_.thread, os_.kind, _ns(os_.t_s), os_.cpu_ns,
                                      os_.runqueue_ns, os_.num_voluntary_switches,
                                      os_.num_involuntary_switches, os_.num_major_faults]),
    }  # fmt: skip
    stop = int(max(s1.max(), b.max(initial=0))) + 1
    out, prev = [], -1
    for f in [*cuts, stop]:
        c: dict = {}
        for k in TABLE_COLS:
            if k not in tables:
                c[k] = np.zeros(0, dtype=np.float64 if k == "counters" else np.int64)
                continue
            done, cols = tables[k]
            sel = (done > prev) & (done <= f)
            c[k] = np.column_stack([np.asarray(x)[sel] for x in cols]).astype(np.int64).ravel()
        c["labels"] = np.array(list(log.labels))
        c["counter_names"] = np.array([], dtype=str)
        c["request_ids"] = np.array(list(log.request_ids) if prev < 0 else [], dtype=str)
        c["request_ids_start"] = np.array(0)
        c["config"] = np.array("{}")
        c["flush_tick"] = np.array(f)
        c["t0_tick"] = np.array(0)
        c["seconds_per_tick"] = np.array(1e-9)
        open_ = (a <= f) & (b > f)
        if f == stop:
            c["stop_tick"] = np.array(f)
        elif open_.any():
            c["open_tick"] = np.array(int(a[open_].min()))
        out.append(c)
        prev = f
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(_os_step, min_size=2, max_size=14),
    cut_at=st.sets(st.integers(0, 27)),
    hold_ms=st.sampled_from([0, 2, 9]),
)
def test_flushes_cut_anywhere_in_a_run_with_os_samples_settle_to_the_offline_sums(
    steps, cut_at, hold_ms
):
    from tracekit.live.settler import ttft_by_cause

    log = _os_run(steps)
    p, tp = partition(log), ttft_partition(log)
    assert {"os_runqueue", "os_blocked"} <= set(p.labels)
    # cut points: each step's end (2k) and the middle of the idle time after it (2k + 1)
    s0, s1 = _ns(log.steps.t_start_s), _ns(log.steps.t_end_s)
    ends = np.column_stack([s1[:-1], (s1[:-1] + s0[1:]) // 2]).ravel()
    cuts = sorted({int(ends[i]) for i in cut_at if i < len(ends)})
    s = Settler(hold_s=hold_ms / 1e3, ttft_partitioner=ttft_by_cause)
    s.open({"t0_tick": 0, "seconds_per_tick": 1e-9, "os_evidence": {"recorded": True}})
    for c in _flushes(log, cuts):
        s.add(c)
    t = s.totals
    assert t.late_rows == 0 and t.truncated_gaps == 0 and t.final
    assert t.gaps == len(p)
    for j, lb in enumerate(p.labels):
        off = float(p.parts_ms[:, j].sum())
        assert t.cause_ms.get(lb, 0.0) == pytest.approx(off, rel=1e-9, abs=1e-9), lb
    assert t.ttft_n == len(tp)
    for j, lb in enumerate(tp.labels):
        if lb not in ("graph", "decode_other"):  # their sum is exported (decode)
            off = float(tp.parts_ms[:, j].sum())
            assert t.ttft_cause_ms.get(lb, 0.0) == pytest.approx(off, rel=1e-9, abs=1e-9), lb
    dec = t.ttft_cause_ms.get("graph", 0.0) + t.ttft_cause_ms.get("decode_other", 0.0)
    off = float(tp.column("graph").sum() + tp.column("decode_other").sum())
    assert dec == pytest.approx(off, rel=1e-9, abs=1e-9)


# -- what a scraper and a trace viewer see ---------------------------------------------------


def test_an_engine_label_named_like_a_derived_part_stays_its_own_cause():
    # the hand-built run with its side-thread window labelled "graph" instead of "tok": the
    # window's 800 ms are the cause engine_graph; graph and forward are the decode split
    # of the hand-built test (30 and 78 ms), never added to it
    live = LiveMetrics(hold_s=1.2)
    _replay(live, _hand_chunks(labels=("decode", "graph")))
    s = live.snapshot()
    assert s["cause_ms"]["engine_graph"] == pytest.approx(800, abs=1e-9)
    assert s["cause_ms"]["graph"] == pytest.approx(30, abs=1e-9)
    assert s["cause_ms"]["forward"] == pytest.approx(78, abs=1e-9)


def test_any_label_string_keeps_the_scrape_valid():
    from urllib.request import Request, urlopen

    from prometheus_client.openmetrics.parser import text_string_to_metric_families as om
    from prometheus_client.parser import text_string_to_metric_families as text

    bad = "t\udcffk"  # a lone surrogate (a byte-decoded name), as a label and a run name
    live = LiveMetrics(hold_s=1.2, const_labels={"run": "r\udcff", "engine": 'e"\\n'})
    _replay(live, _hand_chunks(labels=("decode", bad)))
    port = live.serve(0)
    try:
        for accept, parse in (("text/plain", text), ("application/openmetrics-text", om)):
            req = Request(f"http://127.0.0.1:{port}/metrics", headers={"Accept": accept})
            with urlopen(req, timeout=10) as r:
                assert r.status == 200
                body = r.read().decode("utf-8")  # valid UTF-8
            fams = list(parse(body))
            causes = {
                smp.labels["cause"]
                for f in fams
                if f.name == "tracekit_gap_cause_seconds"
                for smp in f.samples
            }
            assert "t\\udcffk" in causes  # the surrogate, escaped
    finally:
        live.shutdown()


def test_every_labelled_series_is_there_at_zero_before_the_first_gap():
    live = LiveMetrics(const_labels={"run": "r1"})
    s = live.snapshot()
    # every primary cause (never forward or residual, design.md) and clean
    assert set(s["tail_count"]) == {"preempt", "gc", "tok", "prefill", "graph", "clean"}
    assert all(v == 0 for v in s["tail_count"].values())
    from prometheus_client import generate_latest

    live.open(META)
    try:
        body = generate_latest(live.registry).decode()
    finally:
        live.close({})
    for cause in ("preempt", "gc", "tok", "prefill", "decode", "residual"):
        assert f'tracekit_gap_cause_seconds_total{{cause="{cause}",run="r1"}} 0.0' in body
    assert 'tracekit_ttft_cause_seconds_total{cause="wait_kv_blocks",run="r1"} 0.0' in body
    assert 'tracekit_tail_gaps_total{primary_cause="clean",run="r1"} 0.0' in body


def test_a_run_with_os_evidence_serves_the_os_causes_at_zero_from_the_start():
    """The OS causes appear in a partition only where the run has OS intervals, which the
    sink knows from the recorder's start meta (docs/partition.md, "OS evidence"): their
    series are there at 0 before the first gap is settled, as the standard causes' are
    (Prometheus' `increase()` counts a counter from the first sample it sees)."""
    from prometheus_client import generate_latest

    os_meta = {**META, "os_evidence": {"recorded": True}}
    bodies = {}
    for name, meta in (("with", os_meta), ("without", META)):
        live = LiveMetrics(const_labels={"run": "r1"})
        live.open(meta)
        try:
            bodies[name] = generate_latest(live.registry).decode()
        finally:
            live.close({})
    for cause in ("os_runqueue", "os_blocked"):
        for metric, key in (("tracekit_gap_cause_seconds_total", "cause"),
                            ("tracekit_tail_gap_cause_seconds_total", "cause"),
                            ("tracekit_tail_gaps_total", "primary_cause"),
                            ("tracekit_ttft_cause_seconds_total", "cause")):  # fmt: skip
            assert f'{metric}{{{key}="{cause}",run="r1"}} 0.0' in bodies["with"], metric
        assert f'"{cause}"' not in bodies["without"]


def _has_otlp_http() -> bool:
    try:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: F401
            OTLPSpanExporter,
        )
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _has_otlp_http(), reason="opentelemetry-exporter-otlp-proto-http "
                    "is not installed (the live extra installs it)")  # fmt: skip
def test_otlp_endpoint_sends_the_slow_gaps_spans_over_http():
    import http.server

    got: list[tuple[str, str, int]] = []

    class Collector(http.server.BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802 (the handler's protocol)
            n = int(self.headers["Content-Length"])
            got.append((self.path, self.headers["Content-Type"], len(self.rfile.read(n))))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), Collector)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        url = f"http://127.0.0.1:{srv.server_port}/v1/traces"
        live = LiveMetrics(hold_s=1.2, slo_ms=50.0, otlp_endpoint=url)
        _hand_run(live)
        live.shutdown()  # flushes the spans the sink's own provider batched
    finally:
        srv.shutdown()
    assert live.snapshot()["spans"] == 24
    assert got and all(p == "/v1/traces" and ct == "application/x-protobuf" for p, ct, _ in got)


@pytest.mark.skipif(_has_otlp_http(), reason="the OTLP exporter is installed")
def test_otlp_endpoint_without_its_exporter_says_how_to_install_it():
    with pytest.raises(ImportError, match=r"pip install 'tracekit\[live\]'"):
        LiveMetrics(slo_ms=50.0, otlp_endpoint="http://127.0.0.1:4318/v1/traces")


def test_a_failing_ttft_partition_costs_its_causes_only(caplog):
    def broken(window, requests):
        raise RuntimeError("ttft down")

    live = LiveMetrics(hold_s=1.2, ttft_partitioner=broken)
    with caplog.at_level(logging.ERROR, logger="tracekit.live"):
        _hand_run(live)
    s = live.snapshot()
    # the hand-built run's 24 gaps and its one TTFT (10 ms) are all there; its one TTFT
    # settlement failed: one error, said once, no TTFT causes
    assert s["gaps"] == 24 and s["ttft_n"] == 1 and s["final"]
    assert s["errors"] == 1 and s["ttft_cause_ms"] == {}
    assert sum("ttft down" in r.getMessage() for r in caplog.records) == 1


def test_a_wait_longer_than_max_retain_is_counted_without_its_causes():
    # the hand-built run plus request "b" (index 1): arrives at 0 and has its first token
    # only at step 20's end (2006 ms). With max_retain_s 0.5, at the second flush (2106,
    # settled to 2106 - 1200 = 906) b's arrival is older than 906 - 500: it pins no rows,
    # and the rows of its wait's start are dropped. Its TTFT (2006 ms) is counted, never
    # partitioned: the causes are a's TTFT alone (10 ms)
    done = [(0, "requests", (0, 0, -1, 25)), (0, "requests", (1, 0, -1, 1))]
    for k, d in enumerate(D):
        e = 100 * k + 2 + d
        graph = 0 if 10 <= k < 15 else 1
        done.append((e, "segments", (k, 0, 100 * k + 2, e, 0, 0)))
        done.append((e, "emissions", (0, e, k, 1, k)))
        if k == 20:
            done.append((e, "emissions", (1, e, k, 1, k)))
        done.append((e, "steps", (100 * k, e, 1, 0, graph, 0, 0)))
    chunks = _split(done, [1014, 2106, 2500])
    for c in chunks:
        if len(c["requests"]):
            c["request_ids"] = np.array(["a", "b"])
    live = LiveMetrics(hold_s=1.2, max_retain_s=0.5)
    _replay(live, chunks)
    s = live.snapshot()
    assert s["ttft_n"] == 2 and s["truncated_ttfts"] == 1 and s["errors"] == 0
    assert s["ttft_sum_s"] == pytest.approx((10 + 2006) / 1e3)
    assert sum(s["ttft_cause_ms"].values()) == pytest.approx(10.0)


def test_a_label_that_appears_mid_run_is_at_zero_from_the_flush_that_names_it():
    """docs/live.md, "Series that appear mid-run": an engine's own label (`prepare`, the
    side thread's window [150, 950] of the hand-built run) has its series at 0 from the
    first flush that names it, long before its window's gaps settle, with the time it was
    created; then its value. Every scraper reads the same values: one that joins at the end
    reads the settled 800 ms at once (each scraper saw a mid-run label at 0 first before)."""
    from prometheus_client import generate_latest

    live = LiveMetrics(hold_s=1.2)
    chunks = _hand_chunks(labels=("decode", "prepare"))
    live.open(META)
    live.write(chunks[0])  # flushed at 1014: names `prepare`; its window ends at 1050
    _wait_idle(live)
    t, _, _ = live._read()
    assert t.cause_ms["prepare"] == 0.0 and t.tail_count["prepare"] == 0
    assert t.created_s["prepare"] > 0 and t.created_s["prepare"] >= t.created_s["gc"]
    early = generate_latest(live.registry).decode().splitlines()
    prepare = 'tracekit_gap_cause_seconds_total{cause="prepare",'
    assert float(next(ln for ln in early if ln.startswith(prepare)).rsplit(" ", 1)[1]) == 0.0
    assert any(ln.startswith('tracekit_gap_cause_seconds_created{cause="prepare",') for ln in early)
    for c in chunks[1:]:
        live.write(c)
    live.close({})
    # a scraper that reads the run for the first time after it (a one-off curl, a
    # Prometheus that joined late) reads the same settled values as the one that was there
    fresh = LiveMetrics(hold_s=1.2)
    _replay(fresh, _hand_chunks(labels=("decode", "prepare")))
    texts = [generate_latest(x.registry).decode() for x in (live, fresh)]
    drop = ("tracekit_live_", "# ")  # the sink's own health and the help lines
    keep = [[ln for ln in t.splitlines() if not ln.startswith(drop) and "_created" not in ln]
            for t in texts]  # fmt: skip
    assert keep[0] == keep[1]
    line = next(ln for ln in keep[1] if ln.startswith(prepare))
    assert float(line.rsplit(" ", 1)[1]) == pytest.approx(0.8)
