"""Every form a run takes on disk opens the same way (`tracekit.open_run`), so every reading
command accepts every form: a raw log, the published layout, a killed recorder's parts
folder, a multi-process server's directory (with and without tensor parallelism, and with
a killed process), and the run `tracekit merge` wrote. Each command runs through the CLI
on each form, exits 0 and writes its output; `export` writes one row per gap of the run.
`check` validates files only (a folder has its own command: `recover`, `merge`)."""

from __future__ import annotations

import json
import os
import shutil

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from synthlog import synthetic_log
from test_merge import record_pair
from test_merge_tp import record_tp

import tracekit
from tracekit.cli import main
from tracekit.log.published import save_published

FORMS = ("npz", "published", "parts", "server", "server_killed", "tp", "merged")
#: The forms that are one file (what `check` validates).
FILES = ("npz", "published", "merged")


def cli(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, str]:
    """One small run of each form, by name."""
    root = tmp_path_factory.mktemp("forms")
    out: dict[str, str] = {}
    # the published layout has four segment labels only
    log = synthetic_log(duration_s=0.5, rate_per_s=10, extra_label=None, config={"rung": "a"})
    log.save(str(root / "raw.npz"))
    out["npz"] = str(root / "raw.npz")
    out["published"] = save_published(log, str(root / "published.npz"))
    (root / "server").mkdir()
    out["server"] = record_pair(root / "server", n=12)[0]
    (root / "killed").mkdir()
    out["server_killed"] = record_pair(root / "killed", n=12, kill_core=True)[0]
    # a killed recorder's parts folder, on its own: the killed engine core's
    parts = root / "core.npz.parts"
    shutil.copytree(os.path.join(out["server_killed"], "engine_core-1.npz.parts"), parts)
    out["parts"] = str(parts)
    (root / "tp").mkdir()
    out["tp"] = record_tp(root / "tp")
    merged = root / "merged.npz"
    r = cli("merge", out["server"], "-o", str(merged))
    assert r.exit_code == 0, r.output
    out["merged"] = str(merged)
    return out


def test_every_form_is_a_form_open_run_knows(runs):
    assert set(runs) == set(FORMS)
    assert os.path.isdir(runs["parts"]) and os.path.isdir(runs["server"])
    for form, path in runs.items():
        log = tracekit.open_run(path)
        assert len(log.steps) and len(log.emissions), form
    # a server's directory opens as the run `tracekit merge` writes
    a, b = tracekit.open_run(runs["server"]), tracekit.load(runs["merged"])
    assert a.request_ids == b.request_ids and a.labels == b.labels
    assert "tensor_parallel" in tracekit.open_run(runs["tp"]).meta


def _gaps_of(path: str) -> int:
    r = cli("analyze", path, "--format", "jsonl")
    assert r.exit_code == 0, r.output
    return int(json.loads(r.stdout.splitlines()[0])["gaps"])


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "command", ["analyze", "gaps", "ttft", "whatif", "compare", "report", "trace"]
)
def test_every_reading_command_reads_every_form(runs, form, command, tmp_path):
    path = runs[form]
    out = str(tmp_path / "out")
    args = {
        "analyze": [path],
        "gaps": [path],
        "ttft": [path],
        "whatif": [path],
        "compare": [path],
        "report": [path, "-o", out + ".html"],
        "trace": [path, "-o", out + ".json"],
    }[command]
    r = cli(command, *args)
    assert r.exit_code == 0, r.output
    if command in ("report", "trace"):
        written = out + (".html" if command == "report" else ".json")
        assert os.path.getsize(written) > 0
    else:
        assert r.stdout.strip()


@pytest.mark.parametrize("form", FORMS)
def test_check_validates_a_file_and_sends_a_folder_to_its_command(runs, form):
    """`check` validates a raw log as it is on disk, a recorder's parts folder included
    (read in place); a server's directory is not one log (`tracekit merge`)."""
    r = cli("check", runs[form])
    if form in FILES or form == "parts":
        assert r.exit_code == 0, r.output
        assert r.stdout.startswith("ok ")
    else:
        assert r.exit_code == 2
        assert r.stdout.startswith("BAD ")


@pytest.mark.parametrize("form", FORMS)
def test_export_writes_every_gap_of_every_form(runs, form, tmp_path):
    path = runs[form]
    gaps = _gaps_of(path)
    assert gaps > 0
    dataset = tmp_path / "dataset"
    r = cli("export", path, "-o", str(dataset))
    assert r.exit_code == 0, r.output
    assert pq.read_table(str(dataset / "gaps")).num_rows == gaps
    meta = json.loads((dataset / "_tracekit_dataset.json").read_text())
    assert meta["gaps"] == gaps


@pytest.mark.parametrize("form", ["server", "parts"])
def test_fleet_takes_a_run_directory_as_a_run(runs, form):
    r = cli("fleet", runs[form], "--by", "process.role", "--format", "jsonl")
    assert r.exit_code == 0, r.output
    assert r.stdout.strip()
