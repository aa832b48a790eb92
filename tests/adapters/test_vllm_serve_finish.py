"""The `vllm serve` plugin's API server forgets each HTTP request's engine requests once its
response is over (docs/adapters.md, "vllm serve": finished requests), so its recorder's
memory stays flat over any number of requests.

A real uvicorn server (the one `vllm serve` runs) with the plugin's uvicorn hooks serves a
small ASGI app that streams two chunks per request, and a real HTTP client reads them. The
app plays the part of vLLM's completion handler where the plugin's handler hooks record:
it names an engine request in the API server's recorder and in the HTTP request's slot.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

pytestmark = pytest.mark.adapters


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_each_http_requests_engine_requests_are_finished_when_its_response_ends(
    tmp_path, monkeypatch
):
    uvicorn = pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from engine_adapters import vllm_serve as vs
    from engine_adapters._common import Patches

    monkeypatch.setenv(vs.ENV_DIR, str(tmp_path))
    monkeypatch.setattr(vs, "_rec", {})  # this test's own API server recorder
    keys: dict[str, str] = {}  # client name -> recorder name, as the handler hooks make them

    async def app(scope, receive, send):
        if scope["type"] == "lifespan":
            while True:
                kind = (await receive())["type"]  # lifespan.startup, then .shutdown
                await send({"type": f"{kind}.complete"})
                if kind == "lifespan.shutdown":
                    return
        name = scope["path"].strip("/")
        rec = vs.frontend_recorder()
        http = vs._http.get()[0] = vs._Http(rec.now(), rec.now())  # the handler's slot
        key = keys[name] = f"{name}{vs.FRONT_SEP}engine-{name}"
        h = rec.request(key)
        http.keys[name] = vs._front.key[name] = key
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for k in range(2):
            t = rec.now()
            await send({"type": "http.response.body", "body": b"x", "more_body": True})
            rec.emit_chunk(h, t, rec.now(), 1)
            await asyncio.sleep(0)
            assert k == 0 or rec.handle(key) == h  # still the request's own while it streams
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    patches = Patches()
    vs._install_write_hooks(patches)  # uvicorn's cycle: the slot, the write stamps, the end
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
            time.sleep(0.02)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            for name in ("r0", "r1", "r2"):
                with client.stream("GET", f"/{name}") as r:
                    assert b"".join(r.iter_bytes()) == b"xx"
        rec = vs.frontend_recorder()
        deadline = time.monotonic() + 30  # the ASGI task ends just after the client's read
        while any(n in vs._front.key for n in keys):
            assert time.monotonic() < deadline, f"still known: {sorted(vs._front.key)}"
            time.sleep(0.02)
        for key in keys.values():
            with pytest.raises(ValueError, match="was finished"):
                rec.handle(key)  # its id left the book (docs/capture.md, "Finished requests")
    finally:
        server.should_exit = True
        thread.join(30)
        patches.restore()
        rec = vs._rec.get(vs.FRONTEND)
        if rec is not None:
            rec.stop()
    log = rec.log()  # read back from its parts
    assert sorted(log.request_ids) == sorted(keys.values())  # every request reached the log
    assert len(log.emissions) == 6  # two chunks each, recorded before the finish
