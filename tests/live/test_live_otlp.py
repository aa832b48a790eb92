"""Live spans sent over OTLP/HTTP to a real receiver on loopback (`tests/otlp_receiver.py`,
which decodes the protobuf `ExportTraceServiceRequest` as a collector does): a real
`tracekit demo run --otlp-endpoint` sends exactly the gaps `tracekit gaps --min-ms SLO`
lists for its log, and a request whose engine propagated a W3C `traceparent` has its gap
spans in that trace, as children of that span.
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http.trace_exporter")

import tracekit  # noqa: E402
from tests.otlp_receiver import OtlpReceiver  # noqa: E402
from tests.procs import run_cli  # noqa: E402
from tracekit.live import LiveMetrics, attach  # noqa: E402
from tracekit.live.otel import SPAN_NAME  # noqa: E402
from tracekit.live.traceparent import parse_traceparent  # noqa: E402

SLO_MS = 20.0


def _wait_for(cond, timeout_s: float = 30.0) -> None:
    """Poll `cond` (no time asserted: only a bound on how long the test waits)."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and not cond():
        time.sleep(0.05)


def test_demo_run_sends_the_gaps_tracekit_gaps_lists_over_otlp(tmp_path):
    with OtlpReceiver() as rx:
        before_ns = time.time_ns()
        r = run_cli(
            "demo", "run", "--rung", "baseline", "--seed", "1", "--duration", "4",
            "--rate", "6", "--out", str(tmp_path), "--quiet", "--metrics-port", "0",
            "--slo-ms", str(SLO_MS), "--otlp-endpoint", rx.url, timeout=240,
        )  # fmt: skip
        after_ns = time.time_ns()
        assert r.returncode == 0, r.stderr
        spans = rx.named(SPAN_NAME)  # the SDK sends what is batched as the process exits
    assert not rx.errors, rx.errors
    path = str(tmp_path / "baseline__s1.npz")
    g = run_cli("gaps", path, "--min-ms", str(SLO_MS), "--format", "jsonl")
    assert g.returncode == 0, g.stderr
    want = [json.loads(x) for x in g.stdout.splitlines() if x.strip()]
    assert len(want) > 0, "the run has no gap at or above the SLO: the test checks nothing"
    # the same gaps: each named by its request and the steps of its two emissions
    key = lambda rid, s0, s1: (rid, s0, s1)  # noqa: E731
    got = {key(s.attributes["tracekit.request_id"], s.attributes["tracekit.step0"],
               s.attributes["tracekit.step1"]): s for s in spans}  # fmt: skip
    assert len(spans) == len(got) == len(want)
    assert set(got) == {key(w["request"], w["step0"], w["step1"]) for w in want}
    for w in want:
        sp = got[key(w["request"], w["step0"], w["step1"])]
        at = sp.attributes
        assert at["tracekit.t0_s"] == pytest.approx(w["t0_s"], abs=1e-9)
        assert at["tracekit.t1_s"] == pytest.approx(w["t1_s"], abs=1e-9)
        assert at["tracekit.gap_ms"] == pytest.approx(w["gap_ms"], abs=1e-9)
        for lb, v in w["parts"].items():  # graph/forward: split with the fit so far
            if lb not in ("graph", "forward"):
                assert at[f"tracekit.part.{lb}_ms"] == pytest.approx(v, abs=1e-9), lb
        if w["parts"]["graph"] == at["tracekit.part.graph_ms"] == 0:
            assert at["tracekit.primary_cause"] == w["primary"]
        # on the wall clock, within the run, and in order
        assert before_ns <= sp.start_ns <= sp.end_ns <= after_ns
        assert sp.service == "tracekit"
    # one trace per request (no trace context propagated): a request's spans share a trace
    # id and a parent (the trace's root id), and no two requests share a trace
    traces: dict[str, set[tuple[str, str]]] = {}
    for sp in spans:
        traces.setdefault(sp.attributes["tracekit.request_id"], set()).add(
            (sp.trace_id, sp.parent_span_id)
        )
    assert all(len(v) == 1 for v in traces.values())
    assert len({next(iter(v))[0] for v in traces.values()}) == len(traces)
    assert all(next(iter(v))[1] != "" for v in traces.values())


class _Clock:
    """Integer milliseconds, set by the test."""

    def __init__(self) -> None:
        self.now = 0

    def __call__(self) -> int:
        return self.now


#: Three requests emitting at every step of a hand-built run: step k starts at 100k ms
#: and emits at 100k + 10 ms, so every gap is 100 ms (>= the 50 ms SLO): 9 gaps each.
STEPS, SLO_HAND_MS = 10, 50.0
PARENT_A = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
PARENT_C_UNSAMPLED = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"


def _hand_run(live: LiveMetrics, parents: dict[str, str]) -> tracekit.RawLog:
    clk = _Clock()
    rec = tracekit.Recorder(
        None, clock=clk, seconds_per_tick=1e-3, flush_interval_s=0.3, gc=False,
        handle_signals=False,
    )  # fmt: skip
    attach(rec, live)
    with rec:
        for r in ("a", "b", "c"):
            rec.request(r, max_new_tokens=STEPS, arrival_tick=0)
            if r in parents:  # what an engine does when a request arrives with a context
                live.trace_parent(r, parents[r])
        for k in range(STEPS):
            clk.now = 100 * k
            with rec.step():
                with rec.segment("decode"):
                    clk.now = 100 * k + 10
                rec.emit(["a", "b", "c"])
                rec.step_info(num_decode=3, graph_size=1)
        clk.now = 100 * STEPS
    return rec.log()


def test_a_propagated_traceparent_parents_the_requests_gap_spans():
    with OtlpReceiver() as rx:
        live = LiveMetrics(hold_s=0.1, slo_ms=SLO_HAND_MS, otlp_endpoint=rx.url)
        log = _hand_run(live, {"a": PARENT_A, "c": PARENT_C_UNSAMPLED})
        live.shutdown()  # sends what the sink's provider batched
        _wait_for(lambda: len(rx.named(SPAN_NAME)) >= 2 * (STEPS - 1))
        spans = rx.named(SPAN_NAME)
    assert not rx.errors, rx.errors
    gaps = tracekit.gap_records(log)
    assert len(gaps) == 3 * (STEPS - 1) and all(g["gap_ms"] >= SLO_HAND_MS for g in gaps)
    by_req: dict[str, list] = {}
    for sp in spans:
        by_req.setdefault(sp.attributes["tracekit.request_id"], []).append(sp)
    # a: in the given trace, each a child of the given span
    trace_a, span_a, _ = (f"{x:x}" for x in parse_traceparent(PARENT_A))
    assert len(by_req["a"]) == STEPS - 1
    assert {(s.trace_id, s.parent_span_id) for s in by_req["a"]} == {
        (trace_a.zfill(32), span_a.zfill(16))
    }
    # b: no context propagated: a trace of its own (not a's), under its root id
    assert len(by_req["b"]) == STEPS - 1
    ((tb, pb),) = {(s.trace_id, s.parent_span_id) for s in by_req["b"]}
    assert tb != trace_a.zfill(32) and pb != ""
    # c: its caller's context is not sampled (flags 00): the default parent-based sampler
    # sends none of its spans, and the sink counts only the spans it sent
    assert "c" not in by_req
    assert live.snapshot()["spans"] == 2 * (STEPS - 1) == len(spans)


def test_a_malformed_traceparent_raises_at_the_call_and_is_not_kept():
    live = LiveMetrics(slo_ms=SLO_HAND_MS)
    for bad in ("", "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
                "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01", None):  # fmt: skip
        with pytest.raises(ValueError, match="traceparent"):
            live.trace_parent("a", bad)  # type: ignore[arg-type]
    assert live.trace_parent("a", PARENT_A) is True
    # a sink that sends no spans checks the header too, and keeps nothing
    quiet = LiveMetrics()
    with pytest.raises(ValueError, match="traceparent"):
        quiet.trace_parent("a", "nope")
    assert quiet.trace_parent("a", PARENT_A) is False


def test_a_late_handed_flush_never_shifts_a_span_on_a_wall_clock_recorder():
    # a recorder on its default wall clock (perf_counter_ns); every flush reaches the sink
    # 0.3 s after it was made (a busy dispatcher): each span starts where its gap's first
    # emission was on the wall clock, not 0.3 s later
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    live = LiveMetrics(hold_s=0.1, slo_ms=SLO_HAND_MS, tracer_provider=provider)
    write = live.write

    def late_write(batch):
        time.sleep(0.3)
        write(batch)

    live.write = late_write  # type: ignore[method-assign]
    rec = tracekit.Recorder(None, flush_interval_s=0.05, handle_signals=False)
    attach(rec, live)
    emitted: list[tuple[float, float]] = []  # Unix time just before and after each emit
    with rec:
        rec.request("a", max_new_tokens=4)
        for _ in range(4):
            with rec.step():
                time.sleep(0.06)  # every gap >= 60 ms, above the 50 ms SLO
                before = time.time()
                rec.emit(["a"])
                emitted.append((before, time.time()))
    spans = sorted(exporter.get_finished_spans(), key=lambda s: s.start_time)
    assert len(spans) == 3
    for sp, (before, after) in zip(spans, emitted, strict=False):
        # within the emit call (1 ms for the two clocks' reads at the recorder's start),
        # where the 0.3 s lag would put it far outside
        assert before - 1e-3 <= sp.start_time / 1e9 <= after + 1e-3
