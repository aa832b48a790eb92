"""NVTX ranges: one per step and segment, in the `tracekit` domain, one colour per label,
balanced and nested also when the engine raises, never conditioned on a return value.

Most tests use a fake `nvtx` module that records every call (and returns -1 from push, as
the real library does under Nsight Systems: the return-value trap). One test, marked
`nvtx`, drives the real package (its calls are no-ops without a profiler attached).
"""

from __future__ import annotations

import sys
import threading
import types

import pytest

from tracekit.capture.device import FakeClock, FakeDeviceTimer
from tracekit.capture.recorder import NVTX_DOMAIN, Recorder, active_recorders
from tracekit.labels import colour


class FakeNvtx(types.ModuleType):
    """Records (kind, message, colour, domain, thread) per call; push and pop return -1."""

    _fake = 1

    def __init__(self) -> None:
        super().__init__("nvtx")
        self.calls: list[tuple] = []
        self._lock = threading.Lock()

    def push_range(self, message=None, color=None, domain=None, category=None, payload=None):
        with self._lock:
            self.calls.append(("push", message, color, domain, threading.get_ident()))
        return -1  # what Nsight Systems returns; a guard that trusted it would pop at once

    def pop_range(self, domain=None):
        with self._lock:
            self.calls.append(("pop", None, None, domain, threading.get_ident()))
        return -1

    def mark(self, message=None, **kw):  # body markers, to see where ranges close
        with self._lock:
            self.calls.append(("mark", message, None, None, threading.get_ident()))

    def tree(self, thread: int | None = None) -> list:
        """Nested (message, children) per thread; fails on an unbalanced or foreign pop."""
        roots: list = []
        stack: list = []
        for kind, msg, _c, dom, th in self.calls:
            if thread is not None and th != thread:
                continue
            if kind == "push":
                assert dom == NVTX_DOMAIN
                node = (msg, [])
                (stack[-1][1] if stack else roots).append(node)
                stack.append(node)
            elif kind == "pop":
                assert dom == NVTX_DOMAIN
                assert stack, "pop without a push"
                stack.pop()
            else:
                (stack[-1][1] if stack else roots).append((f"<{msg}>", []))
        assert not stack, f"unclosed ranges: {[n[0] for n in stack]}"
        return roots


@pytest.fixture
def fake_nvtx(monkeypatch):
    mod = FakeNvtx()
    monkeypatch.setitem(sys.modules, "nvtx", mod)
    return mod


def argb(label: str) -> int:
    return 0xFF000000 | int(colour(label)[1:], 16)


def test_steps_and_segments_open_nested_ranges_in_the_tracekit_domain(fake_nvtx):
    rec = Recorder(nvtx=True, gc=False, clock=FakeClock())
    with rec:
        for _ in range(2):
            with rec.step():
                with rec.segment("schedule"):
                    fake_nvtx.mark("scheduling")
                with rec.segment("decode"):
                    with rec.segment("sample"):
                        fake_nvtx.mark("sampling")
    assert fake_nvtx.tree() == 2 * [
        (
            "step",
            [
                ("schedule", [("<scheduling>", [])]),
                ("decode", [("sample", [("<sampling>", [])])]),
            ],
        )
    ]
    pushes = [c for c in fake_nvtx.calls if c[0] == "push"]
    colours = {msg: c for _, msg, c, _, _ in pushes}
    assert colours == {lb: argb(lb) for lb in ("step", "schedule", "decode", "sample")}
    assert all(colours[msg] == c for _, msg, c, _, _ in pushes)  # fixed per label


def test_ranges_stay_balanced_when_the_engine_raises(fake_nvtx):
    rec = Recorder(nvtx=True, gc=False, clock=FakeClock())
    with pytest.raises(RuntimeError, match="engine died"):
        with rec:
            with rec.step():
                with rec.segment("prefill"):
                    pass
                with rec.segment("decode"):
                    with rec.segment("sample"):
                        raise RuntimeError("engine died")
    assert fake_nvtx.tree() == [("step", [("prefill", []), ("decode", [("sample", [])])])]
    assert not rec.running and not active_recorders()
    # the failed step and its open segments are still recorded
    log = rec.log()
    assert len(log.steps) == 1 and len(log.segments) == 3


def test_a_failing_step_end_still_pops_its_range(fake_nvtx, monkeypatch):
    rec = Recorder(nvtx=True, gc=False, clock=FakeClock())
    with rec:
        monkeypatch.setattr(rec._step_cm, "_end", lambda: (_ for _ in ()).throw(OSError("disk")))
        with pytest.raises(OSError):
            with rec.step():
                pass
        monkeypatch.undo()
        rec._step.is_open = False
    assert fake_nvtx.tree() == [("step", [])]


def test_decorators_and_device_segments_open_ranges_too(fake_nvtx):
    clock = FakeClock()
    rec = Recorder(
        nvtx=True, gc=False, clock=clock, device_timer=FakeDeviceTimer(clock, exec_ms=1.0)
    )

    @rec.segment("tok")
    def tokenize():
        fake_nvtx.mark("tokenizing")

    @rec.step
    def step():
        tokenize()
        with rec.segment("decode", device=True):
            fake_nvtx.mark("launch")

    with rec:
        step()
    assert fake_nvtx.tree() == [
        ("step", [("tok", [("<tokenizing>", [])]), ("decode", [("<launch>", [])])])
    ]
    assert (rec.log().segments.is_device == 1).sum() == 1  # the device window: no range


def test_ranges_nest_per_thread(fake_nvtx):
    rec = Recorder(nvtx=True, gc=False, clock=FakeClock())
    started, release = threading.Event(), threading.Event()

    def worker():
        with rec.segment("tok"):
            started.set()
            release.wait(5)

    with rec:
        with rec.step():
            t = threading.Thread(target=worker)
            t.start()
            started.wait(5)
            with rec.segment("decode"):  # open while the worker's range is open
                release.set()
                t.join()
    assert fake_nvtx.tree(threading.get_ident()) == [("step", [("decode", [])])]
    assert fake_nvtx.tree(t.ident) == [("tok", [])]


def test_nvtx_off_never_imports_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvtx", None)  # any import of nvtx would fail
    for rec in (Recorder(gc=False), Recorder(nvtx=True, enabled=False, gc=False)):
        with rec:
            with rec.step(), rec.segment("decode"):
                pass
    assert sys.modules["nvtx"] is None


def test_nvtx_on_without_the_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvtx", None)
    rec = Recorder(nvtx=True, gc=True)
    with pytest.raises(ImportError, match=r"tracekit\[gpu\]"):
        rec.start()
    assert not rec.running and not active_recorders()


@pytest.mark.nvtx
def test_the_real_nvtx_package_accepts_our_ranges():
    pytest.importorskip("nvtx")
    clock = FakeClock()
    rec = Recorder(
        nvtx=True, gc=False, clock=clock, device_timer=FakeDeviceTimer(clock, exec_ms=1.0)
    )
    with pytest.raises(RuntimeError):
        with rec:
            for _ in range(3):
                with rec.step():
                    with rec.segment("schedule"):
                        pass
                    with rec.segment("decode", device=True):
                        pass
                    rec.emit(["a"])
            with rec.step(), rec.segment("decode"):
                raise RuntimeError("engine died")
    assert rec._probes.nvtx is sys.modules["nvtx"] and not getattr(rec._probes.nvtx, "_fake", 0)
    log = rec.log()
    assert len(log.steps) == 4 and int((log.segments.is_device == 1).sum()) == 3


class _StickyError(RuntimeError):
    pass


def test_a_device_segment_whose_event_record_fails_pops_its_range(fake_nvtx):
    # a sticky CUDA error makes `event.record()` raise in begin() (at enter) or end() (at
    # exit): every push still has its pop, the enclosing step's pop closes the step's range,
    # and no stale start stays on the thread's stack
    clock = FakeClock()
    timer = FakeDeviceTimer(clock, exec_ms=1.0)
    rec = Recorder(nvtx=True, gc=False, clock=clock, device_timer=timer)
    real_record = timer._record
    fail = {"opens": None}

    def record(event, opens):
        if fail["opens"] is opens:
            raise _StickyError("CUDA error: an illegal memory access was encountered")
        real_record(event, opens)

    timer._record = record
    with rec:
        for opens in (True, False):
            fail["opens"] = opens
            with pytest.raises(_StickyError):
                with rec.step():
                    with rec.segment("decode", device=True):
                        fake_nvtx.mark("launch")
            assert rec._threads.here().stack == []
        fail["opens"] = None
        with rec.step():
            with rec.segment("decode", device=True):
                fake_nvtx.mark("launch")
    assert fake_nvtx.tree() == [
        ("step", [("decode", [])]),  # begin() failed: the body never ran
        ("step", [("decode", [("<launch>", [])])]),  # end() failed after the body
        ("step", [("decode", [("<launch>", [])])]),
    ]
    sg = rec.log().segments
    # host windows: the one whose end() failed and the healthy one; one device window
    assert (sg.is_device == 0).sum() == 2 and (sg.is_device == 1).sum() == 1
