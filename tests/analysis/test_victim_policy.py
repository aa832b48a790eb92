"""The least-computed-victim estimate (docs/whatif.md, "Victim policy"), by hand.

r0, r1, r2 (prompts of 10 tokens). r0 and r2 are admitted at 0 and prefilled in step 0,
r1 at 10 in step 1; all decode after. At 22 ms (step 2) r2's decode evicts r0 (recompute,
11 tokens lost: its prompt and 2 emitted tokens, less one). Running then: r1 (one token
emitted at 20: 10 + 1 - 1 = 10 computed) and r2 (the evictor: not a candidate). The policy
evicts r1: 10 tokens instead of 11. Computed tokens: prefill 20 + 10 + 11 (r0's re-prefill)
and decode rows 2 + 3 + 2 = 48."""

from __future__ import annotations

import pytest
from logbuilder import LogBuilder

from tracekit.analysis.victim_policy import victim_policy
from tracekit.analysis.whatif import whatif
from tracekit.attribution.itl import partition
from tracekit.attribution.ttft import ttft_partition
from tracekit.log.validate import validate_log
from tracekit.render.whatif import whatif_table


def run(lost=11):
    b = LogBuilder()
    b.step(0, 10, n_decode=0, n_prefill=20)
    b.step(10, 20, n_decode=2, n_prefill=10)
    b.step(20, 30, n_decode=3)
    b.step(30, 40, n_decode=2, n_prefill=11)
    b.admit(0, 0)
    b.admit(2, 0)
    b.admit(1, 10)
    for t, s, reqs in ((10, 0, (0, 2)), (20, 1, (0, 1, 2)), (30, 2, (1, 2)), (40, 3, (0, 1, 2))):
        for r in reqs:
            b.emit(r, t, s)
    b.evict(0, 22, 31, mode=1)
    b.cause(0, 22, 2, "kv_full", by=(2,), lost=lost)
    return validate_log(b.build())


def test_the_least_computed_running_request_would_have_gone():
    v = victim_policy(run())
    assert v is not None
    assert (v.num_decisions, v.num_changed) == (1, 1)
    assert (v.recomputed_tokens, v.policy_recomputed_tokens, v.computed_tokens) == (11, 10, 48)
    assert v.recompute_tax == pytest.approx(11 / 48)
    # the re-prefill shrinks with the loss: 48 - 11 + 10 computed tokens
    assert v.policy_recompute_tax == pytest.approx(10 / 47)


def test_a_victim_that_was_already_the_least_computed_stays():
    v = victim_policy(run(lost=9))
    assert v is not None and v.num_changed == 0
    assert v.policy_recomputed_tokens == v.recomputed_tokens == 9


def test_whatif_prints_the_estimate():
    log = run()
    w = whatif(log, partition(log), ttft_partition(log))
    assert w.victim_policy == victim_policy(log)
    assert (
        "Victim policy (first order): evicting the least-computed running request at each of "
        "the 1 recorded recompute decisions (1 would change victim): recompute tax 22.9% -> "
        "21.3% (11 -> 10 recomputed tokens)"
    ) in whatif_table([w])


def test_whatif_jsonl_carries_the_estimate_the_table_prints():
    """`tracekit whatif --format jsonl`: the run's records end with one of kind
    victim_policy, the same figures as the table's line (1 decision, 1 changed, 11 -> 10
    recomputed tokens of 48 and 47 computed)."""
    log = run()
    recs = whatif(log, partition(log), ttft_partition(log)).to_records()
    last = recs[-1]
    assert (last["kind"], last["removal"], last["policy"]) == (
        "victim_policy",
        None,
        "least_computed_victim",
    )
    assert (last["num_decisions"], last["num_changed"]) == (1, 1)
    assert (last["recomputed_tokens"], last["policy_recomputed_tokens"]) == (11, 10)
    assert last["recompute_tax"] == pytest.approx(11 / 48)
    assert last["policy_recompute_tax"] == pytest.approx(10 / 47)
    assert all(r["kind"] != "victim_policy" for r in recs[:-1])
