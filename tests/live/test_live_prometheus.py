"""Live mode through a real Prometheus server (Debian's `prometheus` package): the server,
started here on loopback with a 1 s scrape interval, scrapes a real `tracekit demo run
--metrics-port`; after the run, what Prometheus answers over its HTTP API is compared
with the offline `tracekit gaps` / `tracekit ttft` of the run's log.

Expected values come from the offline partition of the same log (docs/partition.md,
docs/ttft.md); the rules checked here are Prometheus' own: `increase()` over the run of a
counter that starts at 0 and never decreases is its final value; `resets()` is 0.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlencode

import pytest
from promserver import NO_PROMETHEUS, PROMETHEUS, get_json

pytest.importorskip("prometheus_client")
pytest.importorskip("opentelemetry.sdk")

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason=NO_PROMETHEUS)


def _cli(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run([sys.executable, "-m", "tracekit", *args], capture_output=True,
                       text=True, env=env, check=False)  # fmt: skip
    assert r.returncode == 0, r.stderr
    return r.stdout


def _dashboard_exprs() -> list[str]:
    d = json.loads((ROOT / "dashboards" / "tracekit-live.json").read_text())
    return [t["expr"] for p in d["panels"] for t in p["targets"]]


def test_prometheus_sees_the_offline_partition_of_a_real_demo_run(prometheus, tmp_path):
    prom, port = prometheus
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, "-m", "demo_engine.cli", "run", "--rung", "baseline", "--seed", "2",
         "--rate", "12", "--duration", "8", "--out", str(tmp_path), "--quiet",
         "--metrics-port", str(port), "--slo-ms", "40", "--lead-s", "3", "--linger-s", "4"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert f"127.0.0.1:{port}/metrics" in run.stderr  # the address, --quiet notwithstanding
    path = str(tmp_path / "baseline__s2.npz")
    gaps = [json.loads(x) for x in _cli("gaps", path).splitlines() if x.strip()]
    ttft = [json.loads(x) for x in _cli("ttft", path, "--format", "jsonl").splitlines() if x]
    a = json.loads(_cli("analyze", path, "--format", "jsonl").splitlines()[0])
    assert a["gaps"] == len(gaps) > 0 and len(ttft) > 0

    sel = '{job="tracekit",run="baseline__s2"}'
    now = time.time()
    # the last scrape of the run (the lingering final values): queries are evaluated there,
    # so increase() has nothing to extrapolate past its last sample; and (--lead-s) the
    # first scrapes saw every series at 0, before the run began
    last = prom.one(f"max(max_over_time(timestamp(tracekit_live_final{sel})[5m:1s]))", now)
    first = prom.one(f"min(min_over_time(timestamp(tracekit_gaps_total{sel})[5m:1s]))", last)
    span = f"[{int(last - first) + 5}s]"
    assert prom.one(f"max_over_time(tracekit_live_final{sel}{span})", last) == 1
    assert prom.one(f"tracekit_live_late_rows_total{sel}", last) == 0
    assert prom.one(f"tracekit_live_errors_total{sel}", last) == 0

    def increase(metric: str, **labels: str) -> float:
        lab = ",".join([sel[1:-1], *(f'{k}="{v}"' for k, v in labels.items())])
        return prom.one(f"increase({metric}{{{lab}}}{span})", last)

    assert increase("tracekit_gaps_total") == pytest.approx(len(gaps), rel=0.01)
    # every cause counter over the run = the offline per-gap parts summed (decode: graph
    # + forward; their split is a gauge, final at close)
    labels = a["labels"]
    for lb in labels:
        off = sum(g["parts"][lb] for g in gaps) / 1e3
        if lb in ("graph", "forward"):
            got = prom.one(f'tracekit_gap_decode_split_seconds{{{sel[1:-1]},cause="{lb}"}}', last)
        else:
            got = increase("tracekit_gap_cause_seconds_total", cause=lb)
        assert got == pytest.approx(off, rel=0.01, abs=1e-6), lb
    dec = sum(g["parts"]["graph"] + g["parts"]["forward"] for g in gaps) / 1e3
    assert increase("tracekit_gap_cause_seconds_total", cause="decode") == pytest.approx(
        dec, rel=0.01
    )
    # TTFT by cause (decode_other + graph exported as decode)
    tl = set().union(*(r["parts"] for r in ttft))
    for lb in sorted(tl - {"graph", "decode_other"}):
        off = sum(r["parts"][lb] for r in ttft) / 1e3
        got = increase("tracekit_ttft_cause_seconds_total", cause=lb)
        assert got == pytest.approx(off, rel=0.01, abs=1e-6), lb
    off = sum(r["parts"]["graph"] + r["parts"]["decode_other"] for r in ttft) / 1e3
    assert increase("tracekit_ttft_cause_seconds_total", cause="decode") == pytest.approx(
        off, rel=0.01, abs=1e-6
    )
    assert increase("tracekit_ttft_seconds_count") == pytest.approx(len(ttft), rel=0.01)

    # no series ever decreased: no counter or bucket reset in the whole run
    names = get_json(f"{prom.base}/api/v1/label/__name__/values")["data"]
    monotone = [n for n in names if n.startswith("tracekit_") and n.endswith(
        ("_total", "_bucket", "_count", "_sum"))]  # fmt: skip
    assert "tracekit_gap_cause_seconds_total" in monotone
    assert len(monotone) >= 12
    for m in monotone:
        res = prom.query(f"resets({m}{sel}{span})", last)
        assert res and all(float(r["value"][1]) == 0 for r in res), (m, res)

    # every query of the shipped dashboard returns data, mid-run (rates are not 0/0 there)
    mid = (first + last) / 2
    for expr in _dashboard_exprs():
        q = expr.replace("$__rate_interval", "4s").replace('run=~"$run"', 'run=~".*"')
        assert prom.query(q, mid), expr

    # exemplars: slow gaps' spans on the gap histogram's buckets
    ex = get_json(f"{prom.base}/api/v1/query_exemplars?" + urlencode(
        {"query": f"tracekit_gap_seconds_bucket{sel}", "start": repr(first - 5), "end": repr(last)}
    ))  # fmt: skip
    assert ex["status"] == "success"
    found = [e for series in ex["data"] for e in series["exemplars"]]
    assert found and all(len(e["labels"]["trace_id"]) == 32 for e in found)
    assert all(float(e["value"]) >= 0.040 for e in found)  # only gaps >= the SLO


def test_every_scraper_reads_the_same_series_whenever_it_joins(tmp_path):
    """docs/live.md, "Series that appear mid-run": a series is the same for every reader
    at every instant. Prometheus B joins a demo run mid-way, Prometheus A only after its
    final values; neither scraped before. On B, what the causes' counters increased by
    over its samples adds up to what `tracekit_gap_seconds_sum` increased by (a series
    shown at 0 to a new reader and then at its value counted the run's past twice); A's
    last values are B's, series for series."""
    from promserver import _free_port, running_prometheus

    target = _free_port()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = subprocess.Popen(
        [sys.executable, "-m", "demo_engine.cli", "run", "--rung", "baseline", "--seed", "3",
         "--rate", "12", "--duration", "16", "--out", str(tmp_path), "--quiet",
         "--metrics-port", str(target), "--lead-s", "1", "--linger-s", "15"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip

    def until(cond, timeout_s=120.0) -> None:
        deadline = time.time() + timeout_s
        while time.time() < deadline:
            if cond():
                return
            assert run.poll() is None, run.stderr.read()
            time.sleep(0.2)
        pytest.fail("the demo run never got there")

    try:
        # nothing scrapes the run before B: a scrape of our own would be a first reader
        time.sleep(8)  # the interpreter's start, --lead-s, then gaps for a few seconds
        with running_prometheus(tmp_path / "b", target) as b:
            sel = '{job="tracekit"}'
            until(lambda: b.query(f"tracekit_live_final{sel} == 1", time.time()) != [])
            with running_prometheus(tmp_path / "a", target) as a:
                until(lambda: a.query(f"count_over_time(tracekit_live_final{sel}[1m]) >= 2",
                                      time.time()) != [])  # fmt: skip
                now = time.time()
                first = b.one(
                    f"min(min_over_time(timestamp(tracekit_gaps_total{sel})[5m:1s]))", now
                )
                last = b.one(f"max(max_over_time(timestamp(tracekit_gaps_total{sel})[5m:1s]))", now)
                span = f"[{int(last - first) + 2}s]"
                causes = b.query(f"increase(tracekit_gap_cause_seconds_total{sel}{span})", last)
                total = b.one(f"increase(tracekit_gap_seconds_sum{sel}{span})", last)
                assert len(causes) >= 5 and total > 0
                assert sum(float(r["value"][1]) for r in causes) == pytest.approx(total, rel=0.02)
                for p in (a, b):
                    q = f"last_over_time(tracekit_gap_cause_seconds_total{sel}[1m])"
                    got = {r["metric"]["cause"]: float(r["value"][1]) for r in p.query(q, now)}
                    if p is a:
                        in_a = got
                    else:
                        assert got == in_a
    finally:
        run.wait(120)
    assert run.returncode == 0, run.stderr.read()
