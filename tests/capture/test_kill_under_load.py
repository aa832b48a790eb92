"""A `kill -9` on a machine busy with CPU and disk work loses at most what docs/capture.md
says, and a power loss that tore a part leaves a run that recovers up to it.

A kill loses only what was not yet renamed into place (bytes given to ``write()`` stay in
the kernel's page cache when the process dies), so a part is renamed as soon as it is
written and fsynced afterwards, off the writer's path (`tracekit.fsio.Syncer`). A power
loss may then leave the last parts empty or torn: `merge_parts` names the first such part
and ends the run at the flush before it.
"""

from __future__ import annotations

import mmap
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from procs import python, run_cli

import tracekit
from tracekit.log.parts import merge_parts, part_paths, read_part
from tracekit.log.validate import validate_log

#: An engine loop on its own clock (0.5 ms a step, moved only by a step, never while the
#: engine waits for the writer: the loss is counted in the engine's steps, whatever the
#: machine does), 64 emissions a step, as fast as Python goes, flushing every 0.2 s of
#: that clock. Each step writes the number of steps recorded to a shared page.
#: argv[3] == "stall": from the first part on, every fsync of the process never returns
#: (a disk whose flush hangs: the limit of an fsync that takes hundreds of ms under load).
ENGINE = r"""
import mmap, os, struct, sys, threading
import tracekit
out, prog, how = sys.argv[1], sys.argv[2], sys.argv[3]
STEP_NS, k = 500_000, [0]
mm = mmap.mmap(os.open(prog, os.O_RDWR), 8)
rec = tracekit.Recorder(out, flush_interval_s=0.2, gc=False,
                        clock=lambda: 1_000_000_000 + k[0] * STEP_NS)
rec.start()  # meta.json is on disk
if how == "stall":
    os.fsync = lambda fd: threading.Event().wait()
ids = [f"r{i}" for i in range(64)]
handles = [rec.request(r) for r in ids]
print("started", flush=True)
while True:
    k[0] += 1
    with rec.step():
        with rec.segment("decode"):
            pass
        rec.emit_handles(handles)
    mm[:8] = struct.pack("q", k[0])  # steps whose rows are all recorded
"""

#: Load for `LOAD_S` at most (each process ends itself; the test kills them sooner).
LOAD_S = 120.0
SPIN = "import time\nt_end = time.monotonic() + float(__import__('sys').argv[1])\n" + (
    "while time.monotonic() < t_end: pass"
)
#: Writes 16 MiB to a file and fsyncs it, in a loop: the disk's queue stays full.
IO = r"""
import os, sys, time
path, t_end = sys.argv[1], time.monotonic() + float(sys.argv[2])
block = os.urandom(1 << 20)
while time.monotonic() < t_end:
    with open(path, "wb") as fh:
        for _ in range(16):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
"""


def start_load(folder: Path) -> list[subprocess.Popen]:
    """A busy process per core and one writing and fsyncing in `folder`."""
    cmd = [sys.executable, "-c"]
    procs = [subprocess.Popen([*cmd, SPIN, str(LOAD_S)]) for _ in range(os.cpu_count() or 1)]
    procs.append(subprocess.Popen([*cmd, IO, str(folder / "io-load"), str(LOAD_S)]))
    return procs


@pytest.mark.parametrize("fsync", ["loaded", "stall"])
def test_kill_9_under_cpu_and_disk_load_loses_at_most_six_intervals(tmp_path, fsync):
    """The bound of docs/capture.md ("Flush guarantees"), counted in the engine's steps
    (400 to an interval): a flush is handed over at the first step end an interval after
    the last, or, while one waits for the writer, two intervals after it once the writer
    took the waiting one; a part is renamed into place as soon as it is written, whatever
    its fsync does. So the flush being written, the one waiting and the backlog hold at most
    3 x 800 steps' rows (and a step each). `loaded`: a busy process on every core and one
    fsyncing 16 MiB at a time in the same folder; `stall`: the process's fsyncs never
    return. Before parts were renamed ahead of their fsync, a stalled fsync kept every part
    from view (the writer waited in it, then the engine waited for the writer: all 10,000
    steps lost), and a slow one added its time to every part's."""
    steps_per_interval, per_step = 400, 64
    out, prog = tmp_path / "run.npz", tmp_path / "progress"
    prog.write_bytes(bytes(8))
    load = start_load(tmp_path) if fsync == "loaded" else []
    try:
        proc = python(ENGINE, str(out), str(prog), fsync)
        with open(prog, "rb") as fh:
            mm = mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ)
        try:
            assert proc.stdout.readline() == "started\n", proc.stderr.read()[-2000:]
            # kill once 25 intervals are recorded (the bound is 6), however long it takes;
            # an engine stuck waiting for a stalled writer is killed after 60 s
            t_end = time.monotonic() + 60.0
            while (
                struct.unpack("q", mm[:8])[0] < 25 * steps_per_interval and time.monotonic() < t_end
            ):
                assert proc.poll() is None, proc.stderr.read()[-2000:]
                time.sleep(0.01)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=20)
        finally:
            proc.kill()
    finally:
        for p in load:
            p.kill()
            p.wait()
    steps_recorded = struct.unpack("q", mm[:8])[0] + 1  # the next one may be recorded too
    parts = str(tmp_path / "run.npz.parts")
    steps_on_disk = 0
    if part_paths(parts):
        log = validate_log(merge_parts(parts))
        steps_on_disk = len(log.steps)
        # whole steps, the first ones: each with its emissions, nothing torn or skipped
        assert len(log.emissions) == steps_on_disk * per_step
        assert log.steps.t_start_s == pytest.approx(np.arange(1, steps_on_disk + 1) * 5e-4)
        assert not log.warnings or all("interrupted" in w for w in log.warnings), log.warnings
    lost = steps_recorded - steps_on_disk
    print(f"{fsync}: {lost} of {steps_recorded} steps lost ({lost / steps_per_interval:.2f} "
          "intervals)")  # fmt: skip
    assert steps_recorded >= 25 * steps_per_interval, "the engine stopped stepping"
    assert 0 <= lost <= 3 * (2 * steps_per_interval + 1), (
        f"{lost} steps' rows lost of {steps_recorded} (bound {6 * steps_per_interval + 3})"
    )


#: A small engine loop (step i records i prefill tokens, so a log shows which steps it
#: holds), flushing every 50 ms; it runs until killed.
SMALL_ENGINE = r"""
import sys, time
import tracekit
rec = tracekit.Recorder(sys.argv[1], flush_interval_s=0.05)
rec.start()
i = 0
while True:
    with rec.step():
        rec.step_info(num_prefill_tokens=i)
        time.sleep(0.0005)
        rec.emit(["r%d" % (i % 4)])
    i += 1
"""


def steps_in(paths: list[str]) -> int:
    return sum(len(read_part(str(p)).table("steps")) for p in paths)


@pytest.mark.parametrize("damage", ["empty", "zeros", "torn", "missing"])
def test_a_part_a_power_loss_left_empty_or_torn_is_named_and_the_parts_before_are_read(
    tmp_path, damage
):
    """Parts are renamed before their fsync (a kill must not wait for the disk), so after a
    power loss the parts not yet synced may be empty (ext4's delayed allocation: the name
    without the data), full of zeros (the size without the data), torn, or absent while a
    later one is there. The first such part is named in the recovered log's warnings and
    the run ends at the flush before it (later parts index steps and requests it
    introduced); every part before it is read, and nothing is deleted."""
    out = tmp_path / "run.npz"
    parts = tmp_path / "run.npz.parts"
    proc = python(SMALL_ENGINE, str(out))
    try:
        t_end = time.monotonic() + 30.0
        while not (parts.is_dir() and len(part_paths(str(parts))) >= 5):
            assert time.monotonic() < t_end and proc.poll() is None, proc.stderr.read()
            time.sleep(0.01)
        proc.kill()
        proc.wait(timeout=10)
    finally:
        proc.kill()
    files = [Path(p) for p in part_paths(str(parts))]
    hit = files[-2] if damage == "missing" else files[-1]  # the last two were not synced
    before = steps_in([str(f) for f in files[: files.index(hit)]])
    size = hit.stat().st_size
    if damage == "empty":
        hit.write_bytes(b"")
    elif damage == "zeros":
        hit.write_bytes(bytes(size))
    elif damage == "torn":
        hit.write_bytes(hit.read_bytes()[: size // 2])
    else:
        hit.unlink()

    log = merge_parts(str(parts))
    assert len(log.steps) == before > 0
    assert log.steps.num_prefill_tokens.tolist() == list(range(before))
    named = [w for w in log.warnings if hit.name in w and "left out" in w]
    assert len(named) == 1, log.warnings
    r = run_cli("recover", str(parts))
    assert r.returncode == 0, r.stderr
    again = tracekit.load(out)
    assert len(again.steps) == before
    assert any(hit.name in w for w in again.warnings)
    left = [Path(p) for p in part_paths(str(parts))]
    assert left == [f for f in files if damage != "missing" or f != hit]  # nothing deleted


def test_a_failing_fsync_is_logged_once_and_the_other_parts_are_still_synced(
    tmp_path, monkeypatch, caplog
):
    """The syncer's fsyncs (`tracekit.fsio.Syncer`) never stop a run: one that fails (EIO)
    is one warning, the files added after it are still synced, and `close` returns once
    every file added was handled."""
    from tracekit.fsio import Syncer

    synced: list[int] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        name = os.readlink(f"/proc/self/fd/{fd}") if os.path.isdir("/proc/self/fd") else ""
        if name.endswith("bad"):
            raise OSError(5, "Input/output error")
        synced.append(fd)
        real_fsync(fd)

    paths = [tmp_path / n for n in ("a", "bad", "c", "bad2", "bad")]
    for p in paths:
        p.write_bytes(b"x")
    monkeypatch.setattr(os, "fsync", fsync)
    syncer = Syncer()
    with caplog.at_level("WARNING", logger="tracekit"):
        for p in paths:
            syncer.add(str(p))
        syncer.close()
    assert syncer.num_synced == len(paths)
    warnings = [r for r in caplog.records if "cannot fsync" in r.getMessage()]
    assert len(warnings) == 1 and "bad" in warnings[0].getMessage()
    if os.path.isdir("/proc/self/fd"):  # a, c, bad2, then the folder once or more
        assert len(synced) >= 4
