"""The cause of an eviction, recorded where the scheduler decides it (docs/capture.md,
"Eviction causes"): `Recorder.evict(..., reason=, by=, num_computed_tokens_lost=,
num_free_blocks=, num_used_blocks=)` writes the eviction, one `preemptions` row and one
`evictors` row per evictor, at one clock reading; a plain `evict` writes none of them.

Expected values come from the rules: the row layout in `tracekit.log.rawlog` (Preemptions,
Evictors) and the recorder's docstring (-1: a count not told)."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import tracekit
from tracekit.log.parts import merge_parts, part_paths, read_part
from tracekit.log.rawlog import PREEMPT_REASONS, Evictions
from tracekit.log.validate import validate_log


class Clock:
    """Integer nanoseconds that move only when the test says."""

    def __init__(self) -> None:
        self.now = 1_000_000_000

    def __call__(self) -> int:
        return self.now


def run(out=None) -> tracekit.Recorder:
    """Three requests: a and b run in step 0; in step 1, c's admission evicts a (KV full,
    5 computed tokens lost, 0 free of 8 blocks), then b by priority with two evictors and
    no counts; a plain evict of b later in step 2 after its readmission."""
    clk = Clock()
    rec = tracekit.Recorder(out, clock=clk, gc=False, handle_signals=False)
    with rec:
        for r in ("a", "b", "c"):
            rec.request(r, prompt_tokens=4, max_new_tokens=4)
        with rec.step():  # step 0, ticks 1.001e9 .. 1.002e9
            clk.now += 1_000_000
            rec.admit("a")
            rec.admit("b")
            clk.now += 1_000_000
            rec.emit(["a", "b"])
        with rec.step():  # step 1
            clk.now += 1_000_000  # 3 ms after start
            rec.admit("c")
            rec.evict(
                "a", mode="recompute", reason="kv_full", by=["c"],
                num_computed_tokens_lost=5, num_free_blocks=0, num_used_blocks=8,
            )  # fmt: skip
            clk.now += 1_000_000  # 4 ms
            rec.evict("b", mode="recompute", reason="priority", by=["c", "a"])
            clk.now += 1_000_000
            rec.emit(["c"])
        with rec.step():  # step 2
            clk.now += 1_000_000  # 6 ms
            rec.readmit("b")
            clk.now += 1_000_000  # 7 ms
            rec.evict("b", mode="recompute")
            rec.emit(["c"])
    return rec


def check(log: tracekit.RawLog) -> None:
    pe, by = log.preemptions, log.evictors
    assert log.request_ids == ("a", "b", "c")
    assert pe.step.tolist() == [1, 1]
    assert pe.request.tolist() == [0, 1]
    assert np.allclose(pe.t_s, [3e-3, 4e-3], rtol=0, atol=1e-12)
    assert [PREEMPT_REASONS[int(x)] for x in pe.reason] == ["kv_full", "priority"]
    assert pe.num_computed_tokens_lost.tolist() == [5, -1]
    assert pe.num_free_blocks.tolist() == [0, -1]
    assert pe.num_used_blocks.tolist() == [8, -1]
    assert by.request.tolist() == [0, 1, 1]
    assert by.evictor.tolist() == [2, 2, 0]
    assert by.t_s.tolist() == [pe.t_s[0], pe.t_s[1], pe.t_s[1]]
    # each cause is its eviction's: the same request at the same instant (three
    # evictions, the plain one without a cause)
    ev: Evictions = log.evictions
    assert len(ev) == 3
    pairs = set(zip(ev.request.tolist(), ev.t_evict_s.tolist(), strict=True))
    assert set(zip(pe.request.tolist(), pe.t_s.tolist(), strict=True)) <= pairs


def test_a_cause_is_recorded_with_its_eviction_and_round_trips(tmp_path):
    out = tmp_path / "run.npz"
    run(out)
    check(tracekit.load(out))


def test_a_run_in_memory_records_the_same_causes():
    check(run(None).log())


def test_parts_keep_the_causes_and_a_part_written_before_them_reads_as_empty(tmp_path):
    """The run's parts folder holds the cause rows; parts without the two tables (the
    `.npz` parts written before they existed) merge with none, and the log is valid."""
    out = tmp_path / "run.npz"
    with tracekit.Recorder(out, gc=False, handle_signals=False, flush_interval_s=0.0) as rec:
        rec.request("a", prompt_tokens=3)
        rec.request("b", prompt_tokens=3)
        with rec.step():
            rec.admit("a")
            rec.admit("b")
            rec.evict("a", mode="recompute", reason="kv_full", by=["b"], num_free_blocks=0)
            rec.emit(["b"])
    parts = tmp_path / "run.npz.parts"
    log = validate_log(merge_parts(str(parts)))
    assert log.preemptions.request.tolist() == [0]
    assert log.preemptions.num_free_blocks.tolist() == [0]
    assert log.evictors.evictor.tolist() == [1]
    old = tmp_path / "old.parts"
    shutil.copytree(parts, old)
    for p in part_paths(str(old)):  # each part as an `.npz` part of the earlier format
        rows = read_part(p)
        kept = {k: np.asarray(rows[k]) for k in rows if k not in ("preemptions", "evictors")}
        np.savez(os.path.splitext(p)[0] + ".npz", **kept)
        os.remove(p)
    (old / "index").unlink(missing_ok=True)  # it names the parts of the new format
    log = validate_log(merge_parts(str(old)))
    assert len(log.preemptions) == len(log.evictors) == 0 and len(log.evictions) == 1


BAD = {
    "reason unknown": dict(reason="kv"),
    "reason not a str": dict(reason=0),
    "cause without reason": dict(by=["a"]),
    "count without reason": dict(num_free_blocks=3),
    "its own evictor": dict(reason="kv_full", by=["zz"]),
    "evictor twice": dict(reason="kv_full", by=["a", "a"]),
    "by a str": dict(reason="kv_full", by="a"),
    "by not iterable": dict(reason="kv_full", by=3),
    "lost a fraction": dict(reason="kv_full", num_computed_tokens_lost=1.5),
    "free negative": dict(reason="kv_full", num_free_blocks=-1),
    "used a str": dict(reason="kv_full", num_used_blocks="8"),
    "a new evictor, then an unhashable one": dict(reason="kv_full", by=["new", {}]),
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_wrong_cause_raises_at_the_call_and_records_nothing(name):
    """The run with the refused call is the run without it: no request interned, no
    eviction, no cause row; the error is one line naming the argument."""

    def one(bad):
        clk = Clock()
        rec = tracekit.Recorder(None, clock=clk, gc=False, handle_signals=False)
        with rec:
            rec.request("a", prompt_tokens=4, max_new_tokens=4)
            with rec.step():
                rec.admit("a")
                if bad is not None:
                    with pytest.raises((TypeError, ValueError)) as e:
                        rec.evict("zz", mode="recompute", **bad)
                    assert "\n" not in str(e.value)
                rec.emit(["a"])
        return rec.log()

    good, bad = one(None), one(BAD[name])
    assert bad.request_ids == good.request_ids == ("a",)
    assert len(bad.evictions) == len(bad.preemptions) == len(bad.evictors) == 0
    assert bad.steps.num_preempted.tolist() == [0]
