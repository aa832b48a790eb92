"""`vllm serve` stopped with its defaults while streams still run: what the engine core's
log lost, said, never charged to the API server.

A server (vLLM's OpenAI API server, default multiprocess mode, default
``--shutdown-timeout 0``: the engine core is SIGKILLed right after its SIGTERM) of the
tiny local model, started twice: with the plugin's defaults (it flushes the engine core on
SIGTERM and waits for that flush before vLLM's SIGKILL), and with that wait off
(``TRACEKIT_VLLM_KILL_FLUSH_S=0``: vLLM's bare stop, a real unrecorded window). A real
httpx client streams 8 long completions; while they run, the API server gets SIGTERM, as a
process manager sends it. The merged run must say up to when the engine core's rows are
complete (its coverage; with the plugin's flush, at least up to the SIGTERM), charge no
client-gap time after that to API-server causes (docs/partition.md, "Unrecorded
windows"), and the test counts what was lost.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys

import numpy as np
import pytest

pytestmark = [pytest.mark.adapters, pytest.mark.slow]

# stop once every stream has 16 chunks, and 0.2 s more: mid-stream on a quiet machine too,
# where a stream of 480 tokens of the tiny model ends about a second after it starts
N_STREAMS, MAX_TOKENS, STOP_AT_TOKENS, STOP_AFTER_S = 8, 480, 16, 0.2


@pytest.fixture(scope="module", params=["plugin-default", "no-flush-wait"])
def stopped(request, tmp_path_factory):
    """plugin-default: vLLM's defaults and the plugin's (its flush before the kill);
    no-flush-wait: TRACEKIT_VLLM_KILL_FLUSH_S=0, vLLM's SIGTERM-then-SIGKILL with nothing in
    between, whose engine core loses up to a flush interval while the streams run."""
    pytest.importorskip("vllm")
    pytest.importorskip("httpx")
    from importlib.metadata import entry_points

    if not any(e.value.startswith("engine_adapters.vllm_serve") for e in
               entry_points(group="vllm.general_plugins")):  # fmt: skip
        pytest.skip("tracekit's vLLM plugin entry point is not installed: pip install -e .")
    from engine_adapters import serve_harness as sh
    from engine_adapters.tiny_model import build_tiny_llama

    base = tmp_path_factory.mktemp("stop")
    model = build_tiny_llama(str(base / "model"))
    rec_dir = str(base / "rec")
    env = {k: v for k, v in os.environ.items() if k.startswith("TRACEKIT_VLLM_KILL")}
    assert not env, f"the test runs the plugin's defaults; unset {sorted(env)}"
    wait = request.param == "plugin-default"
    env_extra = {} if wait else {"TRACEKIT_VLLM_KILL_FLUSH_S": "0"}
    server = sh.start_server(model, record_dir=rec_dir, log_path=str(base / "server.log"),
                             flush_s=0.5, env_extra=env_extra)  # fmt: skip
    bodies = [
        sh.completion_body(model, f"the quick brown fox {i} jumps", MAX_TOKENS)
        for i in range(N_STREAMS)
    ]
    streams, t_sig_ns, rc = sh.stop_while_streaming(
        server, bodies, STOP_AFTER_S, grace_s=15, min_tokens=STOP_AT_TOKENS
    )
    return {"dir": rec_dir, "streams": streams, "t_sig_ns": t_sig_ns, "rc": rc, "wait": wait,
            "server_log": server.log_path}  # fmt: skip


@pytest.fixture(scope="module")
def merged(stopped):
    from tracekit.analysis.run import merge_run as merge_dir

    return merge_dir(stopped["dir"])


def test_streams_were_running_when_the_server_was_stopped(stopped):
    s = stopped["streams"]
    assert len(s) == N_STREAMS and all(x.status == 200 for x in s)
    got = [len(x.t_ns) for x in s]
    assert all(0 < n < MAX_TOKENS for n in got), got  # cut mid-stream, not finished


def _killed_before_its_stop(proc: dict) -> bool:
    """Whether a process was killed before its stop wrote ``final.json``: its rows end at
    its last flush. One killed after that and before ``OUT`` (the instant between) is read
    from its parts too, but its log is whole: its stop flushed everything."""
    folder = proc["path"] if proc["recovered"] else proc["path"] + ".parts"
    return bool(proc["recovered"]) and not os.path.exists(os.path.join(folder, "final.json"))


def test_the_engine_core_window_after_its_last_flush_is_unrecorded_not_the_api_server(
    stopped, merged
):
    from tracekit.analysis.unrecorded import unrecorded_report
    from tracekit.attribution.client import client_gaps, client_partition

    procs = merged.meta["processes"]
    core_k = next(i for i, p in enumerate(procs) if p["role"] == "engine_core")
    api_k = next(i for i, p in enumerate(procs) if p["role"] == "api_server")
    cov = {int(k): i for i, k in enumerate(merged.coverage.process)}
    # vLLM's default stop SIGKILLs the engine core once its flush is on disk; a core that
    # got through its own stop within that wait wrote a whole log (docs/adapters.md)
    killed = _killed_before_its_stop(procs[core_k])
    assert merged.coverage.is_clean_stop[cov[core_k]] == (0 if killed else 1)
    # the API server exits on SIGTERM and writes a whole log, unless vLLM's HTTP server kept
    # waiting for streams that the killed engine core never ended ("Waiting for connections
    # to close"), and the harness, as a process manager does after its grace, killed it:
    # then its log is recovered from parts, and says so
    api_killed = stopped["rc"] == -9
    assert merged.coverage.is_clean_stop[cov[api_k]] == (0 if api_killed else 1)
    assert procs[api_k]["recovered"] == api_killed
    core_end = float(merged.coverage.t_end_s[cov[core_k]])
    # the run's clock is the engine core's: seconds from its recorder's start tick
    t0 = merged.meta["t0_tick"] * merged.meta.get("seconds_per_tick", 1e-9)
    t_sig = stopped["t_sig_ns"] * 1e-9 - t0
    if stopped["wait"]:
        # the API server got the SIGTERM first and passed it on to the engine core, whose
        # handler flushed before vLLM's SIGKILL: its rows are complete past the signal
        assert core_end >= t_sig, (core_end, t_sig)
    else:  # nothing ran between SIGTERM and SIGKILL: the rows end at an earlier flush
        assert killed

    cp = client_partition(merged)  # raises if a gap does not reconcile
    g = client_gaps(merged)
    # by the rule: a gap whose token the core never recorded and that reaches past the
    # core's span has no API-server cause, and its time after the span is unrecorded
    cut = np.isnan(g.e) & (g.b > core_end)
    after = np.clip(g.b - np.maximum(g.a, core_end), 0, None) * 1e3
    assert np.all(cp.frontend_ms()[cut] == 0)
    assert np.all(cp.unrecorded_ms()[cut] >= after[cut] - 1e-6)
    assert np.all(cp.unrecorded_ms()[~cut] <= 1e-9) or core_end < g.b.max()

    # what was lost: tokens the API server streamed (its client-boundary record, which
    # tests/adapters/test_adapters_vllm_serve.py checks against the client chunk by chunk) that the
    # engine core's log lacks, and the client-gap time left unrecorded
    sent = collections.Counter()
    ce = merged.client_emissions
    for r, n in zip(ce.request.tolist(), ce.num_tokens.tolist(), strict=True):
        sent[r] += n
    core_tokens = collections.Counter()
    for r, n in zip(merged.emissions.request.tolist(), merged.emissions.num_tokens.tolist(),
                    strict=True):  # fmt: skip
        core_tokens[r] += n
    lost = sum(max(0, sent[r] - core_tokens[r]) for r in sent)
    client_tokens = sum(len([t for t in s.text if t]) for s in stopped["streams"])
    how = "plugin flush before the kill" if stopped["wait"] else "TRACEKIT_VLLM_KILL_FLUSH_S=0"
    last_chunk = float(merged.client_emissions.t_s.max())
    window_ms = max(0.0, last_chunk - core_end) * 1e3
    print(
        f"\nvllm serve stopped with its defaults ({how}): SIGTERM at {t_sig:.3f} s, engine core "
        f"{'killed' if killed else 'stopped whole'}, "
        f"complete to {core_end:.3f} s ({(core_end - t_sig) * 1e3:+.1f} ms), API server's "
        f"last chunk {window_ms:.1f} ms after that; {lost} of {sum(sent.values())} streamed "
        f"tokens ({client_tokens} non-empty chunks at the client) not in the engine core's "
        f"log; {cp.unrecorded_ms().sum():.1f} ms of client gap time in {int(cut.sum())} gaps "
        "unrecorded"
    )
    assert sum(sent.values()) > 0
    said = [u for u in unrecorded_report(merged, cp) if u["role"] == "engine_core"]
    if killed:
        (u,) = said
        assert f"no rows after {core_end:.3f} s" in u["line"]
    else:
        assert said == [] and cp.unrecorded_ms().sum() == 0


def test_merge_and_analyze_say_it(stopped, merged, tmp_path):
    killed = _killed_before_its_stop(
        next(p for p in merged.meta["processes"] if p["role"] == "engine_core")
    )
    cli = [sys.executable, "-m", "tracekit"]
    r = subprocess.run([*cli, "merge", stopped["dir"], "-o", str(tmp_path / "m.npz")],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    said = "unrecorded: engine_core pid" in r.stdout and "no rows after" in r.stdout
    assert said == killed, r.stdout
    r = subprocess.run([*cli, "analyze", str(tmp_path / "m.npz")], capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert ("unrecorded: engine_core pid" in r.stdout) == killed
