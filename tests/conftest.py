"""Fixtures shared by every test. The autouse guard fails a test that leaves a hook behind."""

from __future__ import annotations

import gc
import os
import secrets
import signal
import sys
import threading

import pytest
from hypothesis import settings

# Tests live in one folder per pipeline stage (tests/capture, tests/log, ...); their shared
# helpers (logbuilder, synthlog, procs, ...) here. A test may import another stage's test
# module for its builders (test_merge's record_pair): every stage folder is on the path.
_HERE = os.path.dirname(os.path.abspath(__file__))
for _stage in sorted(os.listdir(_HERE)):
    if os.path.isdir(os.path.join(_HERE, _stage)) and not _stage.startswith(("_", ".")):
        sys.path.insert(0, os.path.join(_HERE, _stage))
from promserver import prometheus  # noqa: F401  (the real Prometheus fixture, for every module)

from tracekit.analysis.window import run_span_s
from tracekit.capture import signals
from tracekit.capture.recorder import active_recorders
from tracekit.log.reader import load

# Property tests (hypothesis) are derandomised by default: each test's examples are fixed by
# its name, so a CI run is reproducible and never fails at random (no example database is
# replayed either). TRACEKIT_PROPERTY_SEED=random runs them on fresh random examples, with a
# seed printed in the header (TRACEKIT_PROPERTY_SEED=<that number> reruns the same ones).
settings.register_profile("fixed", derandomize=True)
settings.register_profile("random", derandomize=False)
_seed_env = os.environ.get("TRACEKIT_PROPERTY_SEED", "").strip()
PROPERTY_SEED = (
    None if not _seed_env else secrets.randbelow(2**32) if _seed_env == "random" else int(_seed_env)
)
settings.load_profile("fixed" if PROPERTY_SEED is None else "random")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if PROPERTY_SEED is not None and config.getoption("hypothesis_seed", None) is None:
        config.option.hypothesis_seed = str(PROPERTY_SEED)  # read by hypothesis's plugin


def pytest_report_header(config):
    if PROPERTY_SEED is None:
        return "property tests: derandomised (TRACEKIT_PROPERTY_SEED=random for a random run)"
    return f"property tests: random, seed {PROPERTY_SEED} (TRACEKIT_PROPERTY_SEED={PROPERTY_SEED})"


def _is_tracekit(cb) -> bool:
    owner = getattr(cb, "__self__", cb)
    return type(owner).__module__.startswith("tracekit") or getattr(
        cb, "__module__", ""
    ).startswith("tracekit")


@pytest.fixture(autouse=True)
def no_hooks_left_behind(request):
    """Fail any test that leaves a gc callback, a running recorder, a SIGTERM or SIGINT
    handler, a part-writer thread, an engine-adapter method patch or an NVTX module import
    behind (tracekit installs and removes these in matching pairs).
    A test marked `nvtx` may import the real package; it is unloaded again afterwards."""
    callbacks = list(gc.callbacks)
    sigterm = signal.getsignal(signal.SIGTERM)
    sigint = signal.getsignal(signal.SIGINT)
    writers = _writer_threads()
    patches = _installed_patches()
    nvtx_loaded = "nvtx" in sys.modules
    allows_nvtx = request.node.get_closest_marker("nvtx") is not None
    yield
    leaked = []
    ours = [cb for cb in gc.callbacks if cb not in callbacks and _is_tracekit(cb)]
    if ours:  # other libraries (hypothesis) may add their own; tracekit's must be gone
        leaked.append(f"tracekit gc callbacks left: {ours!r}")
        for cb in ours:
            gc.callbacks.remove(cb)
    if active_recorders():
        leaked.append(f"recorders still running: {active_recorders()!r}")
        for r in active_recorders():
            r.stop()
    if signal.getsignal(signal.SIGTERM) != sigterm:
        leaked.append("SIGTERM handler not restored")
        signal.signal(signal.SIGTERM, sigterm)
    if signal.getsignal(signal.SIGINT) != sigint:
        leaked.append("SIGINT handler not restored")
        signal.signal(signal.SIGINT, sigint)
    if signals.IN_GC[0]:  # would defer every SIGTERM to a collection that never ends
        leaked.append("the in-collection flag was left set")
        signals.IN_GC[0] = False
    if _writer_threads() - writers:
        leaked.append(f"part-writer threads still running: {_writer_threads() - writers}")
    if _installed_patches() != patches:
        leaked.append(f"{_installed_patches() - patches} engine-adapter patch(es) not restored")
    if not nvtx_loaded and "nvtx" in sys.modules and not getattr(sys.modules["nvtx"], "_fake", 0):
        if allows_nvtx:
            for name in [m for m in sys.modules if m == "nvtx" or m.startswith("nvtx.")]:
                del sys.modules[name]
        else:
            leaked.append("nvtx imported by a test that did not ask for NVTX")
    assert not leaked, "; ".join(leaked)


def _writer_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "tracekit-writer" and t.is_alive()}


def _installed_patches() -> int:
    mod = sys.modules.get("engine_adapters._common")  # only if a test imported the adapters
    return mod.installed_patches() if mod is not None else 0


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory) -> str:
    """A demo run with recompute evictions (with their causes), GC and eager steps, in at
    least five parts: the run the slice readers' tests read with a small slice budget (made
    once, read only). The recorder flushes a part every 0.4 s of the run's clock (here the
    CPU's): 300 steps took 2.5-5.2 s of CPU on the machines measured, 6-13 parts; a faster
    machine's run is made again with half the interval. More parts cost the tests that read
    it: 21 parts took ~30 s longer than 9 (of ~95 s)."""
    import subprocess

    flush = 0.4
    while True:
        d = tmp_path_factory.mktemp("sliced")
        r = subprocess.run(
            [sys.executable, "-m", "tracekit", "demo", "run", "--steps", "300", "--out", str(d),
             "--preemption-mode", "recompute", "--timer", "cpu", "--flush-interval",
             str(flush), "--quiet"],
            capture_output=True, text=True, timeout=600,
            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        )  # fmt: skip
        assert r.returncode == 0, r.stderr
        parts = list((d / "baseline__s1.npz.parts").glob("part-*.tkp"))
        if len(parts) >= 5 or flush < 0.1:
            break
        flush /= 2
    assert len(parts) >= 5, f"{len(parts)} parts at a flush every {flush} s"
    return str(d / "baseline__s1.npz")


class Span:
    """Windows of a run as fractions of its span. The demo run's length depends on the
    machine (its clock is the CPU's), and where its first step lands on what ran before it:
    a test's window of it is a stretch of the run ("0.15..0.3": from 15 % to 30 % of the
    way from its first recorded moment to its last), never seconds that one machine's run
    happened to cover."""

    def __init__(self, lo: float, hi: float) -> None:
        self.lo, self.hi = lo, hi

    def window(self, spec: str) -> str:
        """ "A..B" of fractions (either may be left open) as `--window`'s seconds."""
        a, b = spec.split("..")
        return "..".join(f"{self.lo + float(x) * (self.hi - self.lo):.6f}" if x else ""
                         for x in (a, b))  # fmt: skip

    def width(self, fraction: float) -> str:
        """`--width` (seconds) of this fraction of the run."""
        return f"{fraction * (self.hi - self.lo):.6f}"


@pytest.fixture(scope="session")
def demo_span(demo_run) -> Span:
    """The demo run's span (`tracekit.analysis.window.run_span_s`), for its windows."""
    return Span(*run_span_s(load(demo_run)))
