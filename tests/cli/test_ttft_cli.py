"""The TTFT partition where users see it: `tracekit ttft`, analyze, compare, report, trace."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from test_ttft_cases import evicted_and_recomputed, queued_behind_kv_then_chunked

from tracekit.render.perfetto import read_trace


def _tk(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tracekit", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("ttft")
    a = queued_behind_kv_then_chunked()
    a = a.__class__(**{**a.__dict__, "config": {"rung": "kv", "seed": 1}})
    b = evicted_and_recomputed()
    b = b.__class__(**{**b.__dict__, "config": {"rung": "evict", "seed": 1}})
    return a.save(d / "kv__s1.npz"), b.save(d / "evict__s1.npz")


def test_ttft_command_lists_each_requests_partition(runs):
    r = _tk("ttft", runs[0], "--format", "jsonl")
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in r.stdout.splitlines()]
    by_id = {x["request"]: x for x in recs}
    # r1 of the hand case (test_ttft_cases): 34 ms = wait_kv_blocks 10 + decode_other 9 +
    # residual 7 + prefill_own 6 + prefill_other 2; queued 16 + prefilling 18
    r1 = by_id["r1"]
    assert r1["ttft_ms"] == pytest.approx(34.0)
    assert r1["parts"]["wait_kv_blocks"] == pytest.approx(10.0)
    assert r1["phases"]["queued"] == pytest.approx(16.0)
    assert r1["primary"] == "wait_kv_blocks"
    assert sum(r1["parts"].values()) == pytest.approx(34.0, abs=1e-9)
    # r0 has no admission row: unsplit, and stderr says so
    assert by_id["r0"]["admitted"] is None
    assert "unsplit" in r.stderr
    t = _tk("ttft", runs[0])
    assert t.returncode == 0 and "SLOWEST" in t.stdout and "wait_kv_blocks 10.0" in t.stdout
    h = _tk("ttft", "--help")
    assert "wait_<reason>" in h.stdout and "prefill_own" in h.stdout


def test_analyze_compare_report_and_trace_carry_ttft(runs, tmp_path):
    r = _tk("analyze", *runs, "--format", "jsonl")
    assert r.returncode == 0, r.stderr
    kv = json.loads(r.stdout.splitlines()[0])["ttft"]
    assert kv["requests"] == 2 and kv["tail_count"] == {"wait_kv_blocks": 1}
    t = _tk("analyze", *runs)
    assert "TTFT TAIL SHARE BY CAUSE" in t.stdout
    c = _tk("compare", *runs)
    assert c.returncode == 0 and "TTFT PER RUNG" in c.stdout
    md = _tk("compare", *runs, "--format", "markdown")
    assert md.returncode == 0 and "**TTFT PER RUNG" in md.stdout and "| kv |" in md.stdout
    cj = _tk("compare", *runs, "--format", "jsonl")
    groups = [json.loads(x) for x in cj.stdout.splitlines()]
    # the evicted run's only request: preempt 16 of 39 ms is its whole tail share
    ev = next(g for g in groups if g["group"] == "evict")
    assert ev["ttft"]["tail_share"]["preempt"] == pytest.approx(16 / 39)
    html = tmp_path / "r.html"
    rep = _tk("report", *runs, "-o", str(html))
    assert rep.returncode == 0, rep.stderr
    page = html.read_text()
    assert "Where TTFT went" in page and "tk-ttft-causes" in page
    tr = tmp_path / "t.json"
    assert _tk("trace", runs[0], "-o", str(tr)).returncode == 0
    slices = [e for e in read_trace(str(tr)) if e.get("name") == "ttft"]
    args = {round(e["args"]["ttft_ms"], 6): e["args"] for e in slices}
    r1 = args[34.0]
    assert r1["primary"] == "wait_kv_blocks"
    assert sum(r1["parts"].values()) == pytest.approx(34.0, abs=1e-3)
    assert sum(r1["phases"].values()) == pytest.approx(34.0, abs=1e-3)
