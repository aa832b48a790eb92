"""Typed results (`tracekit.analysis.results`, `RunAnalysis`): each record is the JSON
object the attribution stage's figures have always been written as, key for key and in
the same order, absent keys included."""

from __future__ import annotations

import json
import math
from dataclasses import replace

from logbuilder import LogBuilder
from test_frontend import _hand_log, serve_log

from tracekit.analysis.figures import analyze
from tracekit.analysis.results import ClientSummary, SpecAcceptance
from tracekit.attribution.client import client_partition, client_summary, spec_acceptance
from tracekit.attribution.itl import partition
from tracekit.formats import json_safe
from tracekit.log.rawlog import Counters

SPEC_NAMES = ("spec.drafts", "spec.drafted", "spec.accepted",
              "spec.accepted_pos.0", "spec.accepted_pos.1", "spec.accepted_pos.2")  # fmt: skip


#: the client-boundary TTFT's keys, after the client block's older ones
TTFT_KEYS = ("ttft_p50_ms", "ttft_p99_ms", "ttft_engine_p50_ms", "ttft_engine_p99_ms",
             "ttft_share")  # fmt: skip


def _with_spec(log):
    step0, step1 = [2, 6, 3, 2, 1, 0], [1, 3, 0, 0, 0, 0]
    counters = Counters.from_columns(
        name=[*range(6), *range(6)], t_s=[0.01] * 6 + [0.02] * 6, value=step0 + step1
    )
    return replace(log, counter_names=SPEC_NAMES, counters=counters)


def _same_json(a, b) -> bool:
    """Equal as `analyze --format jsonl` writes them: bytes, key order included."""
    return json.dumps(json_safe(a)) == json.dumps(json_safe(b))


def test_client_record_is_the_attribution_summary_with_spec():
    log = _with_spec(_hand_log())
    a = analyze(log)
    assert isinstance(a.client, ClientSummary) and isinstance(a.spec, SpecAcceptance)
    want = client_summary(log, client_partition(log), partition(log).gap_ms)
    want["spec"] = spec_acceptance(log)
    # the attribution summary's keys in their order, then the client-boundary TTFT's
    rec = a.client.to_record()
    assert list(rec)[len(want) :] == list(TTFT_KEYS)
    assert _same_json({k: v for k, v in rec.items() if k not in TTFT_KEYS}, want)
    assert _same_json({k: v for k, v in a.to_dict()["client"].items() if k not in TTFT_KEYS},
                      want)  # fmt: skip
    # the one request arrived at 0, its first token left the engine at 10 (step 0, a decode
    # window [0, 10] of others' decoding: decode_other), the API server received it at 10.4
    # and wrote the first chunk at 11: client TTFT 11, engine 10; hop 0.4, frontend_other 0.6
    assert math.isclose(rec["ttft_p50_ms"], 11) and math.isclose(rec["ttft_p99_ms"], 11)
    assert math.isclose(rec["ttft_engine_p50_ms"], 10)
    got = {k: round(v * 11, 9) for k, v in rec["ttft_share"].items() if v}
    assert got == {"decode_other": 10.0, "hop": 0.4, "frontend_other": 0.6}
    assert a.client.spec is a.spec
    assert a.client.itl_ms.per_token.num_values == want["itl_ms"]["per_token"]["n"]


def test_client_record_without_gaps_has_no_tail_keys():
    b = LogBuilder()
    b.step(0, 10)
    b.seg(0, "decode", 0, 10)
    b.emit(0, 10, 0)
    log = serve_log(b, [(0, 11, 1)], [], [(0, 10, 10.4)])
    c = analyze(log).client
    assert c is not None and c.num_gaps == 0 and c.p99_ms is None
    assert list(c.to_record()) == ["gaps", "chunks", "itl_ms", "all_share", "spec", *TTFT_KEYS]


def test_spec_record_keeps_its_keys_and_old_logs_nan():
    b = LogBuilder()
    b.step(0, 10)
    b.emit(0, 10, 0, n=3)
    b.step(10, 20)
    b.emit(0, 20, 1, n=1)
    log = _with_spec(b.build())
    a = analyze(log)
    assert a.client is None
    assert _same_json(a.spec.to_record(), spec_acceptance(log))
    assert a.spec.num_accepted_per_pos == (2.0, 1.0, 0.0)
    totals = Counters.from_columns(name=[0, 1], t_s=[0.01, 0.01], value=[3, 2])
    old = replace(log, counter_names=("spec.drafted", "spec.accepted"), counters=totals)
    s = analyze(old).spec
    assert s is not None and math.isnan(s.num_drafts) and s.acceptance_per_pos == ()
    assert _same_json(s.to_record(), spec_acceptance(old))
    assert analyze(b.build()).to_dict()["spec"] is None
