"""Hostile and careless input on the paths added after the first wave: the merge of a
server's per-process logs, the client boundary, TTFT, `export` and `fleet`.

Every case runs the real `tracekit` command in a subprocess under a timeout and must end
with exit 0, or exit 2 and one line on stderr; never a traceback, an internal error (exit
3) or a hang, and every `.npz` a command wrote must pass `tracekit check`. Each case below
that names an issue-21 item failed on the main before it (a hang, an internal error, a log
`check` rejects, or an overwrite)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest
from logfiles import one_file
from procs import env, tracekit_cmd
from synthlog import synthetic_log
from test_merge import record_pair

from tracekit.analysis.run import merge_run as merge_dir
from tracekit.log.reader import load

#: Seconds a case may take before it counts as a hang.
CASE_TIMEOUT_S = 60


def cli(*args: str, cwd: Path | None = None, mem_gb: float | None = None):
    """Run tracekit; assert the outcome is clean (exit 0, or exit 2 with one line)."""

    def limit_memory() -> None:  # address space: a 16 GiB allocation fails fast
        if mem_gb is not None:
            n = int(mem_gb * (1 << 30))
            resource.setrlimit(resource.RLIMIT_AS, (n, n))

    try:
        r = subprocess.run(
            [*tracekit_cmd(), *args], capture_output=True, text=True, timeout=CASE_TIMEOUT_S,
            env=env(), cwd=cwd, preexec_fn=limit_memory,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"tracekit {' '.join(args)}: no answer after {CASE_TIMEOUT_S} s (a hang)")
    assert "Traceback" not in r.stderr, r.stderr
    assert "internal error" not in r.stderr, r.stderr
    assert r.returncode in (0, 2), (r.returncode, r.stderr)
    if r.returncode == 2 and args[0] != "check":  # check: one BAD line per file on stdout
        lines = [x for x in r.stderr.splitlines() if not x.startswith("tracekit: warning")]
        assert len(lines) == 1 and lines[0].startswith("tracekit: error: "), r.stderr
    return r


def checked(path: str | Path) -> None:
    """A log a command wrote loads (what `tracekit check` does)."""
    load(str(path))


# -- building hostile process directories ----------------------------------------------


def rewrite_npz(path: Path, **members) -> None:
    """Replace members of a log's archive (the rest kept as they are), in its one-file
    form."""
    with np.load(one_file(path), allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays.update(members)
    np.savez(path, **arrays)


def json_member(path: Path, name: str) -> dict:
    with np.load(one_file(path), allow_pickle=False) as z:
        return json.loads(str(z[name]))


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> Path:
    """A valid directory: an engine core and an API server (tests/log/test_merge.py)."""
    d = tmp_path_factory.mktemp("pair")
    record_pair(d, n=40)
    return d


def copy_pair(pair: Path, dst: Path) -> Path:
    shutil.copytree(pair, dst)
    return dst


def killed_parts(d: Path) -> Path:
    """A parts folder of a killed API server beside a complete core."""
    parts = d / "api_server-3.npz.parts"
    parts.mkdir()
    (parts / "meta.json").write_text(json.dumps({"t0_tick": 1}))
    return parts


MERGE_READERS = [
    ("merge", "{d}", "-o", "{out}"),
    ("analyze", "{d}"),
    ("trace", "{d}", "-o", "{out}.json"),
    ("report", "{d}", "-o", "{out}.html"),
    ("ttft", "{d}"),
]


@pytest.mark.parametrize("fifo", ["meta.json", "lock", "part-000001.npz"])
@pytest.mark.parametrize("argv", MERGE_READERS, ids=lambda a: a[0])
def test_a_fifo_in_a_parts_folder_never_hangs_a_reader(pair, tmp_path, fifo, argv):
    d = copy_pair(pair, tmp_path / "d")
    parts = killed_parts(d)
    if fifo == "meta.json":
        (parts / "meta.json").unlink()
    os.mkfifo(parts / fifo)
    out = tmp_path / "out.npz"
    cli(*(a.format(d=d, out=out) for a in argv))
    if out.exists():
        checked(out)


def test_a_fifo_parts_folder_never_hangs_recover(tmp_path):
    for fifo in ("meta.json", "lock"):
        parts = tmp_path / f"{fifo}.npz.parts"
        parts.mkdir()
        if fifo != "meta.json":
            (parts / "meta.json").write_text(json.dumps({"t0_tick": 1}))
        os.mkfifo(parts / fifo)
        cli("recover", str(parts), "-o", str(tmp_path / f"{fifo}-out.npz"))


def test_a_fifo_named_like_a_process_log_is_refused(pair, tmp_path):
    d = copy_pair(pair, tmp_path / "d")
    os.mkfifo(d / "worker-9.npz")
    r = cli("merge", str(d), "-o", str(tmp_path / "m.npz"))
    assert r.returncode == 2 and "FIFO" in r.stderr
    assert not (tmp_path / "m.npz").exists()


def test_glob_characters_in_a_directory_name_merge_that_directory(pair, tmp_path):
    d = copy_pair(pair, tmp_path / "run[1]")
    (tmp_path / "run1").mkdir()  # what the glob pattern run[1]/*.npz would list
    r = cli("merge", str(d), "-o", str(tmp_path / "m.npz"))
    assert r.returncode == 0, r.stderr
    checked(tmp_path / "m.npz")
    assert cli("analyze", str(d)).returncode == 0


@pytest.mark.parametrize(
    "field,value",
    [
        ("meta.t0_tick", "abc"),
        ("meta.t0_tick", 1.5),
        ("meta.seconds_per_tick", "x"),
        ("config.process.pid", {"a": 1}),
        ("config.process.pid", -4),
        ("config.process.boot_id", [1]),
    ],
)
def test_hostile_process_metadata_is_one_line_before_any_output(pair, tmp_path, field, value):
    d = copy_pair(pair, tmp_path / "d")
    fe = d / "api_server-2.npz"
    member, *keys = field.split(".")
    doc = json_member(fe, member)
    node = doc
    for k in keys[:-1]:
        node = node[k]
    node[keys[-1]] = value
    rewrite_npz(fe, **{member: np.array(json.dumps(doc))})
    out = tmp_path / "m.npz"
    r = cli("merge", str(d), "-o", str(out))
    assert r.returncode == 2 and keys[-1] in r.stderr, r.stderr
    assert not out.exists() and r.stdout == ""
    assert cli("analyze", str(d)).returncode == 2


def test_colliding_client_ids_make_a_log_check_accepts(pair, tmp_path):
    d = copy_pair(pair, tmp_path / "d")
    fe = d / "api_server-2.npz"
    with np.load(one_file(fe)) as z:
        ids = [str(x) for x in z["request_ids"]]
    # two engine requests the API server names alike (two clients reusing an id)
    ids[1] = ids[0].split("\x1f")[0] + "\x1f" + ids[1].split("\x1f")[1]
    rewrite_npz(fe, request_ids=np.array(ids))
    out = tmp_path / "m.npz"
    r = cli("merge", str(d), "-o", str(out))
    assert r.returncode == 0, r.stderr
    log = load(str(out))
    assert len(set(log.request_ids)) == len(log.request_ids)
    assert "cmpl-0-0~2" in log.request_ids and "taken by another request" in r.stderr


def test_absurd_start_ticks_are_refused_not_written(pair, tmp_path):
    d = copy_pair(pair, tmp_path / "d")
    fe = d / "api_server-2.npz"
    meta = json_member(fe, "meta")
    meta["t0_tick"] = 2**62
    rewrite_npz(fe, meta=np.array(json.dumps(meta)))
    out = tmp_path / "m.npz"
    r = cli("merge", str(d), "-o", str(out))
    assert r.returncode == 2 and not out.exists()
    assert cli("analyze", str(d)).returncode == 2  # analysed only when it would validate


def test_merge_never_overwrites_an_input_without_force(pair, tmp_path):
    d = copy_pair(pair, tmp_path / "d")
    core = d / "engine_core-1.npz"
    before = core.read_bytes()
    r = cli("merge", str(d), "-o", str(core))
    assert r.returncode == 2 and "--force" in r.stderr
    assert core.read_bytes() == before
    parts = killed_parts(d)
    r = cli("merge", str(d), "-o", str(parts / "part-000001.npz"))
    assert r.returncode == 2 and not (parts / "part-000001.npz").exists()


def test_merge_is_linear_in_processes(pair, tmp_path):
    """One clock entry and no printed line per pair of processes: with k API servers the
    output has k entries and k + 2 lines, not k^2."""
    d = copy_pair(pair, tmp_path / "d")
    fe = d / "api_server-2.npz"
    for pid in range(10, 16):
        cfg = json_member(fe, "config")
        cfg["process"]["pid"] = pid
        dst = d / f"api_server-{pid}.npz"
        shutil.copy(fe, dst)
        rewrite_npz(dst, config=np.array(json.dumps(cfg)))
    log = merge_dir(str(d))
    assert len(log.meta["clock_pairs"]) == 7
    r = cli("merge", str(d), "-o", str(tmp_path / "m.npz"))
    assert len(r.stdout.splitlines()) == 8 + 1


def test_ttft_reads_a_directory_like_analyze(pair, tmp_path):
    r = cli("ttft", str(pair), "--format", "jsonl")
    assert r.returncode == 0 and len(r.stdout.splitlines()) == 40


@pytest.mark.parametrize("command", ["merge", "analyze", "ttft", "trace", "report", "export",
                                     "fleet", "check", "gaps", "compare"])  # fmt: skip
def test_max_inflate_mb_on_every_command_that_reads_logs(pair, tmp_path, command):
    core = str(pair / "engine_core-1.npz")
    out = str(tmp_path / "o")
    argv = {
        "merge": [str(pair), "-o", out + ".npz"],
        "trace": [core, "-o", out + ".json"],
        "report": [core, "-o", out + ".html"],
        "export": [core, "-o", out],
        "fleet": [core, "--by", "rung"],
    }.get(command, [core])
    r = cli(command, *argv, "--max-inflate-mb", "0.001")
    assert r.returncode == 2 and "inflate" in (r.stdout if command == "check" else r.stderr)


# -- the client boundary --------------------------------------------------------------


def test_chunks_claiming_2_31_tokens_cost_their_bytes(pair, tmp_path):
    """Every chunk claims the most tokens a count may hold: 80 x 2^31 tokens, which the
    per-token percentiles once expanded one value per token."""
    d = copy_pair(pair, tmp_path / "d")
    fe_log = d / "api_server-2.npz"
    with np.load(one_file(fe_log)) as z:
        n = z["emissions.num_tokens"].copy()
    n[:] = 2**31 - 1
    rewrite_npz(fe_log, **{"emissions.num_tokens": n})
    r = cli("analyze", str(d), "--format", "jsonl", mem_gb=6)
    assert r.returncode == 0, r.stderr


# -- export and fleet -------------------------------------------------------------------


def save(log, path: Path) -> str:
    log.save(str(path))
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[str]:
    d = tmp_path_factory.mktemp("runs")
    return [
        save(synthetic_log(seed=s, rung=r, duration_s=0.4), d / f"{r}-{s}.npz")
        for s, r in ((1, "baseline"), (2, "baseline"), (3, "fix"))
    ]


def test_the_readme_pair_on_runs_without_the_key(runs, tmp_path):
    ds = tmp_path / "ds"
    r = cli("export", *runs, "-o", str(ds), "--partition-by", "rung,replica")
    assert r.returncode == 0 and "replica" in r.stderr
    r = cli("fleet", str(ds), "--by", "rung")
    assert r.returncode == 0 and "2 group(s)" in r.stdout
    for table in ("gaps", "runs"):  # pyarrow (pandas and Ray Data read through it)
        t = pads.dataset(str(ds / table), format="parquet", partitioning="hive").to_table()
        assert sorted(set(t.column("rung").to_pylist())) == ["baseline", "fix"]


def test_a_key_only_some_runs_have_reads_back_as_null(tmp_path):
    a = save(synthetic_log(seed=1, config={"replica": "r0"}, duration_s=0.4), tmp_path / "a.npz")
    b = save(synthetic_log(seed=2, duration_s=0.4), tmp_path / "b.npz")
    ds = tmp_path / "ds"
    assert cli("export", a, b, "-o", str(ds), "--partition-by", "replica").returncode == 0
    t = pads.dataset(str(ds / "runs"), format="parquet", partitioning="hive").to_table()
    assert sorted(t.column("replica").to_pylist(), key=str) == [None, "r0"]
    duckdb = pytest.importorskip("duckdb")
    got = duckdb.sql(
        f"SELECT replica FROM read_parquet('{ds}/runs/**/*.parquet', hive_partitioning=true)"
    ).fetchall()
    assert sorted((x for (x,) in got), key=str) == [None, "r0"]


def test_run_ids_are_unique_across_folders(tmp_path):
    paths = []
    for sub, name in (("x", "a"), ("y", "a"), ("z", "a-2")):
        (tmp_path / sub).mkdir()
        paths.append(save(synthetic_log(seed=len(paths) + 1, duration_s=0.4),
                          tmp_path / sub / f"{name}.npz"))  # fmt: skip
    ds = tmp_path / "ds"
    assert cli("export", *paths, "-o", str(ds)).returncode == 0
    files = sorted(p.name for p in (ds / "runs").rglob("*.parquet"))
    assert len(files) == 3, files
    r = cli("fleet", str(ds), "--by", "seed", "--format", "jsonl")
    assert sum(json.loads(x)["runs"] for x in r.stdout.splitlines()) == 3


def test_labels_a_dash_b_and_a_dot_b_get_distinct_columns(tmp_path):
    a = save(synthetic_log(seed=1, extra_label="a-b", duration_s=0.4), tmp_path / "a.npz")
    b = save(synthetic_log(seed=2, extra_label="a.b", duration_s=0.4), tmp_path / "b.npz")
    ds = tmp_path / "ds"
    assert cli("export", a, b, "-o", str(ds)).returncode == 0
    meta = json.loads((ds / "_tracekit_dataset.json").read_text())
    cols = pq.read_schema(next((ds / "gaps").rglob("*.parquet"))).names
    part = [c for c in cols if c.startswith("part_")]
    assert len(part) == len(set(part)) and len(meta["labels"]) == len(part)
    # letters and digits stay, every other byte is _HH after a leading __ (export.column_name)
    assert "part___a_2db_ms" in part and "part___a_2eb_ms" in part
    for f in (ds / "gaps").rglob("*.parquet"):
        t = pq.read_table(f).to_pandas()
        assert np.allclose(t[part].sum(axis=1), t["gap_ms"], atol=1e-9)


def test_partitioning_by_a_column_of_a_table_is_refused(tmp_path):
    a = save(synthetic_log(seed=1, config={"tok_per_s": 5}, duration_s=0.4), tmp_path / "a.npz")
    r = cli("export", a, "-o", str(tmp_path / "ds"), "--partition-by", "tok_per_s")
    assert r.returncode == 2 and "tok_per_s" in r.stderr
    assert not (tmp_path / "ds").exists()


def test_long_and_non_ascii_partition_values(tmp_path):
    a = save(synthetic_log(seed=1, config={"host": "x" * 300}, duration_s=0.4), tmp_path / "a.npz")
    r = cli("export", a, "-o", str(tmp_path / "ds1"), "--partition-by", "host")
    assert r.returncode == 2 and "host" in r.stderr
    value = "réplica/日本 1"
    b = save(synthetic_log(seed=2, config={"host": value}, duration_s=0.4), tmp_path / "b.npz")
    ds = tmp_path / "ds2"
    assert cli("export", b, "-o", str(ds), "--partition-by", "host").returncode == 0
    t = pads.dataset(str(ds / "runs"), format="parquet", partitioning="hive").to_table()
    assert t.column("host").to_pylist() == [value]
    r = cli("fleet", str(ds), "--by", "host", "--format", "jsonl")
    assert json.loads(r.stdout)["group"] == value


@pytest.fixture()
def dataset(runs, tmp_path) -> Path:
    ds = tmp_path / "ds"
    assert cli("export", *runs, "-o", str(ds), "--partition-by", "rung").returncode == 0
    return ds


def retype(path: Path, column: str, values) -> None:
    t = pq.read_table(path)
    i = t.schema.get_field_index(column)
    pq.write_table(t.set_column(i, column, pa.array(values)), path)


@pytest.mark.parametrize(
    "table,column,make",
    [
        ("gaps", "gap_ms", lambda n: [str(i) for i in range(n)]),
        ("gaps", "primary", lambda n: list(range(n))),
        ("runs", "gaps", lambda n: ["many"] * n),
        ("runs", "run", lambda n: list(range(n))),
    ],
)
def test_fleet_checks_a_datasets_columns_and_types(dataset, table, column, make):
    f = sorted((dataset / table).rglob("*.parquet"))[0]
    retype(f, column, make(pq.read_metadata(f).num_rows))
    r = cli("fleet", str(dataset), "--by", "rung")
    assert r.returncode == 2 and column in r.stderr, r.stderr


def test_fleet_refuses_a_duplicated_run_and_a_fifo(dataset):
    f = sorted((dataset / "runs").rglob("*.parquet"))[0]
    shutil.copy(f, f.with_name("copy.parquet"))
    r = cli("fleet", str(dataset), "--by", "rung")
    assert r.returncode == 2 and "more than one row" in r.stderr
    f.with_name("copy.parquet").unlink()
    os.mkfifo(f.with_name("pipe.parquet"))
    r = cli("fleet", str(dataset), "--by", "rung")
    assert r.returncode == 2 and "FIFO" in r.stderr
    f.with_name("pipe.parquet").unlink()
    (dataset / "_tracekit_dataset.json").unlink()
    os.mkfifo(dataset / "_tracekit_dataset.json")
    assert cli("fleet", str(dataset), "--by", "rung").returncode == 2


@pytest.mark.parametrize("keys", ["rung,rung", "_x", ".x", "a\\b", "k" * 200, "run"])
def test_bad_partition_key_names(runs, tmp_path, keys):
    r = cli("export", runs[0], "-o", str(tmp_path / "ds"), "--partition-by", keys)
    assert r.returncode == 2


# -- --ray ----------------------------------------------------------------------------------


@pytest.mark.parametrize("address", ["127.0.0.1:1", "not-an-address"])
@pytest.mark.parametrize("command", ["export", "fleet"])
def test_a_bad_ray_address_is_one_line(runs, tmp_path, command, address):
    pytest.importorskip("ray")
    args = ["-o", str(tmp_path / "ds")] if command == "export" else ["--by", "rung"]
    r = cli(command, *runs, *args, "--ray", address)
    assert r.returncode == 2 and address in r.stderr, r.stderr
    assert not (tmp_path / "ds").exists() or command == "fleet"


def test_a_retyped_column_under_ray_is_the_same_one_line(dataset):
    pytest.importorskip("ray")
    f = sorted((dataset / "gaps").rglob("*.parquet"))[0]
    retype(f, "gap_ms", [str(i) for i in range(pq.read_metadata(f).num_rows)])
    here = cli("fleet", str(dataset), "--by", "rung")
    try:  # Ray logs lines of its own to stderr (its auth-token notice): tracekit's compared
        on_ray = subprocess.run(
            [*tracekit_cmd(), "fleet", str(dataset), "--by", "rung", "--ray"],
            capture_output=True, text=True, timeout=CASE_TIMEOUT_S, env=env(),
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"fleet --ray: no answer after {CASE_TIMEOUT_S} s (a hang)")
    assert "Traceback" not in on_ray.stderr and "internal error" not in on_ray.stderr
    ours = [x for x in on_ray.stderr.splitlines() if x.startswith("tracekit:")]
    assert here.returncode == on_ray.returncode == 2
    assert ours == [here.stderr.strip()] and "gap_ms" in ours[0], on_ray.stderr


@pytest.mark.parametrize(
    "argv",
    [["analyze"], ["gaps"], ["ttft", "--format", "csv"], ["whatif"], ["compare"], ["report"],
     ["trace"], ["merge"], ["fleet"]],
    ids=lambda a: a[0],
)  # fmt: skip
@pytest.mark.parametrize("where", ["missing_folder", "a_folder"])
def test_output_into_a_missing_folder_or_onto_a_folder_is_one_line(runs, tmp_path, argv, where):
    out = tmp_path / "nope" / "out.txt" if where == "missing_folder" else tmp_path
    run = str(tmp_path) if argv[0] == "merge" else runs[0]
    r = cli(*argv[:1], run, *argv[1:], "-o", str(out))
    assert r.returncode == 2, r.stderr
    assert ("does not exist" if where == "missing_folder" else "is a directory") in r.stderr
    assert not (tmp_path / "nope").exists()


@pytest.mark.parametrize("role", ["engine_core-1", "api_server-2"])
def test_an_identity_without_a_pid_merges_and_says_pid_unknown(pair, tmp_path, role):
    # a process identity is the recorder's config["process"]; `pid` names the process in
    # the merge's table, nothing joins on it: without one the run merges and the table
    # says "pid ?" (it raised KeyError after writing the merged file)
    d = copy_pair(pair, tmp_path / "d")
    log = d / f"{role}.npz"
    doc = json_member(log, "config")
    del doc["process"]["pid"]
    rewrite_npz(log, config=np.array(json.dumps(doc)))
    out = tmp_path / "m.npz"
    r = cli("merge", str(d), "-o", str(out))
    assert r.returncode == 0, r.stderr
    name = role.split("-")[0]
    assert any(ln.startswith(name) and " pid ?" in ln for ln in r.stdout.splitlines()), r.stdout
    checked(out)
