"""Nothing recorded is lost or destroyed: output paths, recover, two writers, fork, a full
disk, the flush interval, part contents, failing sinks, open segments and signal handlers.

Real subprocesses where a process boundary is the point (a run killed without stop, a
fork); a fake clock and in-process sinks elsewhere.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from logfiles import part_files
from procs import python, run_cli

import tracekit
from tracekit.capture.recorder import Recorder
from tracekit.capture.sinks import CaptureError, Dispatcher, Flush, PartsSink
from tracekit.errors import LogError, TracekitError
from tracekit.log.flush import TABLES as TABLE_COLS
from tracekit.log.parts import merge_parts, read_part, recover


def wait_for(predicate, timeout: float = 20.0, what: str = "") -> None:
    t_end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > t_end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def assert_steps_are_a_prefix(log: tracekit.RawLog) -> int:
    """Steps 0..n-1 (prefill tokens = step index), each once and in order, one emission
    each: nothing lost in the middle, nothing doubled."""
    n = len(log.steps)
    assert np.array_equal(log.steps.num_prefill_tokens, np.arange(n))
    assert len(log.emissions) == n
    return n


#: Records N steps (step i: prefill tokens = i, one emission of request r(i mod 3)), one
#: part per step (each on disk before the next step), optionally copies the parts folder
#: to argv[3], then ends as argv[4] says: "exit" (os._exit: a kill, no stop, no atexit) or "stop".
PARTS_SCRIPT = r"""
import os, shutil, sys, time
import tracekit

out, n, copy_to, how = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
rec = tracekit.Recorder(out, flush_interval_s=0.0, gc=False)
rec.start()
parts = out + ".parts"
def on_disk():
    from tracekit.log.parts import part_paths, read_part
    return sum(len(read_part(p).table("steps")) for p in part_paths(parts))
t_end = time.monotonic() + 30
for i in range(n):  # one part per step: each is on disk before the next step
    with rec.step():
        rec.step_info(num_prefill_tokens=i)
        rec.emit(["r%d" % (i % 3)])
    while on_disk() < i + 1 and time.monotonic() < t_end:
        time.sleep(0.005)
if copy_to != "-":
    shutil.copytree(parts, copy_to)
if how == "exit":
    os._exit(0)
rec.stop()
"""


def record_parts(out: Path, n: int, *, copy_to: str = "-", how: str = "exit") -> None:
    proc = python(PARTS_SCRIPT, str(out), str(n), copy_to, how)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err


def part_names(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("part-"))


# -- output paths with glob characters ------------------------------------------------


def test_an_output_path_with_glob_characters_keeps_every_row(tmp_path):
    """`[1]` in a glob is a character class: listing parts by a glob built from the path
    found none, saved an empty log and let `recover --remove-parts` delete the parts."""
    out = tmp_path / "exp[1].npz"
    rec = Recorder(out, gc=False, flush_interval_s=0.0)
    with rec:
        for _i in range(5):
            with rec.step():
                rec.emit(["a"])
    assert len(tracekit.load(out).steps) == 5

    killed = tmp_path / "run[a-z]*.npz"
    record_parts(killed, 12)
    parts = Path(str(killed) + ".parts")
    r = run_cli("recover", str(parts), "--remove-parts")
    assert r.returncode == 0, r.stderr
    assert assert_steps_are_a_prefix(tracekit.load(killed)) == 12
    assert not parts.exists()  # removed only after the 12 steps were written


# -- recover never destroys a log ------------------------------------------------------


def test_recover_beside_a_complete_log_refuses_to_replace_it(tmp_path):
    """A cleanly stopped run (RUN.npz, pointing to RUN.npz.parts/) whose first parts a user
    removed by hand: recovering that folder must not overwrite RUN.npz."""
    out = tmp_path / "run.npz"
    record_parts(out, 10, how="stop")
    good = out.read_bytes()
    assert len(tracekit.load(out).steps) == 10
    parts = tmp_path / "run.npz.parts"
    for name in part_names(parts)[:3]:
        (parts / name).unlink()

    r = run_cli("recover", str(parts))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "already exists" in r.stderr and "--force" in r.stderr and "-o" in r.stderr
    assert out.read_bytes() == good
    # forced, the merge is still checked first: one part per step, step i names r(i mod 3)
    # when new, so part 4 (the first left) names no new id but starts at index 3 while no
    # part before it names any: it skips ids 0..2, refused, nothing written
    r = run_cli("recover", str(parts), "--force")
    assert r.returncode == 2 and "request_ids_start" in r.stderr, r.stderr
    assert "part-000004.tkp" in r.stderr
    assert out.read_bytes() == good
    r = run_cli("recover", str(parts), "-o", str(tmp_path / "other.npz"))
    assert r.returncode == 2 and not (tmp_path / "other.npz").exists()


# -- a recorder never deletes parts it did not write ------------------------------------


def test_a_new_recorder_refuses_a_path_with_unrecovered_parts(tmp_path):
    out = tmp_path / "run.npz"
    record_parts(out, 8)  # killed: 8 steps in parts, no log
    parts = tmp_path / "run.npz.parts"
    before = part_names(parts)
    assert before
    rec = Recorder(out, gc=False)
    with pytest.raises(CaptureError, match=r"tracekit recover .*run\.npz\.parts"):
        rec.start()
    assert not rec.running
    assert part_names(parts) == before  # nothing deleted
    assert assert_steps_are_a_prefix(merge_parts(str(parts))) == 8


def test_two_recorders_on_one_path_do_not_wipe_each_other(tmp_path):
    out = tmp_path / "run.npz"
    first = Recorder(out, gc=False, flush_interval_s=0.0)
    with first:
        for _ in range(3):
            with first.step():
                first.emit(["a"])
        second = Recorder(out, gc=False)
        with pytest.raises(CaptureError, match="already recording to this path"):
            second.start()
        for _ in range(3):
            with first.step():
                first.emit(["a"])
    assert len(tracekit.load(out).steps) == 6


def test_another_process_recording_to_the_path_is_refused(tmp_path):
    out = tmp_path / "run.npz"
    script = r"""
import sys, time, tracekit
rec = tracekit.Recorder(sys.argv[1], flush_interval_s=0.0, gc=False)
with rec:
    print("started", flush=True)
    sys.stdin.readline()
"""
    proc = python(script, str(out), stdin=__import__("subprocess").PIPE)
    try:
        assert proc.stdout.readline().strip() == "started"
        with pytest.raises(CaptureError, match=f"process {proc.pid} is already recording"):
            Recorder(out, gc=False).start()
        with pytest.raises(TracekitError, match=f"still being recorded by process {proc.pid}"):
            recover(str(tmp_path / "run.npz.parts"), str(tmp_path / "x.npz"))
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=30) == 0
    finally:
        proc.kill()
    assert tracekit.load(out).meta["interrupted"] is False


# -- fork --------------------------------------------------------------------------------

FORK_SCRIPT = r"""
import os, sys, threading, time, warnings
import tracekit
warnings.simplefilter("ignore", DeprecationWarning)  # fork() with threads running

out, mode = sys.argv[1], sys.argv[2]
rec = tracekit.Recorder(out, flush_interval_s=0.0, gc=False)
rec.start()
seg = rec.segment("decode")

def step(i):
    with rec.step():
        rec.step_info(num_prefill_tokens=i)
        with seg:
            pass
        rec.emit(["r0"])

for i in range(10):
    step(i)
if mode == "exit":
    pid = os.fork()
    if pid == 0:  # the child records a little, then exits normally (atexit runs)
        step(99)
        sys.exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    for i in range(10, 20):
        step(i)
    rec.stop()
    print("ok")
else:  # fork while another thread holds the recorder's lock, again and again
    stop = threading.Event()
    def holder():
        while not stop.is_set():
            with rec._lock:
                time.sleep(0.002)
    t = threading.Thread(target=holder)
    t.start()
    hung = 0
    for k in range(12):
        time.sleep(0.003)
        pid = os.fork()
        if pid == 0:
            with seg:          # takes the recorder's lock in the child
                pass
            rec.counter("x", 1.0)
            os._exit(0)
        t_end = time.monotonic() + 10
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > t_end:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                hung += 1
                break
            time.sleep(0.005)
    stop.set()
    t.join()
    rec.stop()
    print("hung", hung)
"""


def test_a_forked_child_exiting_normally_leaves_the_parents_run_alone(tmp_path):
    """The child inherits the recorder and its atexit stop(): it must not merge the
    parent's parts, remove them, or write the log; the parent records on."""
    out = tmp_path / "run.npz"
    proc = python(FORK_SCRIPT, str(out), "exit")
    stdout, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and stdout.strip() == "ok", err
    log = tracekit.load(out)
    # the parent's steps 0..19, each once; the child's step (prefill 99) is not there
    assert assert_steps_are_a_prefix(log) == 20
    assert log.meta["pid"] == proc.pid


def test_fork_while_another_thread_holds_the_recorder_lock_does_not_deadlock(tmp_path):
    out = tmp_path / "run.npz"
    proc = python(FORK_SCRIPT, str(out), "locked")
    stdout, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err
    assert stdout.strip() == "hung 0", stdout
    assert len(tracekit.load(out).steps) == 10


# -- a full disk -------------------------------------------------------------------------


@pytest.fixture
def full_disk(monkeypatch):
    """While `full[0]` is set, writing a part fails like a full disk: some bytes reach the
    temporary file, then ENOSPC."""
    import contextlib

    import tracekit.log.parts as stream

    real = stream.atomic_open
    full = [False]

    @contextlib.contextmanager
    def atomic_open(path, **kw):
        with real(path, **kw) as fh:
            if full[0] and os.path.basename(path).startswith("part-"):
                fh.write(b"\0" * 100)
                raise OSError(errno.ENOSPC, "No space left on device")
            yield fh

    monkeypatch.setattr(stream, "atomic_open", atomic_open)
    return full


def test_a_temporarily_full_disk_loses_nothing(tmp_path, full_disk, caplog):
    out = tmp_path / "run.npz"
    parts = tmp_path / "run.npz.parts"
    rec = Recorder(out, gc=False, flush_interval_s=0.0)
    caplog.set_level(logging.WARNING, logger="tracekit")
    with rec:
        for i in range(10):
            with rec.step():
                rec.step_info(num_prefill_tokens=i)
                rec.emit(["a"])
        # the writer may be a few flushes behind (a busy machine): the ten steps on disk
        wait_for(lambda: steps_on_disk(parts) >= 10, what="the first ten steps on disk")
        full_disk[0] = True
        for i in range(10, 30):  # the engine never sees the error
            with rec.step():
                rec.step_info(num_prefill_tokens=i)
                rec.emit(["a"])
        time.sleep(0.3)  # the dispatcher tries (and fails) meanwhile
        on_disk = part_names(parts)
        assert not [p for p in os.listdir(parts) if p.endswith(".tmp")]
        # what is on disk now recovers on its own (a kill here keeps it)
        shutil.copytree(parts, tmp_path / "copy.parts")
        (tmp_path / "copy.parts" / "lock").unlink()
        recovered = merge_parts(str(tmp_path / "copy.parts"))
        assert assert_steps_are_a_prefix(recovered) >= 10
        full_disk[0] = False  # space is back
        for i in range(30, 35):
            with rec.step():
                rec.step_info(num_prefill_tokens=i)
                rec.emit(["a"])
    assert on_disk
    log = tracekit.load(out)
    assert assert_steps_are_a_prefix(log) == 35
    assert not list(parts.glob("*.tmp")) and not list(tmp_path.glob("*.tmp")) and not log.warnings
    assert (parts / "final.json").exists()  # stopped cleanly: the folder is the run
    full_warnings = [r for r in caplog.records if "cannot write parts" in r.getMessage()]
    assert len(full_warnings) == 1  # once, not once per flush


def _chunk(start_req: int, n_steps: int, tick0: int) -> dict:
    """A hand-made chunk of `n_steps` steps with one emission each, naming one new request."""
    steps = np.array([[tick0 + 10 * i, tick0 + 10 * i + 5, 1, 0, 1, 0, 0] for i in range(n_steps)])
    em = np.array([[start_req, tick0 + 10 * i + 5, -1, 1, -1] for i in range(n_steps)])
    c = {k: np.zeros(0, dtype=np.int64) for k in TABLE_COLS}
    c["counters"] = np.zeros(0)
    c.update(
        steps=steps.ravel().astype(np.int64),
        emissions=em.ravel().astype(np.int64),
        labels=np.array([], dtype=str),
        counter_names=np.array([], dtype=str),
        request_ids=np.array([f"q{start_req}"]),
        request_ids_start=np.array(start_req),
        config=np.array("{}"),
        flush_tick=np.array(tick0 + 10 * n_steps),
        t0_tick=np.array(0),
        seconds_per_tick=np.array(1e-9),
    )
    return c


def test_a_disk_full_for_long_drops_the_oldest_held_rows_and_says_so(tmp_path, full_disk):
    """Held rows are bounded: with room for one chunk's rows, a second held chunk drops
    the first's rows (its vocabulary stays, so later parts still name their requests)."""
    sink = PartsSink(tmp_path / "run.npz", max_pending_values=4 * (7 + 5))
    sink.open({"t0_tick": 0, "seconds_per_tick": 1e-9, "config": {}})
    sink.write(_chunk(0, 4, 0))  # written
    full_disk[0] = True
    sink.write(_chunk(1, 4, 100))  # held: 4 steps x (7 + 5) values = at the bound
    sink.write(_chunk(2, 4, 200))  # held too: over the bound, chunk 1's 48 values dropped
    full_disk[0] = False
    sink.write(_chunk(3, 4, 300))  # space back: held chunks first, in order
    sink.close({"config": {}})
    log = tracekit.load(tmp_path / "run.npz")
    # chunks 0, 2, 3 keep their 4 steps each; chunk 1 lost its 4 steps and 4 emissions
    assert len(log.steps) == 12 and len(log.emissions) == 12
    assert log.request_ids == ("q0", "q1", "q2", "q3")
    assert sorted(set(log.emissions.request.tolist())) == [0, 2, 3]
    assert any("48 recorded value(s) were dropped" in w for w in log.warnings), log.warnings


# -- the flush interval, under load and idle ---------------------------------------------


def steps_on_disk(parts: Path) -> int:
    return sum(len(read_part(str(p)).table("steps")) for p in part_files(parts))


def emissions_on_disk(parts: Path) -> int:
    return sum(len(read_part(str(p)).table("emissions")) for p in part_files(parts))


def test_rows_recorded_just_before_the_engine_goes_idle_reach_disk(tmp_path):
    """No hook is called after the last step and the emission outside any step: the
    dispatcher's idle timer still flushes them within about one interval."""
    out = tmp_path / "run.npz"
    parts = tmp_path / "run.npz.parts"
    rec = Recorder(out, gc=False, flush_interval_s=0.05)
    with rec:
        with rec.step():
            rec.emit(["a"])
        rec.emit(["b"])  # outside any step (an adapter reporting late)
        # the engine goes idle: nothing calls the recorder any more
        wait_for(lambda: emissions_on_disk(parts) == 2, timeout=10, what="the idle flush")
        assert steps_on_disk(parts) == 1


def test_the_idle_timer_never_splits_an_open_step(tmp_path):
    out = tmp_path / "run.npz"
    parts = tmp_path / "run.npz.parts"
    rec = Recorder(out, gc=False, flush_interval_s=0.02)
    with rec:
        with rec.step():
            with rec.segment("decode"):
                pass
            time.sleep(0.3)  # many intervals inside one step: the timer must wait
            assert steps_on_disk(parts) == 0
            for p in part_files(parts):
                assert len(read_part(str(p)).table("segments")) == 0  # waits with its step
        wait_for(lambda: steps_on_disk(parts) == 1, timeout=10, what="the step's flush")


def test_flushes_waiting_for_a_slow_sink_are_merged_into_one_write():
    """The queue to the sinks cannot grow one chunk per flush: a sink that takes a while
    gets everything that arrived meanwhile in its next write."""
    from array import array

    gate = threading.Event()
    writes: list[dict] = []

    class Slow:
        def open(self, meta):
            pass

        def write(self, chunk):
            writes.append(chunk)
            gate.wait(10)

        def close(self, final):
            pass

    d = Dispatcher([Slow()], t0_tick=0, seconds_per_tick=1e-9, interval_s=60, idle=lambda: None)

    def flush(i: int) -> Flush:
        bufs = {k: array("d" if k == "counters" else "q") for k in TABLE_COLS}
        bufs["steps"].extend([i, i + 1, 1, 0, 1, 0, 0])
        return Flush(bufs, [], [], [f"q{i}"], i, {}, i + 1, None)

    d.submit(flush(0))
    wait_for(lambda: len(writes) == 1, what="the first write")
    for i in range(1, 6):  # five flushes while the sink is busy
        d.submit(flush(i))
    gate.set()
    d.close()
    assert len(writes) == 2
    second = writes[1]
    assert second["steps"].reshape(-1, 7)[:, 0].tolist() == [1, 2, 3, 4, 5]
    assert second["request_ids"].tolist() == ["q1", "q2", "q3", "q4", "q5"]
    assert int(second["request_ids_start"]) == 1 and int(second["flush_tick"]) == 6


def test_the_engine_waits_until_every_waiting_flush_is_taken():
    """`Dispatcher.wait_taken` (the engine's wait once its backlog is two intervals old)
    returns only when no flush waits, not merely when no write runs: here the writer is
    in its idle call, not writing, while a flush waits; the wait ends only once the
    writer has taken it (else flushes could pile up between two writes, unbounded)."""
    from array import array

    in_idle, release, taken = threading.Event(), threading.Event(), threading.Event()
    writes: list[dict] = []

    class Sink:
        def open(self, meta):
            pass

        def write(self, chunk):
            writes.append(chunk)

        def close(self, final):
            pass

    def idle() -> None:
        if not in_idle.is_set():
            in_idle.set()
            release.wait(20)

    d = Dispatcher([Sink()], t0_tick=0, seconds_per_tick=1e-9, interval_s=0.01, idle=idle)
    try:
        assert in_idle.wait(20), "the writer never went idle"
        bufs = {k: array("d" if k == "counters" else "q") for k in TABLE_COLS}
        bufs["steps"].extend([0, 1, 1, 0, 1, 0, 0])
        d.submit(Flush(bufs, [], [], ["q0"], 0, {}, 1, None))
        waiter = threading.Thread(target=lambda: (d.wait_taken(), taken.set()), daemon=True)
        waiter.start()
        # the flush waits and nothing is being written: the engine must still wait
        assert not taken.wait(0.3), "wait_taken returned while a flush was waiting"
        assert d.waiting() and not writes
        release.set()  # the writer leaves its idle call and takes the flush
        assert taken.wait(20), "wait_taken never returned"
    finally:
        release.set()
        d.close()
    assert len(writes) == 1 and writes[0]["steps"].reshape(-1, 7)[:, 0].tolist() == [0]


# -- recover checks what it merges -------------------------------------------------------


def _parts_folder(d: Path, chunks: list[dict], meta: dict | None = None) -> Path:
    import json

    d.mkdir()
    (d / "meta.json").write_text(json.dumps(meta or {"t0_tick": 0, "seconds_per_tick": 1e-9}))
    for i, c in enumerate(chunks, 1):
        np.savez(d / f"part-{i:06d}.npz", **c)
    return d


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda cs: cs[1].update(request_ids_start=np.array(-1)), "request_ids_start"),
        (lambda cs: cs[1].update(request_ids_start=np.array(0)), "request_ids_start"),
        (lambda cs: cs[1].update(request_ids_start=np.array(5)), "request_ids_start"),
        (lambda cs: cs[1].update(flush_tick=np.array([1, 2])), "flush_tick"),
        (lambda cs: cs[1].update(config=np.array("[1]")), "config"),
        (lambda cs: cs[1].update(steps=np.arange(8)), "steps"),
        (lambda cs: cs[1].update(emissions=np.array([7, 5, -1, 1, -1])), "emissions.request"),
    ],
)
def test_recover_refuses_parts_that_contradict_the_run(tmp_path, change, field):
    """A negative start silently gave emissions to other requests; now each part's
    contents are checked and the error names the part and the field."""
    chunks = [_chunk(0, 2, 0), _chunk(1, 2, 100)]
    change(chunks)
    parts = _parts_folder(tmp_path / "run.npz.parts", chunks)
    r = run_cli("recover", str(parts))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "part-000002.npz" in r.stderr and field in r.stderr, r.stderr
    assert "internal error" not in r.stderr
    assert not (tmp_path / "run.npz").exists()


@pytest.mark.parametrize(
    ("meta", "field"),
    [
        ({"t0_tick": 0, "seconds_per_tick": "fast"}, "seconds_per_tick"),
        ({"t0_tick": 0, "seconds_per_tick": -1.0}, "seconds_per_tick"),
        ({"t0_tick": 0, "config": [1]}, "config"),
        ({"t0_tick": 0, "cause_map": {"swap": 3}}, "cause_map"),
        ({"t0_tick": 0, "warnings": "x"}, "warnings"),
    ],
)
def test_recover_names_the_bad_meta_value(tmp_path, meta, field):
    parts = _parts_folder(tmp_path / "run.npz.parts", [_chunk(0, 2, 0)], meta)
    r = run_cli("recover", str(parts))
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert f"meta.json: {field}" in r.stderr and "internal error" not in r.stderr
    assert not (tmp_path / "run.npz").exists()


# -- sinks, open windows, signal handlers, temporary files ---------------------------------


def test_a_sink_that_raises_is_detached_and_the_run_goes_on(tmp_path, caplog):
    threads = []

    class Broken:
        def open(self, meta):
            pass

        def write(self, chunk):
            threads.append(threading.current_thread())
            raise ValueError("boom")

        def close(self, final):
            raise ValueError("boom again")

    caplog.set_level(logging.WARNING, logger="tracekit")
    rec = Recorder(tmp_path / "run.npz", gc=False, flush_interval_s=0.0, sinks=[Broken()])
    with rec:
        for _ in range(20):
            with rec.step():
                rec.emit(["a"])
    assert len(tracekit.load(tmp_path / "run.npz").steps) == 20
    assert threads and threading.main_thread() not in threads  # never the engine's thread
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("Broken failed in write()" in m for m in msgs) == 1  # once, then detached
    assert sum("Broken failed in close()" in m for m in msgs) == 0  # detached: not closed


def test_a_segment_or_step_never_closed_is_a_warning_in_the_log():
    rec = Recorder(None, gc=False)
    rec.start()
    with rec.step():
        rec.emit(["a"])
    rec.segment("decode").__enter__()  # never exited
    rec.step().__enter__()  # never ended
    t_stop = rec.now()
    log = rec.stop()
    # the open step is closed at the stop time (its rows stay valid), the segment is not kept
    assert len(log.steps) == 2 and len(log.segments) == 0
    assert log.steps.t_end_s[1] >= (t_stop - rec.t0_tick) * 1e-9
    assert any("segment was still open at stop() on 1 thread" in w for w in log.warnings)
    assert any(
        "step 1 was still open at stop(): it is closed at the stop time" in w for w in log.warnings
    )


def test_stop_restores_signal_handlers_only_if_they_are_still_tracekits():
    default = signal.getsignal(signal.SIGTERM)

    def app_handler(signum, frame):
        pass

    rec = Recorder(None, gc=False)
    rec.start()
    signal.signal(signal.SIGTERM, app_handler)  # the application's, after start()
    try:
        rec.stop()
        assert signal.getsignal(signal.SIGTERM) is app_handler
    finally:
        signal.signal(signal.SIGTERM, default)

    first, second = Recorder(None, gc=False), Recorder(None, gc=False)
    first.start()
    ours = signal.getsignal(signal.SIGTERM)
    second.start()
    first.stop()
    assert signal.getsignal(signal.SIGTERM) is ours  # the second still records
    second.stop()
    assert signal.getsignal(signal.SIGTERM) == default


def test_a_symlink_at_the_old_temporary_name_is_not_followed(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "run.npz"
    os.symlink(victim, f"{out}.tmp-{os.getpid()}")  # the name writers used to use
    log = Recorder(None, gc=False).start().stop()
    log.save(out)
    assert victim.read_text() == "precious"
    assert out.is_file() and not out.is_symlink()
    assert len(tracekit.load(out).steps) == 0
    leftovers = [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
    assert leftovers == []


def test_an_in_memory_run_never_touches_the_disk(tmp_path, monkeypatch):
    """The memory sink merges chunks in memory: no temporary folder, no file."""
    import tempfile

    def no_disk(*a, **k):
        raise AssertionError("an in-memory run touched the disk")

    monkeypatch.setattr(tempfile, "TemporaryDirectory", no_disk)
    monkeypatch.setattr(tempfile, "mkstemp", no_disk)
    monkeypatch.setattr(np, "savez", no_disk)
    rec = Recorder(None, gc=False, flush_interval_s=0.0)
    with rec:
        for _ in range(5):
            with rec.step():
                rec.emit(["a"])
    assert len(rec.log().steps) == 5 and rec.log().path == "<memory>"


def test_log_errors_from_parts_are_one_line(tmp_path):
    chunks = [_chunk(0, 2, 0)]
    chunks[0]["request_ids_start"] = np.array(-3)
    parts = _parts_folder(tmp_path / "bad\nname.npz.parts", chunks)
    with pytest.raises(LogError) as e:
        merge_parts(str(parts))
    assert "\n" not in str(e.value) and "request_ids_start" in str(e.value)


def test_a_recovered_folder_is_still_refused_and_says_it_was_recovered(tmp_path):
    out = tmp_path / "run.npz"
    record_parts(out, 4)
    parts = tmp_path / "run.npz.parts"
    r = run_cli("recover", str(parts))  # keeps the parts (the default)
    assert r.returncode == 0, r.stderr
    before = part_names(parts)
    with pytest.raises(CaptureError, match="already recovered into"):
        Recorder(out, gc=False).start()
    assert part_names(parts) == before


# -- the malformed parts corpus ----------------------------------------------------------


def test_every_malformed_parts_folder_recovers_or_is_refused_in_one_line(tmp_path):
    from malformed import parts_cases

    cases = parts_cases()
    assert {c.expect for c in cases} == {"ok", "reject"} and len(cases) >= 35
    failures = []
    for i, c in enumerate(cases):
        folder = c.write(tmp_path / f"{i:03d}.npz.parts")
        out = tmp_path / f"{i:03d}.npz"
        try:
            recover(str(folder), str(out))
        except TracekitError as e:
            msg = str(e)
            if c.expect != "reject":
                failures.append(f"{c.name}: refused: {msg}")
            elif c.needle not in msg or "\n" in msg or not msg.startswith(str(folder)):
                failures.append(f"{c.name}: not one line naming {c.needle!r}: {msg!r}")
            elif out.exists():
                failures.append(f"{c.name}: refused, but a log was written")
            continue
        if c.expect == "reject":
            failures.append(f"{c.name}: recovered, expected a refusal naming {c.needle!r}")
            continue
        log = tracekit.load(out)
        if c.needle and not any(c.needle in w for w in log.warnings):
            failures.append(f"{c.name}: no warning with {c.needle!r}: {log.warnings}")
    assert not failures, "\n".join(failures)


def test_the_recorded_parts_of_the_corpus_recover_whole(tmp_path):
    """The corpus's valid folder is a real recording: 3 flushes x 4 steps, each step one
    segment and one emission, request r{phase}-{i % 2} arriving at every step (so 2 new
    ids per phase), one eviction per phase readmitted in the same phase."""
    from malformed import parts_cases

    good = parts_cases()[0]
    recover(str(good.write(tmp_path / "run.npz.parts")), str(tmp_path / "run.npz"))
    log = tracekit.load(tmp_path / "run.npz")
    assert len(log.steps) == 12 and len(log.segments) == 12 and len(log.emissions) == 12
    assert log.request_ids == ("r0-0", "r0-1", "r1-0", "r1-1", "r2-0", "r2-1")
    assert len(log.evictions) == 3 and not np.isnan(log.evictions.t_readmit_s).any()
    assert len(log.counters) == 12 and log.config == {"rung": "parts"}


def test_trace_output_does_not_follow_a_symlink_at_the_old_temporary_name(tmp_path):
    from tracekit.render.perfetto import read_trace, write_trace

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "run.trace.json"
    os.symlink(victim, f"{out}.tmp-{os.getpid()}")
    write_trace([{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "x"}}], str(out))
    assert victim.read_text() == "precious"
    assert read_trace(str(out))[0]["args"]["name"] == "x"
