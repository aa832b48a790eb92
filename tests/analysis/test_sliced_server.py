"""`analyze DIR` of a server run longer than one slice (docs/reports.md, "Reading a long run
in slices"): merged chunk by chunk into a temporary parts folder and read in slices, with
the whole merged run's figures, its client boundary's included; the commands that cannot
read it in slices refuse it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest
from test_merge_parts import record_server

from tracekit.analysis import stream_client
from tracekit.analysis.figures import analyze
from tracekit.analysis.run import merge_run
from tracekit.analysis.stream_server import analyze_server_path
from tracekit.log.flush import TABLES
from tracekit.log.merged_tables import MERGED_TABLES
from tracekit.log.slices import SlicedRun


def _sliced(d, tmp_path, monkeypatch, budget: int):
    monkeypatch.setenv("TRACEKIT_SLICE_EMISSIONS", str(budget))
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir(exist_ok=True)
    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR read again
    sliced = analyze_server_path(str(d))
    assert os.listdir(tmp_path / "tmp") == []  # the temporary merge is removed
    return sliced.to_dict()


@pytest.mark.parametrize(
    "kw",
    [
        # requests only the API server saw (chunks with no engine emission), two requests
        # whose chunks lie in two parts
        {"fe_only": (3, 40), "core_cut_mid": (12, 31)},
        # the engine core killed: client-gap time unrecorded after its last part
        {"kill_core_at": 40},
        # chunks recorded a part before the emission they carry (clocks that disagree)
        {"chunk_first": (7, 22, 23)},
        # chunks of 1 to 3 tokens (speculative decoding): the per-token ITL weighted
        {"multi_token": True},
    ],
    ids=["clean", "core-killed", "chunk-first", "multi-token"],
)
def test_analyze_of_a_long_server_run_reads_it_in_slices_with_the_whole_runs_figures(
    tmp_path, monkeypatch, kw
):
    """`analyze DIR` of a server run longer than one slice: merged into a temporary parts
    folder and read in slices, the figures of the whole merged run, figure for figure, the
    client boundary's (gaps between chunks, client TTFTs, unrecorded processes) included
    and no warning of its own; a command that cannot read it in slices refuses it in one
    line, naming the merge that can."""
    d = tmp_path / "srv"
    d.mkdir()
    record_server(d, n=60, core_every=5, fe_every=7, **kw)
    killed = "kill_core_at" in kw
    for budget in (3, 25):  # a slice a part; several parts a slice
        whole = analyze(merge_run(str(d))).to_dict()
        assert whole["client"]["chunks"] == 2 * (60 - len(kw.get("fe_only", ())))
        got = _sliced(d, tmp_path, monkeypatch, budget)
        if killed:  # the unrecorded processes' lines, each once, as the whole run says them
            lines = [u["line"] for u in whole["client"]["unrecorded"]]
            assert lines and whole["client"]["all_share"]["unrecorded:engine_core"] > 0
            assert set(whole["warnings"]) >= set(lines)
        assert_same(whole, got)
        w, g = whole["client"], got["client"]
        for key in ("per_chunk", "per_token", "per_engine_step"):  # counts, percentiles
            for k in ("p50", "p90", "p99", "n"):
                assert w["itl_ms"][key][k] == g["itl_ms"][key][k], (key, k)
        for k in ("gaps", "chunks", "p99_ms", "ttft_p50_ms", "ttft_p99_ms",
                  "ttft_engine_p50_ms", "ttft_engine_p99_ms"):  # fmt: skip
            assert w[k] == g[k], k
    if "fe_only" not in kw:
        return
    r = subprocess.run([sys.executable, "-m", "tracekit", "gaps", str(d)], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--parts" in r.stderr and "116 engine emissions" in r.stderr


@pytest.mark.parametrize("cmd", ["gaps", "ttft"])
def test_the_client_boundary_of_a_whole_long_run_is_refused_above_the_one_file_limit(
    tmp_path, cmd
):
    """`gaps`/`ttft --boundary client` read the whole run: above TRACEKIT_ONE_FILE_EMISSIONS
    (here 50, of a merged run of 60 requests of 2 emissions each) refused in one line
    (exit 2), naming what reads it in bounded memory; a window of it is still listed, as
    the whole run's records ending in it."""
    d = tmp_path / "srv"
    d.mkdir()
    record_server(d, n=60, core_every=5, fe_every=7)
    out = str(tmp_path / "m.npz")
    env = {**os.environ, "TRACEKIT_SLICE_EMISSIONS": "3"}

    def run(*args, **more):
        return subprocess.run([sys.executable, "-m", "tracekit", *args], capture_output=True,
                              text=True, timeout=120, env={**env, **more})  # fmt: skip

    assert run("merge", str(d), "-o", out, "--parts").returncode == 0
    refused = run(cmd, out, "--boundary", "client", TRACEKIT_ONE_FILE_EMISSIONS="50")
    err = refused.stderr.strip()
    assert refused.returncode == 2 and len(err.splitlines()) == 1, refused.stderr
    assert "120 emissions" in err and "--window" in err and f"tracekit analyze {out}" in err
    window = ("--boundary", "client", "--window", "0..0.2", "--format", "jsonl")
    some = run(cmd, out, *window, TRACEKIT_ONE_FILE_EMISSIONS="50")
    whole = run(cmd, out, *window, TRACEKIT_SLICE_EMISSIONS="100000000")
    assert some.returncode == 0 and some.stdout.strip() and some.stdout == whole.stdout


def test_a_client_gap_across_a_slice_edge_by_hand(tmp_path, monkeypatch):
    """Four requests, each with its two chunks in two parts of the engine core, read a part
    a slice: every client gap spans a slice's edge. By the fixture's times (a step of 3 ms:
    a 1.5 ms decode window, the token at 2.0 ms, its outputs at the API server at 2.3 ms,
    the chunk written in an sse_write window from 2.3 to 2.4 ms) each gap is 3.0 ms: from
    the first chunk (2.4 ms) to the second token (5.0 ms) the engine part, 0.6 ms between
    the steps and 0.5 ms of the step after its decode window (`residual`, 1.1 ms) and its
    1.5 ms decode (`forward`); then the hop to the API server (0.3 ms) and the write
    (`sse_write`, 0.1 ms). A client TTFT is 3.4 ms (sent at 0; the first chunk at 1 + 2.4
    ms), the engine boundary's 3.0 ms (the first token at 1 + 2.0 ms)."""
    d = tmp_path / "srv"
    d.mkdir()
    record_server(d, n=4, core_every=1000, fe_every=1000, core_cut_mid=(0, 1, 2, 3))
    c = _sliced(d, tmp_path, monkeypatch, 1)["client"]
    assert c is not None, "the client figures are left out"
    assert (c["gaps"], c["chunks"]) == (4, 8)
    for k in ("p50", "p90", "p99", "mean"):
        assert c["itl_ms"]["per_chunk"][k] == pytest.approx(3.0, abs=1e-6)
    want = {"forward": 1.5, "residual": 1.1, "hop": 0.3, "sse_write": 0.1}
    for label, v in c["all_share"].items():
        assert v == pytest.approx(want.get(label, 0.0) / 3.0, abs=1e-6), label
    assert c["frontend_share"] == pytest.approx(0.4 / 3.0, abs=1e-6)
    assert c["ttft_p50_ms"] == pytest.approx(3.4, abs=1e-6)
    assert c["ttft_engine_p50_ms"] == pytest.approx(3.0, abs=1e-6)
    assert c["ttft_share"]["sse_write"] == pytest.approx(0.1 / 3.4, abs=1e-6)
    assert c["ttft_share"]["hop"] == pytest.approx(0.3 / 3.4, abs=1e-6)


def test_a_client_slice_holds_only_the_requests_its_parts_name(tmp_path, monkeypatch):
    """A client slice's log holds the requests its parts' rows name (engine rows, chunks,
    arrivals), numbered 0, 1, ... in the run's order, not every request named so far (a
    day's ~3 M columns a slice): here, a part a slice of 60 requests, each slice names
    fewer than the run, and its numbers are exactly those the parts' rows carry."""
    d = tmp_path / "srv"
    d.mkdir()
    record_server(d, n=60, core_every=5, fe_every=7)
    held = []
    real = stream_client.slice_log

    def spy(task):
        log, prep, numbers = real(task)
        run = SlicedRun(task.parts_dir)
        named = set()
        for i in range(task.c, task.d):
            for table, rows in run.read(i)["tables"].items():
                cols = {**TABLES, **MERGED_TABLES}.get(table, ())
                for j, col in enumerate(cols):
                    if col in ("request", "evictor") and len(rows):
                        named |= set(rows[:, j].astype(int).tolist())
        held.append((numbers.tolist(), sorted(named), len(log.request_ids)))
        return log, prep, numbers

    monkeypatch.setattr(stream_client, "slice_log", spy)
    got = _sliced(d, tmp_path, monkeypatch, 3)
    assert got["client"]["chunks"] == 120 and len(held) > 2
    for numbers, named, n_ids in held:
        assert numbers == named and n_ids == len(numbers) < 60


def assert_same(whole, sliced, path=""):
    """Analysis records equal: floats to float rounding (sums add in another order in
    slices, docs/reports.md), anything else exactly."""
    if isinstance(whole, dict):
        assert list(whole) == list(sliced), path
        for k in whole:
            assert_same(whole[k], sliced[k], f"{path}.{k}")
    elif isinstance(whole, list):
        assert len(whole) == len(sliced), path
        for i, (a, b) in enumerate(zip(whole, sliced, strict=True)):
            assert_same(a, b, f"{path}[{i}]")
    elif isinstance(whole, float) and isinstance(sliced, float):
        assert whole == sliced or abs(whole - sliced) <= 1e-9 * max(1.0, abs(whole)), path
    else:
        assert whole == sliced, path
