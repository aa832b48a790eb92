"""Open a page in a real headless Chromium and report what happened, with no dependency:
the DevTools protocol over ``--remote-debugging-pipe`` (JSON messages separated by NUL on
file descriptors 3 and 4), so no websocket client is needed.

    page = open_page("file:///tmp/report.html", expression="...")
    page.console_errors, page.exceptions, page.requests, page.value

Used by the HTML report test and by `docs/make_screenshot.py`.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any


def chromium_path() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        p = shutil.which(name)
        if p:
            return p
    return None


@dataclass
class Page:
    console_errors: list[str] = field(default_factory=list)  # console.error/assert, log errors
    exceptions: list[str] = field(default_factory=list)  # uncaught JS exceptions
    requests: list[str] = field(default_factory=list)  # every URL the page asked for
    value: Any = None  # the result of `expression`
    screenshot_png: bytes | None = None
    loaded: bool = False  # the page's load event has fired


class _Pipe:
    def __init__(self, proc: subprocess.Popen, w: int, r: int) -> None:
        self.proc, self.w, self.r = proc, w, r
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.replies: dict[int, dict[str, Any]] = {}
        self.cv = threading.Condition()
        self.n = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        buf = b""
        while True:
            try:
                chunk = os.read(self.r, 1 << 16)
            except OSError:
                chunk = b""
            if not chunk:
                with self.cv:
                    self.cv.notify_all()
                return
            buf += chunk
            while b"\0" in buf:
                raw, buf = buf.split(b"\0", 1)
                msg = json.loads(raw)
                if "id" in msg:
                    with self.cv:
                        self.replies[msg["id"]] = msg
                        self.cv.notify_all()
                else:
                    self.events.put(msg)

    def call(self, method: str, params: dict | None = None, session: str | None = None,
             timeout_s: float = 20.0) -> dict[str, Any]:  # fmt: skip
        self.n += 1
        msg: dict[str, Any] = {"id": self.n, "method": method, "params": params or {}}
        if session:
            msg["sessionId"] = session
        os.write(self.w, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        with self.cv:
            while self.n not in self.replies:
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise TimeoutError(f"no reply to {method} from chromium")
                self.cv.wait(left)
            reply = self.replies.pop(self.n)
        if "error" in reply:
            raise RuntimeError(f"{method}: {reply['error']}")
        return reply.get("result", {})


def open_page(
    url: str,
    *,
    expression: str | None = None,
    ready: str = "true",
    width: int = 1400,
    height: int = 2000,
    screenshot: bool = False,
    clip: dict[str, float] | None = None,
    timeout_s: float = 30.0,
) -> Page:
    """Load `url`, wait until the JS expression `ready` is truthy, evaluate `expression`
    (its JSON-able value comes back), optionally take a PNG screenshot of the viewport
    (or of `clip`: x, y, width, height in CSS pixels)."""
    exe = chromium_path()
    if exe is None:
        raise FileNotFoundError("chromium is not installed")
    profile = tempfile.mkdtemp(prefix="tracekit-chromium-")
    to_child_r, to_child_w = _high_pipe()
    from_child_r, from_child_w = _high_pipe()
    args = [
        exe, "--headless", "--disable-gpu", "--no-sandbox", "--remote-debugging-pipe",
        f"--user-data-dir={profile}", "--no-first-run", "--no-default-browser-check",
        "--disable-extensions", "--disable-background-networking", "--disable-sync",
        "--disable-component-update", "--disable-default-apps", "--mute-audio",
        "--hide-scrollbars", f"--window-size={width},{height}", "about:blank",
    ]  # fmt: skip
    # the protocol wants its pipes on fds 3 (commands in) and 4 (replies out)
    cmd = " ".join(_sh(a) for a in args) + f" 3<&{to_child_r} 4>&{from_child_w}"
    proc = subprocess.Popen(
        [shutil.which("bash") or "/bin/bash", "-c", "exec " + cmd],  # dash takes fds 0-9 only
        pass_fds=(to_child_r, from_child_w),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=open(os.path.join(profile, "stderr.txt"), "wb"),  # noqa: SIM115
    )
    os.close(to_child_r)
    os.close(from_child_w)
    pipe = _Pipe(proc, to_child_w, from_child_r)
    page = Page()
    try:
        try:
            target = pipe.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        except (OSError, TimeoutError) as e:
            proc.wait(timeout=10)
            with open(os.path.join(profile, "stderr.txt"), "rb") as fh:
                tail = fh.read()[-2000:].decode(errors="replace")
            raise RuntimeError(f"chromium did not start ({e}); its stderr:\n{tail}") from None
        sid = pipe.call("Target.attachToTarget", {"targetId": target, "flatten": True})["sessionId"]
        for m in ("Runtime.enable", "Log.enable", "Network.enable", "Page.enable"):
            pipe.call(m, session=sid)
        pipe.call(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
            session=sid,
        )
        pipe.call("Page.navigate", {"url": url}, session=sid)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            # whichever read takes the load event off the queue notes it (on a busy machine
            # the drain may be the one that does)
            _drain(pipe, page)
            if not page.loaded:
                _saw(pipe, page, "Page.loadEventFired", 0.2)
                continue
            r = pipe.call("Runtime.evaluate", {"expression": f"!!({ready})",
                                               "returnByValue": True}, session=sid)  # fmt: skip
            if r.get("result", {}).get("value"):
                break
            time.sleep(0.1)
        else:
            raise TimeoutError(f"{url}: not ready ({ready}) within {timeout_s} s")
        if expression is not None:
            r = pipe.call(
                "Runtime.evaluate",
                {"expression": expression, "returnByValue": True},
                session=sid,
            )
            page.value = r.get("result", {}).get("value")
        if screenshot:
            import base64

            r = pipe.call(
                "Page.captureScreenshot",
                {"format": "png", "captureBeyondViewport": clip is not None}
                | ({"clip": {**clip, "scale": 1}} if clip else {}),
                session=sid,
            )
            page.screenshot_png = base64.b64decode(r["data"])
        time.sleep(0.1)
        _drain(pipe, page)
        try:
            pipe.call("Browser.close", timeout_s=5)
        except (TimeoutError, RuntimeError, OSError):
            pass
    finally:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        os.close(to_child_w)
        os.close(from_child_r)
        shutil.rmtree(profile, ignore_errors=True)
    return page


def _high_pipe() -> tuple[int, int]:
    """A pipe whose fds are >= 100, so the shell's ``3<&X 4>&Y`` cannot clobber one of
    them (an fd that happens to be 3 or 4 would be overwritten by the other redirection)."""
    import fcntl

    out = []
    for fd in os.pipe():
        high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 100)
        os.close(fd)
        out.append(high)
    return out[0], out[1]


def _sh(a: str) -> str:
    import shlex

    return shlex.quote(a)


def _record(page: Page, msg: dict[str, Any]) -> None:
    method, p = msg.get("method"), msg.get("params", {})
    if method == "Page.loadEventFired":
        page.loaded = True
    elif method == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert", "warning"):
        args = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
        page.console_errors.append(f"console.{p['type']}: {args}")
    elif method == "Runtime.exceptionThrown":
        d = p.get("exceptionDetails", {})
        page.exceptions.append(str(d.get("exception", {}).get("description") or d.get("text")))
    elif method == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
        page.console_errors.append(f"log: {p['entry'].get('text')}")
    elif method == "Network.requestWillBeSent":
        page.requests.append(p.get("request", {}).get("url", ""))


def _drain(pipe: _Pipe, page: Page) -> None:
    while True:
        try:
            _record(page, pipe.events.get_nowait())
        except queue.Empty:
            return


def _saw(pipe: _Pipe, page: Page, method: str, wait_s: float) -> bool:
    end = time.monotonic() + wait_s
    while True:
        left = end - time.monotonic()
        if left <= 0:
            return False
        try:
            msg = pipe.events.get(timeout=left)
        except queue.Empty:
            return False
        _record(page, msg)
        if msg.get("method") == method:
            return True
