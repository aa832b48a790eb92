"""`Recorder.finish` / `finish_handle` (docs/capture.md, "Finished requests"): a finished
request's id leaves the recorder's book, its handle stays its own, finishing writes no
row, and a wrong call raises at the call and records nothing."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from logfiles import one_file_arrays

import tracekit
from tracekit.capture.finished import FIRST_SLOTS, FinishedIds


class ManualClock:
    """Integer nanoseconds that move only when the test says."""

    def __init__(self) -> None:
        self.now = 1_000_000_000

    def __call__(self) -> int:
        return self.now

    def tick(self, ns: int = 1_000_000) -> None:
        self.now += ns


def arrays_of(path: Path) -> dict[str, np.ndarray]:
    return {k: v for k, v in one_file_arrays(path).items() if k != "meta"}


def assert_same_log(a: Path, b: Path) -> None:
    x, y = arrays_of(a), arrays_of(b)
    assert sorted(x) == sorted(y)
    for k in x:
        nan = x[k].dtype.kind == "f"  # a first token never emitted is NaN
        assert x[k].dtype == y[k].dtype and np.array_equal(x[k], y[k], equal_nan=nan), k


def run(tmp_path: Path, name: str, during=None, *, finish: bool = True, flush_s: float = 1e6):
    """Three requests over four steps: a, b emit in steps 0-1, a finishes after step 1,
    c arrives in step 2; b emits again in step 2 and 3; `during(rec, ha)` is called in
    step 3 (after a's finish). Returns the log's path."""
    clk = ManualClock()
    out = tmp_path / f"{name}.npz"
    rec = tracekit.Recorder(
        out, clock=clk, gc=False, handle_signals=False, flush_interval_s=flush_s
    )
    with rec:
        ha = rec.request("a", prompt_tokens=4, max_new_tokens=2)
        hb = rec.request("b", prompt_tokens=4, max_new_tokens=4)
        for i in range(4):
            clk.tick()
            with rec.step():
                if i == 0:
                    rec.admit_handle(ha)
                    rec.admit_handle(hb)
                if i == 2:
                    rec.request("c", prompt_tokens=1)
                clk.tick()
                rec.emit_handles([ha, hb] if i < 2 else [hb])
                if i == 3 and during is not None:
                    during(rec, ha)
            if i == 1 and finish:
                rec.finish("a")  # its last token is out
            clk.tick()
        if finish:
            rec.finish_handle(hb)
            rec.finish("c")
    return out


def test_finishing_writes_no_row(tmp_path):
    """Finish says the book may forget an id: the log is the log without the calls."""
    assert_same_log(run(tmp_path, "with"), run(tmp_path, "without", finish=False))


def test_a_finished_request_keeps_its_name_and_rows_across_flushes(tmp_path):
    """Flushed at every step end (a 0 s interval): a's name went with the first flush,
    before its finish dropped it from the book; every name is in the log, in arrival
    order, and every row names its request."""
    out = run(tmp_path, "flushed", flush_s=0.0)
    log = tracekit.load(out)
    assert list(log.request_ids) == ["a", "b", "c"]
    # a: steps 0, 1; b: steps 0-3 (rows in call order: a, b; a, b; b; b)
    assert log.emissions.request.tolist() == [0, 1, 0, 1, 1, 1]
    assert log.emissions.step.tolist() == [0, 0, 1, 1, 2, 3]


def test_a_name_finished_before_any_flush_still_reaches_the_log(tmp_path):
    clk = ManualClock()
    out = tmp_path / "early.npz"
    rec = tracekit.Recorder(out, clock=clk, gc=False, handle_signals=False,
                            flush_interval_s=1e6)  # fmt: skip
    with rec:
        h = rec.request("x", prompt_tokens=1)
        with rec.step():
            rec.emit_handles([h])
        rec.finish("x")  # before the only flush (at stop) handed its name over
        rec.request("y", prompt_tokens=1)
    assert list(tracekit.load(out).request_ids) == ["x", "y"]


def test_a_finished_handle_still_names_its_request(tmp_path):
    """The handle is the request's index in the log: a row by handle after finish is
    that request's (one more emission of a, in step 3)."""
    out = run(tmp_path, "late", lambda rec, ha: rec.emit_handles([ha]))
    log = tracekit.load(out)
    assert list(log.request_ids) == ["a", "b", "c"]
    assert log.emissions.request.tolist() == [0, 1, 0, 1, 1, 1, 0]
    assert log.emissions.step.tolist() == [0, 0, 1, 1, 2, 3, 3]


FINISHED_ID_CALLS = {
    "request": lambda rec, ha: rec.request("a"),
    "emit": lambda rec, ha: rec.emit(["a"]),
    "emit with a new id first": lambda rec, ha: rec.emit(["new", "a"]),
    "admit": lambda rec, ha: rec.admit("a"),
    "evict": lambda rec, ha: rec.evict("a", mode="recompute"),
    "readmit": lambda rec, ha: rec.readmit("a"),
    "wait": lambda rec, ha: rec.wait(["a"], "other"),
    "handle": lambda rec, ha: rec.handle("a"),
    "finish again": lambda rec, ha: rec.finish("a"),
    "finish_handle again": lambda rec, ha: rec.finish_handle(ha),
    "finish an unknown id": lambda rec, ha: rec.finish("zz"),
    "finish an unhashable id": lambda rec, ha: rec.finish(["a"]),
    "finish_handle out of range": lambda rec, ha: rec.finish_handle(3),
    "finish_handle negative": lambda rec, ha: rec.finish_handle(-1),
    "finish_handle str": lambda rec, ha: rec.finish_handle("b"),
    "finish_handle bool": lambda rec, ha: rec.finish_handle(True),
    "finish_handle fraction": lambda rec, ha: rec.finish_handle(1.5),
}


@pytest.mark.parametrize("name", list(FINISHED_ID_CALLS))
def test_a_wrong_call_after_finish_raises_and_records_nothing(tmp_path, name):
    """A call naming a finished id (it cannot name a new request: the log names requests
    by id, and two with one id would be one), a second finish, an unknown id or handle
    and a wrong type raise at the call; the run is the run without the call."""
    bad = FINISHED_ID_CALLS[name]

    def during(rec, ha):
        with pytest.raises((TypeError, ValueError)) as e:
            bad(rec, ha)
        assert "\n" not in str(e.value)

    assert_same_log(run(tmp_path, "good"), run(tmp_path, "bad", during))


def test_a_disabled_recorder_takes_finish_as_a_no_op():
    rec = tracekit.Recorder(enabled=False)
    rec.finish("anything")
    rec.finish_handle(-1)


def book_bytes_per_request(tmp_path: Path, n: int, *, finish: bool) -> float:
    """Python memory the recorder keeps per request after `n` requests that each arrived
    and (with `finish`) finished, measured past the first 2,000; the clock moves 1 ms a
    request, so the rows and the names are flushed to disk every 50 requests."""
    clk = ManualClock()
    rec = tracekit.Recorder(tmp_path / f"mem-{finish}.npz", clock=clk, gc=False,
                            handle_signals=False, flush_interval_s=0.05)  # fmt: skip
    ids = [f"request-{i:08d}" for i in range(n)]  # made before: not the recorder's memory
    with rec:
        tracemalloc.start()
        try:
            for i, rid in enumerate(ids):
                clk.tick()
                h = rec.request(rid, prompt_tokens=8)
                if i == 2_000:
                    base = tracemalloc.get_traced_memory()[0]
                if finish:
                    rec.finish_handle(h)
            grown = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
    return grown / (n - 2_000)


def test_finished_requests_leave_the_book_flat(tmp_path):
    """What finished requests leave in Python's and numpy's memory (docs/capture.md,
    "Finished requests") does not grow with their number. Here each request finishes at
    once and a flush comes every 50, so the book forgets the finished ones once 4,096 are
    flushed: it holds at most 4,096 + 50 slots, in columns of at most 8,192 slots (26
    bytes each: 213 KB) and two lists of at most 4,146 entries (8 bytes, +1/8: 75 KB),
    whatever the run's length; with what the writer holds in flight, under 800 KB at
    12,000 and at 24,000 requests (three and six times the threshold). Their ids' hashes
    are in mapped tables (bounded below). A book never told `finish` keeps every id: about
    170 bytes a request, 1.7 MB over the 10,000 requests measured."""
    for n in (12_000, 24_000):
        assert book_bytes_per_request(tmp_path, n, finish=True) * (n - 2_000) < 800_000, n
    assert book_bytes_per_request(tmp_path, 12_000, finish=False) > 100


def test_finished_ids_find_every_id_added_and_no_other():
    done = FinishedIds()
    ids = [f"cmpl-{i:06d}-0" for i in range(100_000)]
    for rid in ids[::2]:
        done.add(rid)
    assert len(done) == 50_000
    assert all(rid in done for rid in ids[::2])
    assert not any(rid in done for rid in ids[1::2])


def test_finished_ids_take_about_four_slots_a_hash():
    """Tables of c = 2**15, 2c, 4c, ... slots, each filled to half before the next (twice
    as large) is made. With tables c .. 2**k c, the k full ones hold c/2 (2**k - 1) hashes
    and there are c (2**(k+1) - 1) slots: slots <= 4 n + c for n hashes (8 bytes a slot)."""
    done = FinishedIds()
    for i in range(200_000):
        done.add(f"r{i}")
        if i % 997 == 0:
            assert done.nbytes <= 8 * (4 * (i + 1) + FIRST_SLOTS), i
    assert done.nbytes <= 8 * (4 * 200_000 + FIRST_SLOTS)


# -- the book forgets finished requests (`RequestBook.compact`) --------------------------

COMPACT_AT = 4096  # docs/capture.md, "Finished requests": the book's compaction threshold


def served(tmp_path: Path, name: str, n: int, during=None, *, pinned: bool = False):
    """`n` requests, one a step: request i arrives, is admitted and emits one token in
    step i, and is finished after it; a flush every 100 requests. With `pinned`, request
    "long" arrives first (handle 0), emits in step 0 and every 1,000th step, and is
    finished after step n - 600. `during(rec, handles, clock, i)` runs in every step i
    after its emission (with `pinned`), or in the last one only. Returns the log's path
    and every handle by request id."""
    clk = ManualClock()
    out = tmp_path / f"{name}.npz"
    rec = tracekit.Recorder(out, clock=clk, gc=False, handle_signals=False,
                            flush_interval_s=1e6)  # fmt: skip
    handles: dict[str, int] = {}
    with rec:
        if pinned:
            handles["long"] = rec.request("long", prompt_tokens=2)
        for i in range(n):
            clk.tick()
            h = handles[f"r{i}"] = rec.request(f"r{i}", prompt_tokens=2)
            with rec.step():
                rec.admit_handle(h)
                clk.tick()
                rec.emit_handles([h])
                if pinned and i % 1000 == 0:
                    rec.emit_handles([handles["long"]])
                if during is not None and (pinned or i == n - 1):
                    during(rec, handles, clk, i)
            rec.finish_handle(h)
            if pinned and i == n - 600:
                rec.finish("long")
            if i % 100 == 99:
                rec.flush_soon()
    return out, handles


def test_a_forgotten_handle_is_refused_at_every_call_and_records_nothing(tmp_path):
    """6,000 requests finished one by one, flushed every 100: the book forgets the first
    ones once 4,096 are finished and flushed (docs/capture.md, "Finished requests"), so a
    call by the handle of request 0 raises naming it finished, whichever call it is, and
    the run is the run without the call."""
    calls = {
        "emit_handles few": lambda rec, h: rec.emit_handles([h["r0"]]),
        "emit_handles batch": lambda rec, h: rec.emit_handles(
            np.array([h[f"r{i}"] for i in range(5990, 6000)] + [h["r0"]], dtype=np.int64)
        ),
        "emit_handles counts": lambda rec, h: rec.emit_handles([h["r0"]], [2]),
        "emit_chunk": lambda rec, h: rec.emit_chunk(h["r0"], 1, 2),
        "admit_handle": lambda rec, h: rec.admit_handle(h["r0"]),
        "prefill_handles": lambda rec, h: rec.prefill_handles([h["r0"]], [1]),
        "prefill_handles batch": lambda rec, h: rec.prefill_handles(
            np.arange(10, dtype=np.int64), np.ones(10, dtype=np.int64)
        ),
        "wait_handles": lambda rec, h: rec.wait_handles([h["r0"]], "other"),
        "finish_handle": lambda rec, h: rec.finish_handle(h["r0"]),
    }
    good, _ = served(tmp_path, "good", 6000)
    for name, bad in calls.items():

        def during(rec, handles, clk, i, bad=bad, name=name):
            with pytest.raises(ValueError, match="finished") as e:
                bad(rec, handles)
            assert "\n" not in str(e.value), name

        out, _ = served(tmp_path, f"bad-{name.replace(' ', '-')}", 6000, during)
        assert_same_log(good, out)


def test_the_run_read_back_names_every_request_after_the_book_forgets(tmp_path):
    """What the book forgets is never the log's: every request's one emission, in its
    step, under its own name, by hand from `served`; a batch of 16 live handles in the
    last step (the per-step path, past the forgotten ones) names those 16 requests."""
    n = 6000
    batch = list(range(n - 16, n))

    def during(rec, handles, clk, i):
        rec.emit_handles(np.array([handles[f"r{i}"] for i in batch], dtype=np.int64))

    out, handles = served(tmp_path, "run", n, during)
    log = tracekit.load(out)
    assert list(log.request_ids) == [f"r{i}" for i in range(n)]
    assert [handles[f"r{i}"] for i in range(n)] == list(range(n))
    em = log.emissions
    assert em.request.tolist() == list(range(n)) + batch
    assert em.step.tolist() == list(range(n)) + [n - 1] * 16


def test_an_unfinished_request_keeps_its_handle_and_everything_after_it(tmp_path):
    """A request alive across the run pins the book: nothing after it is forgotten while
    it lives, so request 0's handle, finished 2,999 steps before, still names it in step
    2,999 (its handle stays its own, as before any book forgot), and "long" (handle 0)
    emits every 1,000 steps under its name; once it is finished (after step 5,400) the
    book forgets up to the requests finished and flushed since, so in the last step its
    handle is refused."""
    n = 6000

    def at(rec, handles, clk, i):
        if i == 2999:
            rec.emit_handles([handles["r0"]])
        if i == n - 1:
            with pytest.raises(ValueError, match="finished"):
                rec.emit_handles([handles["long"]])

    out, _ = served(tmp_path, "pinned", n, at, pinned=True)
    log = tracekit.load(out)
    assert list(log.request_ids) == ["long"] + [f"r{i}" for i in range(n)]
    em = log.emissions
    assert em.step[em.request == 0].tolist() == list(range(0, n, 1000))
    assert em.step[em.request == 1].tolist() == [0, 2999]


def test_an_arrival_after_the_emission_tick_is_checked_past_the_forgotten_handles(tmp_path):
    """The batch path reads the arrivals of the handles it got (`emit_handles`' arrival
    check, docs/capture.md) in the book's columns, which start at the first handle kept:
    16 requests arriving in the last step at tick T, emitted at T - 5 in one call of 16
    handles, are emitted at T (taken as their arrival), with the warning."""
    n = 6000

    def during(rec, handles, clk, i):
        hs = [rec.request(f"late{j}", prompt_tokens=1) for j in range(16)]
        rec.emit_handles(np.array(hs, dtype=np.int64), at_tick=clk.now - 5)

    out, _ = served(tmp_path, "late", n, during)
    log = tracekit.load(out)
    late = np.isin(log.emissions.request, np.arange(n, n + 16))
    assert late.sum() == 16
    arrivals = log.requests.arrival_s[n : n + 16]
    assert np.array_equal(log.emissions.t_s[late], arrivals)
    assert any("before the request's arrival" in w for w in log.warnings)
