"""Who evicted whom, per run (docs/partition.md, "Who evicted whom"; docs/ttft.md,
"Eviction debt"): evictions by reason, the recompute tax, each eviction's debt, the top
evictors and thrash; in `analyze`, the text report, the verdict and the HTML report.

Expected values by hand from the rules, on one small log (times in ms)."""

from __future__ import annotations

import json
import math

import pytest
from logbuilder import LogBuilder

from tracekit.analysis.compare import Comparison, GroupSummary, Spread, compare
from tracekit.analysis.evictions import eviction_summary
from tracekit.analysis.figures import analyze
from tracekit.analysis.verdict import verdict
from tracekit.log.validate import validate_log
from tracekit.render import text
from tracekit.render.html_tables import evictions_html


def run():
    """Steps: s0 [0,10] prefills 100 tokens; s1 [10,20] decodes 3, where r1's decode
    evicts r0 at 12 (recompute, kv_full, 60 tokens lost, 0 free / 4 used); s2 [20,40]
    re-prefills r0's 60 tokens in a `recompute` segment [21,31] (readmitted at 21) and
    decodes 2, and r0's re-prefill evicts r2 at 24 (priority, 30 lost); s3 [40,50] decodes
    3 (r2 readmitted at 41); s4 [50,60] decodes 2, and r2 is evicted again at 52 with no
    cause told, never readmitted."""
    b = LogBuilder()
    b.step(0, 10, n_decode=0, n_prefill=100)
    b.step(10, 20, n_decode=3)
    b.step(20, 40, n_decode=2, n_prefill=60)
    b.step(40, 50, n_decode=3)
    b.step(50, 60, n_decode=2)
    b.seg(2, "recompute", 21, 31)
    for t, s, reqs in ((10, 0, (0, 1, 2)), (20, 1, (1, 2)), (40, 2, (0, 1)),
                       (50, 3, (0, 1, 2)), (60, 4, (0, 1))):  # fmt: skip
        for r in reqs:
            b.emit(r, t, s)
    b.evict(0, 12, 21, mode=1)
    b.cause(0, 12, 1, "kv_full", by=(1,), lost=60, free=0, used=4)
    b.evict(2, 24, 41, mode=1)
    b.cause(2, 24, 2, "priority", by=(0,), lost=30)
    b.evict(2, 52, mode=1)
    return validate_log(b.build())


def test_the_run_figures_by_hand():
    e = eviction_summary(run())
    assert e is not None
    assert (e.num_evictions, e.num_with_cause) == (3, 2)
    assert e.by_reason == {"kv_full": 1, "priority": 1, "other": 0, "unknown": 1}
    # recomputed: the told losses of recompute evictions, 60 + 30; computed: prefill
    # 100 + 60 (the re-prefill included) and decode rows 3 + 2 + 3 + 2
    assert (e.recomputed_tokens, e.computed_tokens) == (90, 170)
    assert e.recompute_tax == pytest.approx(90 / 170)
    assert e.recompute_ms == pytest.approx(10.0)
    # r0 at 12: evicted 9 ms (to 21), then 19 ms to its next token at 40: debt 28;
    # r2 at 24: evicted 17 ms (to 41), then 9 ms to 50: debt 26; r2 at 52: never back
    assert e.evicted_ms == pytest.approx(26.0)
    assert e.debt_ms == pytest.approx(54.0)
    assert [(w.victim, round(w.evicted_ms, 9), round(w.resume_ms, 9)) for w in e.worst] == [
        ("r0", 9.0, 19.0),
        ("r2", 17.0, 9.0),
    ]
    assert e.worst[0].evictors == ("r1",) and e.worst[0].step == 1
    assert (e.worst[0].num_free_blocks, e.worst[0].num_used_blocks) == (0, 4)
    # top evictors, most debt first: r1 (r0's 28 ms), r0 (r2's 26 ms)
    assert [(r, n, round(ms, 9)) for r, n, ms in e.top_evictors] == [
        ("r1", 1, 28.0),
        ("r0", 1, 26.0),
    ]
    assert e.thrash == (("r2", 2),) and e.num_thrashed == 1


def test_analyze_carries_them_and_the_reports_show_them():
    a = analyze(run())
    assert a.recompute_tax == pytest.approx(90 / 170)
    rec = json.loads(json.dumps(a.to_dict()))
    assert rec["evictions"]["by_reason"]["unknown"] == 1
    assert rec["evictions"]["worst"][0]["debt_ms"] == pytest.approx(28.0)
    lines = text.evictions_lines(a)
    assert lines[0].startswith("evictions 3 (2 with a recorded cause; by reason: kv_full 1, ")
    assert "recompute tax 52.9% (90 of 170 computed tokens, 10.0 ms in recompute)" in lines[0]
    assert lines[1] == (
        "top evictors (their victims' debt): r1 (1 victim, 28.0 ms), r0 (1 victim, 26.0 ms); "
        "evicted more than once: 1 request(s): r2 x2"
    )
    page = evictions_html([a], ["run"])
    assert '<h2 id="tk-evictions">Who evicted whom</h2>' in page
    assert "<td>r0</td><td>r1</td><td>1</td><td>kv_full</td><td>60</td><td>0 / 4</td>" in page


def test_a_run_without_evictions_has_no_summary_and_no_section():
    b = LogBuilder()
    b.step(0, 10)
    b.emit(0, 10, 0)
    b.emit(0, 20, 0)
    a = analyze(validate_log(b.build()))
    assert a.evictions is None and a.recompute_tax == 0.0
    assert text.evictions_lines(a) == [] and evictions_html([a], ["run"]) == ""


def test_compare_and_the_verdict_put_the_recompute_tax_beside_the_preemptions():
    g = compare([analyze(run())]).groups[0]
    assert g.counts["recompute_tax"].median == pytest.approx(90 / 170)
    share = {"preempt": 0.5, "forward": 0.5}
    figures = {n: Spread(1.0, 1.0, 1.0, 1) for n in
               ("itl_p50", "itl_p99", "itl_p999", "itl_max", "ttft_p50", "tok_per_s")}  # fmt: skip
    counts = {"preemptions": Spread(12, 12, 12, 1), "eager_steps": Spread(3, 3, 3, 1),
              "recompute_tax": Spread(0.128, 0.128, 0.128, 1)}  # fmt: skip
    labels = ("preempt", "gc", "tok", "prefill", "graph", "forward", "residual")
    v = verdict(Comparison("rung", labels, (GroupSummary("baseline", ("x",), figures, share,
                                                         {}, counts),)))  # fmt: skip
    assert v.findings[0] == (
        "baseline: preemption owns 50% of tail time (12 preemptions, recompute tax 12.8%, "
        "3 eager steps); median p99.9 1.0 ms."
    )
    assert not math.isnan(g.counts["preemptions"].median)
