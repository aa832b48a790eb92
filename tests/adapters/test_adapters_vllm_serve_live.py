"""`vllm serve` with the plugin's live options: the engine core serves its live per-cause
metrics and sends its slow gaps' spans while the server runs, and they equal the offline
analysis of the same recording.

One server (vLLM's OpenAI API server, default multiprocess mode) of the tiny local model,
4 KV blocks of 32 tokens so the scheduler preempts, recorded into a directory with
``TRACEKIT_VLLM_DIR`` and live with ``TRACEKIT_VLLM_METRICS_PORT``/``_SLO_MS``/
``_OTLP_ENDPOINT``/``_HOLD_S``/``_LINGER_S``. vLLM traces too (``--otlp-traces-endpoint``,
over OTLP/HTTP to the same loopback receiver), so it carries each request's
``traceparent`` header to the engine core. An httpx client streams completions at once,
half of them with a ``traceparent`` of their own. The metrics port is scraped during the
run, once every gap is settled, and while the engine core lingers after SIGTERM
(``--shutdown-timeout`` longer than the linger, so the engine core stops its recorder).
Where Debian's ``prometheus`` is installed, a real Prometheus scrapes the same port every
second and its ``increase()`` over the run is compared too.

Expected values come from the offline partition of the recording (`tracekit analyze` /
`tracekit gaps` of the merged run: its engine-boundary gaps are the engine core's; `tracekit
ttft` of the engine core's own log: docs/live.md says why not the merged run's).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlencode
from urllib.request import Request, urlopen

import pytest

pytestmark = [pytest.mark.adapters, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
MAX_TOKENS = 32
N_REQUESTS = 6
SLO_MS = 5.0
HOLD_S, LINGER_S, FLUSH_S = 1.0, 8.0, 0.2
#: W3C trace contexts, sampled, one per traced request (even indices).
PARENTS = {
    k: f"00-{(0xA1B2C3D4E5F60718293A4B5C6D7E8F90 + k):032x}-{(0x1122334455667788 + k):016x}-01"
    for k in range(0, N_REQUESTS, 2)
}


def _scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of the metrics port, keyed (name, labels without the constant ones)."""
    from prometheus_client.parser import text_string_to_metric_families

    const = {"run", "engine", "model", "process", "dp_rank", "api_server"}
    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(body):
        for s in fam.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k not in const))
            out[(s.name, labels)] = s.value
    return out


def _cli(*args: str) -> str:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    r = subprocess.run([sys.executable, "-m", "tracekit", *args], capture_output=True,
                       text=True, env=env, check=False, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout


def _start_prometheus(tmp: Path, target: int):
    """A real Prometheus scraping `target` every second (None where it is not installed)."""
    exe = shutil.which("prometheus")
    if exe is None:
        return None, None
    from engine_adapters.serve_harness import free_port

    web = free_port()
    cfg = tmp / "prometheus.yml"
    cfg.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n"
        "scrape_configs:\n  - job_name: tracekit\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{target}']\n"
    )
    proc = subprocess.Popen(
        [exe, f"--config.file={cfg}", f"--storage.tsdb.path={tmp / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{web}"],
        stdout=subprocess.DEVNULL, stderr=open(tmp / "prometheus.log", "w"),
    )  # fmt: skip
    for _ in range(300):
        try:
            with urlopen(f"http://127.0.0.1:{web}/-/ready", timeout=1) as r:
                if r.status == 200:
                    return proc, f"http://127.0.0.1:{web}"
        except OSError:
            time.sleep(0.1)
    proc.terminate()
    pytest.fail("prometheus never became ready: " + (tmp / "prometheus.log").read_text())


def _prom_one(base: str, expr: str, at: float) -> float:
    with urlopen(f"{base}/api/v1/query?" + urlencode({"query": expr, "time": repr(at)}),
                 timeout=10) as r:  # fmt: skip
        out = json.loads(r.read().decode())
    assert out["status"] == "success", (expr, out)
    res = out["data"]["result"]
    assert len(res) == 1, (expr, res)
    return float(res[0]["value"][1])


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("vllm")
    pytest.importorskip("httpx")
    pytest.importorskip("prometheus_client")
    pytest.importorskip("opentelemetry.proto.collector.trace.v1.trace_service_pb2")
    from importlib.metadata import entry_points

    if not any(e.value.startswith("engine_adapters.vllm_serve") for e in
               entry_points(group="vllm.general_plugins")):  # fmt: skip
        pytest.skip("tracekit's vLLM plugin entry point is not installed: pip install -e .")
    from engine_adapters import serve_harness as sh
    from engine_adapters.tiny_model import build_tiny_llama
    from tests.otlp_receiver import OtlpReceiver

    base = tmp_path_factory.mktemp("serve_live")
    model = build_tiny_llama(str(base / "model"))
    rec_dir = str(base / "rec")
    mport, aport = sh.free_port(), sh.free_port()
    prom, prom_url = _start_prometheus(base, mport)
    rx = OtlpReceiver().__enter__()
    env = {
        "TRACEKIT_VLLM_METRICS_PORT": str(mport),
        "TRACEKIT_VLLM_API_METRICS_PORT": str(aport),
        "TRACEKIT_VLLM_SLO_MS": str(SLO_MS),
        "TRACEKIT_VLLM_OTLP_ENDPOINT": rx.url,
        "TRACEKIT_VLLM_HOLD_S": str(HOLD_S),
        "TRACEKIT_VLLM_LINGER_S": str(LINGER_S),
        "TRACEKIT_VLLM_RUN": "serve-live",
        # vLLM's own request spans, to the same receiver over OTLP/HTTP
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf",
    }
    during: list[dict] = []
    lingering: list[dict] = []
    stop = threading.Event()

    def scraper(into: list[dict]) -> None:
        while not stop.is_set():
            try:
                into.append(_scrape(mport))
            except OSError:  # not listening yet, or gone
                pass
            stop.wait(0.3)

    out: dict = {"dir": rec_dir, "receiver": rx, "port": mport, "prom": prom_url,
                 "api_port": aport}  # fmt: skip
    try:
        server = sh.start_server(
            model, record_dir=rec_dir, log_path=str(base / "server.log"), flush_s=FLUSH_S,
            extra_args=[*sh.PREEMPTING_ARGS, "--otlp-traces-endpoint", rx.url,
                        "--shutdown-timeout", str(int(LINGER_S + 20))],
            env_extra=env,
        )  # fmt: skip
        out["server_log"] = server.log_path
        try:
            out["before"] = _scrape(mport)  # the engine core serves from its start
            out["api_before"] = _scrape(aport)  # the API server too, from its engine client's
            t = threading.Thread(target=scraper, args=(during,), daemon=True)
            t.start()
            bodies = [
                sh.completion_body(model, f"the quick brown fox {i} jumps over", MAX_TOKENS)
                for i in range(N_REQUESTS)
            ]
            headers = [{"traceparent": PARENTS[k]} if k in PARENTS else None
                       for k in range(N_REQUESTS)]  # fmt: skip
            out["t_load0"] = time.time()
            out["streams"] = sh.stream_load(server, bodies, headers)
            # settled: every gap of the load, while the server idles (its idle flushes move
            # the watermark). No speculative decoding: each step emits one token per running
            # request, so each request has MAX_TOKENS emissions (ignore_eos), MAX_TOKENS - 1
            # engine-boundary gaps, and one TTFT
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                s = _scrape(mport)
                if (s[("tracekit_gaps_total", ())] >= N_REQUESTS * (MAX_TOKENS - 1)
                        and s[("tracekit_ttft_seconds_count", ())] >= N_REQUESTS):  # fmt: skip
                    break
                time.sleep(0.2)
            out["settled"] = s
            while time.monotonic() < deadline:  # the API server's flush of the first chunks
                a = _scrape(aport)
                if a[("tracekit_ttft_client_seconds_count", ())] >= N_REQUESTS:
                    break
                time.sleep(0.2)
            out["api_settled"] = a
            req = Request(f"http://127.0.0.1:{mport}/metrics",
                          headers={"Accept": "application/openmetrics-text"})  # fmt: skip
            with urlopen(req, timeout=5) as r:  # what Prometheus asks for with exemplars on
                out["openmetrics"] = r.read().decode()
            time.sleep(2.5)  # two more Prometheus scrapes of the settled values
            stop.set()
            t.join()
            # SIGTERM: the engine core stops its recorder (every gap settled, final) and
            # keeps serving for the linger
            stop.clear()
            t2 = threading.Thread(target=scraper, args=(lingering,), daemon=True)
            t2.start()
            out["rc"] = server.stop(signal.SIGTERM, timeout_s=LINGER_S + 60)
            stop.set()
            t2.join()
        finally:
            server.stop(signal.SIGKILL)
        out["during"], out["lingering"] = during, lingering
        kept = {"settled": out["settled"], "final": lingering[-1] if lingering else {}}
        with open(base / "scrapes.json", "w") as fh:  # for a reader of a failed run
            json.dump({k: [[n, list(lb), v] for (n, lb), v in d.items()]
                       for k, d in kept.items()}, fh)  # fmt: skip
        if prom is not None:
            out["t_last"] = time.time()
        _wait = time.monotonic() + 15  # vLLM's and tracekit's batched spans
        while time.monotonic() < _wait and not rx.named("tracekit.gap"):
            time.sleep(0.2)
        yield out
    finally:
        stop.set()
        rx.__exit__(None, None, None)
        if prom is not None:
            prom.terminate()
            prom.wait(10)


@pytest.fixture(scope="module")
def offline(served, tmp_path_factory):
    d = served["dir"]
    merged = str(tmp_path_factory.mktemp("merged") / "run.npz")
    _cli("merge", d, "-o", merged)
    a = json.loads(_cli("analyze", merged, "--format", "jsonl").splitlines()[0])
    gaps = [json.loads(x) for x in _cli("gaps", merged, "--format", "jsonl").splitlines() if x]
    (core,) = [n for n in os.listdir(d) if n.startswith("engine_core-") and n.endswith(".parts")]
    core_path = os.path.join(d, core)
    ttft = [json.loads(x) for x in _cli("ttft", core_path, "--format", "jsonl").splitlines() if x]
    core_gaps = [json.loads(x) for x in _cli("gaps", core_path, "--format", "jsonl").splitlines()
                 if x]  # fmt: skip
    return {"analyze": a, "gaps": gaps, "ttft": ttft, "core_gaps": core_gaps, "core": core}


def test_the_engine_core_serves_from_its_start_and_prints_its_port(served):
    log = Path(served["server_log"]).read_text(errors="replace")
    assert f"live metrics at http://127.0.0.1:{served['port']}/metrics" in log
    b = served["before"]
    assert b[("tracekit_gaps_total", ())] == 0 and b[("tracekit_live_final", ())] == 0
    assert b[("tracekit_gap_cause_seconds_total", (("cause", "preempt"),))] == 0


def test_settled_totals_equal_the_offline_partition_of_the_merged_run(served, offline):
    a, gaps, s = offline["analyze"], offline["gaps"], served["settled"]
    assert all(st.status == 200 for st in served["streams"])
    assert s[("tracekit_live_late_rows_total", ())] == 0
    assert s[("tracekit_live_truncated_gaps_total", ())] == 0
    assert s[("tracekit_live_errors_total", ())] == 0
    # every gap at the engine boundary: the merged run keeps the engine core's tables
    assert len(gaps) == a["gaps"] == len(offline["core_gaps"]) == N_REQUESTS * (MAX_TOKENS - 1)
    assert s[("tracekit_gaps_total", ())] == a["gaps"]
    total_s = sum(g["gap_ms"] for g in gaps) / 1e3
    assert s[("tracekit_gap_seconds_sum", ())] == pytest.approx(total_s, rel=1e-2)
    labels = set().union(*(g["parts"] for g in gaps))
    for lb in labels - {"graph", "forward"}:
        off = sum(g["parts"][lb] for g in gaps) / 1e3
        live = s.get(("tracekit_gap_cause_seconds_total", (("cause", lb),)), 0.0)
        assert live == pytest.approx(off, rel=1e-2, abs=1e-2 * total_s / len(labels)), lb
    dec = sum(g["parts"]["graph"] + g["parts"]["forward"] for g in gaps) / 1e3
    live_dec = s[("tracekit_gap_cause_seconds_total", (("cause", "decode"),))]
    assert live_dec == pytest.approx(dec, rel=1e-2)
    assert sum(g["parts"]["preempt"] for g in gaps) > 0  # the KV pool made it preempt
    # TTFT: every request, by cause as `tracekit ttft` of the engine core's log
    ttft = offline["ttft"]
    assert s[("tracekit_ttft_seconds_count", ())] == len(ttft) == N_REQUESTS
    for lb in ttft[0]["parts"]:
        off = sum(r["parts"][lb] for r in ttft) / 1e3
        key = "decode" if lb in ("graph", "decode_other") else lb
        if key == "decode":
            off = sum(r["parts"].get("graph", 0) + r["parts"].get("decode_other", 0)
                      for r in ttft) / 1e3  # fmt: skip
        live = s.get(("tracekit_ttft_cause_seconds_total", (("cause", key),)), 0.0)
        assert live == pytest.approx(off, rel=1e-2, abs=1e-4), lb


def test_the_api_servers_client_boundary_ttft_equals_the_offline_one(served):
    """docs/live.md, "TTFT at the client boundary": the API server's live histogram of
    arrival -> first chunk's write, from its own rows, equals `tracekit ttft --boundary
    client` of the merged run, request for request: the same count, every bucket's count
    of TTFTs <= its bound, and the sum to float rounding (the merge moves the API server's
    rows by one offset, which a difference of two of them does not see)."""
    from tracekit.live import TTFT_BUCKETS_S

    log = Path(served["server_log"]).read_text(errors="replace")
    assert f"client-boundary TTFT at http://127.0.0.1:{served['api_port']}/metrics" in log
    b = served["api_before"]  # served before the first request, at 0
    assert b[("tracekit_ttft_client_seconds_count", ())] == 0
    assert b[("tracekit_ttft_client_seconds_bucket", (("le", "+Inf"),))] == 0
    off = [json.loads(x) for x in _cli("ttft", served["dir"], "--boundary", "client",
                                       "--format", "jsonl").splitlines() if x]  # fmt: skip
    ttft_s = [r["ttft_ms"] / 1e3 for r in off]
    a = served["api_settled"]
    assert len(ttft_s) == N_REQUESTS == a[("tracekit_ttft_client_seconds_count", ())]
    for bound in TTFT_BUCKETS_S:
        le = (("le", repr(float(bound))),)
        n = sum(t <= bound for t in ttft_s)
        assert a[("tracekit_ttft_client_seconds_bucket", le)] == n, bound
    assert a[("tracekit_ttft_client_seconds_bucket", (("le", "+Inf"),))] == N_REQUESTS
    assert a[("tracekit_ttft_client_seconds_sum", ())] == pytest.approx(sum(ttft_s), rel=1e-9)
    print(
        f"client-boundary TTFT: live sum {a[('tracekit_ttft_client_seconds_sum', ())]:.9f} s,"
        f" offline {sum(ttft_s):.9f} s over {len(ttft_s)} requests"
    )


def test_counters_never_decrease_and_the_lingering_values_are_final(served, offline):
    seq = [served["before"], *served["during"], served["settled"], *served["lingering"]]
    counters = {k for k in served["settled"] if k[0].endswith(("_total", "_count", "_bucket"))}
    counters -= {k for k in counters if k[0] == "tracekit_live_cpu_seconds_total"}
    for k in counters:
        vals = [d[k] for d in seq if k in d]
        assert all(x <= y for x, y in zip(vals, vals[1:], strict=False)), k
    assert any(0 < d.get(("tracekit_gaps_total", ()), 0) < offline["analyze"]["gaps"]
               for d in served["during"]), "no scrape saw the run part way"  # fmt: skip
    final = [d for d in served["lingering"] if d.get(("tracekit_live_final", ()), 0) == 1]
    assert final, "no scrape saw tracekit_live_final 1 while the engine core lingered"
    f = final[-1]
    assert f[("tracekit_gaps_total", ())] == offline["analyze"]["gaps"]
    # nothing arrived after the load: the close settled nothing more than the idle flushes
    for k in counters:
        assert f[k] == served["settled"][k], k


def test_a_traceparent_puts_the_requests_slow_gap_spans_in_its_trace(served, offline):
    spans = served["receiver"].named("tracekit.gap")
    core_gaps = offline["core_gaps"]  # the engine core's own names: vLLM's internal ids
    slow = [g for g in core_gaps if g["gap_ms"] >= SLO_MS]
    key = lambda rid, s0, s1: (rid, s0, s1)  # noqa: E731
    got = {key(s.attributes["tracekit.request_id"], s.attributes["tracekit.step0"],
               s.attributes["tracekit.step1"]): s for s in spans}  # fmt: skip
    assert len(spans) == len(got) == len(slow) > 0
    assert set(got) == {key(g["request"], g["step0"], g["step1"]) for g in slow}
    # vLLM's internal id is the client's (`cmpl-ID-0`) and 8 random characters
    client_of = {st.name(0): k for k, st in enumerate(served["streams"])}
    by_request: dict[int, set[tuple[str, str]]] = {}
    for sp in spans:
        k = client_of[sp.attributes["tracekit.request_id"][:-9]]
        by_request.setdefault(k, set()).add((sp.trace_id, sp.parent_span_id))
    traced = [k for k in PARENTS if k in by_request]
    assert traced, "no traced request had a gap above the SLO: the test checks nothing"
    for k, ids in by_request.items():
        assert len(ids) == 1, k  # one trace per request
        if k in PARENTS:
            _, trace_id, span_id, _ = PARENTS[k].split("-")
            assert ids == {(trace_id, span_id)}, k
        else:
            ((tid, _),) = ids
            assert tid not in {p.split("-")[1] for p in PARENTS.values()}
    # vLLM's own request span for a traced request is in the same trace, under the same
    # parent: the gaps sit beside it in the client's trace
    vllm_spans = [s for s in served["receiver"].spans if s.name != "tracekit.gap"]
    for k in traced:
        _, trace_id, span_id, _ = PARENTS[k].split("-")
        assert any(s.trace_id == trace_id and s.parent_span_id == span_id for s in vllm_spans)


def test_exemplars_name_slow_gap_spans_the_receiver_got(served):
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    ex = [smp.exemplar for f in text_string_to_metric_families(served["openmetrics"])
          if f.name == "tracekit_gap_seconds" for smp in f.samples if smp.exemplar]  # fmt: skip
    assert ex, "no exemplar on the gap histogram"
    sent = {(s.trace_id, s.span_id): s for s in served["receiver"].named("tracekit.gap")}
    for e in ex:
        sp = sent[(e.labels["trace_id"], e.labels["span_id"])]
        assert e.value == pytest.approx(sp.attributes["tracekit.gap_ms"] / 1e3)
        assert e.value >= SLO_MS / 1e3


def test_prometheus_increase_over_the_run_equals_the_offline_totals(served, offline):
    base = served["prom"]
    if base is None:
        pytest.skip("no prometheus binary (Debian: apt-get install prometheus)")
    sel = '{job="tracekit",run="serve-live"}'
    last = _prom_one(base, f"max(max_over_time(timestamp(tracekit_live_final{sel})[10m:1s]))",
                     served["t_last"])  # fmt: skip
    first = _prom_one(base, f"min(min_over_time(timestamp(tracekit_gaps_total{sel})[10m:1s]))",
                      last)  # fmt: skip
    span = f"[{int(last - first) + 5}s]"
    # the engine core served every series at 0 before the first request: increase() over
    # the whole run is the final value
    assert _prom_one(base, f"min_over_time(tracekit_gaps_total{sel}{span})", last) == 0
    gaps = offline["gaps"]
    got = _prom_one(base, f"increase(tracekit_gaps_total{sel}{span})", last)
    assert got == pytest.approx(len(gaps), rel=1e-2)
    for lb in ("preempt", "prefill"):
        off = sum(g["parts"][lb] for g in gaps) / 1e3
        lab = sel[:-1] + f',cause="{lb}"}}'
        got = _prom_one(base, f"increase(tracekit_gap_cause_seconds_total{lab}{span})", last)
        assert got == pytest.approx(off, rel=1e-2), lb
    assert _prom_one(base, f"sum(resets(tracekit_gap_cause_seconds_total{sel}{span}))", last) == 0
