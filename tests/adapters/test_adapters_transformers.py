"""The transformers continuous-batching adapter on the real engine (CPU, tiny random Llama).

One recorded `generate_batch` run (8 requests x 48 tokens, a KV pool of 8 pages of 16
tokens, so the engine soft-resets requests) is checked against what the engine itself
returned and counted: tokens per request, every soft reset, its per-token timestamps
(`record_timestamps=True`). A second, streaming run checks idle loop iterations, and a
third one that uninstalling puts every method back after an exception.
"""

from __future__ import annotations

import collections
import os
import sys
import time

import numpy as np
import pytest
from adapters_common import (
    analyze_jsonl,
    emission_times,
    gc_ms_between,
    log_origin_s,
    one_torch_thread,
    patches_left,
    tokens_by_request,
)

import tracekit

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported (engines.md)

pytestmark = pytest.mark.adapters

transformers = pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install -e '.[adapters]')"
)
cb_api = pytest.importorskip(
    "transformers.generation.continuous_batching.continuous_api",
    reason="this transformers has no continuous batching (the adapter reads 5.19)",
)
from engine_adapters.tiny_model import build_tiny_llama, tiny_prompts  # noqa: E402
from engine_adapters.transformers_cb import instrument_transformers  # noqa: E402
from tracekit.attribution.itl import partition  # noqa: E402

NUM_REQUESTS = 8
MAX_NEW_TOKENS = 48


def _cb_config(**kw):
    # a pool of 8 pages x 16 tokens cannot hold 8 requests of ~16 + 48 tokens: the engine
    # offloads (soft-resets, on a CPU) requests about 7 times
    base = dict(page_size=16, num_blocks=8, use_async_batching=False, use_cuda_graph=False)
    return transformers.ContinuousBatchingConfig(**{**base, **kw})


def _gen_config(max_new_tokens=MAX_NEW_TOKENS):
    # eos -1: random weights must not stop early, so every request runs to its limit
    return transformers.GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import torch

    path = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
    tok = transformers.AutoTokenizer.from_pretrained(path)
    m = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa"
    )
    inputs = [tok(p).input_ids for p in tiny_prompts(NUM_REQUESTS, seed=1)]
    return m, inputs


@pytest.fixture(scope="module")
def batch_run(model, tmp_path_factory):
    """One instrumented generate_batch run, plus the soft resets the engine did."""
    m, inputs = model
    out = str(tmp_path_factory.mktemp("cb") / "cb.npz")
    resets: list[str] = []
    positions: list[tuple[str, int]] = []
    state_cls = cb_api.RequestState
    original = state_cls.create_equivalent_initial_request

    def counting(self):  # the engine's own soft reset, counted independently of tracekit
        resets.append(self.request_id)
        positions.append((self.request_id, self.position_offset))  # what it had computed
        return original(self)

    rec = tracekit.Recorder(out, config={"engine": "transformers-cb"})
    with pytest.MonkeyPatch.context() as mp, one_torch_thread():
        mp.setattr(state_cls, "create_equivalent_initial_request", counting)
        with rec, instrument_transformers(rec) as adapter:
            results = m.generate_batch(
                inputs,
                _gen_config(),
                continuous_batching_config=_cb_config(),
                record_timestamps=True,
            )
    return {
        "log": tracekit.load(out),
        "path": out,
        "results": results,
        "inputs": inputs,
        "resets": resets,
        "positions": positions,
        "adapter": adapter,
        "rec": rec,
    }


def test_every_finished_request_left_the_recorders_book(batch_run):
    """Every request ran to its end (soft-reset ones included: an offload keeps the id
    among the waiting, not finished): each was finished after its last token, so naming
    it again raises (docs/capture.md, "Finished requests")."""
    log, rec = batch_run["log"], batch_run["rec"]
    assert len(batch_run["resets"]) >= 2 and len(log.request_ids) == NUM_REQUESTS
    for name in log.request_ids:
        with pytest.raises(ValueError, match="was finished"):
            rec.handle(name)


def test_emitted_tokens_equal_the_tokens_the_engine_returned(batch_run):
    results, log = batch_run["results"], batch_run["log"]
    assert len(results) == NUM_REQUESTS
    engine = {rid: len(r.generated_tokens) for rid, r in results.items()}
    assert engine == tokens_by_request(log)
    assert set(engine.values()) == {MAX_NEW_TOKENS}


def test_every_engine_preemption_is_an_explicit_eviction(batch_run):
    log, resets = batch_run["log"], batch_run["resets"]
    assert len(resets) >= 2, "the KV pool was meant to force preemption"
    ev = log.evictions
    by_request = collections.Counter(log.request_ids[i] for i in ev.request)
    assert by_request == collections.Counter(resets)
    assert set(ev.mode.tolist()) == {tracekit.log.rawlog.MODE_RECOMPUTE}  # soft reset on a CPU
    assert np.isfinite(ev.t_readmit_s).all()  # every request finished, so each came back
    assert int(log.steps.num_preempted.sum()) == len(resets)
    assert batch_run["adapter"].num_evictions == {"swap": 0, "recompute": len(resets)}


def test_every_soft_reset_has_one_cause_and_the_tokens_it_threw_away(batch_run):
    """Each soft reset the engine did has exactly one recorded cause (kv_full); per
    request, in time order, its computed tokens lost are the position_offset the engine's
    own reset read; its evictors are other requests."""
    log, positions = batch_run["log"], batch_run["positions"]
    pe = log.preemptions
    assert len(pe) == len(log.evictions) == len(positions) >= 2
    assert {tracekit.log.rawlog.PREEMPT_REASONS[c] for c in pe.reason} == {"kv_full"}
    got = collections.defaultdict(list)
    for i in np.lexsort((pe.t_s, pe.request)).tolist():
        got[log.request_ids[pe.request[i]]].append(int(pe.num_computed_tokens_lost[i]))
    want = collections.defaultdict(list)
    for rid, n in positions:
        want[rid].append(n)
    assert dict(got) == dict(want) and sum(n for _, n in positions) > 0
    by = log.evictors
    assert (by.evictor != by.request).all()
    assert len(by) >= 1  # some offloads made room for another starved request


def test_emission_times_agree_with_the_engines_timestamps(batch_run):
    log, results = batch_run["log"], batch_run["results"]
    origin = log_origin_s(log)  # engine stamps are time.perf_counter(), the recorder's clock
    emitted, stamped = [], []
    for rid, r in results.items():
        em = emission_times(log, rid)
        ts = np.asarray(r.timestamps) - origin
        # a soft reset starts a fresh request state: its stamps cover the tokens after it
        assert 0 < len(ts) <= len(em)
        emitted.append(em[len(em) - len(ts) :])
        stamped.append(ts)
    em, ts = np.concatenate(emitted), np.concatenate(stamped)
    lag_ms = (ts - em) * 1e3
    # the engine stamps each token in update_batch, after tracekit's emission in the step
    assert lag_ms.min() >= -0.01
    assert np.median(lag_ms) < 1.0
    worst = (lag_ms - gc_ms_between(log, em, ts)).max()
    assert worst < 50.0, "a stamp far from its emission: clocks not mapped?"


def test_every_gap_reconciles(batch_run):
    p = partition(batch_run["log"])
    assert len(p) == NUM_REQUESTS * (MAX_NEW_TOKENS - 1)
    assert p.reconcile_max_err_ms < 1e-6


def test_requests_steps_and_segments(batch_run):
    log, inputs = batch_run["log"], batch_run["inputs"]
    rq = log.requests
    assert np.isfinite(rq.arrival_s).all()
    assert (rq.arrival_s <= rq.first_token_s).all()
    assert sorted(rq.prompt_tokens.tolist()) == sorted(len(x) for x in inputs)
    assert set(rq.max_new_tokens.tolist()) == {MAX_NEW_TOKENS}
    st = log.steps
    assert ((st.num_decode + st.num_prefill_tokens) > 0).all(), "a step without work"
    assert set(st.graph_size[st.num_decode > 0].tolist()) == {0}  # no CUDA graphs on a CPU
    assert set(log.labels) >= {"schedule", "prepare", "prefill", "decode", "sample", "update"}
    assert "swap" in log.labels  # the offload windows
    sg = log.segments
    in_step = sg.step >= 0
    assert in_step.all()
    # segments of one step never overlap (one thread, exclusive windows)
    order = np.lexsort((sg.t_start_s, sg.step))
    same = sg.step[order][1:] == sg.step[order][:-1]
    assert (sg.t_start_s[order][1:][same] >= sg.t_end_s[order][:-1][same]).all()


def test_analyze_shows_a_preempt_share(batch_run):
    row = analyze_jsonl(batch_run["path"])
    assert row["requests"] == NUM_REQUESTS
    assert row["preemptions"] == len(batch_run["resets"])
    assert row["all_share"]["preempt"] > 0
    assert row["reconcile_max_err_ms"] < 1e-6


def test_streaming_manager_idle_iterations_are_not_steps(model, tmp_path):
    """A manager instrumented by itself; it idles before and between requests."""
    m, inputs = model
    manager = m.init_continuous_batching(_gen_config(12), _cb_config(num_blocks=32))
    rec = tracekit.Recorder(tmp_path / "stream.npz")
    with one_torch_thread(), rec, instrument_transformers(rec, manager):
        manager.start()
        try:
            time.sleep(0.35)  # the loop waits up to 0.1 s per idle iteration
            t_first = rec.now()
            rids = [manager.add_request(x, max_new_tokens=12) for x in inputs[:4]]
            done = {}
            while len(done) < len(rids):
                r = manager.get_result(timeout=10)
                assert r is not None, "the engine stopped answering"
                if r.is_finished():
                    done[r.request_id] = r
            processor = manager.batch_processor
            time.sleep(0.25)
        finally:
            manager.stop(block=True)
    log = rec.log()
    assert tokens_by_request(log) == {rid: len(r.generated_tokens) for rid, r in done.items()}
    st = log.steps
    assert ((st.num_decode + st.num_prefill_tokens) > 0).all()
    first_s = (t_first - log.meta["t0_tick"]) * log.meta["seconds_per_tick"]
    assert st.t_start_s.min() >= first_s  # the idle second before any request: no step
    assert (
        patches_left(
            manager,
            processor,
            processor.scheduler,
            processor.offloading_manager,
            processor.inputs_and_outputs,
            processor.model_runner,
        )
        == []
    )


def test_uninstall_restores_every_method_after_an_exception(model, tmp_path):
    m, inputs = model
    start_before = vars(cb_api.ContinuousBatchingManager)["start"]
    manager = m.init_continuous_batching(_gen_config(4), _cb_config(num_blocks=32))
    own_before = set(vars(manager))
    processor = None
    rec = tracekit.Recorder(tmp_path / "boom.npz")
    with one_torch_thread(), pytest.raises(RuntimeError, match="boom"):
        with rec, instrument_transformers(rec):  # class-level: patches start()
            assert vars(cb_api.ContinuousBatchingManager)["start"] is not start_before
            manager.start()
            try:
                rid = manager.add_request(inputs[0], max_new_tokens=4)
                while not (r := manager.get_result(rid, timeout=10)).is_finished():
                    pass
                processor = manager.batch_processor
                raise RuntimeError("boom")
            finally:
                manager.stop(block=True, keep_for_next_session=False)
    assert vars(cb_api.ContinuousBatchingManager)["start"] is start_before
    assert processor is not None and r.request_id == rid
    assert (
        patches_left(
            manager,
            processor,
            processor.scheduler,
            processor.offloading_manager,
            processor.inputs_and_outputs,
            processor.model_runner,
            cb_api.ContinuousBatchingManager,
            cb_api.ContinuousBatchProcessor,
        )
        == []
    )
    # the instance attributes that shadowed the class methods are gone again
    patched = {"add_request", "_generation_loop_body", "_create_batch_processor"}
    assert not patched & set(vars(manager)) and not patched & own_before
    assert len(rec.log().emissions) >= 1  # the recorder still saved what it saw


def test_async_batching_is_refused_and_leaves_nothing_behind(model):
    m, _ = model
    manager = m.init_continuous_batching(_gen_config(4), _cb_config(use_async_batching=True))
    rec = tracekit.Recorder(None)
    with pytest.raises(ValueError, match="use_async_batching=False"):
        instrument_transformers(rec, manager)
    assert patches_left(manager) == []


# -- TTFT events (docs/ttft.md) ----------------------------------------------------------


def test_admissions_equal_the_engines_request_state(batch_run):
    """One admission per request, as many as the engine's request states that left
    PENDING (`lifespan[0]`, stamped inside schedule_batch), at the same time."""
    from tracekit.attribution.reference import ttft_partition_reference
    from tracekit.attribution.ttft import ttft_partition

    log, results = batch_run["log"], batch_run["results"]
    resets = set(batch_run["resets"])
    started = {rid for rid, r in results.items() if r.lifespan[0] > 0}
    assert len(started) == NUM_REQUESTS
    admitted = [log.request_ids[i] for i in log.admissions.request]
    assert sorted(admitted) == sorted(started)
    assert batch_run["adapter"].num_admissions == len(started)
    # a soft reset replaces the request state (its lifespan restarts): compare the others
    origin = log_origin_s(log)
    lags = []
    for rid in started - resets:
        t_adm = float(log.admissions.t_s[admitted.index(rid)])
        lags.append(results[rid].lifespan[0] - origin - t_adm)
    assert lags, "every request was soft-reset: nothing to compare"
    lag_ms = np.array(lags) * 1e3
    # tracekit stamps the start of schedule_batch; the engine stamps inside it
    assert lag_ms.min() >= -0.01 and lag_ms.max() < 50.0
    p = ttft_partition(log)  # raises if a TTFT does not reconcile
    assert len(p) == NUM_REQUESTS and p.is_split.all()
    ref = ttft_partition_reference(log)
    np.testing.assert_allclose(p.parts_ms, ref.parts_ms, rtol=0, atol=1e-9)
    # 8 requests in 8 pages of 16 tokens: some waited, and the adapter said why
    assert len(log.waits) > 0 and len(log.prefill_chunks) >= NUM_REQUESTS


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OS evidence: Linux only")
def test_the_cb_loop_thread_records_os_evidence(batch_run):
    """The CB loop thread (the one that runs the steps) samples its OS counters at every
    step boundary (the recorder's default on wall time, docs/capture.md), and the partition
    has the OS causes."""
    log = batch_run["log"]
    os_ = log.os_samples
    assert log.meta["os_evidence"]["recorded"] is True
    step_rows = os_.kind <= 1
    assert int(step_rows.sum()) == 2 * len(log.steps)
    loop = set(log.segments.thread[log.segments.step >= 0].tolist())
    assert set(os_.thread[step_rows].tolist()) == loop
    assert (os_.runqueue_ns[step_rows] >= 0).all()  # schedstat read on this kernel
    p = partition(log)
    assert "os_runqueue" in p.labels and "os_blocked" in p.labels
