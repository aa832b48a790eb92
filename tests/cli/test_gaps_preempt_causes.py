"""`tracekit gaps --format jsonl` names the eviction behind every `preempt` part: on a
demo-engine run with recompute preemption, each gap with preempt time carries pieces that
sum to it, and every piece whose time a recorded eviction explains names its victim, the
step that decided it, the reason and the evictors; each gap whose prefill part holds
another's re-prefill names that victim's eviction (docs/partition.md, "Who evicted
whom")."""

from __future__ import annotations

import json

import pytest
from procs import run_cli

import tracekit
from demo_engine.config import EngineConfig, WorkloadConfig
from demo_engine.engine import Engine
from demo_engine.tokenizer import train_tokenizer
from demo_engine.workload import TraceRequest, make_trace


def test_every_preempt_part_names_its_eviction(tmp_path):
    cfg = EngineConfig(
        vocab_size=512, num_kv_blocks=24, max_num_seqs=8, max_num_batched_tokens=96,
        max_prompt_tokens=128, max_new_tokens=64, num_startup_objects=2_000,
        captured_graph_sizes=(1, 2, 4), preemption_mode="recompute",
    )  # fmt: skip
    tok = train_tokenizer(512, WorkloadConfig())
    tr = make_trace(0, 60.0, WorkloadConfig(rate_req_s=50.0, doc_frac=0.0))
    trace = [TraceRequest(i, 0.0, t.text[:300], 40, False) for i, t in enumerate(tr[:10])]
    out = tmp_path / "run.npz"
    with tracekit.Recorder(out, config={"rung": "test", "engine": cfg.to_dict()}) as rec:
        eng = Engine(cfg, rec, tok)
        try:
            eng.startup()
            eng.serve(trace, 60.0, is_drain=True)
        finally:
            eng.close()
    log = tracekit.load(out)
    assert len(log.preemptions) == len(log.evictions) > 0
    res = run_cli("gaps", str(out), "--format", "jsonl", timeout=120)
    assert res.returncode == 0, res.stderr
    records = [json.loads(x) for x in res.stdout.splitlines()]
    kinds = set()
    with_pre = [r for r in records if r["parts"].get("preempt", 0) > 0]
    assert with_pre
    for r in with_pre:
        pieces = r["preempt_causes"]
        assert sum(x["ms"] for x in pieces) == pytest.approx(r["parts"]["preempt"], abs=1e-6)
        for x in pieces:
            kinds.add(x["kind"])
            assert x["victim"] in log.request_ids
            assert x["reason"] == "kv_full" and isinstance(x["step"], int)
            # the demo scheduler names the grower it made room for, or none (a self-eviction)
            assert len(x["evictors"]) <= 1 and x["victim"] not in x["evictors"]
    assert kinds == {"evicted", "recompute"}
    assert all("preempt_causes" not in r for r in records if not r["parts"].get("preempt"))
    # others' re-prefill is their prefill, named by the victim's eviction: never the gap's
    # own request (its own is preempt), within the gap's prefill part
    with_rc = [r for r in records if "recompute_causes" in r]
    assert with_rc
    for r in with_rc:
        pieces = r["recompute_causes"]
        assert 0 < sum(x["ms"] for x in pieces) <= r["parts"]["prefill"] + 1e-6
        for x in pieces:
            assert x["kind"] == "recompute" and x["victim"] in log.request_ids
            assert x["victim"] != r["request"] and x["reason"] == "kv_full"
    # the TTFT records name theirs the same way (docs/ttft.md, "Eviction debt")
    res = run_cli("ttft", str(out), "--format", "jsonl", timeout=120)
    assert res.returncode == 0, res.stderr
    ttfts = [json.loads(x) for x in res.stdout.splitlines()]
    for r in ttfts:
        if r["parts"].get("preempt", 0) > 0:
            got = sum(x["ms"] for x in r["preempt_causes"])
            assert got == pytest.approx(r["parts"]["preempt"], abs=1e-6)
        else:
            assert "preempt_causes" not in r
        for x in r.get("recompute_causes", []):
            assert x["kind"] == "recompute" and x["victim"] != r["request"]
        others = r["parts"].get("prefill_other", 0) + r["parts"].get("prefill", 0)
        assert sum(x["ms"] for x in r.get("recompute_causes", [])) <= others + 1e-6
