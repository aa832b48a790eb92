"""A real Prometheus server for the live-mode tests (Debian's `prometheus` package): started
on loopback with a 1 s scrape interval against one target port, queried over its HTTP API.
The `prometheus` fixture yields (a `Prom` client, the target port the sink must serve on)."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import time
from urllib.parse import urlencode
from urllib.request import urlopen

import pytest

PROMETHEUS = shutil.which("prometheus")
NO_PROMETHEUS = "no prometheus binary (Debian: apt-get install prometheus; .ci/run installs it)"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urlopen(url, timeout=10) as r:
        return json.loads(r.read().decode())


class Prom:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def query(self, expr: str, at: float) -> list[dict]:
        out = get_json(f"{self.base}/api/v1/query?" + urlencode({"query": expr, "time": repr(at)}))
        assert out["status"] == "success", (expr, out)
        return out["data"]["result"]

    def one(self, expr: str, at: float) -> float:
        res = self.query(expr, at)
        assert len(res) == 1, (expr, res)
        return float(res[0]["value"][1])


@contextlib.contextmanager
def running_prometheus(folder, target: int):
    """A Prometheus server scraping 127.0.0.1:`target` every second, its files in
    `folder`, ready when this yields its client; stopped on exit."""
    folder.mkdir(parents=True, exist_ok=True)
    web = _free_port()
    cfg = folder / "prometheus.yml"
    cfg.write_text(
        "global:\n  scrape_interval: 1s\n  scrape_timeout: 900ms\n"
        "scrape_configs:\n  - job_name: tracekit\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{target}']\n"
    )
    proc = subprocess.Popen(
        [PROMETHEUS, f"--config.file={cfg}", f"--storage.tsdb.path={folder / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{web}", "--enable-feature=exemplar-storage"],
        stdout=subprocess.DEVNULL, stderr=open(folder / "prometheus.log", "w"),
    )  # fmt: skip
    try:
        for _ in range(300):
            try:
                with urlopen(f"http://127.0.0.1:{web}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.fail("prometheus never became ready: " + (folder / "prometheus.log").read_text())
        yield Prom(web)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def prometheus(tmp_path):
    if PROMETHEUS is None:
        pytest.skip(NO_PROMETHEUS)
    target = _free_port()
    with running_prometheus(tmp_path, target) as prom:
        yield prom, target


def wait_for(prom: Prom, expr: str, timeout_s: float = 30) -> float:
    """Poll until `expr` returns a sample (Prometheus scraped what it names); the time."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        now = time.time()
        if prom.query(expr, now):
            return now
        time.sleep(0.2)
    pytest.fail(f"prometheus never answered {expr!r} within {timeout_s} s")
