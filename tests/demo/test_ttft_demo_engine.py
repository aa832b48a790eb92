"""The demo engine records admissions, prefill chunks and wait reasons; its TTFT partitions
reconcile and count what its scheduler did."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_demo_engine import SMALL, _burst, _run

from demo_engine.config import WorkloadConfig
from demo_engine.scheduler import Scheduler
from demo_engine.tokenizer import train_tokenizer
from tracekit.attribution.reference import ttft_partition_reference
from tracekit.attribution.ttft import ttft_partition
from tracekit.log.rawlog import WAIT_REASONS


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(512, WorkloadConfig())


class _CountingScheduler(Scheduler):
    """Counts, from the scheduler's own queues, every request it takes off `waiting`."""

    num_taken = 0

    def schedule(self):
        before = set(id(r) for r in self.waiting)
        out = super().schedule()
        self.num_taken += len(before - set(id(r) for r in self.waiting))
        return out


def _run_counting(cfg, tokenizer, trace, tmp_path):
    from demo_engine.engine import Engine

    class CountingEngine(Engine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.scheduler.__class__ = _CountingScheduler

    return _run(cfg, tokenizer, trace, tmp_path, engine_cls=CountingEngine)


def test_demo_engine_admissions_prefill_rows_and_waits(tokenizer, tmp_path):
    cfg = SMALL.replace(num_kv_blocks=24, max_num_seqs=4)
    eng, stats, log = _run_counting(cfg, tokenizer, _burst(10), tmp_path)
    assert stats.num_finished == 10
    # one admission per request, as many as the scheduler took off its waiting queue
    assert len(log.admissions) == eng.scheduler.num_taken == 10
    assert sorted(log.admissions.request.tolist()) == list(range(10))
    # every prompt token was prefilled once in `prefill` segments (swap mode: no recompute)
    per_req = np.bincount(log.prefill_chunks.request, log.prefill_chunks.num_tokens, 10)
    assert per_req.tolist() == log.requests.prompt_tokens.tolist()
    # per step, the rows' tokens are what the step reports (no recompute in swap mode)
    steps = np.bincount(log.prefill_chunks.step, log.prefill_chunks.num_tokens, len(log.steps))
    assert steps.tolist() == log.steps.num_prefill_tokens.tolist()
    # 10 at once with max_num_seqs 4: the others waited, and the scheduler said why
    reasons = {WAIT_REASONS[c] for c in log.waits.reason.tolist()}
    assert "max_num_seqs" in reasons
    p = ttft_partition(log)  # raises if any TTFT does not reconcile
    assert len(p) == 10 and p.is_split.all() and p.notes == ()
    ref = ttft_partition_reference(log)
    np.testing.assert_allclose(p.parts_ms, ref.parts_ms, rtol=0, atol=1e-9)
    # the requests admitted in the first step queued only for its scheduling: the rest
    # queued for whole steps, part of it held by max_num_seqs
    held = p.column("wait_max_num_seqs")
    assert (held > 0).sum() >= 5
    assert (p.phase("queued")[held > 0] >= held[held > 0] - 1e-9).all()


def test_watermark_holds_requests_for_kv_blocks(tokenizer, tmp_path):
    cfg = SMALL.replace(num_kv_blocks=24, max_num_seqs=8, admit_free_frac=0.3)
    _, stats, log = _run(cfg, tokenizer, _burst(10), tmp_path)
    assert stats.num_finished == 10
    reasons = {WAIT_REASONS[c] for c in log.waits.reason.tolist()}
    assert "kv_blocks" in reasons
    p = ttft_partition(log)
    assert p.column("wait_kv_blocks").sum() > 0


def test_recompute_chunks_are_not_prefill_rows(tokenizer, tmp_path):
    cfg = SMALL.replace(num_kv_blocks=24, max_num_seqs=8, preemption_mode="recompute")
    _, stats, log = _run(cfg, tokenizer, _burst(10), tmp_path)
    assert stats.num_preemptions > 0
    # a recompute re-prefills in `recompute` segments: its chunks are not prefill rows, so
    # every request's rows still add up to its prompt once
    per_req = np.bincount(log.prefill_chunks.request, log.prefill_chunks.num_tokens, 10)
    assert (per_req <= log.requests.prompt_tokens).all()
    ttft_partition(log)


def test_async_scheduling_records_valid_ttft_events(tokenizer):
    """Under async scheduling a step's tokens are emitted one iteration later: admissions
    still precede first tokens and the TTFT partition reconciles."""
    pytest.importorskip("torch")
    from test_torch_runner import _serve

    from demo_engine.torch_runner import TorchModelRunner
    from tracekit.log.validate import validate_log

    cfg = SMALL.replace(num_kv_blocks=24, is_async_scheduling=True)
    _, stats, log = _serve(cfg, tokenizer, TorchModelRunner(cfg, tokenizer.get_vocab_size()))
    assert stats.num_finished == 10
    log = validate_log(log)  # admission before first token, evictions after admission
    assert len(log.admissions) == 10
    p = ttft_partition(log)
    assert len(p) == 10 and p.is_split.all()


def test_off_loop_tokenizer_states_tokenizing_waits(tokenizer, tmp_path):
    """Requests in the off-loop tokenizer cannot be admitted yet: the engine says so. On the
    step clock (whatever the machine's load: the worker's results are taken at the next
    step's intake), five requests arrive at step 0 and five at step 1: each waits in the
    step it arrived in (on the seconds clock a loaded machine could let the worker finish
    all ten before any step ran, and no step saw one wait)."""
    import tracekit
    from demo_engine.engine import Engine

    cfg = SMALL.replace(is_tokenize_off_loop=True)
    trace = [replace(t, arrival=float(t.index >= 5)) for t in _burst(10)]
    rec = tracekit.Recorder(tmp_path / "run.npz", config={"rung": "test", "seed": 0})
    with rec:
        eng = Engine(cfg, rec, tokenizer)
        try:
            eng.startup()
            stats = eng.serve(trace, 1000, clock="steps", is_drain=True)
        finally:
            eng.close()
    log = tracekit.load(tmp_path / "run.npz")
    assert stats.num_finished == 10
    # each request waits for the tokenizer in the step it arrived in, and in no other: its
    # tokens are back by the next step's intake (`Engine._intake`)
    tok = log.waits.reason == WAIT_REASONS.index("tokenizing")
    steps_of = {log.request_ids[r]: [] for r in range(len(log.request_ids))}
    for r, k in zip(log.waits.request[tok].tolist(), log.waits.step[tok].tolist(), strict=True):
        steps_of[log.request_ids[r]].append(k)
    assert steps_of == {str(i): [int(i >= 5)] for i in range(10)}, steps_of
    assert ttft_partition(log).column("wait_tokenizing").sum() > 0


def test_off_loop_tokenizer_takes_no_tok_time_on_the_loop(tokenizer, tmp_path):
    """On the seconds clock the loop never waits for the off-loop tokenizer: no `tok`."""
    cfg = SMALL.replace(is_tokenize_off_loop=True)
    _, stats, log = _run(cfg, tokenizer, _burst(10), tmp_path)
    assert stats.num_finished == 10
    assert (
        not (log.segments.label == log.labels.index("tok")).any() if "tok" in log.labels else True
    )
