"""The re-prefill in the TTFT partition (docs/ttft.md, rule 4, and "Eviction debt"): a
request waiting across another's re-prefill has it as others' prefill (`prefill_other`),
named by the victim's eviction; the victim's own TTFT window keeps its re-prefill as
`preempt`, named by its own eviction. Expected values derived by hand from the rules (times
in ms; every step on a captured size, so decode is all `decode_other`). Both
implementations are checked."""

from __future__ import annotations

import numpy as np
import pytest
from logbuilder import LogBuilder

from tracekit.analysis.ttft_records import ttft_records
from tracekit.attribution.reference import ttft_partition_reference
from tracekit.attribution.ttft import ttft_partition
from tracekit.log.validate import validate_log

IMPLS = [ttft_partition, ttft_partition_reference]


def victim_and_waiter():
    """r0 arrives at 0, is admitted and prefills its 32 tokens in step 0 [0, 8]; step 1's
    scheduler evicts it at 12 (recompute, kv_full) before its first token; it is back at 21
    and re-prefills in step 2's `recompute` segment [21, 31]; r1 arrives at 15, waits for
    KV blocks in step 1, is admitted at 20 and prefills its 16 tokens in [31, 35]; both
    first tokens at 40, after step 2's decode [35, 40]."""
    b = LogBuilder()
    b.step(0, 10)
    b.admit(0, 0)
    b.prefill(0, 0, 32)
    b.seg(0, "prefill", 0, 8)
    b.step(10, 20)
    b.seg(1, "decode", 12, 20)
    b.wait(1, 1, "kv_blocks")
    b.evict(0, 12, 21, mode=1)
    b.cause(0, 12, 1, "kv_full", lost=32)
    b.step(20, 40)
    b.admit(1, 20)
    b.prefill(2, 1, 16)
    b.seg(2, "recompute", 21, 31)
    b.seg(2, "prefill", 31, 35)
    b.seg(2, "decode", 35, 40)
    b.emit(0, 40, 2)
    b.emit(1, 40, 2)
    return validate_log(b.build(arrivals_ms=[0, 15]))


def _parts(p, req: int) -> dict[str, float]:
    i = int(np.flatnonzero(p.request == req)[0])
    return {lb: float(v) for lb, v in zip(p.labels, p.parts_ms[i], strict=True) if abs(v) > 1e-9}


def _close(got: dict[str, float], want: dict[str, float]) -> None:
    assert set(got) == set(want), (got, want)
    for k, v in want.items():
        assert got[k] == pytest.approx(v, abs=1e-9), (k, got, want)


@pytest.mark.parametrize("impl", IMPLS)
def test_a_ttft_window_across_anothers_re_prefill_has_it_as_others_prefill(impl):
    """r1's window [15, 40], 25 ms: held for KV blocks [15, 20] (step 1's wait row, from
    its arrival: rule 3) 5; residual [20, 21] 1; r0's re-prefill [21, 31]: r0 re-prefills
    there (recompute, back at 21 by the step's end, no emission since), not r1, so it is
    others' prefill, `prefill_other` 10 (rule 4); its own prefill [31, 35], all of step 2's
    recorded tokens, `prefill_own` 4; decode [35, 40] `decode_other` 5. No preempt."""
    p = impl(victim_and_waiter())
    _close(_parts(p, 1), {"wait_kv_blocks": 5.0, "residual": 1.0, "prefill_other": 10.0,
                          "prefill_own": 4.0, "decode_other": 5.0})  # fmt: skip
    i = int(np.flatnonzero(p.request == 1)[0])
    assert p.reprefill_other_ms[i] == pytest.approx(10.0, abs=1e-9)
    assert p.reprefill_own_ms[i] == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("impl", IMPLS)
def test_the_victims_own_ttft_window_keeps_its_re_prefill_as_preempt(impl):
    """r0's window [0, 40], 40 ms: its prefill [0, 8] `prefill_own` 8 (32 of step 0's 32
    tokens); nothing covers [8, 12]: `residual` 4; evicted [12, 21]: `preempt` 9 (rule 1;
    what ran meanwhile is context); its own re-prefill [21, 31]: `preempt` 10, 19 in all;
    r1's prefill [31, 35]: `prefill_other` 4; decode [35, 40]: `decode_other` 5."""
    p = impl(victim_and_waiter())
    _close(_parts(p, 0), {"prefill_own": 8.0, "residual": 4.0, "preempt": 19.0,
                          "prefill_other": 4.0, "decode_other": 5.0})  # fmt: skip
    i = int(np.flatnonzero(p.request == 0)[0])
    assert p.reprefill_own_ms[i] == pytest.approx(10.0, abs=1e-9)


def test_ttft_records_name_the_eviction_behind_preempt_and_others_re_prefill():
    """`tracekit ttft --format jsonl`'s records: r0's preempt 19 ms is its evicted time 9
    and its re-prefill 10, both named by its eviction at 12 (step 1, kv_full, no
    evictors); r1's prefill_other holds r0's re-prefill, 10 ms, named the same."""
    log = victim_and_waiter()
    recs = {r["request"]: r for r in ttft_records(log)}
    pieces = recs["r0"]["preempt_causes"]
    assert [(x["kind"], x["victim"], x["step"], x["reason"], x["evictors"], round(x["ms"], 9))
            for x in pieces] == [("evicted", "r0", 1, "kv_full", [], 9.0),
                                 ("recompute", "r0", 1, "kv_full", [], 10.0)]  # fmt: skip
    assert "recompute_causes" not in recs["r0"]
    assert "preempt_causes" not in recs["r1"]
    assert [(x["kind"], x["victim"], x["evicted_at_s"], round(x["ms"], 9))
            for x in recs["r1"]["recompute_causes"]] == [
        ("recompute", "r0", pytest.approx(0.012), 10.0)
    ]  # fmt: skip
