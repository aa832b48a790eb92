"""Every hook tracekit installs is removed: on stop, when the engine raises, when stop
itself fails, and at interpreter exit when nobody called stop.

Hooks: the gc callback, the SIGTERM handler, the atexit registration, the part-writer
thread, NVTX ranges (a fake `nvtx` module that counts pushes and pops), and the method
patches the engine adapters install. tests/conftest.py checks the same after every test.
"""

from __future__ import annotations

import gc
import json
import signal
import sys
import threading
import types

import pytest
from procs import python

import tracekit
from tracekit.capture.recorder import Recorder, active_recorders
from tracekit.capture.sinks import CaptureError

#: Starts a recorder with every hook (gc, SIGTERM, NVTX through a fake module, parts on
#: disk) and never calls stop(). An atexit function registered *before* the recorder runs
#: *after* the recorder's own (atexit is last in, first out) and reports what is left.
EXIT_SCRIPT = r"""
import atexit, gc, json, signal, sys, threading, time, types

class FakeNvtx(types.ModuleType):
    _fake = 1
    pushes = pops = 0
    def push_range(self, message=None, color=None, domain=None, **kw):
        FakeNvtx.pushes += 1
        return -1
    def pop_range(self, domain=None):
        FakeNvtx.pops += 1
        return -1

sys.modules["nvtx"] = FakeNvtx("nvtx")
import tracekit
from tracekit.capture.recorder import active_recorders

out, how = sys.argv[1], sys.argv[2]

def report():
    print(json.dumps({
        "gc_callbacks": [repr(cb) for cb in gc.callbacks],
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "running": len(active_recorders()),
        "writers": [t.name for t in threading.enumerate() if t.name == "tracekit-writer"],
        "pushes": FakeNvtx.pushes,
        "pops": FakeNvtx.pops,
    }), flush=True)

atexit.register(report)
rec = tracekit.Recorder(out, nvtx=True, flush_interval_s=0.01).start()
for i in range(50):
    with rec.step():
        with rec.segment("decode"):
            gc.collect(0)
        rec.emit(["a", "b"])
if how == "raise":
    with rec.step():
        with rec.segment("prefill"):
            raise RuntimeError("the engine crashed inside a segment")
if how == "sigterm":
    print("ready", flush=True)
    while True:
        with rec.step():
            with rec.segment("decode"):
                time.sleep(0.001)
"""


@pytest.mark.parametrize("how", ["end", "raise", "sigterm"])
def test_at_interpreter_exit_every_hook_is_gone_and_the_npz_complete(tmp_path, how):
    out = tmp_path / "run.npz"
    proc = python(EXIT_SCRIPT, str(out), how)
    try:
        if how == "sigterm":
            assert proc.stdout.readline() == "ready\n"
            proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == {"end": 0, "raise": 1, "sigterm": 128 + signal.SIGTERM}[how], stderr
    state = json.loads(stdout.splitlines()[-1])
    assert state == {
        "gc_callbacks": [],
        "sigterm_default": True,
        "running": 0,
        "writers": [],
        "pushes": state["pushes"],
        "pops": state["pushes"],
    }
    assert state["pushes"] >= 100  # a step and a segment range per step
    assert out.exists() and (tmp_path / "run.npz.parts" / "final.json").exists()
    log = tracekit.load(out)
    assert len(log.steps) >= 50 + (how == "raise")
    assert (log.gc_pauses.generation == 0).sum() >= 50
    assert log.meta["interrupted"] is False


@pytest.fixture
def counting_nvtx(monkeypatch):
    class FakeNvtx(types.ModuleType):
        _fake = 1

        def __init__(self) -> None:
            super().__init__("nvtx")
            self.depth = {}

        def push_range(self, message=None, color=None, domain=None, **kw):
            t = threading.get_ident()
            self.depth[t] = self.depth.get(t, 0) + 1
            return -1

        def pop_range(self, domain=None):
            t = threading.get_ident()
            self.depth[t] -= 1
            assert self.depth[t] >= 0, "pop without a push"
            return -1

    mod = FakeNvtx()
    monkeypatch.setitem(sys.modules, "nvtx", mod)
    return mod


def test_a_stop_that_fails_still_removes_every_hook(tmp_path, counting_nvtx):
    """Neither parts nor the log can be written any more (an unmounted disk): stop()
    raises, but the gc callback, the SIGTERM handler, the writer thread and NVTX ranges are
    all gone, and the run is still in memory."""
    sigterm = signal.getsignal(signal.SIGTERM)
    rec = Recorder(tmp_path / "run.npz", nvtx=True, flush_interval_s=0.0)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(CaptureError, match="could not be written"):
        with rec:
            with rec.step():
                with rec.segment("decode"):
                    pass
            # every later write fails: a folder cannot be made inside a regular file
            rec._own.dir = str(blocker / "run.npz.parts")
            rec._own.out = str(blocker / "run.npz")
            with rec.step():
                rec.emit(["a"])
    assert len(rec.log().steps) == 2 and len(rec.log().emissions) == 1
    assert not rec.running and not active_recorders()
    assert rec._on_gc not in gc.callbacks
    assert signal.getsignal(signal.SIGTERM) == sigterm
    assert not [t for t in threading.enumerate() if t.name == "tracekit-writer"]
    assert set(counting_nvtx.depth.values()) == {0}


def test_hooks_from_several_threads_and_recorders_are_removed(counting_nvtx):
    """Two recorders at once, segments from worker threads, one recorder stopped from
    another thread: every callback and range is removed; only one SIGTERM handler is
    installed (the first recorder's) and the original is back after both stop."""
    sigterm = signal.getsignal(signal.SIGTERM)
    a = Recorder(nvtx=True).start()
    b = Recorder(nvtx=True).start()
    assert a._on_gc in gc.callbacks and b._on_gc in gc.callbacks

    def work() -> None:
        for _ in range(200):
            with a.segment("tok"), b.segment("tok"):
                pass

    threads = [threading.Thread(target=work) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stopper = threading.Thread(target=b.stop)
    stopper.start()
    stopper.join()
    a.stop()
    assert a._on_gc not in gc.callbacks and b._on_gc not in gc.callbacks
    assert signal.getsignal(signal.SIGTERM) == sigterm
    assert set(counting_nvtx.depth.values()) == {0}
    assert len(a.log().segments) == len(b.log().segments) == 600


def test_the_adapters_count_their_patches_for_the_guard():
    """The conftest guard sees adapter patches through `installed_patches()`."""
    common = pytest.importorskip("engine_adapters._common")

    class Engine:
        def step(self) -> int:
            return 1

    e = Engine()
    before = common.installed_patches()
    p = common.Patches()
    p.wrap(e, "step", lambda orig: lambda: orig() + 1)
    assert e.step() == 2 and common.installed_patches() == before + 1
    p.restore()
    assert e.step() == 1 and common.installed_patches() == before
