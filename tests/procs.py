"""Running the real `tracekit` command and small Python scripts in subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tracekit_cmd() -> list[str]:
    """The installed `tracekit` console script beside this interpreter (not a pyenv shim,
    which would start a shell first), or the same entry point through `python -c`."""
    script = Path(sys.executable).parent / "tracekit"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "from tracekit.cli import main; main()"]


def env() -> dict[str, str]:
    e = dict(os.environ)
    e.pop("TRACEKIT_DEBUG", None)
    e["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), e.get("PYTHONPATH")]))
    e["OMP_NUM_THREADS"] = e["OPENBLAS_NUM_THREADS"] = e["MKL_NUM_THREADS"] = "1"
    return e


def run_cli(
    *args: str, timeout: float = 60, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*tracekit_cmd(), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env(),
        cwd=cwd,
    )


def _interruptible() -> None:
    """In the child before it runs: Ctrl-C as in a terminal. A test runner started in the
    background by a shell without job control has SIGINT ignored, and its children would
    inherit that (Python then leaves it ignored, and so does tracekit)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def python(script: str, *args: str, **kw) -> subprocess.Popen:
    """Start `python -c script args...` with stdout/stderr piped, SIGINT at its default."""
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env(),
        preexec_fn=_interruptible,
        **kw,
    )
