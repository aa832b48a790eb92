"""Schema v2's TTFT tables: recorded by the recorder, saved, loaded; v1 logs and parts
written before the tables existed still load, with the tables empty."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import numpy as np
import pytest
from logfiles import one_file

import tracekit
from tracekit.attribution.ttft import ttft_partition
from tracekit.errors import LogError
from tracekit.log.parts import merge_flushed, parse_flushed
from tracekit.log.rawlog import SCHEMA_VERSION, WAIT_REASONS


def _record(out=None):
    rec = tracekit.Recorder(out)
    with rec:
        rec.request("a", prompt_tokens=8)
        rec.request("b", prompt_tokens=4)
        with rec.step():
            rec.admit("a")
            rec.prefill("a", 8)
            rec.wait(["b"], "max_num_seqs")
            with rec.segment("prefill"):
                pass
            rec.emit(["a"])
        with rec.step():
            rec.admit("b")
            rec.prefill("b", 4)
            with rec.segment("prefill"):
                pass
            with rec.segment("decode"):
                pass
            rec.emit(["a", "b"])
    if out is not None:
        one_file(out)  # the tests below rewrite the one-file form's members
    return rec


def test_recorder_writes_the_ttft_tables_and_they_round_trip(tmp_path):
    out = str(tmp_path / "run.npz")
    _record(out)
    log = tracekit.load(out)
    # "a" (index 0) admitted in step 0, "b" (1) in step 1: two admission rows, in order
    assert log.admissions.request.tolist() == [0, 1]
    assert log.admissions.t_s[0] < log.admissions.t_s[1]
    assert log.prefill_chunks.step.tolist() == [0, 1]
    assert log.prefill_chunks.request.tolist() == [0, 1]
    assert log.prefill_chunks.num_tokens.tolist() == [8, 4]
    assert log.waits.step.tolist() == [0] and log.waits.request.tolist() == [1]
    assert WAIT_REASONS[int(log.waits.reason[0])] == "max_num_seqs"
    with np.load(out, allow_pickle=False) as z:
        assert int(z["schema_version"]) == SCHEMA_VERSION == 5
        assert tuple(z["wait_reasons"].tolist()) == WAIT_REASONS
    p = ttft_partition(log)
    assert len(p) == 2 and p.is_split.all() and p.reconcile_max_err_ms < 1e-9


def _rewrite(src: str, dst: str, drop=(), **replace) -> None:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            key = info.filename[: -len(".npy")]
            if any(key.startswith(d) for d in drop):
                continue
            if key in replace:
                import io

                buf = io.BytesIO()
                np.save(buf, replace[key])
                zout.writestr(info.filename, buf.getvalue())
            else:
                zout.writestr(info, zin.read(info))


def test_version_1_log_loads_with_empty_ttft_tables_and_an_unsplit_partition(tmp_path):
    out = str(tmp_path / "run.npz")
    _record(out)
    v1 = str(tmp_path / "v1.npz")
    _rewrite(
        out,
        v1,
        drop=("admissions.", "prefill_chunks.", "waits.", "wait_reasons"),
        schema_version=np.array(1, dtype=np.int64),
    )
    log = tracekit.load(v1)
    assert len(log.admissions) == len(log.prefill_chunks) == len(log.waits) == 0
    p = ttft_partition(log)
    assert not p.is_split.any()
    assert p.notes and "no admission events" in p.notes[0]
    assert np.allclose(p.phase("unsplit"), p.ttft_ms)


def test_unknown_version_and_a_foreign_reason_vocabulary_are_refused(tmp_path):
    out = str(tmp_path / "run.npz")
    _record(out)
    v6 = str(tmp_path / "v6.npz")
    _rewrite(out, v6, schema_version=np.array(6, dtype=np.int64))
    with pytest.raises(
        LogError, match="schema_version: is 6; this tracekit reads versions 1, 2, 3, 4, 5"
    ):
        tracekit.load(v6)
    other = str(tmp_path / "other.npz")
    _rewrite(out, other, wait_reasons=np.array(["memory", "seqs"]))
    with pytest.raises(LogError, match="wait_reasons: vocabulary"):
        tracekit.load(other)


def test_parts_written_before_the_ttft_tables_still_merge():
    class Keep:  # a sink that keeps the raw chunks, as parts on disk would hold them
        def open(self, meta):
            self.meta = dict(meta)
            self.chunks = []

        def write(self, chunk):
            self.chunks.append(dict(chunk))

        def close(self, final):
            pass

    keep = Keep()
    rec = tracekit.Recorder(None, sinks=[keep])
    with rec:
        rec.request("a", prompt_tokens=8)
        with rec.step():
            rec.admit("a")
            rec.prefill("a", 8)
            rec.emit(["a"])
    old = [  # strip the new tables: what a recorder before them wrote
        {k: v for k, v in c.items() if k not in ("admissions", "prefill_chunks", "waits")}
        for c in keep.chunks
    ]
    log = merge_flushed(keep.meta, [parse_flushed(c, "old") for c in old], final={})
    assert len(log.emissions) == 1 and len(log.steps) == 1
    assert len(log.admissions) == len(log.prefill_chunks) == len(log.waits) == 0


def test_recorder_misuse_is_an_error_that_says_how_to_fix():
    rec = tracekit.Recorder(None)
    with rec:
        with pytest.raises(RuntimeError, match="inside rec.step"):
            rec.prefill("a", 3)
        with rec.step():
            with pytest.raises(ValueError, match="not one of"):
                rec.wait(["a"], "busy")
    disabled = tracekit.Recorder(None, enabled=False)
    disabled.admit("a")  # off costs nothing and records nothing
    disabled.prefill("a", 3)
    disabled.wait(["a"], "busy")


def test_bad_ttft_input_is_one_line_and_exit_2(tmp_path):
    out = str(tmp_path / "run.npz")
    _record(out)
    cases = {
        # "b" admitted before "a"'s arrival: row 1's admission moved to before its arrival
        "admission out of order": ({"admissions.t_s": np.array([0.0, -1.0])}, "admissions.t_s"),
        "prefill row for an unknown request": (
            {"prefill_chunks.request": np.array([0, 9])},
            "prefill_chunks.request",
        ),
        "first emission before arrival": (
            {"requests.arrival_s": np.array([5.0, 5.0])},
            "requests.first_token_s",
        ),
    }
    for name, (repl, field) in cases.items():
        bad = str(tmp_path / f"{name.replace(' ', '_')}.npz")
        _rewrite(out, bad, **repl)
        r = subprocess.run(
            [sys.executable, "-m", "tracekit", "ttft", bad], capture_output=True, text=True
        )
        assert r.returncode == 2, (name, r.stdout, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and bad in lines[0] and field in lines[0], (name, r.stderr)
