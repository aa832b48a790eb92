"""Every `tracekit ...` command that README.md and docs/ show in a code block runs as written.

The commands are read from the fenced code blocks of README.md and docs/*.md (a line that
starts with `tracekit `, comments after `#` left to the shell), and run by bash in a folder
whose `raw/` holds a small demo ladder recorded with the names the docs use
(`raw/baseline__s1.npz`, `raw/gc-freeze__s2.npz`, ...). Each must exit 0. A command that
needs what this machine cannot give (a Ray cluster's address, a `vllm serve` run's
folder, a long live run) is listed in `NOT_HERE` with the reason, so a new command in the
docs is run unless someone says why not.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: command prefix -> why it does not run here (checked elsewhere where it can be)
NOT_HERE = {
    "tracekit merge raw/serve": "needs a `vllm serve` run (tests/adapters/test_adapters_vllm_serve.py)",
    "tracekit analyze raw/serve": "needs a `vllm serve` run (tests/adapters/test_adapters_vllm_serve.py)",
    "tracekit report raw/serve": "needs a `vllm serve` run (tests/adapters/test_adapters_vllm_serve.py)",
    "tracekit trace raw/serve": "needs a `vllm serve` run (tests/adapters/test_adapters_vllm_serve.py)",
    "tracekit analyze /shared/raw": "a cluster's shared folder and address (tests/analysis/test_ray.py)",
    "tracekit fleet ds/ --by replica --format jsonl --ray auto": "a Ray cluster to join",
    "tracekit analyze raw/*.npz --ray auto": "a Ray cluster to join (tests/analysis/test_ray.py)",
    "tracekit demo ladder": "records a whole ladder (the README's first command; CI time)",
    "tracekit demo run --rate 8 --duration 60 --metrics-port 9400": "serves for a minute on a "
    "fixed port (tests/live/test_live.py and tests/live/test_live_prometheus.py run it short)",
}


def documented_commands() -> list[tuple[str, str]]:
    out = []
    for doc in DOCS:
        in_block = False
        for line in doc.read_text().splitlines():
            if line.lstrip().startswith("```"):
                in_block = not in_block
                continue
            cmd = line.strip().removeprefix("$ ")
            if in_block and cmd.startswith("tracekit "):
                out.append((doc.name, cmd))
    return out


COMMANDS = documented_commands()


def _skip_reason(cmd: str) -> str | None:
    return next((why for pre, why in NOT_HERE.items() if cmd.startswith(pre)), None)


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory):
    """raw/ with the rungs and seeds the docs name, short runs; ds/ made by the README's
    export command when the fleet command needs it (they run in order)."""
    d = tmp_path_factory.mktemp("docs")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    subprocess.run(
        [sys.executable, "-m", "tracekit", "demo", "ladder", "--seeds", "1,2", "--steps", "120",
         "--rungs", "baseline,+gc.freeze,+admit watermark", "--out", str(d / "raw")],
        check=True, env=env, capture_output=True, timeout=600,
    )  # fmt: skip
    return d


def test_the_docs_show_commands():
    assert len(COMMANDS) >= 15, COMMANDS


@pytest.mark.parametrize(
    "doc,cmd", COMMANDS, ids=[f"{d}:{c.split('#')[0].strip()[:60]}" for d, c in COMMANDS]
)
def test_documented_command_runs_as_written(doc, cmd, docs_dir):
    why = _skip_reason(cmd)
    if why:
        pytest.skip(why)
    bindir = pathlib.Path(sys.executable).parent
    if not (bindir / "tracekit").exists():
        pytest.skip("the tracekit console script is not installed beside this interpreter")
    env = {
        **os.environ,
        "PATH": f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}",
        "BROWSER": "true",  # `report --open`: a browser that opens nothing and exits 0
    }
    if re.search(r"--ray\b", cmd) and importlib.util.find_spec("ray") is None:
        pytest.skip("needs the ray extra (pip install -e '.[ray]'); tests/analysis/test_ray.py runs it")
    if "ds/" in cmd and "export" not in cmd and not (docs_dir / "ds").exists():
        pytest.skip("runs after the export command that writes ds/")
    p = subprocess.run(
        ["bash", "-c", cmd], cwd=docs_dir, env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, f"{doc}: `{cmd}` exited {p.returncode}:\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr and "internal error" not in p.stderr, p.stderr[-3000:]


def test_no_stale_module_paths_in_the_docs():
    """Every `tracekit/...py` path and `tracekit.x.y` module the docs name exists."""
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"\btracekit/[\w/]+\.py\b", text):
            if not (ROOT / m.group(0)).exists():
                stale.append(f"{doc.name}: {m.group(0)}")
        for m in re.finditer(r"`(tracekit(?:\.\w+)+)", text):
            parts = m.group(1).split(".")
            here = ROOT / "tracekit" / parts[1]
            if here.with_suffix(".py").exists() or (here / "__init__.py").exists():
                # a module path, then attributes: the longest module prefix, then the rest
                k = len(parts)
                while k > 2 and not _is_module(parts[:k]):
                    k -= 1
                if not _has_attrs(".".join(parts[:k]), parts[k:]):
                    stale.append(f"{doc.name}: {m.group(1)}")
            elif parts[1] in FLAT_MODULES and not _has_attrs("tracekit", parts[1:2]):
                stale.append(f"{doc.name}: {m.group(1)} (a module of the old flat layout)")
    assert not stale, "\n".join(stale)


#: the modules of the flat layout before the stage packages (a doc naming one is stale)
FLAT_MODULES = {
    "hooks", "sinks", "stream", "rawlog", "archive", "published", "validate", "merge",
    "frontend", "analysis", "gaps", "compare", "verdict", "export", "fleet", "cluster",
    "device", "signals", "ttft",
}  # fmt: skip


def _is_module(parts: list[str]) -> bool:
    p = ROOT.joinpath(*parts)
    return p.with_suffix(".py").exists() or (p / "__init__.py").exists()


def _has_attrs(module: str, attrs: list[str]) -> bool:
    import importlib

    try:
        obj = importlib.import_module(module)
    except ImportError:
        return False
    for a in attrs:
        if not hasattr(obj, a):
            return False
        obj = getattr(obj, a)
    return True


def test_shell_is_bash():
    assert shutil.which("bash")
