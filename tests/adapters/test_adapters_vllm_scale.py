"""`vllm serve` scaled out, recorded by tracekit's plugin, against a real streaming client.

Two servers of the tiny local model (2 KV heads), each started once for the module:

- ``vllm serve --api-server-count 2 --data-parallel-size 2``: two API server processes
  (one listening socket: which one accepts a connection is the kernel's choice), two
  engine cores (DP ranks 0 and 1) with a worker each, each engine core serving its live
  metrics (``TRACEKIT_VLLM_METRICS_PORT``: rank R on port + R). 12 completions stream
  at once.
- ``--tensor-parallel-size 2`` (gloo): two workers, ranks 0 and 1, and a test-only hook
  (``TRACEKIT_VLLM_TEST_INJECT``) that stalls rank 1 at the start of every 6th forward
  pass, alternately with a 40 ms sleep and a full garbage collection.

Both are stopped with SIGTERM (vLLM's default --shutdown-timeout 0).
"""

from __future__ import annotations

import collections
import glob
import os
import signal
import time

import numpy as np
import pytest

pytestmark = [pytest.mark.adapters, pytest.mark.slow]

MAX_TOKENS = 24
N_STREAMS = 12


def _require_plugin():
    pytest.importorskip("vllm")
    pytest.importorskip("httpx")
    from importlib.metadata import entry_points

    if not any(e.value.startswith("engine_adapters.vllm_serve") for e in
               entry_points(group="vllm.general_plugins")):  # fmt: skip
        pytest.skip("tracekit's vLLM plugin entry point is not installed: pip install -e .")


def _api_servers_that_streamed(rec_dir: str) -> set[int]:
    """The pids of a running server's API servers that have streamed a chunk so far (their
    parts on disk read in place, never changed; one that has recorded nothing yet has no
    parts at all)."""
    from tracekit.log.parts import merge_parts

    out = set()
    for d in glob.glob(os.path.join(rec_dir, "api_server-*.npz.parts")):
        if len(merge_parts(d).emissions):
            out.add(int(os.path.basename(d).split("-")[1].split(".")[0]))
    return out


def _port_pair() -> int:
    """A free port P with P + 1 free too (data-parallel rank R serves on P + R)."""
    import socket

    from engine_adapters.serve_harness import free_port

    for _ in range(100):
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise AssertionError("no two consecutive free ports")


def _scrape_live(port: int) -> dict[str, dict]:
    """One scrape of an engine core's live metrics: every sample by name and full labels."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body = r.read().decode()
    out: dict[str, dict] = collections.defaultdict(dict)
    for fam in text_string_to_metric_families(body):
        for smp in fam.samples:
            out[smp.name][tuple(sorted(smp.labels.items()))] = smp.value
    return out


def _settled_live(ports: tuple[int, ...], gaps: int) -> dict[int, dict]:
    """Scrapes of every live port once their gaps add up to `gaps` (the engine cores
    settle the load's last gaps at their idle flushes), at most 60 s."""
    deadline = time.monotonic() + 60
    while True:
        got = {p: _scrape_live(p) for p in ports}
        n = sum(sum(g["tracekit_gaps_total"].values()) for g in got.values())
        if n >= gaps or time.monotonic() > deadline:
            return got
        time.sleep(0.2)


def _serve(base, args, env=None, cli=False, n=N_STREAMS, stagger_s=0.0, live_ports=()):
    num_api = int(args[args.index("--api-server-count") + 1]) if "--api-server-count" in args else 1
    from engine_adapters import serve_harness as sh
    from engine_adapters.tiny_model import build_tiny_llama

    model = build_tiny_llama(str(base.parent / "model"))
    rec_dir = str(base / "rec")
    server = sh.start_server(model, record_dir=rec_dir, log_path=str(base / "server.log"),
                             extra_args=["--max-model-len", "256", *args], cli=cli,
                             env_extra=env)  # fmt: skip
    try:
        bodies = [sh.completion_body(model, f"the quick brown fox {i} jumps", MAX_TOKENS)
                  for i in range(n)]  # fmt: skip
        streams = sh.stream_load(server, bodies, stagger_s=stagger_s)
        time.sleep(1.0)  # > the flush interval: everything recorded reaches disk
        # several API servers share one listening socket, and which one accepts is the
        # kernel's choice (here one took all of 48 connections in three waves): while an
        # API server has streamed nothing, one more wave with those that have stopped
        # until it is accepted elsewhere (read from their parts as they are)
        for _ in range(num_api - 1):
            streamed = _api_servers_that_streamed(rec_dir)
            if len(streamed) == num_api:
                break
            streams += sh.stream_load(server, bodies, stagger_s=stagger_s,
                                      pause_pids=tuple(sorted(streamed)))  # fmt: skip
            time.sleep(1.0)
        live = _settled_live(live_ports, len(streams) * (MAX_TOKENS - 1)) if live_ports else {}
    finally:
        rc = server.stop(signal.SIGTERM)
    return {"dir": rec_dir, "streams": streams, "rc": rc, "log": server.log_path, "live": live}


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    _require_plugin()
    pytest.importorskip("prometheus_client")
    base = tmp_path_factory.mktemp("scale")
    port = _port_pair()
    out = _serve(
        base, ["--api-server-count", "2", "--data-parallel-size", "2"], cli=True, stagger_s=0.15,
        env={"TRACEKIT_VLLM_METRICS_PORT": str(port)}, live_ports=(port, port + 1),
    )  # fmt: skip
    return {**out, "port": port}


@pytest.fixture(scope="module")
def scaled_runs(scaled):
    from tracekit.analysis.run import merge_run as merge_dir

    return [merge_dir(scaled["dir"], engine=k) for k in (0, 1)]


def test_every_api_server_left_a_whole_log_after_sigterm(scaled):
    names = sorted(os.listdir(scaled["dir"]))
    api = [n for n in names if n.startswith("api_server-") and n.endswith(".npz")]
    assert len(api) == 2, names
    # whole: each stopped (its pointer written, final.json in its parts folder)
    assert all(os.path.exists(os.path.join(scaled["dir"], n + ".parts", "final.json"))
               for n in api), names  # fmt: skip
    cores = [n for n in names if n.startswith("engine_core-") and n.endswith(".npz.parts")]
    assert len(cores) == 2, names


def test_data_parallel_runs_are_merged_per_engine_core(scaled, scaled_runs):
    from tracekit.analysis.run import merge_run as merge_dir
    from tracekit.errors import LogError

    with pytest.raises(LogError, match="--engine"):
        merge_dir(scaled["dir"])
    # every request is in exactly one engine core's run, with all its tokens there
    seen = collections.Counter()
    for run in scaled_runs:
        core = run.meta["process"]
        assert core["role"] == "engine_core"
        ce, em = run.client_emissions, run.emissions
        for j, name in enumerate(run.request_ids):
            if np.any(em.request == j):
                seen[name] += 1
                assert int(em.num_tokens[em.request == j].sum()) == MAX_TOKENS
                assert int(ce.num_tokens[ce.request == j].sum()) == MAX_TOKENS
        # its worker is its own DP rank's
        ranks = {p.get("dp_rank") for p in run.meta["processes"] if p["role"] == "worker"}
        assert ranks == {core["dp_rank"]}
    client = {s.name(0) for s in scaled["streams"]}
    assert dict(seen) == dict.fromkeys(client, 1)
    assert all(len(r.steps) for r in scaled_runs), "both engine cores served requests"


def test_chunk_counts_equal_per_request_and_each_joined_to_its_api_server(scaled, scaled_runs):
    client = {s.name(0): len(s.t_ns) for s in scaled["streams"]}
    got: dict[str, int] = {}
    servers: dict[str, set[int]] = collections.defaultdict(set)
    for run in scaled_runs:
        ce = run.client_emissions
        for j in np.unique(ce.request).tolist():
            name = run.request_ids[j]
            got[name] = int(np.sum(ce.request == j))
            pid = run.meta["processes"][int(ce.process[ce.request == j][0])]["pid"]
            servers[name].update(int(run.meta["processes"][int(k)]["pid"])
                                 for k in ce.process[ce.request == j])  # fmt: skip
            assert len(servers[name]) == 1 and pid in servers[name]
    assert got == client
    used = set().union(*servers.values())
    assert len(used) == 2, "both API servers were meant to serve streams"


def test_each_data_parallel_engine_core_serves_its_own_live_metrics(scaled, scaled_runs):
    """`TRACEKIT_VLLM_METRICS_PORT=P` with two DP ranks: rank R's engine core serves on
    P + R, every sample labelled ``dp_rank`` R and ``process`` its own engine core
    (docs/live.md). Each engine core partitions only its own requests' gaps: a request
    streams MAX_TOKENS tokens one a step (ignore_eos, no speculative decoding), so MAX_TOKENS
    emissions and MAX_TOKENS - 1 engine-boundary gaps; the settled live count is that for
    the requests of that core's merged run, and the live gap time is the offline
    partition's."""
    from tracekit.attribution.itl import partition

    for run in scaled_runs:
        rank = int(run.meta["process"]["dp_rank"])
        got = scaled["live"][scaled["port"] + rank]
        labels = {dict(k).get("dp_rank") for k in got["tracekit_gaps_total"]}
        assert labels == {str(rank)}, labels
        procs = {dict(k).get("process") for k in got["tracekit_gaps_total"]}
        assert procs == {f"engine_core-{run.meta['process']['pid']}"}, procs
        served = np.unique(run.emissions.request).size
        assert served > 0
        (n,) = got["tracekit_gaps_total"].values()
        assert n == served * (MAX_TOKENS - 1)
        p = partition(run)
        assert len(p) == n
        (total_s,) = got["tracekit_gap_seconds_sum"].values()
        assert total_s == pytest.approx(float(p.gap_ms.sum()) / 1e3, rel=1e-9)


def test_each_api_servers_windows_are_charged_only_to_its_own_gaps(scaled_runs):
    from dataclasses import replace

    from tracekit.attribution.client import client_partition
    from tracekit.attribution.reference import client_partition_reference

    for run in scaled_runs:
        cp = client_partition(run)
        assert cp.reconcile_err_ms.max() < 1e-6
        ref = client_partition_reference(run)
        assert np.allclose(cp.parts_ms, ref.parts_ms, atol=1e-6)
        procs = run.meta["processes"]
        api = [k for k, p in enumerate(procs) if p["role"] == "api_server"]
        ce = run.client_emissions
        for k in api:
            # drop the other API server's windows: this one's gaps keep every part
            ps = run.proc_segments
            keep = ~np.isin(ps.process, [x for x in api if x != k])
            alone = replace(run, proc_segments=ps.take(np.flatnonzero(keep)))
            cp_alone = client_partition(alone)
            mine = np.isin(cp.request, np.unique(ce.request[ce.process == k]))
            assert np.allclose(cp.parts_ms[mine], cp_alone.parts_ms[mine], atol=1e-9)


# -- tensor parallel ----------------------------------------------------------------------

INJECT_EVERY, INJECT_MS = 6, 40


@pytest.fixture(scope="module")
def tp(tmp_path_factory):
    _require_plugin()
    base = tmp_path_factory.mktemp("tp")
    env = {"TRACEKIT_VLLM_TEST_INJECT": f"rank=1,every={INJECT_EVERY},ms={INJECT_MS},"
           "kinds=sleep+gc"}  # fmt: skip
    return _serve(base, ["--tensor-parallel-size", "2"], env=env, n=6)


@pytest.fixture(scope="module")
def tp_run(tp):
    from tracekit.analysis.run import merge_run as merge_dir

    return merge_dir(tp["dir"])


def _rank_worker(run, rank):
    k = next(i for i, p in enumerate(run.meta["processes"])
             if p["role"] == "worker" and p.get("tp_rank") == rank)  # fmt: skip
    return k


def test_each_rank_recorded_its_forward_collectives_and_gc(tp, tp_run):
    ps = tp_run.proc_segments
    for rank in (0, 1):
        k = _rank_worker(tp_run, rank)
        labels = {tp_run.labels[i] for i in ps.label[ps.process == k]}
        assert {"prepare", "forward", "collective"} <= labels, (rank, labels)
    k1 = _rank_worker(tp_run, 1)
    assert "gc" in {tp_run.labels[i] for i in ps.label[ps.process == k1]}
    assert "injected" in {tp_run.labels[i] for i in ps.label[ps.process == k1]}


def _injected(run, kind_label):
    """The injected windows on rank 1 (run clock), split by what rank 1 did then: a GC
    pause (the gc kind) or not (the sleep kind)."""
    ps = run.proc_segments
    k1 = _rank_worker(run, 1)
    lab = run.labels
    mine = ps.process == k1
    inj = np.flatnonzero(mine & (ps.label == lab.index("injected")))
    gc = np.flatnonzero(mine & (ps.label == lab.index("gc")))
    out = []
    for i in inj.tolist():
        a, b = ps.t_start_s[i], ps.t_end_s[i]
        gc_in = sum(max(0.0, min(b, ps.t_end_s[g]) - max(a, ps.t_start_s[g])) for g in gc)
        is_gc = gc_in > 0.5 * (b - a)
        if (kind_label == "gc") == is_gc:
            out.append((a, b, gc_in if is_gc else b - a))
    return out


def _lateness_after(run, t):
    """How late rank 1 entered the first collective it entered at or after `t` (run
    clock), behind rank 0's entry into the same call (the n-th of each): 0 if not late."""
    ps = run.proc_segments
    col = run.labels.index("collective")
    entries = []
    for rank in (0, 1):
        mine = (ps.process == _rank_worker(run, rank)) & (ps.label == col)
        entries.append(np.sort(ps.t_start_s[mine]))
    n = int(np.searchsorted(entries[1], t, side="left"))
    assert n < min(len(e) for e in entries), "no collective after the stall"
    return max(0.0, float(entries[1][n] - entries[0][n]))


@pytest.mark.parametrize("kind", ["injected", "gc"])
def test_a_stall_on_rank_1_is_charged_to_rank_1_in_every_gap_of_its_step(tp_run, kind):
    from tracekit.attribution.itl import partition

    p = partition(tp_run)  # reconciles or raises
    assert p.reconcile_max_err_ms < 1e-6
    label = f"rank1:{kind}"
    assert label in p.labels, p.labels
    col = p.column(label)
    windows = _injected(tp_run, "gc" if kind == "gc" else "sleep")
    assert windows, f"no {kind} stall was injected"
    checked, whole = 0, 0
    for a, b, ms in windows:
        # the rule (docs/adapters.md): rank 1's lateness at the next collective it enters
        # goes to its stall, at most the stall's length; rank 0 may itself have entered
        # late on this shared machine, and then the stall held the step only that long
        late = _lateness_after(tp_run, b)
        want = min(ms, late)
        whole += want > 0.9 * ms
        # every gap that contains the stall's step carries it
        hit = np.flatnonzero((p.t0_s <= a) & (p.t1_s >= b))
        for i in hit.tolist():
            assert abs(col[i] - want * 1e3) < 1.0, (col[i], want * 1e3, ms * 1e3)
            checked += 1
    assert checked >= 2
    # the stall is what made rank 1 late: most stalls held the step their whole length
    assert whole >= len(windows) / 2, (whole, len(windows))
    print(f"{label}: {checked} gaps, injected {np.mean([w[2] for w in windows]) * 1e3:.1f} ms")


def test_rank_waits_are_exclusive_and_reported(tp_run):
    rep = tp_run.meta["tensor_parallel"]
    assert rep["ranks"] == [0, 1] or rep["ranks"] == [1]
    sg = tp_run.segments
    # the carved segments never overlap the engine core's forward windows of their step
    rank_ids = [i for i, lb in enumerate(tp_run.labels) if lb.startswith("rank")]
    fwd_ids = [tp_run.labels.index(x) for x in ("prefill", "decode") if x in tp_run.labels]
    r = np.isin(sg.label, rank_ids)
    f = np.isin(sg.label, fwd_ids)
    for i in np.flatnonzero(r).tolist():
        same = f & (sg.step == sg.step[i])
        ov = np.minimum(sg.t_end_s[same], sg.t_end_s[i]) - np.maximum(
            sg.t_start_s[same], sg.t_start_s[i]
        )
        assert np.all(ov <= 1e-12)


def test_trace_has_a_track_per_rank(tp, tmp_path):
    import subprocess
    import sys

    out = str(tmp_path / "t.json")
    r = subprocess.run([sys.executable, "-m", "tracekit", "trace", tp["dir"], "-o", out],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    from tracekit.render.perfetto import read_trace

    events = read_trace(out)
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert any("tp rank 0" in n for n in names) and any("tp rank 1" in n for n in names), names
    # and in the engine process, one track per rank with the slow steps it held
    from tracekit.render.perfetto import PID_ENGINE, TID_RANKS

    tracks = {e["tid"]: e["args"]["name"] for e in events
              if e.get("name") == "thread_name" and e["pid"] == PID_ENGINE
              and TID_RANKS <= e["tid"] < TID_RANKS + 100}  # fmt: skip
    assert tracks == {TID_RANKS: "tp rank 0", TID_RANKS + 1: "tp rank 1"}, tracks
    held = [e for e in events if e.get("name") == "held slow step"]
    assert any(e["tid"] == TID_RANKS + 1 for e in held), held  # rank 1 held a slow step


def test_the_slowest_gap_was_held_by_the_stalled_rank(tp_run):
    """The rank view (docs/adapters.md, "Which rank held each slow step"): the longest gap
    holds a 40 ms stall of rank 1 (nothing else in this run is that long), so the step
    that closed it is a slow step held by rank 1, charged to its stall."""
    from tracekit.analysis.figures import analyze
    from tracekit.attribution.itl import partition

    p = partition(tp_run)
    v = analyze(tp_run, p).tp_ranks.to_dict()
    worst = int(p.step1[int(np.argmax(p.gap_ms))])
    steps = {s["step"]: s for s in v["slow_steps"]}
    assert worst in steps, (worst, sorted(steps))
    s = steps[worst]
    assert s["holder"] == 1 and s["holder_cause"] in ("injected", "gc"), s
    assert s["wait_ms"]["1"] > s["wait_ms"].get("0", 0.0)
    rank1 = next(r for r in v["ranks"] if r["rank"] == 1)
    assert rank1["slow_steps_held"] >= 1 and rank1["top_cause"] in ("injected", "gc")
    print({r["rank"]: (r["slow_steps_held"], round(r["charged_slow_ms"], 2), r["top_cause"])
           for r in v["ranks"]})  # fmt: skip


def test_every_worker_clock_pair_holds(tp_run):
    """The paired stamps that check each worker's clock (docs/adapters.md, "The merge")
    hold on one host: rank 1 may end its ``execute_model`` after the engine core's wait
    for rank 0 returned, and that is no violation (its end side is its collective entries)."""
    for p in tp_run.meta["processes"]:
        if p["role"] == "worker":
            fit = p["clock_fit"]
            print(p.get("tp_rank"), fit["pairs"], fit["bound_s"], fit["violations"])
            assert fit["violations"] == 0, (p.get("tp_rank"), fit)
            assert fit["pairs"] > 0
    assert not [w for w in tp_run.meta["warnings"] if "violate causality" in w]


def test_each_rank_samples_its_os_counters_at_every_collective(tp, tp_run):
    """Each collective is an OS interval of its own (its entry and exit are samples of the
    rank's thread): the evidence for a rank held by the OS after its entry stamp."""
    from tracekit.log.processes import process_logs, windows

    workers = [p for p in process_logs(tp["dir"]) if p.role == "worker"]
    assert len(workers) == 2
    for p in workers:
        col = windows(p.log, ("collective",), steps_only=False)
        # each stamped right after its counters were read, at the one tick that is also
        # the collective's entry (exit): the window and its OS interval are one
        # (docs/partition.md, "When the counters are read")
        samples = np.round(p.log.os_samples.t_s * 1e9)
        assert len(col) and np.isin(np.round(col * 1e9), samples).all(), p.path
    print("os_runqueue past the entry stamps:",
          {k: round(v * 1e3, 3) for k, v in tp_run.meta["tensor_parallel"]["charged_s"].items()
           if k.endswith("os_runqueue")})  # fmt: skip
