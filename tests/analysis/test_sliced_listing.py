"""`tracekit gaps` and `tracekit ttft` of a whole long run read in slices (docs/reports.md,
"Reading a long run in slices"): the whole run's records in its order, every field exact
but the per-label parts (float rounding), with its request names and step numbers; the
table's longest gaps and slowest TTFTs as the whole run's table lists them."""

from __future__ import annotations

import ast
import csv
import io
import json
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from test_sliced import _hand_run, _retained_run

import tracekit
from tracekit.analysis.gaps import gap_records
from tracekit.analysis.stream_listing import gap_listing_sliced, ttft_listing_sliced
from tracekit.analysis.ttft_records import ttft_records
from tracekit.cli import main
from tracekit.log.slices import SlicedRun

REPO = Path(__file__).resolve().parents[2]
STEP_NS = 10_000_000  # 10 ms
SLICES = "TRACEKIT_SLICE_EMISSIONS"
WHOLE = "100000000"  # more emissions than any test run: read whole


def _differences(x, y, path=""):
    """Where two records differ: a per-label part or context (or an eviction piece's share
    of one) beyond 1e-9 ms (a slice's prefix sums start at the slice), anything else at all
    (keys and their order included)."""
    if isinstance(x, dict) and isinstance(y, dict):
        if list(x) != list(y):
            return [f"{path}: keys {list(x)} != {list(y)}"]
        return [d for k in x for d in _differences(x[k], y[k], f"{path}.{k}")]
    if isinstance(x, list) and isinstance(y, list):
        if len(x) != len(y):
            return [f"{path}: {len(x)} != {len(y)} items"]
        return [d for i, (a, b) in enumerate(zip(x, y, strict=True))
                for d in _differences(a, b, f"{path}[{i}]")]  # fmt: skip
    loose = ".parts." in path or ".context." in path or (path.endswith(".ms") and
                                                          "_causes[" in path)  # fmt: skip
    if isinstance(x, float) and isinstance(y, float) and loose:
        return [] if abs(x - y) <= 1e-9 else [f"{path}: {x!r} != {y!r}"]
    same = x == y and type(x) is type(y)
    return [] if same else [f"{path}: {x!r} != {y!r}"]


@pytest.fixture(scope="module")
def whole(demo_run) -> dict[str, list[dict]]:
    """The whole run's gap and TTFT records, as JSON gives them back."""
    log = tracekit.load(demo_run)
    plain = lambda recs: [json.loads(json.dumps(r)) for r in recs]  # noqa: E731
    return {"gaps": plain(gap_records(log)), "ttft": plain(ttft_records(log))}


def _parsed(fmt: str, text: str) -> list:
    """A command's output as records: JSON lines parsed, CSV rows with each record's parts
    and context (``parts.LABEL``, ``context.LABEL``) and eviction pieces parsed back into
    their record's shape; a table's lines, its reconcile error (of parts) left out."""
    if fmt == "jsonl":
        return [json.loads(x) for x in text.splitlines()]
    if fmt == "table":
        return [re.sub(r"reconcile max err \S+", "", x) for x in text.splitlines()]
    rows = list(csv.reader(io.StringIO(text)))
    out: list = [rows[0]]
    for row in rows[1:]:
        rec: dict = {"parts": {}, "context": {}}
        for k, v in zip(rows[0], row, strict=True):
            if k.startswith(("parts.", "context.")):
                rec[k.split(".")[0]][k] = float(v) if v else v
            elif k.endswith("_causes") and v:
                rec[k] = ast.literal_eval(v)
            else:
                rec[k] = v
        out.append(rec)
    return out


def _cli(args: list[str], budget: str) -> tuple[str, str]:
    r = CliRunner().invoke(main, args, env={SLICES: budget}, catch_exceptions=False)
    assert r.exit_code == 0, r.stderr
    return r.stdout, r.stderr


@settings(max_examples=6, deadline=None, derandomize=True)
@given(budget=st.integers(min_value=1, max_value=6_000))
def test_any_slice_size_lists_the_whole_runs_records(demo_run, whole, tmp_path_factory, budget):
    parts = demo_run + ".parts"
    run = SlicedRun(parts)
    run.index()
    assert len(run.bounds(budget)) >= 2 or budget > 3_000  # most budgets cut the run
    folder = tmp_path_factory.mktemp("spill")
    (folder / "g").mkdir()
    (folder / "t").mkdir()
    g = gap_listing_sliced(parts, str(folder / "g"), max_emissions=budget, top=0)
    t = ttft_listing_sliced(parts, str(folder / "t"), max_emissions=budget, top=0)
    assert _differences(whole["gaps"], list(g.records())) == []
    assert _differences(whole["ttft"], list(t.records())) == []
    assert any("preempt_causes" in r for r in whole["gaps"])  # evictions named
    assert any("recompute_causes" in r for r in whole["gaps"])
    # the table's records: every one, longest first, ties in the whole run's order
    order = sorted(range(len(whole["gaps"])), key=lambda i: -whole["gaps"][i]["gap_ms"])
    assert _differences([whole["gaps"][i] for i in order], g.longest) == []


@pytest.mark.parametrize(
    "args",
    [
        ("gaps", "--format", "jsonl"),
        ("gaps", "--format", "table"),
        ("gaps", "--format", "table", "--top", "5", "--min-ms", "20"),
        ("gaps", "--format", "csv"),
        ("gaps", "--format", "csv", "--request", "7"),
        ("gaps", "--format", "jsonl", "--min-ms", "1e9"),
        ("ttft", "--format", "jsonl"),
        ("ttft", "--format", "table", "--top", "4"),
        ("ttft", "--format", "csv", "--min-ms", "100"),
        ("ttft", "--format", "jsonl", "--request", "7"),
        ("gaps", "--format", "parquet"),
        ("ttft", "--format", "parquet"),
    ],
)  # fmt: skip
def test_the_commands_in_slices_write_the_whole_runs_output_without_reading_it(
    demo_run, args, monkeypatch, tmp_path
):
    """`gaps` and `ttft` of a long run read in slices: the whole run's output (its records
    as `_parsed` reads them back), and reading the whole run is made to fail. CSV and
    Parquet are written in blocks of 97 records here, so a block may lack a column."""
    from tracekit import cli_listing
    from tracekit.analysis import workers

    cmd = [args[0], demo_run, *args[1:]]
    if args[2] == "parquet":
        return _same_parquet(cmd, tmp_path, monkeypatch)
    out_whole, err_whole = _cli(cmd, WHOLE)
    monkeypatch.setattr(cli_listing, "BLOCK_RECORDS", 97)

    def no_whole_run(*_a, **_k):
        raise AssertionError("a long run's listing read the whole run")

    monkeypatch.setattr(workers, "partitions", no_whole_run)
    monkeypatch.setattr(workers, "open_run", no_whole_run)
    out_sliced, err_sliced = _cli(cmd, "500")
    assert "read in slices (bounded memory)" in err_sliced and "in slices" not in err_whole
    assert _differences(_parsed(args[2], out_whole), _parsed(args[2], out_sliced)) == []
    assert err_sliced.replace(f"tracekit: {demo_run}: read in slices (bounded memory)\n",
                              "") == err_whole  # fmt: skip


def _same_parquet(cmd: list[str], tmp_path: Path, monkeypatch) -> None:
    """`--format parquet` in slices (row groups of 97 records) holds the whole run's table:
    the same schema and rows, parts (and eviction pieces) to float rounding."""
    from tracekit import cli_listing
    from tracekit.analysis import workers

    _cli([*cmd, "-o", str(tmp_path / "whole.parquet")], WHOLE)
    monkeypatch.setattr(cli_listing, "BLOCK_RECORDS", 97)
    monkeypatch.setattr(workers, "partitions", None)  # a whole read would fail
    _, err = _cli([*cmd, "-o", str(tmp_path / "sliced.parquet")], "500")
    assert "read in slices" in err
    whole, sliced = (pq.read_table(tmp_path / f"{x}.parquet") for x in ("whole", "sliced"))
    assert whole.schema.remove_metadata() == sliced.schema and whole.num_rows > 1
    for name in whole.schema.names:
        a, b = whole.column(name).to_pylist(), sliced.column(name).to_pylist()
        if name.startswith(("parts.", "context.")) or name.endswith("_causes"):
            assert _differences({"parts": {name: a}}, {"parts": {name: b}}) == [], name
        else:
            assert a == b, name


def test_a_gap_across_twenty_slices_is_listed_with_its_steps_and_eviction(tmp_path):
    """Hand case (docs/partition.md rules 1-3, "Who evicted whom"): read one part a slice,
    "long"'s one gap (step 0's end, 10 ms, to step 23's end, 240 ms) is owned by a slice
    reading 23 parts back, whose log numbers steps from its first part: listed, it spans
    steps 0..23 as in the whole run, 200 ms preempt (evicted 30..230 ms, one piece naming
    its own eviction at 30 ms), 30 ms forward. "alive" (named first) has 29 gaps of 10 ms,
    step k to k+1, all forward. Records by request, then time: alive's, then long's."""
    out = tmp_path / "run.npz"
    _hand_run(out)
    parts = str(out) + ".parts"
    (tmp_path / "g").mkdir()
    g = gap_listing_sliced(parts, str(tmp_path / "g"), max_emissions=1, top=1)
    recs = list(g.records())
    assert [r["request"] for r in recs] == ["alive"] * 29 + ["long"]
    for k, r in enumerate(recs[:29]):
        assert (r["step0"], r["step1"]) == (k, k + 1)
        assert r["gap_ms"] == pytest.approx(10.0) and r["primary"] == "clean"
        assert r["parts"]["forward"] == pytest.approx(10.0)
    long = recs[-1]
    assert (long["step0"], long["step1"]) == (0, 23)
    assert (long["t0_s"], long["t1_s"]) == (pytest.approx(0.010), pytest.approx(0.240))
    assert long["gap_ms"] == pytest.approx(230.0) and long["primary"] == "preempt"
    assert long["parts"]["preempt"] == pytest.approx(200.0)
    assert long["parts"]["forward"] == pytest.approx(30.0)
    (piece,) = long["preempt_causes"]
    assert (piece["kind"], piece["victim"]) == ("evicted", "long")
    assert piece["ms"] == pytest.approx(200.0) and piece["evicted_at_s"] == pytest.approx(0.030)
    assert g.longest == [long] and g.count == 30  # the table: the longest, of 30
    (tmp_path / "t").mkdir()
    t = ttft_listing_sliced(parts, str(tmp_path / "t"), max_emissions=1)
    # both arrived at engine time 0 and had their first token at step 0's end
    assert [(r["request"], r["ttft_ms"]) for r in t.records()] == [
        ("alive", pytest.approx(10.0)),
        ("long", pytest.approx(10.0)),
    ]
    log = tracekit.load(out)
    assert _differences(json.loads(json.dumps(gap_records(log))), recs) == []


@pytest.mark.parametrize("request_id", [None, "r390"])
def test_a_run_whose_first_parts_were_removed_lists_as_read_whole(tmp_path, request_id):
    """A run recorded with retention (its first parts removed), listed in slices: requests
    named only in removed parts are '(removed N)' and steps are numbered from the first
    part left, as the whole-run reader gives them (docs/design.md, "The run's log on
    disk"); `--request` reads only the slices where the request emits."""
    out = tmp_path / "run.npz"
    _retained_run(out)  # requests that live ~10 steps each, two emitting per step
    log = tracekit.load(out)
    assert any(n.startswith("(removed ") for n in log.request_ids)  # parts were removed
    budget = len(log.emissions) // 5
    whole = json.loads(json.dumps(gap_records(log, request_id=request_id)))
    (tmp_path / "g").mkdir()
    g = gap_listing_sliced(str(out) + ".parts", str(tmp_path / "g"), max_emissions=budget,
                           request_id=request_id)  # fmt: skip
    assert whole and _differences(whole, list(g.records())) == []
    assert request_id is not None or whole[0]["request"].startswith("(removed ")
    if request_id is None:
        (tmp_path / "t").mkdir()
        t = ttft_listing_sliced(str(out) + ".parts", str(tmp_path / "t"), max_emissions=budget)
        assert _differences(json.loads(json.dumps(ttft_records(log))), list(t.records())) == []


@pytest.mark.parametrize("min_ms", [None, 20.0])
def test_the_table_alone_writes_no_record(demo_run, whole, tmp_path, min_ms):
    """`gaps` as a table (`records=False`) makes the table's records only: its `top`
    longest gaps equal to the whole run's longest (length, then the whole run's order),
    their count the whole run's, and nothing spilled (a day's ~900 M records)."""
    parts = demo_run + ".parts"
    folder = tmp_path / "g"
    folder.mkdir()
    g = gap_listing_sliced(parts, str(folder), max_emissions=700, top=5, min_ms=min_ms,
                           records=False)  # fmt: skip
    want = [r for r in whole["gaps"] if min_ms is None or r["gap_ms"] >= min_ms]
    # the table's order: longest first, ties in the whole run's order (a stable sort)
    longest = sorted(want, key=lambda r: -r["gap_ms"])[:5]
    assert g.count == len(want) and list(folder.iterdir()) == [] and not g.pieces
    assert len(g.longest) == 5
    for a, b in zip(longest, json.loads(json.dumps(g.longest)), strict=True):
        assert not _differences(a, b)
