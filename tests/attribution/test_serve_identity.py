"""A server run's request identity and its stages before the engine (hand-built logs).

Rule 0 of the TTFT partition (docs/ttft.md): from arrival (the HTTP request's first byte)
to the handler is ``http``, from the handler to the engine core's add is ``frontend``; the
other rules apply from the add on. Names: a client id used twice keeps ``~2`` on the later
request; ``--request`` takes the id the client saw.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from tests.logbuilder import LogBuilder
from tracekit.analysis.gaps import requests_named
from tracekit.attribution.reference import ttft_partition_reference
from tracekit.attribution.ttft import ttft_partition
from tracekit.errors import LogError
from tracekit.log.rawlog import Requests
from tracekit.log.request_identity import distinct_names


def _served_log():
    # one request: HTTP receipt 0 ms, handler 3 ms, engine core adds 5 ms, admitted 6 ms,
    # a prefill step 6-10 ms, first token at 10 ms
    b = LogBuilder(num_requests=1)
    s = b.step(6, 10, n_decode=0, n_prefill=8)
    b.seg(s, "prefill", 6, 10)
    b.emit(0, 10, s)
    b.admit(0, 6)
    b.prefill(s, 0, 8)
    log = b.build(arrivals_ms=[0.0])
    rq = log.requests
    return replace(log, requests=replace(rq, handler_s=np.array([3e-3]), engine_s=np.array([5e-3])))


def test_rule_0_charges_the_time_before_the_engine_had_the_request():
    log = _served_log()
    p = ttft_partition(log)
    parts = dict(zip(p.labels, p.parts_ms[0].tolist(), strict=True))
    # by hand: http 3 ms (0-3), frontend 2 ms (3-5), residual 1 ms (5-6: nothing recorded
    # in the engine core), prefill_own 4 ms (6-10: its own prefill, all 8 tokens its own)
    assert parts["http"] == pytest.approx(3.0)
    assert parts["frontend"] == pytest.approx(2.0)
    assert parts["residual"] == pytest.approx(1.0)
    assert parts["prefill_own"] == pytest.approx(4.0)
    assert sum(parts.values()) == pytest.approx(10.0)
    # queued spans arrival to admission (6 ms), prefilling 4 ms
    assert p.phases_ms[0].tolist()[:2] == pytest.approx([6.0, 4.0])
    ref = ttft_partition_reference(log)
    assert np.allclose(ref.parts_ms, p.parts_ms) and np.allclose(ref.phases_ms, p.phases_ms)


def test_without_the_stages_nothing_changes():
    log = _served_log()
    plain = replace(log, requests=Requests(**{
        k: getattr(log.requests, k) for k in ("arrival_s", "prompt_tokens", "max_new_tokens",
                                              "first_token_s")}))  # fmt: skip
    p = ttft_partition(plain)
    assert "http" not in p.labels and "frontend" not in p.labels
    assert p.parts_ms[0].sum() == pytest.approx(10.0)


def test_saved_and_loaded_stages_round_trip_and_old_logs_load(tmp_path):
    from tracekit.log.reader import load

    log = _served_log()
    back = load(log.save(tmp_path / "a.npz"))
    assert back.requests.handler_s.tolist() == pytest.approx([3e-3])
    assert back.requests.engine_s.tolist() == pytest.approx([5e-3])
    # a log without the stages does not write them, and loads them as NaN
    plain = LogBuilder(num_requests=1).build(arrivals_ms=[0.0])
    path = plain.save(tmp_path / "b.npz")
    with np.load(path) as z:
        assert "requests.handler_s" not in z.files
    assert np.isnan(load(path).requests.engine_s).all()


def test_a_client_id_used_twice_gets_a_suffix_in_arrival_order():
    names = ["cmpl-a-0", "cmpl-b-0", "cmpl-a-0", "cmpl-a-0"]
    arrival = np.array([2.0, 0.0, 1.0, 3.0])
    # the earliest arrival keeps the id, the others ~2, ~3 in order of arrival
    assert distinct_names(names, arrival) == ["cmpl-a-0~2", "cmpl-b-0", "cmpl-a-0", "cmpl-a-0~3"]
    # a suffixed name that exists already is skipped, never repeated
    assert distinct_names(["x", "x", "x~2"], np.array([0.0, 1.0, 2.0])) == ["x", "x~3", "x~2"]


def test_request_takes_the_id_the_client_saw():
    ids = ("cmpl-a-0", "cmpl-a-0~2", "cmpl-b-0#0", "cmpl-b-0#1", "chatcmpl-c", "cmpl-ab-0")
    log = replace(LogBuilder(num_requests=6).build(), request_ids=ids)
    assert requests_named(log, "cmpl-a-0").tolist() == [0]  # exact wins
    assert requests_named(log, "cmpl-a").tolist() == [0, 1]  # what the client saw
    assert requests_named(log, "cmpl-b").tolist() == [2, 3]  # every choice
    assert requests_named(log, "cmpl-b-0").tolist() == [2, 3]
    assert requests_named(log, "chatcmpl-c").tolist() == [4]
    with pytest.raises(LogError, match="'cmpl-z'"):
        requests_named(log, "cmpl-z")


def test_rule_0_gives_the_api_servers_os_share_to_the_os():
    """docs/ttft.md rule 0 with the API server's OS intervals (docs/partition.md,
    "Unrecorded windows", rule 5): over http and frontend, each interval's run-queue share
    and, inside a segment, its off-CPU share of the overlap are frontend_os_*."""
    from tracekit.log.rawlog import ClientEmissions, ProcOs

    log = _served_log()
    ms = 1e-3
    log = replace(
        log,
        # the first chunk of request 0 was written by process 1, the API server
        client_emissions=ClientEmissions.from_columns(
            request=[0], t_s=[10 * ms], t_ready_s=[10 * ms], num_tokens=[1], process=[1]
        ),
        proc_os=ProcOs.from_columns(
            process=[1, 1, 1],
            t_start_s=[1 * ms, 3 * ms, 4.5 * ms],
            t_end_s=[2.5 * ms, 4 * ms, 7 * ms],
            runqueue_s=[0.3 * ms, 0.25 * ms, 0.5 * ms],
            offcpu_s=[0.6 * ms, 0.25 * ms, 0.0],
            in_segment=[0, 1, 1],
        ),
        meta={**log.meta, "processes": [{"role": "engine_core"}, {"role": "api_server"}]},
    )
    p = ttft_partition(log)
    parts = dict(zip(p.labels, p.parts_ms[0].tolist(), strict=True))
    # by hand: http [0, 3] overlaps [1, 2.5] (between segments: R/L 0.2, B not evidence):
    #   run queue 0.3, http 3 - 0.3 = 2.7;
    # frontend [3, 5] overlaps [3, 4] (in a segment: R/L 0.25, B/L 0.25): 0.25 and 0.25,
    #   and [4.5, 5] of [4.5, 7] (R/L 0.2): run queue 0.1; frontend 2 - 0.6 = 1.4;
    # the engine's part from 5 ms on is unchanged (its interval there is not the engine's)
    assert parts["http"] == pytest.approx(2.7)
    assert parts["frontend"] == pytest.approx(1.4)
    assert parts["frontend_os_runqueue"] == pytest.approx(0.65)
    assert parts["frontend_os_blocked"] == pytest.approx(0.25)
    assert parts["residual"] == pytest.approx(1.0)
    assert parts["prefill_own"] == pytest.approx(4.0)
    assert sum(parts.values()) == pytest.approx(10.0)
    ref = ttft_partition_reference(log)
    assert ref.labels == p.labels
    assert np.allclose(ref.parts_ms, p.parts_ms) and np.allclose(ref.phases_ms, p.phases_ms)
    # a request no API server wrote a chunk of: no OS share
    bare = replace(log, client_emissions=ClientEmissions.empty())
    q = ttft_partition(bare)
    assert q.column("http")[0] == pytest.approx(3.0) and q.column("frontend_os_runqueue")[0] == 0
