"""`analyze DIR` of a server run longer than one slice (docs/reports.md, "Reading a long run
in slices"): merged chunk by chunk into a temporary parts folder and read in slices, with
the whole merged run's figures; the commands that cannot read it in slices refuse it."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

from test_merge_parts import record_server

from tracekit.analysis.figures import analyze
from tracekit.analysis.run import merge_run
from tracekit.analysis.stream_server import CLIENT_NOT_SLICED, analyze_server_path


def test_analyze_of_a_long_server_run_reads_it_in_slices_with_the_whole_runs_figures(
    tmp_path, monkeypatch
):
    """`analyze DIR` of a server run longer than one slice: merged into a temporary parts
    folder and read in slices, the figures of the whole merged run; a command that cannot
    read it in slices refuses it in one line, naming the merge that can."""
    d = tmp_path / "srv"
    d.mkdir()
    record_server(d, n=60, core_every=5, fe_every=7)
    whole = analyze(merge_run(str(d))).to_dict()
    monkeypatch.setenv("TRACEKIT_SLICE_EMISSIONS", "25")
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", None)  # TMPDIR read again
    sliced = analyze_server_path(str(d))
    assert os.listdir(tmp_path / "tmp") == []  # the temporary merge is removed
    got = sliced.to_dict()
    assert got.pop("client") is None and whole.pop("client")["chunks"] == 120
    assert got.pop("warnings") == [*whole.pop("warnings"), CLIENT_NOT_SLICED]
    assert_same(whole, got)
    r = subprocess.run([sys.executable, "-m", "tracekit", "gaps", str(d)], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--parts" in r.stderr and "120 engine emissions" in r.stderr


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
