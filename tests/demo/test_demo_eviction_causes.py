"""The demo engine's scheduler keeps the cause of every preemption where it decides it,
and the engine records it with the eviction (docs/capture.md, "Eviction causes").

Expected values by hand from the scheduler's rules (demo_engine/scheduler.py: the newest
running request is preempted when a decoding request cannot grow; swap keeps the victim's
KV, recompute throws its computed tokens away)."""

from __future__ import annotations

import numpy as np
import pytest

import tracekit
from demo_engine.block_manager import BlockManager
from demo_engine.config import EngineConfig, WorkloadConfig
from demo_engine.engine import Engine
from demo_engine.scheduler import Request, Scheduler, Status
from demo_engine.tokenizer import train_tokenizer
from demo_engine.workload import TraceRequest, make_trace
from tracekit.log.rawlog import PREEMPT_REASONS

SMALL = EngineConfig(
    vocab_size=512,
    num_kv_blocks=24,
    max_num_seqs=8,
    max_num_batched_tokens=96,
    max_prompt_tokens=128,
    max_new_tokens=64,
    num_startup_objects=2_000,
    captured_graph_sizes=(1, 2, 4),
)


def _decoding(sched: Scheduler, rid: int, num_tokens: int) -> Request:
    """A running request whose prompt is computed (`num_tokens - 1` positions have KV)."""
    r = Request(rid=rid, arrival_tick=0, token_ids=list(range(1, num_tokens + 1)),
                max_new_tokens=50)  # fmt: skip
    r.num_computed_tokens = num_tokens - 1
    r.status = Status.RUNNING
    sched.bm.allocate(r, num_tokens - 1)
    sched.running.append(r)
    return r


@pytest.mark.parametrize(("mode", "lost"), [("swap", 0), ("recompute", 128)])
def test_the_newest_is_evicted_for_the_oldest_request_whose_decode_needed_a_block(mode, lost):
    """24 blocks of 16, three requests of 128 computed tokens (8 blocks each): the pool is
    dry. Request 0's decode needs a 9th block: the newest (2) goes, for request 0, with 0
    blocks free and 24 used; swap loses nothing, recompute its 128 computed tokens."""
    cfg = SMALL.replace(preemption_mode=mode)
    sched = Scheduler(cfg, BlockManager(cfg.num_kv_blocks, cfg.block_size))
    reqs = [_decoding(sched, i, 129) for i in range(3)]
    out = sched.schedule()
    (op,) = out.kv_ops
    assert op.req is reqs[2] and op.cause is not None
    assert op.cause.evictor is reqs[0]
    assert op.cause.reason == "kv_full"
    assert op.cause.num_computed_tokens_lost == lost
    assert (op.cause.num_free_blocks, op.cause.num_used_blocks) == (0, 24)


def test_the_newest_request_that_cannot_grow_evicts_itself_with_no_evictor():
    """24 blocks: request 0 still in prefill holds 16 (256 of 300 tokens computed),
    request 1 decodes at a block boundary with 8: the pool is dry. Request 1 is the newest,
    so it is its own victim; nobody else needed the block (evictor None); it loses its 128
    computed tokens, with 0 blocks free and 24 used."""
    cfg = SMALL.replace(preemption_mode="recompute")
    sched = Scheduler(cfg, BlockManager(cfg.num_kv_blocks, cfg.block_size))
    first = Request(rid=0, arrival_tick=0, token_ids=list(range(1, 301)), max_new_tokens=5)
    first.num_computed_tokens = 256
    first.status = Status.RUNNING
    sched.bm.allocate(first, 256)
    sched.running.append(first)
    r = _decoding(sched, 1, 129)
    assert sched.bm.num_free_blocks == 0
    (op,) = sched.schedule().kv_ops
    assert op.req is r and op.cause is not None and op.cause.evictor is None
    assert (op.cause.num_computed_tokens_lost, op.cause.num_free_blocks) == (128, 0)
    assert op.cause.num_used_blocks == 24


class _Watching(Engine):
    """Reads, before each schedule, every running request's computed tokens; keeps per
    eviction what the engine saw: (victim, step, computed tokens before, the requests that
    decoded in that step)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.seen: list[tuple[int, int, int, set[int]]] = []
        self.step_no = -1
        sched = self.scheduler
        decide = sched.schedule

        def watched():
            self.step_no += 1
            before = {r.rid: r.num_computed_tokens for r in sched.running}
            out = decide()
            decoded = {r.rid for r in out.decode_reqs}
            for op in out.kv_ops:
                if op.kind == "drop":
                    self.seen.append((op.req.rid, self.step_no, before[op.req.rid], decoded))
            return out

        sched.schedule = watched


def test_every_recorded_preemption_has_one_cause_matching_the_engine(tmp_path):
    """Recompute preemption under a tight pool: one cause per eviction, at the eviction's
    instant, in the step that decided it; the victim's computed tokens lost are what it had
    before that step's schedule; its evictor decoded in that step; the pool was full."""
    tok = train_tokenizer(512, WorkloadConfig())
    tr = make_trace(0, 60.0, WorkloadConfig(rate_req_s=50.0, doc_frac=0.0))
    trace = [TraceRequest(i, 0.0, t.text[:300], 40, False) for i, t in enumerate(tr[:10])]
    cfg = SMALL.replace(preemption_mode="recompute")
    out = tmp_path / "run.npz"
    with tracekit.Recorder(out, config={"rung": "test", "engine": cfg.to_dict()}) as rec:
        eng = _Watching(cfg, rec, tok)
        try:
            eng.startup()
            eng.serve(trace, 60.0, is_drain=True)
        finally:
            eng.close()
    log = tracekit.load(out)
    pe, by, ev = log.preemptions, log.evictors, log.evictions
    assert len(eng.seen) > 0 and len(pe) == len(ev) == len(eng.seen)
    assert {PREEMPT_REASONS[int(x)] for x in pe.reason} == {"kv_full"}
    names = log.request_ids
    rows = sorted(
        zip([int(names[i]) for i in pe.request], pe.step.tolist(),
            pe.num_computed_tokens_lost.tolist(), strict=True)
    )  # fmt: skip
    assert rows == sorted((v, s, lost) for v, s, lost, _ in eng.seen)
    # this scheduler preempts only when a decode's next token needs a block and none is
    # free: the whole pool is in use at every decision
    assert set(pe.num_free_blocks.tolist()) == {0}
    assert set(pe.num_used_blocks.tolist()) == {cfg.num_kv_blocks}
    decoded_in = {(v, s): dec for v, s, *_, dec in eng.seen}
    for i in range(len(pe)):
        decoded = decoded_in[(int(names[pe.request[i]]), int(pe.step[i]))]
        mine = by.evictor[(by.request == pe.request[i]) & (by.t_s == pe.t_s[i])]
        assert len(mine) <= 1
        assert {int(names[e]) for e in mine} <= decoded
    # each cause is at its eviction's instant
    assert set(zip(pe.request.tolist(), pe.t_s.tolist(), strict=True)) == set(
        zip(ev.request.tolist(), ev.t_evict_s.tolist(), strict=True)
    )
    assert np.all(pe.step >= 0)
