"""A server's run merged chunk by chunk into a parts folder (`tracekit.log.merge_stream`):
read whole, it is the one-file merge's run, table by table; rows land in the part whose
time range holds them (docs/adapters.md, "Merging a long server run")."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
import tracemalloc
from dataclasses import replace

import numpy as np
import pytest

import tracekit
from tracekit.analysis.run import merge_run, open_run
from tracekit.analysis.server_parts import save_merged_parts
from tracekit.errors import LogError
from tracekit.formats import json_safe
from tracekit.log import merge_stream
from tracekit.log.merge_stream import OsCarry
from tracekit.log.merged_tables import MERGED_TABLES
from tracekit.log.osintervals import side_thread_intervals
from tracekit.log.partfile import read_part_file
from tracekit.log.parts import part_paths
from tracekit.log.rawlog import (
    OS_SEGMENT_END,
    OS_SEGMENT_START,
    TABLES,
    Counters,
    OsSamples,
    RawLog,
    Requests,
    Segments,
    Steps,
)

SEP = "\x1f"
SHARED = "clock_gettime(CLOCK_MONOTONIC)"
FIELDS = ("labels", "request_ids", "counter_names", "cause_map", "config", "wall_s", "warnings")


class Clock:
    def __init__(self) -> None:
        self.true_s = 0.0

    def __call__(self) -> int:
        return round((100.0 + self.true_s) * 1e9)


def _rec(path, clock, role, pid, **ident):
    config = {"process": {"role": role, "pid": pid, "host": "h", "name": role,
                          "boot_id": "b", "clock": SHARED, **ident}}  # fmt: skip
    rec = tracekit.Recorder(str(path), clock=clock, gc=False, handle_signals=False,
                            flush_interval_s=1e9, config=config)  # fmt: skip
    rec.start()
    return rec


def _cut(rec, path) -> None:
    """A part now: asked, and waited for (the writer would join two flushes into one)."""
    folder = str(path) + ".parts"
    n = len(part_paths(folder))
    rec.flush_soon()
    deadline = time.monotonic() + 60.0
    while len(part_paths(folder)) < n + 1:
        assert time.monotonic() < deadline, f"no part {n + 1} in 60 s"
        time.sleep(0.005)


def record_server(d, *, n=40, core_every=6, fe_every=4, kill_core_at=None, dp_rank=None,
                  fe_only=(), seed=1, core_cut_mid=(), chunk_first=(),
                  multi_token=False):  # fmt: skip
    """An engine core and an API server on one clock: request i is sent, added 0.2 ms
    later, emits two tokens (a step each, 3 ms apart); each step's outputs reach the API
    server 0.3 ms after they are built and are written as a chunk inside an ``sse_write``
    window of 0.1 ms. The core flushes a part every `core_every` requests, the API server
    every `fe_every` (at other times). `kill_core_at=i`: the core's last flush is at
    request i, then it is killed. `fe_only`: requests the core never sees. `core_cut_mid`:
    requests whose second step the core begins with a new part (the request's two chunks
    then lie in two parts). `chunk_first`: requests whose second chunk the API server
    writes 0.5 ms before the core's second step begins, which begins a new part (the chunk
    recorded a part before the emission it carries: clocks that disagree). `multi_token`:
    step k of request i emits 1 + (i + k) % 3 tokens (speculative decoding: 2 drafted,
    all but one accepted), its chunk carries them all."""
    rng = np.random.default_rng(seed)
    clk = Clock()
    ident = {} if dp_rank is None else {"dp_rank": dp_rank}
    core = _rec(d / "engine_core-1.npz", clk, "engine_core", 1, **ident)
    fe = _rec(d / "api_server-2.npz", clk, "api_server", 2)
    t = 0.01
    for i in range(n):
        eid = f"cmpl-{i}-0-abcd{i:04d}"
        clk.true_s = t
        if i and i % core_every == 0 and (kill_core_at is None or i <= kill_core_at):
            _cut(core, d / "engine_core-1.npz")
        if i and i % fe_every == 0:
            clk.true_s = t + 1e-4
            _cut(fe, d / "api_server-2.npz")
        idx = fe.request(f"cmpl-{i}-0{SEP}{eid}")
        fe.counter("serve.sent", idx)
        if i in fe_only:
            t += 5e-3
            continue
        clk.true_s = t + 2e-4
        cidx = core.request(eid)
        core.counter("serve.added", cidx)
        t_step = t + 1e-3
        clk.true_s = t_step
        core.admit(eid)
        for k in range(2):
            clk.true_s = t_step
            if k and i in chunk_first:
                clk.true_s = t_step - 5e-4
                fe.emit([f"cmpl-{i}-0{SEP}{eid}"])
                clk.true_s = t_step - 2e-4
                _cut(core, d / "engine_core-1.npz")
                clk.true_s = t_step
            if k and i in core_cut_mid:
                _cut(core, d / "engine_core-1.npz")
            with core.step():
                core.add_segment("decode", clk(), clk() + 1_500_000)
                clk.true_s = t_step + 2e-3
                n_tok = 1 + (i + k) % 3 if multi_token else 1
                core.emit([eid], [n_tok])
                if multi_token:
                    core.counter("spec.drafted", 2.0)
                    core.counter("spec.accepted", float(n_tok - 1))
                core.counter("serve.out", 1000.0 + t_step)
            clk.true_s = t_step + 2.3e-3
            fe.counter("serve.recv", 1000.0 + t_step)
            with fe.segment("sse_write"):
                clk.true_s = t_step + 2.4e-3
            if not (k and i in chunk_first):
                fe.emit([f"cmpl-{i}-0{SEP}{eid}"], [1 + (i + k) % 3 if multi_token else 1])
            t_step += 3e-3
        t = t_step + rng.uniform(0, 2e-3)
    clk.true_s = t + 0.01
    fe.stop()
    if kill_core_at is not None:
        core._rows.dispatcher.close()  # every flushed row is in its part, as after a SIGKILL
        core._running = False
        tracekit.capture.recorder._ACTIVE.pop(core, None)
        tracekit.capture.signals.cancel_at_exit(core.stop)
    else:
        core.stop()
    return str(d)


def assert_same_log(a: RawLog, b: RawLog, tmp_path=None) -> None:
    """Two runs equal table by table, column by column (NaN equal to NaN); their names,
    vocabularies and meta (as JSON holds it: a non-finite float is null). A run read from
    disk says its warnings from its meta (`warnings_of`): `b`'s are compared with those of
    `a` written as one file and read back (`tracekit merge DIR -o RUN.npz`)."""
    for t in TABLES:
        x, y = getattr(a, t).columns(), getattr(b, t).columns()
        for c, v in x.items():
            assert v.dtype == y[c].dtype, (t, c)
            assert np.array_equal(v, y[c], equal_nan=True), (t, c, len(v), len(y[c]))
    for f in FIELDS:
        if f != "warnings":
            assert getattr(a, f) == getattr(b, f), f
    assert json_safe(a.meta) == json_safe(b.meta)
    one = tracekit.load(a.save(str(b.path) + ".one-file.npz"))
    assert one.warnings == b.warnings
    os.remove(str(b.path) + ".one-file.npz")


def _merged(d, tmp_path, name="run.npz", **kw):
    out = str(tmp_path / name)
    save_merged_parts(d, out, **kw)
    return out


def _part_tables(parts_dir, table):
    """Per merged part, its rows of `table` (columns by name)."""
    out = []
    for p in part_paths(parts_dir):
        z = read_part_file(p)
        cols = MERGED_TABLES[table]
        rows = z[table].reshape(-1, len(cols)) if table in z else np.zeros((0, len(cols)))
        out.append({c: rows[:, j] for j, c in enumerate(cols)})
    return out


def test_the_parts_folder_read_whole_is_the_one_file_merge(tmp_path):
    d = tmp_path / "srv"
    d.mkdir()
    record_server(d, fe_only=(5,))
    before = sorted(os.listdir(d))
    out = _merged(str(d), tmp_path)
    assert sorted(os.listdir(d)) == before  # nothing written into the processes' folders
    assert len(part_paths(out + ".parts")) == 7  # a part per core part: 40 requests, every 6
    whole, back = merge_run(str(d)), open_run(out)
    assert len(whole.client_emissions) == 78 and len(whole.proc_segments) == 78
    assert whole.request_ids[-1] == "cmpl-5-0"  # only the API server saw it: named last
    assert_same_log(whole, back)
    assert back.path == out


def test_rows_land_in_the_part_whose_time_range_holds_them(tmp_path):
    """Part k holds what happened in [flush of part k-1, flush of part k) on the core's
    clock: the core flushes as request 6 is sent (t6); that request's chunks are written
    after t6 + 1 ms, so they are in part 2, its predecessor's before t6 in part 1."""
    d = tmp_path / "srv"
    d.mkdir()
    record_server(d, n=12, core_every=6, fe_every=100)
    out = _merged(str(d), tmp_path)
    ce = _part_tables(out + ".parts", "client_emissions")
    assert [len(p["request"]) for p in ce] == [12, 12]
    assert set(ce[0]["request"].tolist()) == set(range(6))
    assert set(ce[1]["request"].tolist()) == set(range(6, 12))


def test_a_chunk_written_at_a_parts_flush_goes_to_the_next_part(tmp_path):
    """A chunk whose time on the core's clock is the core's flush exactly belongs to the
    part after the flush (ranges are closed at their start, open at their end)."""
    clk = Clock()
    d = tmp_path / "srv"
    d.mkdir()
    core = _rec(d / "engine_core-1.npz", clk, "engine_core", 1)
    fe = _rec(d / "api_server-2.npz", clk, "api_server", 2)
    for i, t in enumerate((0.01, 0.02, 0.03)):
        clk.true_s = t
        eid = f"e{i}"
        fe.counter("serve.sent", fe.request(f"c{i}{SEP}{eid}"))
        core.counter("serve.added", core.request(eid))
        with core.step():
            core.emit([eid])
        if i == 1:
            _cut(core, d / "engine_core-1.npz")  # at t = 0.02, as the chunk below is written
        fe.emit([f"c{i}{SEP}{eid}"])
    clk.true_s = 0.05
    fe.stop()
    core.stop()
    out = _merged(str(d), tmp_path)
    ce = _part_tables(out + ".parts", "client_emissions")
    assert [np.round(p["t_s"], 9).tolist() for p in ce] == [[0.01], [0.02, 0.03]]
    assert_same_log(merge_run(str(d)), open_run(out))


def test_a_killed_engine_core_is_read_in_place_and_kept(tmp_path):
    d = tmp_path / "srv"
    d.mkdir()
    record_server(d, kill_core_at=20)
    parts = os.path.join(d, "engine_core-1.npz.parts")
    listing = sorted(os.listdir(parts))
    out = _merged(str(d), tmp_path)
    assert sorted(os.listdir(parts)) == listing  # read in place, never removed
    whole, back = merge_run(str(d)), open_run(out)
    assert whole.meta["interrupted"] and back.meta["interrupted"]
    assert len(back.steps) == 36  # 18 requests flushed by request 18's flush, 2 steps each
    assert_same_log(whole, back)


def test_a_damaged_part_of_the_api_server_is_named_and_the_rest_read(tmp_path):
    d = tmp_path / "srv"
    d.mkdir()
    record_server(d)
    fe_parts = os.path.join(d, "api_server-2.npz.parts")
    third = part_paths(fe_parts)[2]
    with open(third, "r+b") as fh:
        fh.seek(40)
        fh.write(b"\xff" * 8)
    os.remove(os.path.join(d, "api_server-2.npz"))  # read as a killed process's parts
    out = _merged(str(d), tmp_path)
    back = open_run(out)
    # the API server's first two parts hold requests 0-7 (it cut a part at 4 and at 8)
    assert len(back.client_emissions) == 16
    assert any(w.startswith("api_server-2.npz.parts: part-000003.tkp is unreadable")
               for w in back.warnings)  # fmt: skip
    assert_same_log(merge_run(str(d)), back)


def test_an_engine_core_whose_first_parts_were_removed(tmp_path):
    """Retention removed the engine core's first parts: the run is read from its first
    part left (steps renumbered from it, the requests named only before it removed), both
    ways alike, deliveries naming the same steps."""
    d = tmp_path / "srv"
    d.mkdir()
    record_server(d)
    os.remove(part_paths(os.path.join(d, "engine_core-1.npz.parts"))[0])
    out = _merged(str(d), tmp_path)
    whole, back = merge_run(str(d)), open_run(out)
    # the removed part held requests 0-5 (the first cut is at request 6): their 12 outputs'
    # build stamps went with it, so 80 - 12 deliveries are paired, into the steps read
    assert back.request_ids[:6] == tuple(f"(removed {i})" for i in range(6))
    assert len(back.deliveries) == 68
    assert back.deliveries.step.min() == 0 and back.deliveries.step.max() == len(back.steps) - 1
    assert_same_log(whole, back)


def test_an_existing_output_is_refused_without_force(tmp_path):
    d = tmp_path / "srv"
    d.mkdir()
    record_server(d, n=8)
    out = _merged(str(d), tmp_path)
    with pytest.raises(LogError, match="already exists"):
        save_merged_parts(str(d), out)
    save_merged_parts(str(d), out, force=True)
    assert_same_log(merge_run(str(d)), open_run(out))


def test_one_engine_of_a_data_parallel_server(tmp_path):
    d = tmp_path / "srv"
    d.mkdir()
    record_server(d, n=10, dp_rank=0)
    clk = Clock()
    other = _rec(d / "engine_core-3.npz", clk, "engine_core", 3, dp_rank=1)
    clk.true_s = 0.5
    other.counter("serve.added", other.request("cmpl-x-0-ffff0000"))
    with other.step():
        other.emit(["cmpl-x-0-ffff0000"])
    other.stop()
    with pytest.raises(LogError, match="--engine"):
        save_merged_parts(str(d), str(tmp_path / "x.npz"))
    for rank in (0, 1):
        out = _merged(str(d), tmp_path, f"r{rank}.npz", engine=rank)
        assert_same_log(merge_run(str(d), engine=rank), open_run(out))


def test_os_intervals_continued_over_parts_are_the_whole_logs(tmp_path):
    """An event loop's OS samples cut into parts anywhere: the intervals and the nesting
    `OsCarry` hands each part are those of the whole log's (side_thread_intervals)."""
    rng = np.random.default_rng(3)
    n = 60
    kind = rng.choice([OS_SEGMENT_START, OS_SEGMENT_END], n)
    thread = rng.choice([0, 0, 0, 1], n)
    cpu = np.cumsum(rng.integers(0, 1000, n))
    cpu[rng.integers(0, n, 3)] = -1
    os_ = OsSamples.from_columns(
        thread=thread, kind=kind, t_s=np.arange(n) * 0.01, cpu_ns=cpu,
        runqueue_ns=np.cumsum(rng.integers(0, 500, n)), num_voluntary_switches=np.zeros(n),
        num_involuntary_switches=np.zeros(n), num_major_faults=np.zeros(n),
    )  # fmt: skip
    with tracekit.Recorder(str(tmp_path / "x.npz"), gc=False, handle_signals=False) as rec:
        rec.request("r")
    whole = replace(tracekit.load(str(tmp_path / "x.npz")), os_samples=os_)
    want, inside = side_thread_intervals(whole, 0)
    for cuts in ([0, n], [0, 7, 8, 30, n], list(range(0, n + 1, 5))):
        carry = OsCarry(0)
        got_t, got_in = [], []
        for a, b in zip(cuts, cuts[1:], strict=False):
            part = os_.columns()
            piece = OsSamples.from_columns(**{k: v[a:b] for k, v in part.items()})
            lg = carry.next(replace(whole, os_samples=piece))
            osi, ins = side_thread_intervals(lg, 0)
            got_t.append(osi.t0_s)
            got_in.append(ins)
        assert np.array_equal(np.concatenate(got_t), want.t0_s)
        assert np.array_equal(np.concatenate(got_in), inside)


def test_merge_cli_writes_a_parts_folder_with_parts(tmp_path):
    d = tmp_path / "srv"
    d.mkdir()
    record_server(d, n=8)
    out = str(tmp_path / "run.npz")
    cmd = [sys.executable, "-m", "tracekit", "merge", str(d), "-o", out, "--parts"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "api_server" in r.stdout and "one clock" in r.stdout
    assert os.path.isdir(out + ".parts") and os.path.isfile(out)
    assert_same_log(merge_run(str(d)), open_run(out))
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "already exists" in r.stderr
    r = subprocess.run([*cmd, "--force"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def record_tp_parts(d, n_steps=8, stall_steps=(1, 4, 5)):
    """An engine core and two tensor-parallel workers on one clock (tests/log/
    test_merge_tp.py's `record_tp`, times in ms): step k runs [10k, 10k+8], its forward
    window [10k+1, 10k+7]; rank 1 stalls in `stall_steps` and enters the collective 1.8 ms
    after rank 0. The core cuts a part after every second step (at 10k+9), and rank 1
    records a ``sample`` window [10k+8.5, 10k+9.5] across each cut."""
    clk = Clock()
    core = _rec(d / "engine_core-1.npz", clk, "engine_core", 1, dp_rank=0)
    w = [_rec(d / f"worker-{10 + r}.npz", clk, "worker", 10 + r, tp_rank=r, rank=r)
         for r in (0, 1)]  # fmt: skip

    def tick(t_ms):
        return round((100.0 + t_ms * 1e-3) * 1e9)

    clk.true_s = 0.5e-3
    core.request("r0")
    for k in range(n_steps):
        b = 10.0 * k + 1.0
        clk.true_s = (b - 1.0) * 1e-3
        with core.step():
            core.add_segment("decode", tick(b), tick(b + 6.0))
            clk.true_s = (b + 6.5) * 1e-3
            core.emit(["r0"])
        for r, rec in enumerate(w):
            rec.add_segment("forward", tick(b + 0.2), tick(b + 5.8))
            enter = b + 1.0 + (0.1 if r else 0.0)
            if r == 1 and k in stall_steps:
                rec.add_segment("injected", tick(b + 0.5), tick(b + 2.5))
                enter = b + 2.9
            rec.add_segment("collective", tick(enter), tick(b + 3.0))
        if k % 2 == 1:
            w[1].add_segment("sample", tick(b + 7.5), tick(b + 8.5))
            clk.true_s = (b + 8.0) * 1e-3
            _cut(core, d / "engine_core-1.npz")
    clk.true_s = (10.0 * n_steps + 1) * 1e-3
    for rec in (core, *w):
        rec.stop()
    return str(d)


def test_a_tensor_parallel_run_carved_part_by_part_is_the_whole_merges(tmp_path):
    d = tmp_path / "srv"
    d.mkdir()
    record_tp_parts(d)
    out = _merged(str(d), tmp_path)
    assert len(part_paths(out + ".parts")) == 5
    whole, back = merge_run(str(d)), open_run(out)
    assert whole.meta["tensor_parallel"]["waits"] > 0
    assert any(x.startswith("rank1:") for x in back.labels)
    spans = [p for p in _part_tables(out + ".parts", "proc_segments")]
    sample = back.labels.index("sample")
    # each `sample` window starts before its cut: it is in the part that ends there
    assert [int((p["label"] == sample).sum()) for p in spans] == [1, 1, 1, 1, 0]
    assert_same_log(whole, back)


def test_a_merged_run_the_check_rejects_is_never_written(tmp_path):
    """The written folder is checked before it is moved into place: refused, nothing is
    left under the name or beside it (the temporary folder removed)."""
    from tracekit.log.merge_stream import merge_to_parts

    d = tmp_path / "srv"
    d.mkdir()
    record_server(d, n=8)
    out = tmp_path / "out" / "run.npz"
    out.parent.mkdir()

    def reject(parts_dir):
        assert os.path.isfile(os.path.join(parts_dir, "final.json"))  # written whole
        raise LogError(parts_dir, "client_emissions.request", "out of range")

    with pytest.raises(LogError, match="out of range"):
        merge_to_parts(str(d), str(out), verify=reject)
    assert os.listdir(out.parent) == []


def test_a_one_file_merge_of_a_server_too_long_for_one_file_is_refused(tmp_path, monkeypatch):
    """`merge DIR -o FILE.npz` holds every process's rows at once: above
    TRACEKIT_ONE_FILE_EMISSIONS (here 10, the core's 16 emissions over it) it is refused in
    one line naming `--parts`, and nothing is written; `--parts` merges it. `--parts` given
    a one-process run is refused (it is already a run's parts), not ignored."""
    from click.testing import CliRunner

    from tracekit.cli import main

    d = tmp_path / "srv"
    d.mkdir()
    record_server(d, n=8)
    monkeypatch.setenv("TRACEKIT_ONE_FILE_EMISSIONS", "10")
    runner = CliRunner()
    out = str(tmp_path / "run.npz")
    r = runner.invoke(main, ["merge", str(d), "-o", out])
    assert r.exit_code == 2 and "--parts" in r.output and "TRACEKIT_ONE_FILE_EMISSIONS" in r.output
    assert len(r.output.strip().splitlines()) == 1 and not os.path.exists(out)
    r = runner.invoke(main, ["merge", str(d), "-o", out, "--parts"])
    assert r.exit_code == 0, r.output
    one = tmp_path / "one"
    one.mkdir()
    r = runner.invoke(main, ["merge", out, "-o", str(one / "x.npz"), "--parts"])
    assert r.exit_code == 2 and "--parts" in r.output and os.listdir(one) == []


def test_what_the_merge_holds_while_it_writes_is_per_request_its_name_stages_and_index(
    tmp_path, monkeypatch
):
    """docs/adapters.md, "Merging a long server run": once planned, the merge holds per
    request only its name in the run, its stages and its index in the API server's
    requests; per step, the rows the deliveries and the tensor-parallel rule read again
    (the step, its forward window, its ``serve.out`` key and time, its forward window's
    ends, the ``serve.recv`` stamp). No process's request ids, request rows or first
    emissions, no engine id dictionary. Measured with tracemalloc when the writing begins,
    on two runs (50 and 400 requests, two steps each): the growth per request."""
    held: list[int] = []

    class Measured(merge_stream.Spool):  # the spool is made as the writing begins
        def __init__(self, *a, **k):
            gc.collect()
            held.append(tracemalloc.get_traced_memory()[0] - base)
            super().__init__(*a, **k)

    monkeypatch.setattr(merge_stream, "Spool", Measured)
    least: list[int] = []
    for n in (50, 400):
        d = tmp_path / f"srv{n}"
        d.mkdir()
        record_server(d, n=n, core_every=50, fe_every=50)
        # the least of three merges: tracemalloc also counts what other threads allocate
        # meanwhile (a thread an earlier test left finishing), never less than the merge's
        for k in range(3):
            gc.collect()
            tracemalloc.start()
            try:
                base = tracemalloc.get_traced_memory()[0]
                merge_stream.merge_to_parts(str(d), str(tmp_path / f"run{n}-{k}.npz"))
            finally:
                tracemalloc.stop()
        least.append(min(held[-3:]))
    name = 64 + 8  # "cmpl-399-0": a str of 49 + 10 bytes (pymalloc: 64), its list slot
    per_request = name + 8 * len(Requests.DTYPES) + 8
    per_step = 8 * (len(Steps.DTYPES) + len(Segments.DTYPES) + len(Counters.DTYPES) + 4)
    grown = (least[1] - least[0]) / (400 - 50)
    assert grown <= per_request + 2 * per_step, (grown, per_request, per_step)
