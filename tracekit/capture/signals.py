"""How a recording process ends: SIGTERM and Ctrl-C, interpreter exit, and fork.

- SIGTERM becomes `SystemExit(143)`, so `with rec:` blocks and `atexit` stop the run like a
  normal exit; SIGINT stays Python's `KeyboardInterrupt`. Neither is acted on inside a
  garbage collection (a gc callback swallows any exception, so the signal would be lost)
  nor inside a flush (between a buffer swap and its hand-over, where it would drop that
  interval's rows): there it is re-sent from a helper thread once that is over.
- The handlers are installed once for all running recorders (`acquire`) and restored when
  the last one stops (`release`), and only if they are still tracekit's: a handler the
  application installed after the run started is left in place.
- At interpreter exit every running recorder is stopped (`atexit`), in the process that
  started it only.
- In a forked child every recorder inherited from the parent is switched off (its run
  belongs to the parent: the child neither records into it nor stops it at exit), and the
  recorders' locks are taken around `fork()` so a child never starts with a lock held by a
  thread that does not exist there.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time
from collections.abc import Callable
from types import CodeType
from typing import Any

#: True between a recorder's gc "start" and "stop" callbacks (a collection is running).
IN_GC = [False]
#: Flushes between their buffer swap and the hand-over to the sinks.
IN_FLUSH = [0]
#: Code objects of gc callbacks: a signal whose frame is inside one is deferred.
_GC_CODES: set[CodeType] = set()

_lock = threading.Lock()
_holders = 0  # running recorders that asked for signal handling
_previous: dict[int, Any] = {}  # signal -> the handler ours replaced


def defer_in(code: CodeType) -> None:
    """Defer signals that land while `code` (a gc callback) runs."""
    _GC_CODES.add(code)


def sigterm_to_exit(signum: int, frame: Any) -> None:
    """SIGTERM -> SystemExit, so `with rec:` blocks and atexit flush like a normal exit
    (deferred inside a collection or a flush, see the module docstring)."""
    if not _deferred(signum, frame):
        raise SystemExit(128 + signum)


def sigint_to_interrupt(signum: int, frame: Any) -> None:
    """Ctrl-C: Python's KeyboardInterrupt, deferred the same way as SIGTERM."""
    if not _deferred(signum, frame):
        raise KeyboardInterrupt


_OURS: dict[int, Any] = {signal.SIGTERM: sigterm_to_exit, signal.SIGINT: sigint_to_interrupt}


def acquire() -> bool:
    """Install tracekit's SIGTERM/SIGINT handlers (main thread only) where the current ones
    are Python's defaults; counted, so each successful call needs one `release`."""
    global _holders
    if threading.current_thread() is not threading.main_thread():
        return False
    with _lock:
        if _holders == 0:
            _previous.clear()
            if signal.getsignal(signal.SIGTERM) in (signal.SIG_DFL, None):
                _previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, sigterm_to_exit)
            if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
                _previous[signal.SIGINT] = signal.signal(signal.SIGINT, sigint_to_interrupt)
        _holders += 1
    return True


def release() -> None:
    """Undo one `acquire`; the last one restores the previous handlers, each only if the
    handler in place is still ours (one installed since is left alone)."""
    global _holders
    with _lock:
        _holders = max(0, _holders - 1)
        if _holders:
            return
        for signum, prev in list(_previous.items()):
            try:
                if signal.getsignal(signum) is _OURS[signum]:
                    signal.signal(signum, prev)
            except ValueError:  # not the main thread any more: cannot touch handlers
                continue
        _previous.clear()


def stop_at_exit(stop: Callable[[], Any]) -> None:
    """Call `stop` at interpreter exit (a run never stopped is still written)."""
    atexit.register(stop)


def cancel_at_exit(stop: Callable[[], Any]) -> None:
    atexit.unregister(stop)


def _deferred(signum: int, frame: Any) -> bool:
    """True (and the signal re-sent later) if it landed in a collection or a flush."""
    f = frame
    while f is not None and f.f_code not in _GC_CODES:
        f = f.f_back
    if IN_GC[0] or IN_FLUSH[0] or f is not None:
        threading.Thread(target=_signal_again, args=(signum,), daemon=True).start()
        return True
    return False


def _signal_again(signum: int) -> None:
    time.sleep(0.001)  # let the callback return first
    while IN_GC[0] or IN_FLUSH[0]:  # and the collection or flush end
        time.sleep(0.001)
    os.kill(os.getpid(), signum)


# -- fork -------------------------------------------------------------------------------

_fork_hooks: list[tuple[Callable[[], None], Callable[[], None], Callable[[], None]]] = []


def on_fork(
    before: Callable[[], None], after_parent: Callable[[], None], after_child: Callable[[], None]
) -> None:
    """Register fork callbacks once per process (`os.register_at_fork` cannot unregister)."""
    _fork_hooks.append((before, after_parent, after_child))


def _before_fork() -> None:
    for before, _, _ in _fork_hooks:
        before()


def _after_fork_parent() -> None:
    for _, after, _ in reversed(_fork_hooks):
        after()


def _after_fork_child() -> None:
    global _holders, _lock
    _lock = threading.Lock()
    IN_FLUSH[0] = 0
    IN_GC[0] = False
    for _, _, after in reversed(_fork_hooks):
        after()
    if _holders:  # the parent's recorders held the handlers; the child has none running
        _holders = 1
        release()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(
        before=_before_fork, after_in_parent=_after_fork_parent, after_in_child=_after_fork_child
    )
