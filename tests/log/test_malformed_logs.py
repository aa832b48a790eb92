"""Bad input: every malformed log analyses (with a warning saying what is odd) or is
rejected with one line naming the file and what is wrong. Never a traceback, never a hang,
never a pickle loaded.

The corpus (tests/malformed.py) is >= 1,000 deterministic files derived from one valid v1
log and one valid published-layout log. All of them go through the Python API (fast); a
sample goes through the real `tracekit` command in subprocesses.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import signal
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from malformed import Case, Pickled, cases, npz_bytes, object_npy, v1_arrays, zip_with
from procs import REPO, run_cli

import tracekit
from tracekit.analysis.figures import analyze
from tracekit.errors import LogError
from tracekit.log.validate import MAX_ABS_TIME_S, MAX_COUNT
from tracekit.render import text

#: A case taking longer than this through load + analyze counts as a hang.
CASE_DEADLINE_S = 5.0

CASES = cases()


@contextlib.contextmanager
def deadline(seconds: float):
    """Raise TimeoutError in the main thread after `seconds` (SIGALRM; restored after)."""

    def on_alarm(signum, frame):
        raise TimeoutError(f"no answer after {seconds} s")

    prev = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, prev)


def outcome(path: Path) -> tuple[str, str]:
    """("ok", warnings) or ("reject", message); anything else raises out of here.

    Python warnings are errors: on the command line a numpy RuntimeWarning is extra
    stderr lines, which breaks the one-line promise as surely as a traceback."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        try:
            log = tracekit.load(path)
            a = analyze(log)
        except LogError as e:
            return "reject", str(e)
        assert a.reconcile_max_err_ms < 1e-6
        json.dumps(a.to_dict(), allow_nan=False)  # what `analyze --format jsonl` writes
        text.analyze_report([a])  # what `analyze` prints
        return "ok", "; ".join(a.warnings)


def check_case(c: Case, path: Path) -> str | None:
    """What is wrong with tracekit's answer to case `c` (None: nothing)."""
    c.write(path)
    try:
        with deadline(CASE_DEADLINE_S):
            got, msg = outcome(path)
    except Exception as e:  # noqa: BLE001 -- every other exception is the finding
        return f"{c.name}: {type(e).__name__}: {str(e)[:200]}"
    if c.expect != "any" and got != c.expect:
        return f"{c.name}: expected {c.expect}, got {got}: {msg[:200]}"
    if c.needle and c.needle not in msg:
        return f"{c.name}: {got} without naming {c.needle!r}: {msg[:200]}"
    if got == "reject" and (not msg.startswith(f"{path}: ") or "\n" in msg):
        return f"{c.name}: the message is not one line starting with the file: {msg[:200]!r}"
    return None


def test_the_corpus_is_big_and_deterministic():
    assert len(CASES) >= 1000
    kinds = {c.expect for c in CASES}
    assert kinds == {"ok", "reject", "any"}
    digest = hashlib.sha256(b"".join(c.payload for c in CASES)).hexdigest()
    again = hashlib.sha256(b"".join(c.payload for c in cases())).hexdigest()
    assert digest == again


def test_every_malformed_log_analyses_or_is_rejected_in_one_line(tmp_path):
    marker = Path(Pickled.marker)
    marker.unlink(missing_ok=True)
    failures = [f for i, c in enumerate(CASES) if (f := check_case(c, tmp_path / f"{i:04d}.npz"))]
    assert not marker.exists(), "a pickle in a log was loaded"
    assert not failures, f"{len(failures)} of {len(CASES)} cases failed:\n" + "\n".join(
        failures[:40]
    )


# -- the real command line ----------------------------------------------------------------


def cli_sample() -> list[Case]:
    """About 30 cases: every 'reject' kind of problem once (first of its kind by name)."""
    picked: dict[str, Case] = {}
    for c in CASES:
        if c.expect != "reject":
            continue
        kind = re.sub(r"[0-9.e+-]+|\[.*?\]|\bv1\b|published", "", c.name).split()
        key = " ".join(kind[-2:])
        picked.setdefault(key, c)
    sample = list(picked.values())
    step = max(1, len(sample) // 30)
    return sample[::step][:30]


def test_the_cli_rejects_malformed_logs_with_exit_2_and_one_stderr_line(tmp_path):
    sample = cli_sample()
    assert len(sample) >= 25
    paths = [str(c.write(tmp_path / f"bad{i:02d}.npz")) for i, c in enumerate(sample)]
    # `analyze`, one process per file (each one is its own exit code)...
    analysed = list(range(0, len(sample), 2))  # about 15: each process is ~0.3 s of CPU
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda i: run_cli("analyze", paths[i]), analysed))
    for i, r in zip(analysed, results, strict=True):
        what = f"{sample[i].name} through `tracekit analyze`"
        assert r.returncode == 2, f"{what}: exit {r.returncode}\n{r.stderr}"
        assert "Traceback" not in r.stdout + r.stderr, what
        assert r.stdout == "", what
        lines = r.stderr.splitlines()
        assert len(lines) == 1, f"{what}: {r.stderr!r}"
        assert lines[0].startswith(f"tracekit: error: {paths[i]}: "), f"{what}: {lines[0]!r}"
    # ... and `check` on all of them at once: one BAD line each, in order, nothing on stderr
    r = run_cli("check", *paths)
    assert r.returncode == 2
    assert "Traceback" not in r.stdout + r.stderr
    assert r.stderr == ""
    lines = r.stdout.splitlines()
    assert len(lines) == len(paths), r.stdout
    for c, p, line in zip(sample, paths, lines, strict=True):
        assert line.startswith(f"BAD   {p}: "), f"{c.name}: {line!r}"


def test_check_reports_each_file_and_exits_2_if_any_is_bad(tmp_path):
    good = tmp_path / "good.npz"
    good.write_bytes(npz_bytes(v1_arrays()))
    odd = tmp_path / "odd.npz"
    a = v1_arrays()
    a["evictions.t_readmit_s"] = np.array([np.nan])
    odd.write_bytes(npz_bytes(a))
    text = tmp_path / "notes.npz"
    text.write_text("not a log\n")
    parts = tmp_path / "run.npz.parts"
    parts.mkdir()
    (parts / "meta.json").write_text("{}")

    r = run_cli("check", str(good), str(odd))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.splitlines()[0].startswith(f"ok    {good}: 12 steps, 33 emissions")
    assert "1 warning(s)" in r.stdout.splitlines()[1]
    assert "never readmitted" in r.stderr

    r = run_cli("check", str(good), str(text), str(parts), str(tmp_path / "missing.npz"))
    assert r.returncode == 2
    lines = r.stdout.splitlines()
    assert [ln.split()[0] for ln in lines] == ["ok", "BAD", "BAD", "BAD"], r.stdout
    assert f"{text}: file: not a readable .npz archive" in lines[1]
    assert f"{parts}: meta.json: not a recorder's meta" in lines[2]  # read in place: checked
    assert "does not exist" in lines[3]
    assert "Traceback" not in r.stdout + r.stderr


def test_load_on_a_parts_folder_reads_it_and_names_a_bad_meta(tmp_path):
    parts = tmp_path / "run.npz.parts"
    parts.mkdir()
    (parts / "meta.json").write_text("{}")
    with pytest.raises(LogError, match=r"run\.npz\.parts: meta\.json: not a recorder's meta"):
        tracekit.load(parts)
    with pytest.raises(LogError, match="is a directory"):
        tracekit.load(tmp_path)


# -- pickles ------------------------------------------------------------------------------


def test_a_pickle_in_a_log_is_never_loaded(tmp_path):
    marker = Path(Pickled.marker)
    marker.unlink(missing_ok=True)
    base = v1_arrays()
    for i, key in enumerate(["config", "steps.t_start_s", "extra.payload", "mystery"]):
        rest = {k: v for k, v in base.items() if k != key}
        p = tmp_path / f"p{i}.npz"
        p.write_bytes(zip_with(rest, {key + ".npy": object_npy(Pickled())}))
        try:
            log = tracekit.load(p)
        except LogError as e:
            assert "pickle" in str(e)
        else:  # an unknown member is skipped unread, and said so
            assert key == "mystery"
            assert any("ignored 1 unknown archive member" in w for w in log.warnings)
    assert not marker.exists(), "unpickling ran"


def test_every_np_load_in_tracekit_refuses_pickles():
    """Every `np.load` / `read_array` call in tracekit passes allow_pickle=False, and nothing
    imports pickle (or its relatives)."""
    calls = scanned = 0
    for py in sorted((REPO / "tracekit").rglob("*.py")):
        scanned += 1
        src = py.read_text()
        for m in re.finditer(r"\b(?:np|numpy)\.load\(|\bread_array\(", src):
            call = src[m.start() : src.index(")", m.end()) + 1]
            assert "allow_pickle=False" in call, f"{py.name}: {call}"
            calls += 1
        assert not re.search(
            r"^\s*(?:import|from)\s+(?:c?pickle|dill|joblib|marshal)\b", src, re.M
        ), py
        assert "allow_pickle=True" not in src, py
    # every array is read through tracekit.log.archive (npz) or tracekit.log.partfile
    # (parts): no np.load is left, and the scan saw the whole package
    assert scanned >= 50 and calls == 0, (scanned, calls)


# -- the rules themselves -----------------------------------------------------------------


def _bullets(text: str) -> list[str]:
    """The '- ' items of the first list in `text`, whitespace collapsed."""
    body = text.strip().split("\n\n")
    items = next(b for b in body if b.lstrip().startswith("- "))
    return [" ".join(b.split()) for b in re.split(r"^\s*- ", items, flags=re.M) if b.strip()]


def test_docs_and_validate_docstring_list_the_same_rules():
    """docs/input-validation.md's two lists are validate.py's docstring, item for item."""
    import tracekit.log.validate as v

    doc = (REPO / "docs" / "input-validation.md").read_text()
    src = v.__doc__
    for doc_head, src_head in (
        ("## Rejected", "Rejected ("),
        ("## Accepted with a warning", "Accepted with a warning ("),
    ):
        in_doc = _bullets(doc.split(doc_head, 1)[1].split("\n## ", 1)[0])
        in_src = _bullets(src.split(src_head, 1)[1].split("\n", 1)[1])
        assert in_doc == in_src, f"{doc_head!r} differs from validate.py's docstring"
    assert "2**31 - 1" in doc and MAX_COUNT == 2**31 - 1
    assert "(1e7 s)" in doc and MAX_ABS_TIME_S == 1e7
