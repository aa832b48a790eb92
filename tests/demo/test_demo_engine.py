"""The demo engine: scheduler, block manager, swap, graph padding, and a recorded run.

Small configs and drained traces keep the whole file fast; nothing here asserts on wall
time. Global state the engine touches (gc freeze, recorders, worker processes) is checked
to be restored.
"""

from __future__ import annotations

import dataclasses
import gc

import numpy as np
import pytest

import tracekit
from demo_engine.block_manager import BlockManager
from demo_engine.config import (
    BASE_GRAPH_SIZES,
    FULL_GRAPH_SIZES,
    RUNG_NAMES,
    EngineConfig,
    WorkloadConfig,
    rung_config,
    rung_slug,
)
from demo_engine.engine import Engine
from demo_engine.model import DecodeRow, NumpyModelRunner
from demo_engine.scheduler import Request, Scheduler, Status
from demo_engine.tokenizer import train_tokenizer
from demo_engine.workload import (
    STEP_WORKLOAD,
    TraceRequest,
    cumulative_arrivals,
    make_trace,
    mean_output_tokens,
    rate_at,
    step_workload,
)
from tracekit.capture.recorder import active_recorders

SMALL = EngineConfig(
    vocab_size=512,
    num_kv_blocks=48,
    max_num_seqs=8,
    max_num_batched_tokens=96,
    max_prompt_tokens=128,
    max_new_tokens=64,
    num_startup_objects=2_000,
    captured_graph_sizes=(1, 2, 4),
)


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(512, WorkloadConfig())


@pytest.fixture(autouse=True)
def _no_leftovers():
    yield
    assert not active_recorders(), "a Recorder was left running"
    assert gc.get_freeze_count() == 0, "gc.freeze() was left in place"


def _req(rid: int, num_prompt: int, *, max_new: int = 50) -> Request:
    return Request(
        rid=rid, arrival_tick=0, token_ids=list(range(1, num_prompt + 1)), max_new_tokens=max_new
    )


def _decoding(sched: Scheduler, rid: int, num_tokens: int) -> Request:
    """A running request whose prompt is computed: a decode row from the next step."""
    r = _req(rid, num_tokens)
    r.num_computed_tokens = num_tokens - 1
    r.status = Status.RUNNING
    sched.bm.allocate(r, num_tokens - 1)
    sched.running.append(r)
    return r


# -- config ----------------------------------------------------------------------------------------


def test_config_validates_itself():
    with pytest.raises(ValueError, match="num_kv_blocks"):
        EngineConfig(num_kv_blocks=0)
    with pytest.raises(ValueError, match="captured_graph_sizes"):
        EngineConfig(captured_graph_sizes=(4, 2))
    with pytest.raises(ValueError, match="preemption_mode"):
        EngineConfig(preemption_mode="drop")
    with pytest.raises(ValueError, match="blocks"):  # one long request must fit the pool
        EngineConfig(num_kv_blocks=10)
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineConfig().num_kv_blocks = 5  # type: ignore[misc]
    assert not hasattr(EngineConfig(), "__dict__")  # slotted


def test_each_rung_keeps_every_fix_above_it():
    base = rung_config("baseline")
    assert base == EngineConfig()
    last = rung_config("+admit watermark")
    assert last.is_gc_freeze and last.is_compact_history and last.is_tokenize_off_loop
    assert last.captured_graph_sizes == FULL_GRAPH_SIZES
    assert last.max_num_batched_tokens == 256 and last.admit_free_frac == 0.10
    assert rung_config("budget-256").max_num_batched_tokens == 256  # slugs work too
    assert not rung_config("+gc.freeze").is_compact_history
    assert [rung_slug(r) for r in RUNG_NAMES][:2] == ["baseline", "gc-freeze"]


# -- workload --------------------------------------------------------------------------------------


def test_workload_is_deterministic_and_shaped():
    cfg = WorkloadConfig(rate_req_s=20.0, doc_frac=0.05)
    a, b = make_trace(3, 30.0, cfg), make_trace(3, 30.0, cfg)
    assert [(t.arrival, t.text, t.max_new_tokens) for t in a] == [
        (t.arrival, t.text, t.max_new_tokens) for t in b
    ]
    assert make_trace(4, 30.0, cfg)[0].text != a[0].text
    assert 0.7 * 600 < len(a) < 1.3 * 600
    arr = np.array([t.arrival for t in a])
    assert np.all(np.diff(arr) > 0) and arr.max() < 30.0
    # the swell: the rising half-period gets more arrivals than the falling one
    phase = (arr % 15.0) < 7.5
    assert phase.sum() > (~phase).sum()
    outs = np.array([t.max_new_tokens for t in a])
    assert outs.min() >= 16 and outs.max() <= 1000
    assert abs(outs.mean() - mean_output_tokens(cfg)) < 40
    docs = [t for t in a if t.is_doc]
    assert docs and all(150_000 <= len(t.text) <= 400_000 for t in docs)
    prompts = [len(t.text) for t in a if not t.is_doc]
    assert 800 < np.mean(prompts) < 1200


def test_bursts_carry_their_share_of_arrivals_in_their_windows():
    # burst_frac 0.9 of a mean 0.5 per step in windows of 30 every 320 from step 20: over
    # 640 steps 320 arrivals expected, 0.9 * 320 = 288 of them in [20, 50) and [340, 370)
    # (144 each, 4.8 per step), the other 32 spread evenly (0.05 per step, no swell)
    cfg = WorkloadConfig(
        clock="steps", rate_req_step=0.5, swell_frac=0.0, burst_frac=0.9,
        burst_period_steps=320, burst_width_steps=30, burst_start_steps=20, doc_frac=0.0,
    )  # fmt: skip
    assert rate_at(25.0, cfg) == pytest.approx(0.05 + 0.45 * 320 / 30)
    assert rate_at(10.0, cfg) == pytest.approx(0.05) == rate_at(100.0, cfg)
    assert float(cumulative_arrivals(np.array([640.0]), cfg)[0]) == pytest.approx(320.0)
    arr = np.array([t.arrival for t in make_trace(1, 640.0, cfg)])
    assert len(arr) in (319, 320, 321)  # stratified: the expected count, give or take one
    in_burst = ((arr >= 20) & (arr < 50)) | ((arr >= 340) & (arr < 370))
    # each window also holds the base rate's 0.05 * 60 = 3
    assert abs(in_burst.sum() - (288 + 3)) <= 2
    with pytest.raises(ValueError, match="burst_width_steps"):
        WorkloadConfig(burst_width_steps=500, burst_period_steps=400)
    with pytest.raises(ValueError, match="burst_frac"):
        WorkloadConfig(burst_frac=1.5)


def test_step_workload_scales_the_rate_to_the_batch_capacity():
    wl = step_workload(0.5, 48)
    assert wl.clock == "steps" and wl.burst_frac == STEP_WORKLOAD["burst_frac"]
    # 0.5 x 48 rows / the mean output length of that shape
    assert wl.rate_req_step == pytest.approx(0.5 * 48 / mean_output_tokens(wl))
    assert step_workload(1.8, 48).rate_req_step == pytest.approx(wl.rate_req_step * 3.6)


# -- block manager ---------------------------------------------------------------------------------


def test_block_manager_alloc_free_can_append():
    bm = BlockManager(num_blocks=4, block_size=16)
    r, s = _req(0, 20), _req(1, 20)
    bm.allocate(r, 20)  # 2 blocks
    assert len(r.block_table) == 2 and bm.num_free_blocks == 2
    assert bm.can_append(r, 32)  # still inside block 2
    bm.allocate(r, 32)
    assert len(r.block_table) == 2  # no new block needed
    bm.allocate(s, 32)
    assert bm.num_free_blocks == 0
    assert bm.can_append(r, 32) and not bm.can_append(r, 33)
    with pytest.raises(RuntimeError, match="exhausted"):
        bm.allocate(r, 33)
    slots = bm.slots(r, 20)
    assert slots.tolist() == [r.block_table[p // 16] * 16 + p % 16 for p in range(20)]
    bm.free(r)
    assert r.block_table == [] and bm.num_free_blocks == 2
    assert bm.can_allocate(2) and not bm.can_allocate(3)
    bm.free(s)
    assert bm.num_free_blocks == 4


# -- scheduler -------------------------------------------------------------------------------------


def test_scheduler_decodes_first_then_fills_budget_with_prefill():
    cfg = SMALL.replace(num_kv_blocks=200, max_num_batched_tokens=64, max_num_seqs=8)
    sched = Scheduler(cfg, BlockManager(cfg.num_kv_blocks, cfg.block_size))
    dec = [_decoding(sched, i, 30) for i in range(3)]
    for i in range(3, 6):
        sched.add(_req(i, 50))
    out = sched.schedule()
    assert out.decode_reqs == dec  # every decoding request got its row
    # the rest of the budget (64 - 3 = 61) went to prefill, FCFS, chunked
    assert [(r.rid, n) for r, n in out.prefill_chunks] == [(3, 50), (4, 11)]
    assert len(out.decode_reqs) + out.num_prefill_tokens == cfg.max_num_batched_tokens
    sched.update(out, {r.rid: 7 for r in out.decode_reqs})
    out2 = sched.schedule()
    assert out2.decode_reqs[:3] == dec  # decodes are never starved by prefill
    # request 3 completed its prompt and sampled? no: update() got no token for it, so it
    # has one position left and is now a decode row; request 4 continues its chunk first
    assert out2.prefill_chunks[0][0].rid == 4
    assert len(out2.decode_reqs) + out2.num_prefill_tokens <= cfg.max_num_batched_tokens


def test_scheduler_respects_max_num_seqs():
    cfg = SMALL.replace(num_kv_blocks=400, max_num_batched_tokens=2048, max_num_seqs=4)
    sched = Scheduler(cfg, BlockManager(cfg.num_kv_blocks, cfg.block_size))
    for i in range(10):
        sched.add(_req(i, 20))
    for _ in range(5):
        out = sched.schedule()
        assert len(sched.running) <= 4
        sched.update(out, {r.rid: 1 for r, _ in out.prefill_chunks})
    assert len(sched.waiting) == 6


def test_scheduler_preempts_the_newest_when_the_pool_is_dry():
    cfg = SMALL.replace(num_kv_blocks=24, max_num_batched_tokens=64, max_num_seqs=8)
    sched = Scheduler(cfg, BlockManager(cfg.num_kv_blocks, cfg.block_size))
    # three requests, each at a block boundary (next token needs a new block); 24 blocks,
    # 3 x 8 used: nothing free, so the newest must go for the older two to grow
    reqs = [_decoding(sched, i, 129) for i in range(3)]
    assert sched.bm.num_free_blocks == 0
    out = sched.schedule()
    assert [op.kind for op in out.kv_ops] == ["swap_out"]
    assert out.kv_ops[0].req is reqs[2] and reqs[2].status is Status.PREEMPTED
    assert out.decode_reqs == reqs[:2]
    assert sched.preempted == [reqs[2]]
    # while a preempted request waits, nothing new is admitted
    sched.add(_req(9, 10))
    sched.update(out, {r.rid: 1 for r in out.decode_reqs})
    out2 = sched.schedule()
    assert not out2.prefill_chunks and sched.waiting[0].rid == 9
    # an older request finishes: the victim comes back (swap in) before anyone new
    reqs[0].max_new_tokens = reqs[0].num_output_tokens + 1
    sched.update(out2, {r.rid: 1 for r in out2.decode_reqs})
    out3 = sched.schedule()
    assert [op.kind for op in out3.kv_ops] == ["swap_in"] and out3.kv_ops[0].req is reqs[2]
    assert reqs[2] in out3.decode_reqs


def test_admission_watermark_keeps_blocks_free():
    cfg = SMALL.replace(num_kv_blocks=40, max_num_batched_tokens=2048, admit_free_frac=0.25)
    assert cfg.num_admit_free_blocks == 10
    sched = Scheduler(cfg, BlockManager(cfg.num_kv_blocks, cfg.block_size))
    for i in range(8):
        sched.add(_req(i, 64))  # 4 blocks each
    out = sched.schedule()
    # admitted while (free - 4) >= 10: 40 -> 36 -> ... -> 12, then 12 - 4 < 10 stops it
    assert len(out.prefill_chunks) == 7 and sched.bm.num_free_blocks == 12
    plain = Scheduler(cfg.replace(admit_free_frac=0.0), BlockManager(40, cfg.block_size))
    for i in range(12):
        plain.add(_req(i, 64))
    plain.schedule()
    assert len(plain.running) == 8  # without it, only max_num_seqs stops admission
    assert plain.bm.num_free_blocks == 8


# -- model runner: graphs and swap -----------------------------------------------------------------


def test_graph_padding_sizes_and_eager_above_largest():
    r = NumpyModelRunner(EngineConfig(vocab_size=64), 64)
    assert r.captured_graph_sizes == BASE_GRAPH_SIZES
    got = {n: r.graph_size_for(n) for n in (0, 1, 2, 3, 5, 9, 17, 24, 25, 32, 33, 48)}
    assert got == {
        0: -1,
        1: 1,
        2: 2,
        3: 4,
        5: 8,
        9: 16,
        17: 24,
        24: 24,
        25: 32,
        32: 32,
        33: 0,
        48: 0,
    }
    r48 = NumpyModelRunner(EngineConfig(vocab_size=64, captured_graph_sizes=FULL_GRAPH_SIZES), 64)
    assert (r48.graph_size_for(33), r48.graph_size_for(48)) == (40, 48)


def test_padded_and_eager_decode_agree_and_eager_projects_per_sequence(monkeypatch):
    cfg = SMALL.replace(captured_graph_sizes=(1, 2, 4, 8))
    r = NumpyModelRunner(cfg, 512)
    rng = np.random.default_rng(1)
    r.kv[:] = rng.standard_normal(r.kv.shape, dtype=np.float32) * 0.1
    rows = [
        DecodeRow(int(t), int(p), np.arange(i * 64, i * 64 + p + 1))
        for i, (t, p) in enumerate(
            zip(rng.integers(0, 512, 5), rng.integers(3, 60, 5), strict=True)
        )
    ]
    calls: list[tuple[int, bool]] = []
    orig = r._decode_rows

    def spy(tokens, positions, rws, num_padded, *, is_eager=False):
        calls.append((num_padded, is_eager))
        return orig(tokens, positions, rws, num_padded, is_eager=is_eager)

    monkeypatch.setattr(r, "_decode_rows", spy)
    # the attention output projection: one matmul per layer per batch (captured) or per
    # sequence (eager); counted on its weight, which nothing else multiplies by
    proj = {id(L.w_o) for L in r.layers}
    n_proj = [0]

    class Counting(np.ndarray):
        def __rmatmul__(self, other):
            n_proj[0] += 1
            return np.asarray(other) @ np.asarray(self)

    for L in r.layers:
        L.w_o = L.w_o.view(Counting)
    assert len(proj) == cfg.num_layers
    kv0 = r.kv.copy()
    padded = r.decode(rows, r.graph_size_for(5))
    assert calls == [(8, False)]  # one batched call, padded to 8
    assert n_proj[0] == cfg.num_layers  # once per layer
    r.kv[:] = kv0
    n_proj[0] = 0
    eager = r.decode(rows, 0)
    assert calls[1:] == [(5, True)]  # eager: unpadded, one call
    assert n_proj[0] == cfg.num_layers * 5  # ... projecting each sequence on its own
    np.testing.assert_array_equal(padded.token_ids, eager.token_ids)
    np.testing.assert_allclose(padded.topk_logprobs, eager.topk_logprobs, atol=1e-4)
    assert padded.topk_ids.shape == (5, cfg.num_topk_logprobs)


def test_prefill_in_chunks_equals_prefill_at_once():
    r = NumpyModelRunner(SMALL, 512)
    toks = list(np.random.default_rng(2).integers(0, 512, 40))
    slots_a, slots_b = np.arange(0, 48), np.arange(100, 148)
    one = r.prefill(toks, 0, slots_a, is_last=True)
    assert r.prefill(toks[:25], 0, slots_b, is_last=False) is None
    two = r.prefill(toks[25:], 25, slots_b, is_last=True)
    np.testing.assert_allclose(r.kv[:, :, slots_a[:40]], r.kv[:, :, slots_b[:40]], atol=1e-5)
    assert one.token_ids[0] == two.token_ids[0]


def test_swap_round_trip_restores_kv_exactly():
    r = NumpyModelRunner(SMALL, 512)
    r.kv[:] = np.random.default_rng(3).standard_normal(r.kv.shape, dtype=np.float32)
    src = np.arange(32, 32 + 37)
    before = r.kv[:, :, src].copy()
    host = r.swap_out(src)
    r.kv[:, :, src] = 0.0  # the blocks are reused by someone else meanwhile
    dst = np.arange(300, 300 + 37)
    r.swap_in(host, dst)
    np.testing.assert_array_equal(r.kv[:, :, dst], before)
    assert not np.shares_memory(host, r.kv)


# -- the engine, recorded --------------------------------------------------------------------------


def _burst(n: int, *, chars: int = 300, max_new: int = 40, seed: int = 0) -> list[TraceRequest]:
    """n requests that all arrive at once: a pool too small for them forces preemption."""
    tr = make_trace(seed, 60.0, WorkloadConfig(rate_req_s=50.0, doc_frac=0.0))
    return [TraceRequest(i, 0.0, t.text[:chars], max_new, False) for i, t in enumerate(tr[:n])]


class _SwapCheckingEngine(Engine):
    """Checks that a victim's KV comes back bit for bit after swap out and in."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.saved: dict[int, np.ndarray] = {}
        self.num_checked = 0

    def _do_kv_op(self, op):
        if op.kind == "swap_out":
            self.saved[op.req.rid] = self.runner.kv[:, :, op.slots].copy()
        super()._do_kv_op(op)
        if op.kind == "swap_in":
            np.testing.assert_array_equal(
                self.runner.kv[:, :, op.slots], self.saved.pop(op.req.rid)
            )
            self.num_checked += 1


def _run(cfg, tokenizer, trace, tmp_path, name="run.npz", engine_cls=Engine):
    path = tmp_path / name
    rec = tracekit.Recorder(path, config={"rung": "test", "seed": 0, "engine": cfg.to_dict()})
    with rec:
        eng = engine_cls(cfg, rec, tokenizer)
        try:
            eng.startup()
            stats = eng.serve(trace, 60.0, is_drain=True)
        finally:
            eng.close()
    return eng, stats, tracekit.load(path)


def test_short_run_logs_evictions_where_the_engine_preempted(tokenizer, tmp_path):
    class CountingEngine(_SwapCheckingEngine):
        """Counts the swap-outs the engine actually performed, per request: a count that
        does not come from the scheduler's preemption counter the log's steps carry."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.swapped_out: list[int] = []

        def _do_kv_op(self, op):
            if op.kind == "swap_out":
                self.swapped_out.append(op.req.rid)
            super()._do_kv_op(op)

    cfg = SMALL.replace(num_kv_blocks=24, max_num_seqs=8)
    eng, stats, log = _run(cfg, tokenizer, _burst(10), tmp_path, engine_cls=CountingEngine)
    assert stats.num_finished == 10 and len(eng.swapped_out) > 0
    assert eng.num_checked > 0  # swap round trips happened and were exact
    assert len(log.requests) == 10
    # one eviction per swap-out performed, of the same requests
    evicted = sorted(log.request_ids[i] for i in log.evictions.request.tolist())
    assert evicted == sorted(str(rid) for rid in eng.swapped_out)
    assert int(log.steps.num_preempted.sum()) == len(eng.swapped_out)
    assert np.isfinite(log.evictions.t_readmit_s).all()  # drained: all came back
    assert (log.evictions.mode == 0).all()  # swap
    assert int(log.steps.num_swapped_in.sum()) == len(log.evictions)
    # every request emitted exactly its max_new_tokens
    counts = np.bincount(log.emissions.request, minlength=10)
    assert counts.tolist() == [40] * 10
    used = {log.labels[i] for i in np.unique(log.segments.label)}
    assert {"tok", "prefill", "decode", "swap"} <= used
    # emissions share their step's time, right after decode: every emission of a step has
    # one time, inside the step, at or after the end of the step's decode segment, and no
    # segment of the step starts between that end and the emission
    em, sg, st = log.emissions, log.segments, log.steps
    decode = log.labels.index("decode")
    steps_with_decode = np.flatnonzero(st.num_decode > 0)
    assert len(steps_with_decode) > 0
    for s in steps_with_decode.tolist():
        t = np.unique(em.t_s[em.step == s])
        assert len(t) == 1, f"step {s}: emissions at {t}"
        assert st.t_start_s[s] <= t[0] <= st.t_end_s[s]
        mine = sg.step == s
        (dec,) = np.flatnonzero(mine & (sg.label == decode))
        assert sg.t_end_s[dec] <= t[0]
        between = mine & (sg.t_start_s >= sg.t_end_s[dec]) & (sg.t_start_s < t[0])
        assert not between.any(), f"step {s}: a segment between decode and the emission"
    assert {"batch_size", "kv_free_blocks"} <= set(log.counter_names)


def test_every_gap_reconciles_and_no_step_is_skipped_without_eviction(tokenizer, tmp_path):
    from tracekit.analysis.figures import analyze
    from tracekit.attribution.itl import partition

    cfg = SMALL.replace(num_kv_blocks=24, max_num_seqs=8)
    _, _, log = _run(cfg, tokenizer, _burst(10), tmp_path)
    part = partition(log)  # check=True: raises ReconcileError on any violation
    res = analyze(log, part)
    assert res.gaps == 10 * 39
    assert res.reconcile_max_err_ms < 1e-6
    assert res.skipped_steps_without_eviction == 0
    assert res.preemptions == len(log.evictions) > 0
    # every gap that spans an eviction of its own request is charged preemption time
    # (other gaps may be too: everyone in a step pays for its swap copies)
    pre = part.parts_ms[:, part.labels.index("preempt")]
    spans = part.num_evictions > 0
    assert spans.any() and (pre[spans] > 0).all()


def test_recompute_preemption_is_recorded_and_reconciles(tokenizer, tmp_path):
    from tracekit.attribution.itl import partition

    cfg = SMALL.replace(num_kv_blocks=24, max_num_seqs=8, preemption_mode="recompute")
    _, stats, log = _run(cfg, tokenizer, _burst(10), tmp_path)
    assert stats.num_finished == 10 and stats.num_preemptions > 0
    assert (log.evictions.mode == 1).all()
    used = {log.labels[i] for i in np.unique(log.segments.label)}
    assert "recompute" in used and "swap" not in used  # re-prefills, no copies
    assert np.bincount(log.emissions.request).tolist() == [40] * 10
    partition(log)


def test_eager_steps_are_recorded_above_the_largest_captured_size(tokenizer, tmp_path):
    cfg = SMALL.replace(num_kv_blocks=200, max_num_seqs=8, max_num_batched_tokens=512)
    _, stats, log = _run(cfg, tokenizer, _burst(8, chars=120, max_new=20), tmp_path)
    g, n = log.steps.graph_size, log.steps.num_decode
    assert stats.num_eager_steps == int((g == 0).sum()) > 0
    assert (n[g == 0] > 4).all()  # eager only above the largest captured size (4)
    cap = g > 0
    assert (g[cap] >= n[cap]).all() and set(g[cap].tolist()) <= {1, 2, 4}
    assert (g[n == 0] == -1).all()


def test_gc_freeze_and_compact_history_rungs(tokenizer, tmp_path):
    cfg = SMALL.replace(is_gc_freeze=True, is_compact_history=True, num_kv_blocks=200)
    rec = tracekit.Recorder(None, config={"rung": "test"})
    with rec:
        eng = Engine(cfg, rec, tokenizer)
        try:
            eng.startup()
            assert gc.get_freeze_count() > 0
            eng.serve(_burst(3, max_new=10), 60.0, is_drain=True)
            assert type(eng.history).__name__ == "CompactHistory"
        finally:
            eng.close()
    assert gc.get_freeze_count() == 0  # close() undid the freeze
    gen2 = rec.log().gc_pauses.generation == 2
    assert gen2.any()  # the startup collect before freezing was recorded


def test_disabled_recorder_runs_the_same_engine(tokenizer):
    cfg = SMALL.replace(num_kv_blocks=24)
    rec = tracekit.Recorder(None, enabled=False)
    with rec:
        eng = Engine(cfg, rec, tokenizer)
        stats = eng.serve(_burst(6), 60.0, is_drain=True)
        eng.close()
    assert stats.num_finished == 6 and stats.num_tokens == 6 * 40


def test_off_loop_tokenizer_keeps_tok_off_the_loop(tokenizer, tmp_path):
    cfg = SMALL.replace(is_tokenize_off_loop=True, num_kv_blocks=200)
    eng, stats, log = _run(cfg, tokenizer, _burst(4, max_new=8), tmp_path)
    assert stats.num_finished == 4 and len(log.requests) == 4
    assert "tok" not in {log.labels[i] for i in np.unique(log.segments.label)}
    assert eng.off_loop is None  # the worker was stopped


def test_off_loop_on_the_step_clock_admits_every_prompt_the_step_after_it_arrived(
    tokenizer, tmp_path
):
    # arrivals at steps 0, 3, 3 and 7, 4 output tokens each, a pool and budget with room.
    # Each prompt goes to the worker in its arrival step and is back at the next step's
    # intake, so it is first scheduled exactly one step later: request 0 at step 1 (its
    # tokens at steps 1-4), requests 1 and 2 at step 4 (tokens 4-7), request 3 at step 8.
    # At step 4 the engine is busy with request 0 when it collects 1 and 2: a `tok` wait.
    cfg = SMALL.replace(
        is_tokenize_off_loop=True, num_kv_blocks=200, max_num_seqs=8, max_num_batched_tokens=512
    )
    arrive = (0, 3, 3, 7)
    reqs = [TraceRequest(i, float(s), f"word {i} " * 20, 4, False) for i, s in enumerate(arrive)]
    path = tmp_path / "run.npz"
    admitted: dict[int, float] = {}
    with tracekit.Recorder(path, config={"rung": "t", "seed": 0}) as rec:
        eng = Engine(cfg, rec, tokenizer)
        orig = eng.scheduler.schedule

        def spy():  # the step clock when each request is first scheduled
            out = orig()
            admitted.update({r.rid: eng._step_clock for r in out.admitted})
            return out

        eng.scheduler.schedule = spy  # type: ignore[method-assign]
        try:
            eng.startup()
            stats = eng.serve(reqs, 40, clock="steps", is_drain=True)
        finally:
            eng.close()
    assert admitted == {0: 1.0, 1: 4.0, 2: 4.0, 3: 8.0}
    assert stats.num_finished == 4
    log = tracekit.load(path)
    assert "tok" in {log.labels[i] for i in np.unique(log.segments.label)}


def test_cli_run_writes_a_named_log(tmp_path):
    from click.testing import CliRunner

    from demo_engine.cli import demo

    res = CliRunner().invoke(
        demo,
        [
            "run",
            "--rung",
            "+gc.freeze",
            "--seed",
            "2",
            "--duration",
            "1.5",
            "--rate",
            "4",
            "--out",
            str(tmp_path),
            "--quiet",
        ],
    )
    assert res.exit_code == 0, res.output
    path = tmp_path / "gc-freeze__s2.npz"
    log = tracekit.load(path)
    assert log.config["rung"] == "+gc.freeze" and log.config["seed"] == 2
    assert log.config["rate"] == 4.0 and log.config["engine"]["is_gc_freeze"] is True
    bad = CliRunner().invoke(demo, ["run", "--rung", "nope", "--out", str(tmp_path)])
    assert bad.exit_code == 2 and "unknown rung" in bad.output


# -- the step clock: the same pressure on any machine ----------------------------------------------


def _step_clock_run(cfg, tokenizer, trace, slowdown: float):
    from demo_engine.model import NumpyModelRunner, SlowedRunner

    runner = NumpyModelRunner(cfg, tokenizer.get_vocab_size())
    if slowdown != 1.0:
        runner = SlowedRunner(runner, slowdown)
    rec = tracekit.Recorder(None, config={"rung": "test"})
    with rec:
        eng = Engine(cfg, rec, tokenizer, runner=runner)
        try:
            eng.startup()
            stats = eng.serve(trace, 120, clock="steps")
        finally:
            eng.close()
    return stats, rec.log()


def test_step_clock_gives_the_same_schedule_at_any_speed(tokenizer):
    """Arrivals paced in engine steps: a 3x slower model runs the same steps (the same
    batches, preemptions and eager steps), only each takes longer."""
    cfg = SMALL.replace(num_kv_blocks=36, captured_graph_sizes=(1, 2, 4, 6))
    wl = WorkloadConfig(
        clock="steps", rate_req_step=0.4, swell_period_steps=60, doc_frac=0.0,
        prompt_chars_mean=150, output_tokens_exp_mean=20, output_tokens_max=60,
    )  # fmt: skip
    trace = make_trace(5, 120, wl)
    assert trace and max(t.arrival for t in trace) < 120
    fast, log_fast = _step_clock_run(cfg, tokenizer, trace, 1.0)
    slow, log_slow = _step_clock_run(cfg, tokenizer, trace, 3.0)
    # the run is its steps (idle stretches skipped count too), whatever they cost
    assert fast.num_steps == slow.num_steps <= 120
    # the regime this config is built for, reached both times
    assert fast.num_preemptions > 0 and fast.num_eager_steps > 0
    for f in ("num_preemptions", "num_eager_steps", "num_tokens", "num_arrived"):
        assert getattr(fast, f) == getattr(slow, f), f
    np.testing.assert_array_equal(log_fast.steps.num_decode, log_slow.steps.num_decode)
    np.testing.assert_array_equal(log_fast.steps.num_preempted, log_slow.steps.num_preempted)


def test_slowed_runner_spins_factor_minus_one_times_each_calls_cpu_time(monkeypatch):
    """SlowedRunner: a call that took 2 ms of CPU (fake clock) is followed by busy work
    until 6 more ms of CPU have passed at 4x ((4 - 1) * 2 ms); results and attributes are
    the inner runner's."""
    import demo_engine.model as model

    readings: list[float] = []
    ticks = iter([0.0, 0.002] + [0.002 + 0.001 * k for k in range(1, 20)])

    def fake_cpu() -> float:
        readings.append(next(ticks))
        return readings[-1]

    monkeypatch.setattr(model.time, "process_time", fake_cpu)

    class Inner:
        captured_graph_sizes = (1, 2)

        def decode(self, rows, graph_size):
            return ("decoded", len(rows), graph_size)

    r = model.SlowedRunner(Inner(), 4.0)
    assert r.decode([1, 2], 2) == ("decoded", 2, 2) and r.captured_graph_sizes == (1, 2)
    # start 0, end of the call 0.002, then spinning until the first reading >= 0.008
    assert readings[:2] == [0.0, 0.002] and readings[-1] == pytest.approx(0.008)
    assert all(x < 0.008 - 1e-12 for x in readings[2:-1])
    with pytest.raises(ValueError, match=">= 1"):
        model.SlowedRunner(Inner(), 0.5)


def test_cli_pacing_options_that_do_not_go_together_are_errors(tmp_path):
    from click.testing import CliRunner

    from demo_engine.cli import demo

    for args, words in (
        (["--duration", "5"], "--duration goes with --rate"),
        (["--rate", "4", "--steps", "100"], "give one or the other"),
        (["--load", "0"], "must be > 0"),
        (["--rate", "4", "--timer", "cpu"], "--timer cpu needs arrivals paced in steps"),
    ):
        res = CliRunner().invoke(demo, ["run", *args, "--out", str(tmp_path), "--quiet"])
        assert res.exit_code == 2 and words in res.output, (args, res.output)
    assert not list(tmp_path.iterdir())  # nothing ran


def test_a_baseline_run_without_the_regime_says_so():
    from types import SimpleNamespace

    from demo_engine.cli import BASELINE_EXPECT, _summary, regime_misses

    stats = SimpleNamespace(
        num_steps=600, num_tokens=100, wall_s=2.0, tok_per_s=50.0, num_arrived=10,
        num_finished=5, num_preemptions=0, num_eager_steps=12, num_max_decode_batch=40,
    )  # fmt: skip
    assert BASELINE_EXPECT == {"preemptions": 1, "eager_steps": 1}
    assert regime_misses("baseline", stats) == ["0 preemptions (needs >= 1)"]
    assert regime_misses("+gc.freeze", stats) == []  # only the baseline carries the regime
    line = _summary("raw/baseline__s1.npz", "baseline", stats)
    assert "regime NOT reached: 0 preemptions (needs >= 1)" in line
    stats.num_preemptions = 3
    assert "regime" not in _summary("raw/baseline__s1.npz", "baseline", stats)


def test_ladder_passes_its_timer_to_every_rung(tmp_path):
    """`demo ladder --timer cpu` records every rung on the process's CPU clock: the runs say
    so in their config and carry no OS evidence (a CPU clock is not wall time)."""
    from click.testing import CliRunner

    import tracekit
    from demo_engine.cli import demo

    args = ["ladder", "--seeds", "1", "--steps", "30", "--rungs", "baseline,+gc.freeze"]
    res = CliRunner().invoke(demo, [*args, "--timer", "cpu", "--out", str(tmp_path)])
    assert res.exit_code == 0, res.output
    runs = sorted(tmp_path.glob("*.npz"))
    assert len(runs) == 2
    for p in runs:
        log = tracekit.load(str(p))
        assert log.config["timer"] == "cpu", p
        assert len(log.os_samples) == 0, p
    bad = CliRunner().invoke(
        demo, ["ladder", "--rate", "4", "--timer", "cpu", "--out", str(tmp_path / "x")]
    )
    assert bad.exit_code == 2 and "--timer cpu needs arrivals paced in steps" in bad.output
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("is_async", [False, True])
def test_every_finished_request_left_the_recorders_book(tokenizer, is_async):
    """The demo engine finishes each request in the recorder after its last token
    (docs/capture.md, "Finished requests"), under KV pressure (preemptions) and under
    async scheduling (the last token is read a step after the scheduler finished it):
    every token reached the log, and each id left the book (naming it raises)."""
    cfg = SMALL.replace(num_kv_blocks=24, is_async_scheduling=is_async)
    runner = None
    if is_async:  # async scheduling needs a runner that launches without waiting
        pytest.importorskip("torch")
        from demo_engine.torch_runner import TorchModelRunner  # needs torch: asked for above

        runner = TorchModelRunner(cfg, tokenizer.get_vocab_size())
    rec = tracekit.Recorder(None, config={"rung": "test"})
    with rec:
        eng = Engine(cfg, rec, tokenizer, runner=runner)
        stats = eng.serve(_burst(6), 60.0, is_drain=True)
        eng.close()
    log = rec.log()
    assert stats.num_finished == 6 and len(log.emissions) == stats.num_tokens == 6 * 40
    assert len(log.request_ids) == 6
    for name in log.request_ids:
        with pytest.raises(ValueError, match="was finished"):
            rec.handle(name)
