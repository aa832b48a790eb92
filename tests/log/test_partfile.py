"""The run's log on disk: the compact part encoding (docs/design.md, "The run's log on disk"),
its checks on hostile bytes, a stop that merges nothing, and the pointer file."""

from __future__ import annotations

import json
import os
import struct
import sys
import threading
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import tracekit
from tracekit.errors import LogError
from tracekit.log.archive import InflateLimitError
from tracekit.log.flush import TABLES
from tracekit.log.partfile import MAGIC, decode_part, encode_part
from tracekit.log.parts import (
    FINAL_NAME,
    INDEX_NAME,
    POINTER_MEMBER,
    merge_parts,
    read_index,
)

REPO = Path(__file__).resolve().parents[2]
I64 = np.iinfo(np.int64)


def _flush(rng: np.random.Generator, n: int) -> dict[str, np.ndarray]:
    """A flush's arrays with `n` rows per table: ticks that grow, handles, extremes."""
    out: dict[str, np.ndarray] = {}
    for k, cols in TABLES.items():
        if k == "counters":
            v = rng.normal(size=(n, len(cols)))
            if n:
                v[0, 2] = np.nan
                v[-1, 2] = np.inf
            out[k] = v.reshape(-1)
            continue
        a = rng.integers(-5, 5, size=(n, len(cols)), dtype=np.int64)
        for j, c in enumerate(cols):
            if c.endswith("_tick"):
                a[:, j] = 10**15 + np.cumsum(rng.integers(0, 10**6, size=n))
        if n > 2:
            a[1, 0], a[2, 0] = I64.min, I64.max  # wraps when delta-coded: must round-trip
        out[k] = a.reshape(-1)
    out.update(
        labels=np.array(["decode", "prefill", "é \x1f|"]),
        counter_names=np.array([], dtype=str),
        request_ids=np.array([f"req-{i}" for i in range(3)]),
        request_ids_start=np.array(7),
        config=np.array('{"rung": "baseline"}'),
        flush_tick=np.array(10**15 + 123),
        t0_tick=np.array(10**15),
        seconds_per_tick=np.array(1e-9),
        open_tick=np.array(-(2**63)),
    )
    return out


def _assert_same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        x, y = np.asarray(a[k]), np.asarray(b[k])
        assert x.shape == y.shape, k
        if x.dtype.kind in "US":
            assert y.dtype.kind == "U" and x.tolist() == y.tolist(), k
        else:
            assert x.dtype == y.dtype, (k, x.dtype, y.dtype)
            assert np.array_equal(x, y, equal_nan=x.dtype.kind == "f"), k


@given(n=st.integers(0, 300), seed=st.integers(0, 2**32 - 1))
def test_a_part_holds_exactly_the_flush_it_was_given(n, seed):
    a = _flush(np.random.default_rng(seed), n)
    _assert_same(a, decode_part(encode_part(a), "p"))


def test_a_realistic_flush_takes_under_4_bytes_a_token():
    """The busy server of bench/busy_server.py (batch 256, deterministic): the issue's goal
    is at most 4 bytes per emitted token on disk, every table included."""
    sys.path.insert(0, str(REPO / "bench"))
    from busy_server import FakeClock, serve

    class Keep:
        def open(self, meta):
            self.rows = []

        def write(self, rows):
            self.rows.append(rows)

        def close(self, final):
            pass

    keep, clock = Keep(), FakeClock()
    rec = tracekit.Recorder(None, clock=clock, seconds_per_tick=1e-9, gc=False,
                            handle_signals=False, sinks=[keep])  # fmt: skip
    with rec:
        counts = serve(rec, clock, minutes=0.5)
    size = sum(len(encode_part(r)) for r in keep.rows)
    assert counts["tokens"] > 100_000
    assert size / counts["tokens"] <= 4.0, size / counts["tokens"]


# -- hostile bytes: every damage is one LogError naming the field, nothing else ---------


def test_every_truncation_of_a_part_is_a_log_error():
    data = encode_part(_flush(np.random.default_rng(1), 40))
    for cut in range(0, len(data), max(1, len(data) // 400)):
        with pytest.raises(LogError):
            decode_part(data[:cut], "p")


def test_a_flipped_byte_anywhere_is_a_log_error_or_the_same_flush():
    """A CRC covers the header and each blob: a flipped byte is named, never decoded into
    other values."""
    a = _flush(np.random.default_rng(2), 40)
    data = encode_part(a)
    for i in range(0, len(data), 7):
        bad = bytearray(data)
        bad[i] ^= 0x55
        with pytest.raises(LogError):
            decode_part(bytes(bad), "p")


def _rebuilt(data: bytes, edit) -> bytes:
    """`data` with its header edited by `edit(header)` (the header's CRC made right)."""
    _, n, _ = struct.unpack_from("<8sII", data)
    header = json.loads(data[16 : 16 + n])
    edit(header)
    raw = json.dumps(header).encode()
    return struct.pack("<8sII", MAGIC, len(raw), zlib.crc32(raw)) + raw + data[16 + n :]


def test_claimed_sizes_beyond_the_file_are_refused_before_anything_is_inflated():
    data = encode_part(_flush(np.random.default_rng(3), 40))

    def huge(h):  # a column claiming 2**40 rows: checked against the file, not allocated
        e = next(e for e in h["arrays"] if e["codec"] == "zlib")
        e["rows"] = 2**40
        e["raw_bytes"] = 2**40 * np.dtype(e["stored"]).itemsize

    with pytest.raises(InflateLimitError, match="would inflate beyond"):
        decode_part(_rebuilt(data, huge), "p")

    def lie(h):  # fewer rows than the blob inflates to: it stops at the claim, then refuses
        e = next(e for e in h["arrays"] if e["codec"] == "zlib" and e["rows"] > 2)
        e["rows"] -= 1
        e["raw_bytes"] -= np.dtype(e["stored"]).itemsize

    with pytest.raises(LogError, match="inflates to other than"):
        decode_part(_rebuilt(data, lie), "p")


@pytest.mark.parametrize(
    "edit, field",
    [
        (lambda h: h["arrays"][0].update(dtype="object"), "steps.t0_tick"),
        (lambda h: h["arrays"][0].update(codec="pickle"), "steps.t0_tick"),
        (lambda h: h["arrays"][0].pop("crc32"), "steps.t0_tick: crc32"),
        (lambda h: h["arrays"][0].update(column=99), "steps"),
        (lambda h: h["arrays"].append(dict(h["arrays"][0])), "file"),
        (lambda h: h["values"].update(config={"a": 1}), "config"),
        (lambda h: h["values"].update(flush_tick=2**70), "flush_tick"),
        (lambda h: h.update(arrays="x"), "header"),
    ],
    ids=["dtype", "codec", "no crc", "column", "twice", "value type", "int64", "arrays"],
)
def test_a_bad_header_names_its_field(edit, field):
    data = encode_part(_flush(np.random.default_rng(4), 10))
    with pytest.raises(LogError) as e:
        decode_part(_rebuilt(data, edit), "p")
    assert e.value.field.startswith(field), (e.value.field, str(e.value))
    assert "\n" not in str(e.value)


def test_another_format_is_named_with_what_to_do():
    data = bytearray(encode_part(_flush(np.random.default_rng(5), 3)))
    data[7] = 9
    with pytest.raises(LogError, match="part format 9; this tracekit reads 1"):
        decode_part(bytes(data), "p")
    with pytest.raises(LogError, match="not a tracekit part"):
        decode_part(b"PK\x03\x04" + bytes(40), "p")


# -- the recorder's folder: stop merges nothing, OUT names the folder -------------------


class Clock:
    """+1 us a reading by the thread that made it; the recorder's writer thread (an idle
    flush, whenever the machine runs it) reads it without moving it, so two recorders
    given one script see the same ticks however busy the machine is."""

    def __init__(self) -> None:
        self.t = 10**12
        self.owner = threading.get_ident()

    def __call__(self) -> int:
        if threading.get_ident() == self.owner:
            self.t += 1000
        return self.t


def _run(rec: tracekit.Recorder) -> None:
    with rec:
        for i in range(50):
            rec.request(f"r{i}", prompt_tokens=i)
            with rec.step():
                with rec.segment("decode"):
                    pass
                rec.emit([f"r{j}" for j in range(max(0, i - 5), i + 1)])
                if i == 20:
                    rec.evict("r18", mode="recompute")
                if i == 30:
                    rec.readmit("r18")
        rec.attach("trace", np.arange(5.0))


def test_the_folder_reads_back_as_the_run_kept_in_memory(tmp_path, monkeypatch):
    """The same run (a deterministic clock) recorded to disk and to memory: the folder, read
    through OUT, is the in-memory run, table for table. stop() reads no part back (it
    merges nothing: a read would be the cost that grows with the run)."""
    import tracekit.log.parts as parts

    mem = tracekit.Recorder(None, clock=Clock(), gc=False, handle_signals=False,
                            flush_interval_s=2e-6)  # fmt: skip
    _run(mem)
    out = tmp_path / "run.npz"
    disk = tracekit.Recorder(out, clock=Clock(), gc=False, handle_signals=False,
                             flush_interval_s=2e-6)  # fmt: skip

    def no_read(*a, **k):
        raise AssertionError("stop() read a part back")

    monkeypatch.setattr(parts, "read_part", no_read)
    monkeypatch.setattr(parts, "merge_parts", no_read)
    assert _run(disk) is None
    monkeypatch.undo()
    folder = tmp_path / "run.npz.parts"
    assert (folder / FINAL_NAME).exists() and not (folder / "lock").exists()
    assert len(list(folder.glob("part-*.tkp"))) > 5  # many flushes: the merge is exercised
    a, b = mem.log(), tracekit.load(out)
    for table in ("steps", "segments", "emissions", "evictions", "requests", "gc_pauses"):
        for col, x in getattr(a, table).columns().items():
            np.testing.assert_array_equal(getattr(getattr(b, table), col), x, err_msg=col)
    assert a.request_ids == b.request_ids and a.config == b.config and a.wall_s == b.wall_s
    np.testing.assert_array_equal(b.extras["trace"], np.arange(5.0))
    assert b.coverage.is_clean_stop.tolist() == [1] and b.meta["interrupted"] is False
    assert disk.log().request_ids == a.request_ids  # log(): read back when asked
    # the folder alone is the same run
    assert tracekit.load(folder).request_ids == a.request_ids
    # one file to share: the same run again
    one = tmp_path / "one.npz"
    r = _cli("merge", str(out), "-o", str(one))
    assert r.returncode == 0, r.stderr
    assert tracekit.load(one).request_ids == a.request_ids and folder.exists()
    entries, bad = read_index(str(folder))
    assert [e.number for e in entries] == list(range(1, len(entries) + 1)) and not bad
    assert sum(e.num_emissions for e in entries) == len(a.emissions)


def test_recording_twice_to_one_path_keeps_the_second_run(tmp_path):
    out = tmp_path / "run.npz"
    for n in (3, 5):
        rec = tracekit.Recorder(out, gc=False, handle_signals=False)
        with rec:
            for _ in range(n):
                with rec.step():
                    rec.emit(["a"])
        assert len(tracekit.load(out).steps) == n


@pytest.mark.parametrize(
    "name, problem",
    [("../elsewhere.parts", "not a folder beside it"), ("/etc", "not a folder beside it"),
     ("gone.parts", "missing or not a run's parts folder"), ("", "not a folder beside it")],
)  # fmt: skip
def test_a_pointer_names_only_a_run_folder_beside_it(tmp_path, name, problem):
    p = tmp_path / "run.npz"
    np.savez(p, **{POINTER_MEMBER: np.array(json.dumps({"parts": name}))})
    with pytest.raises(LogError, match=problem) as e:
        tracekit.load(p)
    assert str(p) in str(e.value)


def test_a_torn_index_line_is_named_and_the_parts_still_read(tmp_path):
    out = tmp_path / "run.npz"
    rec = tracekit.Recorder(out, gc=False, handle_signals=False, flush_interval_s=0.0)
    with rec:
        for _ in range(4):
            with rec.step():
                rec.emit(["a"])
    folder = tmp_path / "run.npz.parts"
    with open(folder / INDEX_NAME, "ab") as fh:
        fh.write(b"5 100 7")  # a power loss cut the line short
    entries, bad = read_index(str(folder))
    assert len(entries) >= 1 and bad == [
        f"{INDEX_NAME} line {len(entries) + 1} is torn or corrupt (ignored)"
    ]
    log = merge_parts(str(folder))
    assert len(log.steps) == 4
    assert any(f"{INDEX_NAME} line" in w and "torn" in w for w in log.warnings), log.warnings
    # the last part's name lost (a power loss): the index still lists it, and says so
    last = sorted(folder.glob("part-*.tkp"))[-1]
    last.unlink()
    log = merge_parts(str(folder))
    assert len(log.steps) < 4
    assert any("after the last one on disk" in w for w in log.warnings), log.warnings


def _cli(*args: str):
    import subprocess

    return subprocess.run([sys.executable, "-m", "tracekit", *args], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO)})  # fmt: skip


# -- retention: the oldest parts removed while the run records ---------------------------


def _long_run(rec: tracekit.Recorder, n: int = 120) -> None:
    """Requests that live ~10 steps each, two emitting per step, one prompt chunk a step."""
    with rec:
        for i in range(n):
            rec.request(f"r{i}", prompt_tokens=3)
            with rec.step():
                rec.admit(f"r{i}")
                rec.prefill(f"r{i}", 3)
                with rec.segment("decode"):
                    pass
                rec.emit([f"r{j}" for j in range(max(0, i - 9), i + 1)])


def test_retention_keeps_the_last_parts_and_they_read_as_the_end_of_the_run(tmp_path):
    """retain_s: the parts whose flush is older than retain_s before the newest are removed
    as the run records; the folder then reads as the end of the same run (the same clock,
    recorded in memory), steps renumbered from the first part left, the requests named only
    in removed parts '(removed N)' with unknown arrivals, covered from the removed part's
    flush (docs/design.md, "The run's log on disk")."""
    # Clock: +1 us a reading; a step reads it ~6 times, a flush every 2 us: ~a part a step
    mem = tracekit.Recorder(None, clock=Clock(), gc=False, handle_signals=False,
                            flush_interval_s=2e-6)  # fmt: skip
    _long_run(mem)
    out = tmp_path / "run.npz"
    disk = tracekit.Recorder(out, clock=Clock(), gc=False, handle_signals=False,
                             flush_interval_s=2e-6, retain_s=100e-6)  # fmt: skip
    _long_run(disk)
    folder = tmp_path / "run.npz.parts"
    numbers = sorted(int(p.name[5:11]) for p in folder.glob("part-*.tkp"))
    assert numbers[0] > 10 and numbers == list(range(numbers[0], numbers[-1] + 1))
    a, b = mem.log(), tracekit.load(out)
    first = len(a.steps) - len(b.steps)
    assert 0 < first < len(a.steps)
    np.testing.assert_array_equal(b.steps.t_start_s, a.steps.t_start_s[first:])
    np.testing.assert_array_equal(
        b.segments.step, a.segments.step[a.segments.step >= first] - first
    )
    kept = a.emissions.step >= first
    np.testing.assert_array_equal(b.emissions.step, a.emissions.step[kept] - first)
    np.testing.assert_array_equal(b.emissions.t_s, a.emissions.t_s[kept])
    # the requests: those named before the first part left are '(removed N)'; the rest as-is
    n_removed = sum(r.startswith("(removed ") for r in b.request_ids)
    assert b.request_ids[:n_removed] == tuple(f"(removed {i})" for i in range(n_removed))
    assert b.request_ids[n_removed:] == a.request_ids[n_removed : len(b.request_ids)]
    assert np.isnan(b.requests.arrival_s[:n_removed]).all()
    np.testing.assert_array_equal(b.requests.arrival_s[n_removed:],
                                  a.requests.arrival_s[n_removed : len(b.request_ids)])  # fmt: skip
    # covered from the removed part before the first left (its flush, from the index)
    entries, _ = read_index(str(folder))
    before = next(e.flush_tick for e in entries if e.number == numbers[0] - 1)
    t0_tick = json.loads((folder / "meta.json").read_text())["t0_tick"]
    assert b.coverage.t_start_s[0] == pytest.approx((before - t0_tick) * 1e-9)
    assert any("parts 1.." in w and "retention" in w for w in b.warnings), b.warnings
    # every gap read is a gap of the whole run: same request, same two emissions
    from tracekit.attribution.itl import partition

    pa, pb = partition(a), partition(b)
    names_a = {(a.request_ids[r], t0, t1) for r, t0, t1 in zip(pa.request, pa.t0_s, pa.t1_s)}
    names_b = {(b.request_ids[r], t0, t1) for r, t0, t1 in zip(pb.request, pb.t0_s, pb.t1_s)}
    assert len(pb) > 50 and pb.reconcile_max_err_ms < 1e-9
    assert {x for x in names_b if not x[0].startswith("(removed")} <= names_a


def test_a_reader_racing_retention_starts_again_at_the_oldest_part_left(tmp_path, monkeypatch):
    import tracekit.log.parts as parts

    out = tmp_path / "run.npz"
    rec = tracekit.Recorder(out, clock=Clock(), gc=False, handle_signals=False,
                            flush_interval_s=2e-6)  # fmt: skip
    _long_run(rec, 20)
    folder = tmp_path / "run.npz.parts"
    (folder / "part-000001.tkp").unlink()  # retention already went this far
    real = parts.read_part
    gone: list[str] = []

    def read_part(path, **kw):  # retention removes the head while the reader reads it
        if not gone:
            gone.append(path)
            os.unlink(path)
            raise FileNotFoundError(path)
        return real(path, **kw)

    monkeypatch.setattr(parts, "read_part", read_part)
    log = parts.merge_parts(str(folder))
    assert gone == [str(folder / "part-000002.tkp")]
    assert any("parts 1..2 were removed" in w for w in log.warnings), log.warnings
    assert len(log.steps) > 0


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), float("inf"), True, "60"])
def test_retain_s_must_be_a_positive_number_of_seconds(tmp_path, bad):
    with pytest.raises(ValueError, match="retain_s"):
        tracekit.Recorder(tmp_path / "r.npz", retain_s=bad)
    with pytest.raises(ValueError, match="on disk only"):
        tracekit.Recorder(None, retain_s=60)


def test_a_stopped_run_reached_through_a_symlink_is_never_emptied(tmp_path):
    """A new recorder on a path replaces a cleanly stopped run there, but never a folder it
    reaches through a symbolic link (it could be anything)."""
    elsewhere = tmp_path / "precious"
    rec = tracekit.Recorder(elsewhere / "run.npz", gc=False, handle_signals=False)
    with rec:
        with rec.step():
            rec.emit(["a"])
    (tmp_path / "run.npz.parts").symlink_to(elsewhere / "run.npz.parts")
    again = tracekit.Recorder(tmp_path / "run.npz", gc=False, handle_signals=False)
    with pytest.raises(tracekit.capture.sinks.CaptureError, match="symbolic link"):
        again.start()
    assert len(tracekit.load(elsewhere / "run.npz").steps) == 1


def test_a_huge_or_garbled_index_costs_its_bytes_and_says_so_once(tmp_path):
    """The index is read line by line, each line bounded, keeping only the entries a reader
    needs: a 20 MB index of garbage and of valid lines for parts that are not there reads
    with a few warnings, not one per line."""
    out = tmp_path / "run.npz"
    rec = tracekit.Recorder(out, gc=False, handle_signals=False, flush_interval_s=0.0)
    with rec:
        for _ in range(3):
            with rec.step():
                rec.emit(["a"])
    folder = tmp_path / "run.npz.parts"
    with open(folder / INDEX_NAME, "ab") as fh:
        fh.write(b"x" * 10_000_000)  # one endless line
        fh.write(b"\n" + b"1 2 3 - 4 deadbeef\n" * 500_000)  # bad CRCs
    log = merge_parts(str(folder))
    assert len(log.steps) == 3
    torn = [w for w in log.warnings if w.startswith(INDEX_NAME)]
    # lines are read 256 bytes at most: the endless line is 39,062 full pieces and one of
    # 128 x's and its newline (39,063 bad "lines"), then the 500,000 bad CRCs; the first 5
    # are named, the rest counted in one line
    bad = 39_063 + 500_000
    assert len(torn) == 6, torn
    assert torn[-1] == f"{INDEX_NAME}: {bad - 5} more torn or corrupt line(s)", torn[-1]


def test_a_run_killed_before_its_pointer_was_written_opens_by_its_name(tmp_path):
    """`OUT` is written last at stop, and a killed process never writes it: asking for
    `OUT` reads `OUT.parts/` (interrupted, or stopped if final.json made it)."""
    out = tmp_path / "engine_core-7.npz"
    rec = tracekit.Recorder(out, gc=False, handle_signals=False, flush_interval_s=0.0)
    with rec:
        for _ in range(3):
            with rec.step():
                rec.emit(["a"])
    out.unlink()  # the kill came between final.json and OUT
    log = tracekit.load(out)
    assert len(log.steps) == 3 and log.meta["interrupted"] is False
    # killed earlier, after the stop's last flush but before final.json: the rows are
    # whole (the last part carries the stop tick), but the stop did not write the log
    (tmp_path / "engine_core-7.npz.parts" / FINAL_NAME).unlink()
    log = tracekit.load(out)
    assert len(log.steps) == 3 and log.coverage.is_clean_stop.tolist() == [0]
    with pytest.raises(LogError, match="does not exist"):
        tracekit.load(tmp_path / "other.npz")
