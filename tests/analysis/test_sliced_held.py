"""What the readers of a long run hold per request (docs/reports.md, "Reading a long run in
slices", "What grows with a run"): a day of a busy server names ~3 M requests, so every
byte held per request for the whole run is ~3 MB of the readers' peak."""

from __future__ import annotations

import gc
import time
import tracemalloc
import weakref
from pathlib import Path

import numpy as np

import tracekit
import tracekit.analysis.stream_check as stream_check
from tracekit.allocator import give_back_freed_memory
from tracekit.analysis.stream import index_pass, run_slice, slice_partition, slice_tasks
from tracekit.analysis.stream_check import PartByPart
from tracekit.attribution.itl import FIT_ALL_CAPTURED
from tracekit.log.request_names import RequestNames
from tracekit.log.slices import SlicedRun

PER_PART = 1000  # requests named a part
NAME_CHARS = 10  # "req-000123"


class FakeClock:
    def __init__(self) -> None:
        self.t = 10**12

    def __call__(self) -> int:
        return self.t


def _many_requests(out: Path, parts: int) -> str:
    """A part per step, `PER_PART` new requests a step, each emitting at its step and the
    next (one gap each): the run's parts alike but for how many requests came before."""
    clock = FakeClock()
    rec = tracekit.Recorder(str(out), clock=clock, seconds_per_tick=1e-9, gc=False,
                            handle_signals=False, flush_interval_s=3600.0)  # fmt: skip
    folder = Path(str(out) + ".parts")
    with rec:
        for k in range(parts):
            new = [f"req-{k * PER_PART + j:06d}" for j in range(PER_PART)]
            before = [f"req-{(k - 1) * PER_PART + j:06d}" for j in range(PER_PART)] if k else []
            with rec.step():
                for name in new:
                    rec.request(name, prompt_tokens=4)
                with rec.segment("decode"):
                    clock.t += 10_000_000
                rec.emit(before + new)
            rec.flush_soon()
            deadline = time.monotonic() + 60.0  # the writer puts the part on disk
            while len(list(folder.glob("part-*.tkp"))) < k + 1:
                assert time.monotonic() < deadline, f"no part {k + 1} in 60 s"
                time.sleep(0.005)
    return str(folder)


def _held_by_index_pass(parts_dir: str) -> int:
    """Bytes the index pass's result and its run hold (tracemalloc, after a collection):
    the least of three passes, as tracemalloc also counts what other threads allocate
    meanwhile (a thread an earlier test left finishing), never less than the pass's."""
    least = None
    for _ in range(3):
        gc.collect()
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            run = SlicedRun(parts_dir)
            ix = index_pass(run, FIT_ALL_CAPTURED, lambda _msg: None)
            gc.collect()
            held = tracemalloc.get_traced_memory()[0] - base
        finally:
            tracemalloc.stop()
        assert len(ix.names) == len(ix.last_tick)  # (both kept till here)
        least = held if least is None else min(least, held)
        del run, ix
    assert least is not None
    return least


def test_the_index_pass_holds_a_few_numbers_and_the_id_bytes_a_request(tmp_path):
    """Two runs alike but for their length (4 and 16 parts of 1,000 requests): what the
    index pass holds grows per request by its columns (the index's last emission tick,
    first part, first emission tick and arrival tick; the run's part of its arrival: 5
    int64, with up to a quarter more room while they grow) and its id (10 UTF-8 bytes and
    an int64 offset, room as those), plus each part's own few hundred bytes (its entry,
    its steps' figures, its eviction rows) spread over its 1,000 requests: 4 bytes. A
    `str` per id (~60 bytes, and 8 in a list) or a placeholder name per request (~70
    bytes) would be more than twice it."""
    held = [_held_by_index_pass(_many_requests(tmp_path / f"run{n}.npz", n)) for n in (4, 16)]
    per_request = (held[1] - held[0]) / (12 * PER_PART)
    columns = 1.25 * 8 * 5
    name = NAME_CHARS + 1.25 * 8
    print(f"{per_request:.1f} bytes a request")
    assert per_request <= columns + name + 4, (per_request, held)


def test_the_check_reads_each_part_with_only_the_requests_its_rows_name(
    tmp_path, monkeypatch
):  # fmt: skip
    """`tracekit check` part by part: each part's log holds the requests its rows name
    (here its 1,000 new ones and the 1,000 of the part before, which emit again), never
    every request named so far, which made each part's check longer than the one before
    (the whole check quadratic in the run's length)."""
    parts_dir = _many_requests(tmp_path / "run.npz", 8)
    held: list[int] = []
    merge = stream_check.merge_flushed

    def counted(*args, **kw):
        log = merge(*args, **kw)
        held.append(len(log.requests))
        return log

    monkeypatch.setattr(stream_check, "merge_flushed", counted)
    checked = PartByPart(parts_dir, parts_dir, None).check(None)
    assert checked.num_emissions == 2 * 8 * PER_PART - PER_PART
    # the 8 parts, the stop's (no rows), then the log of the kept tables: every request
    assert held == [PER_PART] + [2 * PER_PART] * 7 + [0] + [8 * PER_PART]


def test_request_names_are_made_only_for_the_rows_read():
    """`RequestNames`: ``(removed N)`` below its removed count, then the ids added, as a
    tuple of the same ids reads them (docs/design.md: the requests named only in removed
    parts)."""
    names = RequestNames(3, ["a", "é-1"])
    names.extend(["c"])
    assert len(names) == 6
    assert names == ("(removed 0)", "(removed 1)", "(removed 2)", "a", "é-1", "c")
    assert names[4] == "é-1" and names[-1] == "c" and names[2:4] == ("(removed 2)", "a")
    assert names.head(4) == ("(removed 0)", "(removed 1)", "(removed 2)", "a")
    assert names.head(2) == ("(removed 0)", "(removed 1)")
    assert list(names.take(np.array([5, 0]))) == ["c", "(removed 0)"]
    assert names.index("c") == 5 and "a" in names and "b" not in names
    assert names.nbytes == len("aé-1c".encode()) + 8 * 3


def test_a_slice_holds_only_the_requests_its_parts_name(tmp_path):
    """Each slice's log holds the requests its parts' rows name, numbered 0, 1, ... in the
    run's order, never every request named so far (a day's last slices held ~3 M for the
    ~20,000 they read). Part k names requests 1,000 k .. 1,000 (k + 1) - 1 and emits for
    those and the part before's: a slice of parts ``[c, b)`` holds requests
    1,000 (c - 1) .. 1,000 b - 1 (from 0 for c = 0), each row as the run numbers it."""
    parts_dir = _many_requests(tmp_path / "run.npz", 8)
    run = SlicedRun(parts_dir)
    ix = index_pass(run, FIT_ALL_CAPTURED, lambda _msg: None)
    tasks = slice_tasks(run, ix, 2 * PER_PART, float("inf"))
    assert len(tasks) >= 4 and any(t.c >= 2 for t in tasks)
    gaps = 0
    for t in tasks:
        read = slice_partition(t)
        lo = max(t.c - 1, 0) * PER_PART
        hi = min(t.b, 8) * PER_PART  # (part 8: the stop's, no rows)
        assert np.array_equal(read.numbers, np.arange(lo, hi))
        assert len(read.log.requests) == len(read.log.request_ids) == len(read.numbers)
        local = run.local_log_of(t.c, t.b, retained=t.retained)
        whole = run.log_of(t.c, t.b, retained=t.retained)  # the run's numbering
        for k in ("emissions", "requests"):  # the same rows, numbered back
            a, b = getattr(local.log, k), getattr(whole, k)
            req = local.numbers[a.request] if k == "emissions" else local.numbers
            assert np.array_equal(req, b.request if k == "emissions" else np.arange(lo, len(b)))
        assert np.array_equal(local.log.emissions.t_s, whole.emissions.t_s)
        assert np.array_equal(local.log.requests.arrival_s, whole.requests.arrival_s[lo:],
                              equal_nan=True)  # fmt: skip
        named = read.numbers >= t.c * PER_PART  # named in the slice's parts: their ids
        ids = [read.log.request_ids[i] for i in np.flatnonzero(named).tolist()]
        assert ids == [f"req-{g:06d}" for g in read.numbers[named].tolist()]
        assert np.allclose(read.p.gap_ms, 10.0, rtol=1e-9)  # a step apart
        gaps += len(read.p)
    assert gaps == 7 * PER_PART  # a gap per request but the first part's: once, whole


def test_a_slice_is_freed_as_soon_as_it_is_let_go(tmp_path):
    """A slice's log, its prepared runs and its partition are freed when the last name of
    them goes (reference counting), never left for the cyclic collector: a prepared run
    that named itself as its own drift-corrected run was a cycle, and a day's gaps listing
    piled its slices up between two full collections (3.6 GB before one freed them).
    Nothing a slice leaves is garbage for the collector, nor is handing memory back."""
    parts_dir = _many_requests(tmp_path / "run.npz", 4)
    run = SlicedRun(parts_dir)
    ix = index_pass(run, FIT_ALL_CAPTURED, lambda _msg: None)
    tasks = slice_tasks(run, ix, 2 * PER_PART, float("inf"))
    assert len(tasks) >= 2
    run_slice(tasks[0])  # what a first slice imports (numpy's, once) is not the slice's
    gc.collect()
    gc.disable()  # what the slices leave stays where a collection would find it
    try:
        for t in tasks:
            read = slice_partition(t)
            held = [read.log, read.prep, read.prep.corrected(), read.p]
            refs = [weakref.ref(x) for x in held]
            del read, held
            assert [r() for r in refs] == [None] * 4
            run_slice(t)
            give_back_freed_memory()
            assert gc.collect() == 0
    finally:
        gc.enable()
