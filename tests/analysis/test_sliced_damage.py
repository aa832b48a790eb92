"""A long one-process run whose folder is damaged (a part missing, torn or unreadable) or
whose first parts were removed, read in slices: the run ends where `load` ends it, with
`load`'s warnings, without reading it whole (docs/reports.md, "Reading a long run in
slices")."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from tracekit.analysis import workers
from tracekit.analysis.figures import analyze
from tracekit.log.reader import load

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from malformed import parts_cases  # noqa: E402  (tests/ helpers)
from test_sliced import _assert_same  # noqa: E402
from test_sliced_check import _index  # noqa: E402


def _damaged():
    """(case, what a warning of the run must say): the recover corpus's damaged folders,
    and the recorded one with its middle part gone, and with its first part removed."""
    cases = parts_cases()
    ok = next(c for c in cases if c.name == "parts as recorded")
    assert len(ok.files) == 3
    out = [(c, ".npz is unreadable") for c in cases if c.needle == "unreadable"]
    out.append((dataclasses.replace(ok, name="the middle part missing",
                                    files=(ok.files[0], ok.files[2])),
                "part-000002.npz is missing; the run ends at the flush before it"))  # fmt: skip
    out.append((dataclasses.replace(ok, name="the first part removed", files=ok.files[1:]),
                "parts 1..1 were removed (retention)"))  # fmt: skip
    return out


@pytest.mark.parametrize("case, says", _damaged(), ids=lambda x: getattr(x, "name", ""))
def test_a_damaged_long_run_is_read_in_slices_as_load_reads_it(tmp_path, monkeypatch, case,
                                                                says):  # fmt: skip
    folder = case.write(tmp_path / "run.npz.parts")
    _index(folder)  # each part says one emission: longer than a slice of one
    whole = analyze(load(str(folder)))
    whole_whatif = workers.whatif_path(str(folder))  # three parts: under a slice, read whole
    assert any(says in w for w in whole.warnings), whole.warnings  # the rule, from load

    monkeypatch.setenv("TRACEKIT_SLICE_EMISSIONS", "1")

    def read_whole(*_a, **_k):
        raise AssertionError("read whole")

    monkeypatch.setattr(workers, "open_run", read_whole)
    monkeypatch.setattr(workers, "partitions", read_whole)
    sliced = workers.analyze_path(str(folder))
    _assert_same(whole.to_dict(), sliced.to_dict())
    assert workers.whatif_path(str(folder)).warnings == whole_whatif.warnings
