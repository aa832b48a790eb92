"""`tracekit check` of a long one-process run, part by part (docs/reports.md, "Reading a
long run in slices"): the verdict, the error, the counts and the warnings `load` gives
(the rules: docs/input-validation.md), without ever holding the whole run."""

from __future__ import annotations

import os
import re
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import tracekit.analysis.stream_check as stream_check
import tracekit.log.parts
import tracekit.log.reader
from tracekit.analysis.stream_check import check_run
from tracekit.cli import main
from tracekit.errors import TracekitError
from tracekit.log.reader import load

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from malformed import parts_cases, recorded_chunks  # noqa: E402  (tests/ helpers)

REPO = Path(__file__).resolve().parents[2]


def _index(folder: Path) -> None:
    """An index line per part on disk, each saying one emission: with
    TRACEKIT_SLICE_EMISSIONS=1 the run is longer than a slice (docs/design.md, the index)."""
    lines = []
    for name in sorted(os.listdir(folder)):
        if m := re.fullmatch(r"part-(\d{6,})\.(tkp|npz)", name):
            body = f"{int(m.group(1))} 1 0 - 1"
            lines.append(f"{body} {zlib.crc32(body.encode()):08x}\n")
    (folder / "index").write_text("".join(lines))


def _verdict(read, path: str):
    try:
        return "ok", read(path)
    except TracekitError as e:
        return "BAD", str(e)


def _loaded(path: str):
    log = load(path)
    return len(log.steps), len(log.emissions), log.warnings


def _checked(path: str):
    c = check_run(path)
    return c.num_steps, c.num_emissions, c.warnings


@pytest.fixture
def part_by_part(monkeypatch):
    """Slices of one emission, and a record of the runs checked part by part."""
    monkeypatch.setenv("TRACEKIT_SLICE_EMISSIONS", "1")
    seen: list[str] = []
    check = stream_check.PartByPart.check

    def spy(self, *a):
        seen.append(self.parts_dir)
        return check(self, *a)

    monkeypatch.setattr(stream_check.PartByPart, "check", spy)
    return seen


def test_every_damaged_parts_folder_gets_loads_verdict_part_by_part(tmp_path, part_by_part):
    """The corpus `recover` is tested on (torn, truncated, unreadable and contradicting
    parts, bad meta): each folder's verdict, one-line error or counts and warnings are
    `load`'s; every folder whose meta reads is checked part by part."""
    differ = []
    for i, c in enumerate(parts_cases()):
        folder = c.write(tmp_path / f"{i:03d}.npz.parts")
        _index(folder)
        whole, parts = _verdict(_loaded, str(folder)), _verdict(_checked, str(folder))
        if whole != parts:
            differ.append(f"{c.name}: load {whole} != check {parts}")
        if c.files and not c.name.startswith("meta") and str(folder) not in part_by_part:
            differ.append(f"{c.name}: not checked part by part")
        if c.expect == "reject" and parts[0] != "BAD":
            differ.append(f"{c.name}: accepted")
    assert not differ, "\n".join(differ)


def _write(folder: Path, chunks: list[dict], meta: dict, first: int = 1) -> str:
    import io
    import json

    folder.mkdir()
    (folder / "meta.json").write_text(json.dumps(meta))
    for i, c in enumerate(chunks, first):
        buf = io.BytesIO()
        np.savez(buf, **c)
        (folder / f"part-{i:06d}.npz").write_bytes(buf.getvalue())
    _index(folder)
    return str(folder)


def _set(chunks, part, table, row, col, value, width):
    a = chunks[part][table].copy()
    a[row * width + col] = value
    chunks[part][table] = a


# The recorded run: three parts of 4 steps (7 columns), 4 segments (6), 4 emissions (5),
# 2 requests, 4 counters, one eviction (readmitted) each; parts 2 and 3 start at whole-log
# row 4 and 8 of each table. (edits, the field, the message's start).
BAD = {
    "a step that ends before it starts, part 3": (
        [(2, "steps", 1, 1, 72_000, 7)], "steps.t_end_s", "row 9: ends (",
    ),
    "an absurd emission time, part 2": (
        [(1, "emissions", 2, 1, 2 * 10**16, 5)], "emissions.t_s", "row 6: absurd time 2",
    ),
    "a negative decode count, part 2": (
        [(1, "steps", 0, 2, -1, 7)], "steps.num_decode", "row 4: -1 is below 0",
    ),
    "an emission of a step past the run's 12, part 2": (
        [(1, "emissions", 1, 2, 12, 5)], "emissions.step", "row 5: index 12 outside [-1, 11]",
    ),
    "a label past the vocabulary, part 3": (
        [(2, "segments", 3, 1, 1, 6)], "segments.label", "row 11: index 1 outside [0, 0]",
    ),
    "a counter name past the vocabulary, part 1": (
        [(0, "counters", 0, 0, 3, 3)], "counters.name", "row 0: index 3 outside [0, 0]",
    ),
    "is_device 2, part 3": (
        [(2, "segments", 0, 5, 2, 6)], "segments.is_device", "row 8: 2 is absurd: above 1",
    ),
    # evictions: one per part, rows in (request, time) order: part 2's is row 1
    "an eviction mode 7, part 2": (
        [(1, "events", 0, 3, 7, 4)], "evictions.mode", "row 1: 7 is absurd: above 1",
    ),
    # two rules broken: the one checked first is said (spans before counts), not part 1's
    "a negative count in part 1, a reversed step in part 3": (
        [(0, "steps", 0, 2, -1, 7), (2, "steps", 1, 1, 72_000, 7)], "steps.t_end_s", "row 9:",
    ),
    # one rule broken twice: the first row in the whole log
    "reversed steps in parts 3 and 2": (
        [(2, "steps", 1, 1, 72_000, 7), (1, "steps", 2, 1, 40_000, 7)], "steps.t_end_s",
        "row 6:",
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_value_in_any_part_is_named_with_the_whole_logs_row(tmp_path, part_by_part, name):
    meta, chunks = recorded_chunks()
    chunks = [dict(c) for c in chunks]
    edits, field, start = BAD[name]
    for part, table, row, col, value, width in edits:
        _set(chunks, part, table, row, col, value, width)
    path = _write(tmp_path / "run.npz.parts", chunks, meta)
    whole, parts = _verdict(_loaded, path), _verdict(_checked, path)
    assert parts[0] == "BAD" and parts == whole, (whole, parts)
    assert parts[1].startswith(f"{path}: {field}: {start}"), parts[1]
    assert part_by_part == [path]


def test_a_gc_generation_5_is_named_from_the_kept_collections(tmp_path, part_by_part):
    meta, chunks = recorded_chunks()
    chunks = [dict(c) for c in chunks]
    chunks[1]["gc_pauses"] = np.array([34_500, 34_600, 5])
    path = _write(tmp_path / "run.npz.parts", chunks, meta)
    whole, parts = _verdict(_loaded, path), _verdict(_checked, path)
    assert parts == whole
    assert parts[1] == f"{path}: gc_pauses.generation: row 0: 5 is absurd: above 2"


def test_an_emission_of_a_later_parts_step_is_valid(tmp_path, part_by_part):
    """A step index is checked against the whole run's steps, not the part's."""
    meta, chunks = recorded_chunks()
    chunks = [dict(c) for c in chunks]
    _set(chunks, 0, "emissions", 0, 2, 11, 5)
    path = _write(tmp_path / "run.npz.parts", chunks, meta)
    assert _verdict(_checked, path) == _verdict(_loaded, path)
    assert _checked(path)[:2] == (12, 12)


def test_odd_but_usable_runs_warn_as_load_does(tmp_path, part_by_part):
    """Emissions out of time order across parts and before their request's arrival, a
    dropped-rows note, an eviction never readmitted though its request emits again."""
    meta, chunks = recorded_chunks()
    chunks = [dict(c) for c in chunks]
    _set(chunks, 2, "emissions", 0, 1, 30_000, 5)  # request 4 arrives at 65000
    chunks[1]["dropped_rows"] = np.array(3)
    chunks[0]["events"] = chunks[0]["events"][:4]  # r0-1's readmission lost; it emits again
    path = _write(tmp_path / "run.npz.parts", chunks, meta)
    whole, parts = _verdict(_loaded, path), _verdict(_checked, path)
    assert parts == whole and parts[0] == "ok"
    warnings = parts[1][2]
    for words in (
        "not in time order",
        "1 emission(s) before their request's arrival",
        "3 recorded value(s) were dropped",
        "1 eviction(s) never readmitted",
    ):
        assert any(words in w for w in warnings), (words, warnings)
    assert part_by_part == [path]


def test_check_of_a_long_run_never_reads_it_whole_and_says_the_same(demo_run, monkeypatch):
    """`check` of a run longer than a slice: the ok line and warnings of the whole run's
    check, with reading the whole run made to fail."""
    runner = CliRunner()
    monkeypatch.setenv("TRACEKIT_SLICE_EMISSIONS", "100000000")
    whole = runner.invoke(main, ["check", demo_run, demo_run + ".parts"])
    assert whole.exit_code == 0, whole.output
    assert len(os.listdir(demo_run + ".parts")) > 4  # several parts

    def whole_run(*_a, **_k):
        raise AssertionError("check read the whole run")

    monkeypatch.setattr(tracekit.log.reader, "merge_parts", whole_run)
    monkeypatch.setattr(tracekit.log.parts, "merge_parts", whole_run)
    monkeypatch.setattr(stream_check, "load", whole_run)
    monkeypatch.setenv("TRACEKIT_SLICE_EMISSIONS", "500")
    parts = runner.invoke(main, ["check", demo_run, demo_run + ".parts"])
    assert parts.exit_code == 0, parts.output
    assert parts.output == whole.output
    assert parts.output.count("ok    ") == 2


def test_a_run_without_counters_or_gc_is_valid(tmp_path, part_by_part):
    """No counter names and no counters: no index can be outside them (the measured busy
    server's run failed so while this check was written)."""
    meta, chunks = recorded_chunks()
    chunks = [dict(c) for c in chunks]
    for c in chunks:
        c["counters"] = np.zeros(0)
        c["counter_names"] = np.array([], dtype=str)
    path = _write(tmp_path / "run.npz.parts", chunks, meta)
    assert _verdict(_checked, path) == _verdict(_loaded, path) == ("ok", (12, 12, ()))
    assert part_by_part == [path]


def test_a_folder_whose_first_part_was_removed_is_checked_as_its_end(tmp_path, part_by_part):
    """Part 1 removed (retention): steps numbered from part 2's first (step 4 is step 0),
    its 2 requests '(removed N)' with the warning that says so (docs/design.md,
    "Retention"); an emission of step 12 of the whole run is step 8 of the 8 read."""
    meta, chunks = recorded_chunks()
    ok = _write(tmp_path / "ok.npz.parts", [dict(c) for c in chunks[1:]], meta, first=2)
    assert _verdict(_checked, ok) == _verdict(_loaded, ok)
    steps, emissions, warnings = _checked(ok)
    assert (steps, emissions) == (8, 8)
    assert any("parts 1..1 were removed" in w for w in warnings), warnings
    bad = [dict(c) for c in chunks[1:]]
    _set(bad, 0, "emissions", 1, 2, 12, 5)
    path = bad_path = _write(tmp_path / "bad.npz.parts", bad, meta, first=2)
    whole, parts = _verdict(_loaded, path), _verdict(_checked, path)
    assert parts == whole
    assert parts[1] == f"{path}: emissions.step: row 1: index 8 outside [-1, 7]"
    old = [{k: v for k, v in c.items() if k != "first_step"} for c in chunks[1:]]
    path = _write(tmp_path / "old.npz.parts", old, meta, first=2)
    whole, parts = _verdict(_loaded, path), _verdict(_checked, path)
    assert parts == whole and parts[0] == "BAD" and "part-000002.npz" in parts[1]
    assert part_by_part == [ok, ok, bad_path, path]


def _middle(parts: Path) -> Path:
    names = sorted(n for n in os.listdir(parts) if re.fullmatch(r"part-\d{6,}\.tkp", n))
    return parts / names[len(names) // 2]


def _flip(p: Path, at: int) -> None:
    data = bytearray(p.read_bytes())
    data[at] ^= 0xFF
    p.write_bytes(bytes(data))


DAMAGE = {
    "a part missing": lambda d: _middle(d).unlink(),
    "a part truncated": lambda d: _middle(d).write_bytes(_middle(d).read_bytes()[:200]),
    "a part empty (a power loss before its fsync)": lambda d: _middle(d).write_bytes(b""),
    "a byte of a part's header flipped": lambda d: _flip(_middle(d), 20),
    "a byte of a part's last blob flipped": lambda d: _flip(_middle(d), -3),
    "a torn index line": lambda d: (d / "index").open("a").write("99 12 3"),
    "no final.json (interrupted)": lambda d: (d / "final.json").unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_a_damaged_recorded_run_gets_loads_verdict_part_by_part(
    demo_run, tmp_path, part_by_part, damage
):
    """The recorder's own parts (format 1), damaged as a power loss or a disk damages
    them (docs/design.md, "The run's log on disk"): `load`'s verdict, counts and warnings
    (a missing or damaged part ends the run at the part before it, with a warning)."""
    import shutil

    run = tmp_path / os.path.basename(demo_run)  # the pointer names its folder
    shutil.copy(demo_run, run)
    shutil.copytree(demo_run + ".parts", f"{run}.parts")
    DAMAGE[damage](Path(f"{run}.parts"))
    for path in (str(run), f"{run}.parts"):
        whole, parts = _verdict(_loaded, path), _verdict(_checked, path)
        assert parts == whole, (whole, parts)
        if damage != "no final.json (interrupted)":
            assert parts[0] == "ok", parts
            assert len(parts[1][2]) > len(_checked(demo_run)[2])
    assert part_by_part.count(f"{run}.parts") == 2


def _ttft_chunks():
    """The recorded run with admission events: each request admitted at its arrival tick
    plus 100 (in its arrival's part), and in part 2 one wait row (step 5, request 2,
    reason 0)."""
    meta, chunks = recorded_chunks()
    chunks = [dict(c) for c in chunks]
    for c in chunks:
        rq = c["requests"].reshape(-1, 4)
        c["admissions"] = np.stack([rq[:, 0], rq[:, 1] + 100], axis=1).ravel()
    chunks[1]["waits"] = np.array([5, 2, 0])
    return meta, chunks


def test_ttft_and_eviction_cause_rules_are_named_as_load_names_them(tmp_path, part_by_part):
    """docs/ttft.md, "Bad input", and docs/partition.md, "Who evicted whom": a wait reason
    told twice for one request in one step (its rows in two parts), an admission before
    its request's arrival, a preemption row with no eviction at its time."""
    meta, chunks = _ttft_chunks()
    ok = _write(tmp_path / "ok.npz.parts", chunks, meta)
    assert _verdict(_checked, ok) == _verdict(_loaded, ok) and _checked(ok)[:2] == (12, 12)
    cases = {
        # part 3's first row repeats part 2's: whole-log row 1
        "waits twice": ({2: {"waits": np.array([5, 2, 1])}}, "waits.request",
                        "row 1: request 2 has two wait reasons in step 5"),
        # request 3 arrives at tick 40000 (part 2's second request row): admissions row 3
        "admitted early": ({1: {"admissions": np.array([2, 33_100, 3, 39_000])}},
                           "admissions.t_s", "row 3: request 3 admitted at 3.9e-05 s, before"),
        "a cause without its eviction": (
            {1: {"preemptions": np.array([4, 3, 44_001, 0, -1, -1, -1])}}, "preemptions.t_s",
            "row 0: request 3 has no eviction at"),
    }  # fmt: skip
    for name, (edits, field, start) in cases.items():
        cs = [dict(c) for c in chunks]
        for part, change in edits.items():
            cs[part].update(change)
        path = _write(tmp_path / f"{name.replace(' ', '_')}.npz.parts", cs, meta)
        whole, parts = _verdict(_loaded, path), _verdict(_checked, path)
        assert parts == whole, (name, whole, parts)
        assert parts[1].startswith(f"{path}: {field}: {start}"), (name, parts[1])
    assert len(part_by_part) == 2 + len(cases)  # the valid run checked twice


def test_a_pointer_with_other_members_warns_of_them_as_load_does(demo_run, tmp_path, monkeypatch):
    """Members a pointer file's layout does not define are named in a warning (docs/
    input-validation.md, "Accepted with a warning")."""
    import shutil

    run = tmp_path / os.path.basename(demo_run)
    shutil.copytree(demo_run + ".parts", f"{run}.parts")
    with np.load(demo_run) as z:
        np.savez(run, tracekit_parts_log=z["tracekit_parts_log"], junk=np.zeros(3))
    monkeypatch.setenv("TRACEKIT_SLICE_EMISSIONS", "500")
    whole, parts = _verdict(_loaded, str(run)), _verdict(_checked, str(run))
    assert parts == whole and any("junk" in w for w in parts[1][2]), parts
