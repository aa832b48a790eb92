"""`tracekit recover` of a run longer than one slice (docs/capture.md, "Every command reads
`OUT.parts/` in place"; `tracekit.analysis.recover`): checked part by part, never merged
whole, `OUT` becoming the pointer a clean stop writes; and the one-file copies refused
above `TRACEKIT_ONE_FILE_EMISSIONS`."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import numpy as np
from click.testing import CliRunner

import tracekit
import tracekit.analysis.run
import tracekit.analysis.stream_check as stream_check
import tracekit.log.parts
import tracekit.log.reader
from tracekit.analysis.recover import recover_run
from tracekit.cli import main
from tracekit.errors import TracekitError
from tracekit.log.parts import recover

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from malformed import parts_cases  # noqa: E402  (tests/ helpers)
from test_sliced_check import _index  # noqa: E402

EXIT_BAD_INPUT = 2


def _no_whole_reads(monkeypatch) -> None:
    def whole_run(*_a, **_k):
        raise AssertionError("the run was read whole")

    monkeypatch.setattr(tracekit.log.reader, "merge_parts", whole_run)
    monkeypatch.setattr(tracekit.log.parts, "merge_parts", whole_run)
    monkeypatch.setattr(stream_check, "load", whole_run)


def _same_log(a, b) -> None:
    assert a.request_ids == b.request_ids and a.labels == b.labels
    for table in ("steps", "segments", "emissions", "evictions", "requests", "counters"):
        x, y = getattr(a, table), getattr(b, table)
        for col in x.columns():
            u, v = getattr(x, col), getattr(y, col)
            assert np.array_equal(u, v, equal_nan=u.dtype.kind == "f"), (table, col)


def _interrupted(demo_run: str, tmp_path: Path) -> Path:
    """A copy of the demo run's parts without its `final.json`: a run that did not stop."""
    folder = tmp_path / (os.path.basename(demo_run) + ".parts")
    shutil.copytree(demo_run + ".parts", folder)
    (folder / "final.json").unlink()
    return folder


def test_a_long_run_is_recovered_in_place_without_reading_it_whole(demo_run, tmp_path,
                                                                   monkeypatch):  # fmt: skip
    """Longer than a slice, recovered beside its folder: the counts of the whole-run
    recover, `OUT` is the pointer (a few hundred bytes) that reads as the one-file log
    `recover` writes (an interrupted run: not a clean stop), the folder says it is
    recovered, and nothing read the run whole."""
    folder = _interrupted(demo_run, tmp_path)
    whole = tracekit.load(recover(str(folder), str(tmp_path / "whole.npz")))
    (folder / "recovered").unlink()
    monkeypatch.setenv("TRACEKIT_SLICE_EMISSIONS", "500")
    with monkeypatch.context() as m:
        _no_whole_reads(m)
        out, checked = recover_run(str(folder))
    assert out == str(folder)[: -len(".parts")]
    assert os.path.getsize(out) < 1000
    assert (checked.num_steps, checked.num_emissions) == (len(whole.steps), len(whole.emissions))
    _same_log(tracekit.load(out), whole)
    assert (folder / "recovered").read_text().strip() == out
    assert tracekit.load(out).coverage.is_clean_stop.tolist() == [0]  # still interrupted


def test_the_command_says_the_counts_and_refuses_to_replace_what_exists(demo_run, tmp_path,
                                                                        monkeypatch):  # fmt: skip
    folder = _interrupted(demo_run, tmp_path)
    monkeypatch.setenv("TRACEKIT_SLICE_EMISSIONS", "500")
    runner = CliRunner()
    r = runner.invoke(main, ["recover", str(folder)])
    assert r.exit_code == 0, r.output
    n = len(tracekit.load(str(folder)).emissions)
    assert r.output.startswith("recovered ") and f" {n} emissions" in r.output
    again = runner.invoke(main, ["recover", str(folder)])
    assert again.exit_code == EXIT_BAD_INPUT and "already exists" in again.output
    assert len(again.output.strip().splitlines()) == 1


def test_every_malformed_folder_gets_the_whole_recovers_verdict(tmp_path, monkeypatch):
    """The corpus `recover` is tested on, each folder made longer than a slice (an index
    line a part, one emission each): refused in one line by both, with nothing written
    here, or recovered by both to the same log."""
    monkeypatch.setenv("TRACEKIT_SLICE_EMISSIONS", "1")
    differ, pointed = [], 0
    (tmp_path / "whole").mkdir()
    (tmp_path / "long").mkdir()
    for i, c in enumerate(parts_cases()):
        a = c.write(tmp_path / "whole" / f"{i:03d}.npz.parts")
        b = c.write(tmp_path / "long" / f"{i:03d}.npz.parts")
        _index(b)
        try:
            want = tracekit.load(recover(str(a)))
        except TracekitError as e:
            want = "BAD"
            msg = str(e)
        try:
            out, _ = recover_run(str(b))
        except TracekitError as e:
            if want != "BAD":
                differ.append(f"{c.name}: refused only when long: {e}")
            elif "\n" in str(e) or os.path.exists(str(b)[: -len(".parts")]):
                differ.append(f"{c.name}: not one line, or written: {e!r}")
            elif c.needle and c.needle not in str(e) and c.needle in msg:
                differ.append(f"{c.name}: {e} does not name {c.needle!r}")
            continue
        if want == "BAD":
            differ.append(f"{c.name}: recovered only when long")
            continue
        _same_log(tracekit.load(out), want)
        in_place = tracekit.analysis.run.parts_dir_of(out) == str(b)
        if in_place != ((b / "index").read_text().count("\n") > 1):  # longer than a slice
            differ.append(f"{c.name}: recovered in place {in_place}")
        pointed += in_place
    assert not differ, "\n".join(differ)
    assert pointed >= 1


def test_a_one_file_copy_too_long_for_one_file_is_refused_in_one_line(
    demo_run, tmp_path, monkeypatch
):
    """`recover -o ELSEWHERE`, `recover --remove-parts` and `merge RUN -o FILE.npz` hold
    the run whole: above TRACEKIT_ONE_FILE_EMISSIONS each is refused, exit 2, naming the
    setting, and nothing is written or removed."""
    folder = _interrupted(demo_run, tmp_path)
    monkeypatch.setenv("TRACEKIT_SLICE_EMISSIONS", "500")
    monkeypatch.setenv("TRACEKIT_ONE_FILE_EMISSIONS", "1000")
    runner = CliRunner()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    for args in (
        ["recover", str(folder), "-o", str(elsewhere / "run.npz")],
        ["recover", str(folder), "--remove-parts"],
        ["merge", str(folder), "-o", str(elsewhere / "one.npz")],
    ):
        r = runner.invoke(main, args)
        assert r.exit_code == EXIT_BAD_INPUT, (args, r.output)
        assert "TRACEKIT_ONE_FILE_EMISSIONS" in r.output, r.output
        assert len(r.output.strip().splitlines()) == 1, r.output
    assert os.listdir(elsewhere) == [] and (folder / "meta.json").exists()
    assert not os.path.exists(str(folder)[: -len(".parts")])
    monkeypatch.setenv("TRACEKIT_ONE_FILE_EMISSIONS", "100000000")
    r = runner.invoke(main, ["recover", str(folder), "-o", str(elsewhere / "run.npz")])
    assert r.exit_code == 0, r.output
    _same_log(tracekit.load(elsewhere / "run.npz"), tracekit.load(str(folder)))
