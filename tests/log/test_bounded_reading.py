"""Reading is bounded by what the file is: what is not a regular file is refused before it
is read, declared sizes are checked before anything is inflated, and the time and output
of the analysis stay linear in what is analysed, with limits a user can raise by a flag.

(The deflate bombs themselves are in the malformed corpus, tests/malformed.py.)"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from logbuilder import LogBuilder
from malformed import npz_bytes, v1_arrays
from procs import run_cli

import tracekit
from tracekit.attribution.itl import partition
from tracekit.errors import LogError, UsageError
from tracekit.render import perfetto

# -- what the file is ---------------------------------------------------------------------


def _one_error_line(r, path) -> str:
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stdout + r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith(f"tracekit: error: {path}: file: "), lines[0]
    return lines[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    """Opening a FIFO for reading blocks until a writer comes: nobody will. The subprocess
    timeout is the guard: on a tracekit that opens it, the command never returns."""
    fifo = tmp_path / "run.npz"
    os.mkfifo(fifo)
    for cmd in ("analyze", "gaps", "trace"):
        extra = ["-o", str(tmp_path / "t.json")] if cmd == "trace" else []
        r = run_cli(cmd, str(fifo), *extra, timeout=60)
        assert "FIFO" in _one_error_line(r, fifo)
    r = run_cli("check", str(fifo), timeout=60)
    assert r.returncode == 2
    assert r.stdout.startswith(f"BAD   {fifo}: file: is a FIFO"), r.stdout


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_a_symlink_to_a_device_is_refused_before_reading(tmp_path, device):
    """/dev/zero never ends (a reader runs out of memory), /dev/urandom is not a zip
    either; both are character devices, named as such without reading a byte."""
    if not os.path.exists(device):
        pytest.skip(f"no {device}")
    link = tmp_path / "run.npz"
    link.symlink_to(device)
    r = run_cli("analyze", str(link), timeout=60)
    assert "is a character device, not a regular file" in _one_error_line(r, link)
    with pytest.raises(LogError, match="character device"):
        tracekit.load(link)


# -- declared sizes before inflating -------------------------------------------------------


def _log_with_extra(tmp_path: Path, n_bytes: int) -> Path:
    """The corpus's base v1 log plus an `extra.blob` of `n_bytes` (stored, not deflated)."""
    p = tmp_path / "run.npz"
    a = v1_arrays()
    a["extra.blob"] = np.zeros(n_bytes // 8, dtype=np.float64)
    p.write_bytes(npz_bytes(a))
    return p


def test_the_inflate_limit_is_raised_and_lowered_by_flag_and_environment(tmp_path):
    """A 2 MB member is within the default limit (at least 256 MiB); with the limit at
    1 MB it is refused, with the message saying which flag raises it; at 3 MB it loads."""
    p = _log_with_extra(tmp_path, 2_000_000)
    assert tracekit.load(p).extras["blob"].nbytes == 2_000_000
    with pytest.raises(LogError, match=r"over the 1 MB limit.*--max-inflate-mb 3\b"):
        tracekit.load(p, max_inflate_mb=1)
    assert len(tracekit.load(p, max_inflate_mb=3).extras["blob"]) == 250_000

    r = run_cli("check", "--max-inflate-mb", "1", str(p))
    assert r.returncode == 2 and "over the 1 MB limit" in r.stdout, r.stdout
    r = run_cli("analyze", "--max-inflate-mb", "3", str(p))
    assert r.returncode == 0, r.stderr
    os.environ["TRACEKIT_MAX_INFLATE_MB"] = "1"
    try:
        r = run_cli("analyze", str(p))
        assert "TRACEKIT_MAX_INFLATE_MB" in _one_error_line(r, p)
        r = run_cli("analyze", "--max-inflate-mb", "3", str(p))  # the flag wins
        assert r.returncode == 0, r.stderr
    finally:
        del os.environ["TRACEKIT_MAX_INFLATE_MB"]


def test_the_default_inflate_limit_follows_the_file_size():
    from tracekit.log.archive import inflate_limit_bytes

    mib = 2**20
    # by the rule in archive.py: max(file, min(max(64 x file, 256 MiB), 8 GiB))
    assert inflate_limit_bytes(1_000) == 256 * mib  # the floor
    assert inflate_limit_bytes(100 * mib) == 6400 * mib  # 64 x the file
    assert inflate_limit_bytes(1000 * mib) == 8192 * mib  # the absolute cap
    assert inflate_limit_bytes(9000 * mib) == 9000 * mib  # never below the file itself
    assert inflate_limit_bytes(1_000, max_inflate_mb=2.5) == 2_500_000


# -- output linear in what is analysed ------------------------------------------------------


def _long_label_log(tmp_path: Path, n_chars: int) -> tuple[Path, str]:
    """Three steps, one request emitting in each (two gaps), one segment per step with a
    label of `n_chars` characters."""
    label = "L" * (n_chars - 1) + "!"
    b = LogBuilder()
    for i in range(3):
        s = b.step(10 * i, 10 * i + 8)
        b.seg(s, label, 10 * i + 1, 10 * i + 7)
        b.emit(0, 10 * i + 8, s)
    p = tmp_path / "run.npz"
    b.build().save(p)
    return p, label


def test_a_huge_label_is_shortened_at_load_so_gaps_writes_it_once_per_gap_at_most(tmp_path):
    p, label = _long_label_log(tmp_path, 200_000)
    log = tracekit.load(p)
    (short,) = [lb for lb in log.labels if lb.startswith("LLL")]
    # MAX_NAME_CHARS (1000) kept, then "...[200000 chars, sha1 <10 hex>]"
    assert short.startswith("L" * 1000 + "...[200000 chars, sha1 ")
    assert len(short) == 1000 + len("...[200000 chars, sha1 0123456789]")
    assert any("labels: names longer than 1000 characters shortened" in w for w in log.warnings)

    r = run_cli("gaps", str(p))
    assert r.returncode == 0, r.stderr
    records = [json.loads(line) for line in r.stdout.splitlines()]
    assert len(records) == 2  # three emissions of one request
    # each record names the label once in parts (and maybe once in context): < 4 KB each
    assert len(r.stdout) < 2 * 4000, len(r.stdout)
    assert "shortened (--max-label-chars" in r.stderr

    r = run_cli("gaps", "--max-label-chars", "200000", str(p))
    assert r.returncode == 0, r.stderr
    assert label in r.stdout  # raised: whole again


def test_shortened_names_stay_distinct_and_match_their_cause_map_entry(tmp_path):
    b = LogBuilder()
    a_long, b_long = "A" * 50 + "x", "A" * 50 + "y"  # same prefix, same length
    s = b.step(0, 8)
    b.seg(s, a_long, 1, 3)
    b.seg(s, b_long, 3, 7)
    b.emit(0, 0, s)
    b.emit(0, 8, s)
    p = tmp_path / "run.npz"
    from dataclasses import replace

    replace(b.build(), cause_map={a_long: "gc"}).save(p)
    log = tracekit.load(p, max_label_chars=20)
    la, lb = log.labels[-2:]
    assert la != lb and la.startswith("A" * 20 + "...[51 chars")
    assert log.cause_map == {la: "gc"}  # the same shortening on both sides
    part = partition(log)
    # segment a_long (1-3 ms) is cause gc by the cause map: 2 ms of the 8 ms gap
    assert part.parts_ms[0, part.labels.index("gc")] == pytest.approx(2.0)


# -- trace: lanes in O(n log n) -------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 15)), max_size=60))
def test_lanes_equal_the_reference(raw):
    items = sorted(((a, a + d) for a, d in raw), key=lambda x: (x[0], -x[1]))
    starts, ends = [x[0] for x in items], [x[1] for x in items]
    assert perfetto._lanes(starts, ends) == perfetto._lanes_reference(starts, ends)


def _lines_run(fn, *args) -> int:
    """How many lines of tracekit/render/perfetto.py run during fn(*args): a deterministic
    measure of work (the same input runs the same lines), unlike wall time."""
    target = perfetto.__file__
    count = 0

    def local(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return local

    def glob(frame, event, arg):
        return local if frame.f_code.co_filename == target else None

    sys.settrace(glob)
    try:
        fn(*args)
    finally:
        sys.settrace(None)
    return count


def _staggered(n: int, gc: bool):
    """n windows of 1 s starting 1 ms apart: each overlaps the next 999 without nesting,
    so each needs a lane of its own (n lanes, up to n = 1000)."""
    b = LogBuilder()
    s = b.step(0, 2 * n + 1000)
    for i in range(n):
        if gc:
            b.gc(i, i + 1000)
        else:
            b.seg(-1, "decode", i, i + 1000)
    b.emit(0, 0, s)
    b.emit(0, 2 * n + 1000, s)
    return b.build()


@pytest.mark.parametrize("gc", [False, True], ids=["segments", "gc pauses"])
def test_trace_work_grows_linearly_with_overlapping_windows(gc):
    """Doubling the overlapping windows must about double the work, not quadruple it (a
    lane search per window over all lanes, or a scan of all events per lane name, did)."""
    work = []
    for n in (400, 800):
        log = _staggered(n, gc)
        ev = perfetto.chrome_trace_events(log, partition(log))
        assert perfetto.validate_trace(ev) == []
        work.append(_lines_run(perfetto.chrome_trace_events, log, partition(log)))
    # n log n doubles to a bit over 2x; n^2 to 4x
    assert work[1] / work[0] < 2.6, work


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux's /proc")
def test_loading_holds_each_array_once(tmp_path):
    """Reading a member holds its array, not its bytes and then a copy of them: loading a
    log with a 100 MB array raises the peak memory by about 100 MB, not 200 MB."""
    p = _log_with_extra(tmp_path, 100_000_000)
    # VmHWM: this process's peak resident memory (ru_maxrss would start at the forking
    # parent's, which is larger than the whole test)
    script = (
        "import sys, tracekit\n"
        "def peak():\n"
        "    for line in open('/proc/self/status'):\n"
        "        if line.startswith('VmHWM:'):\n"
        "            return int(line.split()[1]) * 1024\n"
        "before = peak()\n"
        "log = tracekit.load(sys.argv[1], validate=False)\n"
        "print(peak() - before)\n"
    )
    from procs import python

    proc = python(script, str(p))
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    grown = int(out.strip())
    assert 90e6 < grown < 150e6, (grown, out, err)


@pytest.mark.parametrize(
    ("env", "value"),
    [("TRACEKIT_MAX_INFLATE_MB", "inf"), ("TRACEKIT_MAX_INFLATE_MB", "lots"),
     ("TRACEKIT_MAX_INFLATE_MB", "0"), ("TRACEKIT_MAX_LABEL_CHARS", "-3"),
     ("TRACEKIT_MAX_LABEL_CHARS", "1e3")],
)  # fmt: skip
def test_a_bad_limit_in_the_environment_is_a_usage_error(tmp_path, monkeypatch, env, value):
    p = _log_with_extra(tmp_path, 8)
    monkeypatch.setenv(env, value)
    with pytest.raises(UsageError, match=f"\\${env}="):
        tracekit.load(p)
