"""`vllm serve` recorded by tracekit's plugin, against what a real streaming client saw.

One server (vLLM's OpenAI API server, default multiprocess mode: API server, engine core,
worker) of the tiny local model, 4 KV blocks of 32 tokens so the scheduler preempts, ngram
speculative decoding so that steps emit and chunks carry 1-4 tokens, recorded into a
directory with TRACEKIT_VLLM_DIR. An httpx client streams 6 completions
at once (one with n=3) and stamps every SSE chunk's arrival with time.perf_counter_ns,
the clock every recorder reads (CLOCK_MONOTONIC, one per host). Then vLLM's own
benchmark client, `vllm bench serve`, sends its random-dataset requests (ids
cmpl-bench-K-0), stamped with time.perf_counter, the same clock. The server is stopped with
SIGTERM; with vLLM's default --shutdown-timeout 0 the engine core and the worker are then
SIGKILLed (unless their own shutdown finishes first), so their logs are the parts they
flushed, which the merge recovers.
"""

from __future__ import annotations

import collections
import os
import shutil
import signal
import sys

import numpy as np
import pytest

from tracekit.log.rawlog import PREEMPT_REASON_CODES

pytestmark = [pytest.mark.adapters, pytest.mark.slow]

MAX_TOKENS = 40
N_SIBLINGS = 3
N_CHAT, CHAT_TOKENS = 2, 40
#: Two concurrent completions sent with one X-Request-Id (vLLM accepts it), told apart by
#: their lengths.
DUP_ID, DUP_TOKENS = "dup-1", (12, 20)
#: vllm bench serve: random prompts of 16 tokens, this many tokens each, 6 at a time
BENCH_PROMPTS, BENCH_TOKENS = 24, 12


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    pytest.importorskip("vllm")
    pytest.importorskip("httpx")
    from importlib.metadata import entry_points

    if not any(e.value.startswith("engine_adapters.vllm_serve") for e in
               entry_points(group="vllm.general_plugins")):  # fmt: skip
        pytest.skip("tracekit's vLLM plugin entry point is not installed: pip install -e .")
    from engine_adapters import serve_harness as sh
    from engine_adapters.tiny_model import build_tiny_llama

    base = tmp_path_factory.mktemp("serve")
    model = build_tiny_llama(str(base / "model"))
    rec_dir = str(base / "rec")
    template = base / "chat.jinja"
    template.write_text(sh.CHAT_TEMPLATE)
    # vLLM's bare stop (SIGTERM and SIGKILL at once, no flush wait): the engine core's and
    # the worker's logs are parts for recover (tests/adapters/test_adapters_vllm_stop.py: the wait)
    server = sh.start_server(model, record_dir=rec_dir, log_path=str(base / "server.log"),
                             extra_args=[*sh.PREEMPTING_ARGS, *sh.NGRAM_ARGS,
                                         "--chat-template", str(template)],
                             env_extra={"TRACEKIT_VLLM_KILL_FLUSH_S": "0"})  # fmt: skip
    try:
        bodies = [
            sh.completion_body(
                model, f"the quick brown fox {i} jumps over the lazy dog", MAX_TOKENS
            )
            for i in range(5)
        ]
        bodies.append(
            sh.completion_body(
                model, "a b c", MAX_TOKENS // 2, n=N_SIBLINGS, temperature=0.8, seed=1
            )  # fmt: skip
        )
        bodies += [sh.completion_body(model, "the dog", k) for k in DUP_TOKENS]
        headers = [None] * (len(bodies) - 2) + [{"X-Request-Id": DUP_ID}] * 2
        streams = sh.stream_load(server, bodies, headers)
        # the chat streams on their own: the client's arrival stamps they are compared with
        # are then not late by its work on a dozen other streams' chunks of the same step
        chat = [sh.chat_body(model, f"a lazy dog {i} sleeps", CHAT_TOKENS)
                for i in range(N_CHAT)]  # fmt: skip
        streams += sh.stream_load(server, chat)
        bodies += chat
        # vLLM's own benchmark client, on its own after them: its requests are named
        # cmpl-bench-K-0 and left out of the comparisons with the streams above
        bench = sh.bench_serve(server, str(base / "bench"), num_prompts=BENCH_PROMPTS,
                               output_len=BENCH_TOKENS)  # fmt: skip
        preemptions = sh.metric(server, "vllm:num_preemptions_total")
        spec = {k: sh.metric(server, f"vllm:spec_decode_num_{k}_tokens_total")
                for k in ("draft", "accepted")}  # fmt: skip
        spec["drafts"] = sh.metric(server, "vllm:spec_decode_num_drafts_total")
        spec["per_pos"] = sh.metric_by_label(
            server, "vllm:spec_decode_num_accepted_tokens_per_pos_total", "position"
        )
        import time

        time.sleep(1.0)  # > the flush interval (0.2 s): everything recorded reaches disk
    finally:
        rc = server.stop(signal.SIGTERM)
    return {"dir": rec_dir, "streams": streams, "preemptions": preemptions, "rc": rc, "spec": spec,
            "bodies": bodies, "server_log": server.log_path, "bench": bench}  # fmt: skip


@pytest.fixture(scope="module")
def merged(served):
    from tracekit.analysis.run import merge_run as merge_dir

    return merge_dir(served["dir"])


def _client_chunks(served, *, chat: bool | None = None):
    """name -> arrival times (s, perf_counter) of its chunks, as the client saw them (the
    two streams that share one X-Request-Id left out: their names are the same)."""
    out = collections.defaultdict(list)
    for s in served["streams"]:
        assert s.status == 200
        if s.id == f"cmpl-{DUP_ID}" or (chat is not None and s.chat != chat):
            continue
        for i, t in zip(s.index, s.t_ns, strict=True):
            out[s.name(i)].append(t * 1e-9)
    return out


def _bench_name(k: int) -> str:
    """tracekit's name of the k-th request of vllm bench serve (its id BENCH_ID_PREFIX{k})."""
    from engine_adapters.serve_harness import BENCH_ID_PREFIX

    return f"cmpl-{BENCH_ID_PREFIX}{k}-0"


def _is_bench(name: str) -> bool:
    from engine_adapters.serve_harness import BENCH_ID_PREFIX

    return name.startswith(f"cmpl-{BENCH_ID_PREFIX}")


def test_every_process_recorded_and_the_killed_ones_left_parts(served, merged):
    procs = {p["role"]: p for p in merged.meta["processes"]}
    assert set(procs) == {"api_server", "engine_core", "worker"}
    # the API server exited normally on SIGTERM: its log is whole
    assert not procs["api_server"]["recovered"]
    assert procs["api_server"]["path"].endswith(".npz")
    names = sorted(os.listdir(served["dir"]))
    parts = [n for n in names if n.endswith(".npz.parts")]
    # every process's run is its parts folder
    assert len(parts) == 3 and {n.split("-")[0] for n in parts} == set(procs), names
    # with --shutdown-timeout 0 the API server SIGKILLs the engine core and the worker,
    # unless their own shutdown wins the race (vLLM's engine core exits its busy loop
    # and may finish first; a stop costs tracekit no time to lose it): a process killed
    # before its stop wrote OUT is read from its parts, one that stopped from OUT
    for n in parts:
        role, out = n.split("-")[0], os.path.join(served["dir"], n[: -len(".parts")])
        assert procs[role]["recovered"] == (not os.path.exists(out)), (role, names)
    api = next(n for n in parts if n.startswith("api_server"))
    assert os.path.exists(os.path.join(served["dir"], api, "final.json"))  # it stopped
    # what each of the other processes recorded, on the run's clock
    ps = merged.proc_segments
    roles = [p["role"] for p in merged.meta["processes"]]
    for role, labels in (("api_server", {"tokenize", "input", "output", "sse_write"}),
                         ("worker", {"prepare", "forward", "sample"})):  # fmt: skip
        mine = ps.label[ps.process == roles.index(role)]
        assert labels <= {merged.labels[i] for i in mine}, role


def test_chunk_counts_equal_client_boundary_emissions(served, merged):
    client = _client_chunks(served)
    ce = merged.client_emissions
    recorded = collections.Counter(merged.request_ids[i] for i in ce.request)
    dup = {f"cmpl-{DUP_ID}-0", f"cmpl-{DUP_ID}-0~2"}
    assert {k: len(v) for k, v in client.items()} == {
        k: v for k, v in recorded.items() if k not in dup and not _is_bench(k)
    }
    # siblings named ID-0#INDEX, chats chatcmpl-ID, not vLLM's internal ids
    assert len(client) == 5 + N_SIBLINGS + N_CHAT
    assert sum(k.startswith("chatcmpl-") for k in recorded) == N_CHAT


def test_every_token_reached_the_log_of_both_boundaries(served, merged):
    # ignore_eos: each choice streams exactly max_tokens tokens; the engine core was
    # SIGKILLed, so this holds only if it flushed before (the idle flush)
    ce, em = merged.client_emissions, merged.emissions
    client_tok = np.bincount(ce.request, ce.num_tokens, minlength=len(merged.request_ids))
    engine_tok = np.bincount(em.request, em.num_tokens, minlength=len(merged.request_ids))
    pairs = zip(served["streams"], served["bodies"], strict=True)
    expect = {s.name(i): b["max_tokens"] for s, b in pairs for i in range(s.n)}
    dup = f"cmpl-{DUP_ID}-0"
    del expect[dup]
    # the bench's requests: output_len tokens each (ignore_eos)
    expect |= {_bench_name(k): BENCH_TOKENS for k in range(BENCH_PROMPTS)}
    got_client = {n: int(c) for n, c in zip(merged.request_ids, client_tok, strict=True)}
    got_engine = {n: int(c) for n, c in zip(merged.request_ids, engine_tok, strict=True)}
    # one X-Request-Id, two requests: each kept its own tokens at both boundaries
    for got in (got_client, got_engine):
        assert sorted((got.pop(dup), got.pop(dup + "~2"))) == sorted(DUP_TOKENS)
    assert got_client == expect
    assert got_engine == expect


def test_client_gaps_agree_with_tracekit_frontend_gaps(served, merged):
    client = _client_chunks(served)
    ce = merged.client_emissions
    t0_s = merged.meta["t0_tick"] * merged.meta["seconds_per_tick"]  # the engine core's start
    diffs, lat = [], []
    for name, ts in client.items():
        i = merged.request_ids.index(name)
        mine = ce.request == i
        order = np.argsort(ce.t_s[mine], kind="stable")
        t_rec, t_ready = ce.t_s[mine][order], ce.t_ready_s[mine][order]
        t_cli = np.asarray(ts) - t0_s  # the client's stamps on the run's clock
        assert len(t_rec) == len(t_cli)
        diffs.append(np.diff(t_cli) - np.diff(t_rec))
        lat.append(t_cli - t_rec)
        # causality on one clock: no chunk reaches the client before it was written (the
        # write is stamped just before its system call while the client keeps reading;
        # stamped after it, the loop thread's wait for the GIL put the stamp up to 5 ms
        # after the client's arrival stamp)
        assert np.all(t_cli >= t_rec)
        assert np.all(t_rec >= t_ready)
    d_ms = np.abs(np.concatenate(diffs)) * 1e3
    lat_ms = np.concatenate(lat) * 1e3
    print(f"|client gap - tracekit gap| ms: median {np.median(d_ms):.4f}, "
          f"p90 {np.percentile(d_ms, 90):.4f}, max {d_ms.max():.3f}; "
          f"write -> client arrival ms: median {np.median(lat_ms):.4f}, "
          f"min {lat_ms.min():.4f}")  # fmt: skip
    assert np.median(d_ms) < 1.0


def _gap_diffs_ms(merged, client):
    ce = merged.client_emissions
    diffs = []
    for name, ts in client.items():
        mine = ce.request == merged.request_ids.index(name)
        t_rec = np.sort(ce.t_s[mine])
        assert len(t_rec) == len(ts)
        diffs.append(np.diff(np.asarray(ts)) - np.diff(t_rec))
    return np.abs(np.concatenate(diffs)) * 1e3


def test_chat_streams_are_recorded_at_the_client_boundary(served, merged):
    chat = _client_chunks(served, chat=True)
    assert len(chat) == N_CHAT and all(len(v) > 1 for v in chat.values())
    d_ms = _gap_diffs_ms(merged, chat)
    print(f"chat: |client gap - tracekit gap| ms: median {np.median(d_ms):.4f}, "
          f"max {d_ms.max():.3f} over {len(d_ms)} gaps")  # fmt: skip
    assert np.median(d_ms) < 1.0
    # the role-only first chunk is not a token chunk: tokens equal max_tokens
    ce = merged.client_emissions
    for name in chat:
        mine = ce.request == merged.request_ids.index(name)
        assert int(ce.num_tokens[mine].sum()) == CHAT_TOKENS


def test_arrival_is_the_http_receipt_after_the_client_sent(served, merged):
    from tracekit.attribution.ttft import ttft_partition

    t0_s = merged.meta["t0_tick"] * merged.meta["seconds_per_tick"]
    rq = merged.requests
    sent, recv, handler = [], [], []
    for s in served["streams"]:
        if s.id == f"cmpl-{DUP_ID}":
            continue
        for i in range(s.n):
            j = merged.request_ids.index(s.name(i))
            t_send = s.t_send_ns * 1e-9 - t0_s  # the client's send on the run's clock
            # causality on one clock: sent, read by the server, handled, in the engine core,
            # first token
            assert t_send <= rq.arrival_s[j] <= rq.handler_s[j] <= rq.engine_s[j]
            assert rq.engine_s[j] <= rq.first_token_s[j]
            sent.append(t_send)
            recv.append(rq.arrival_s[j])
            handler.append(rq.handler_s[j])
    lag = (np.array(recv) - np.array(sent)) * 1e3
    http = (np.array(handler) - np.array(recv)) * 1e3
    print(f"client send -> HTTP receipt ms: median {np.median(lag):.3f}, max {lag.max():.3f}; "
          f"receipt -> handler ms: median {np.median(http):.3f}, max {http.max():.3f}")  # fmt: skip
    tp = ttft_partition(merged)  # reconciles or raises
    col = tp.labels.index("http")
    # rule 0 (docs/ttft.md): http is receipt to handler, frontend handler to the engine
    # core's add, less what the OS took of the API server's event loop (frontend_os_*)
    os_cols = [tp.labels.index(x) for x in ("frontend_os_runqueue", "frontend_os_blocked")]
    for i, r in enumerate(tp.request.tolist()):
        http, front = tp.parts_ms[i, col], tp.parts_ms[i, tp.labels.index("frontend")]
        assert http <= (rq.handler_s[r] - rq.arrival_s[r]) * 1e3 + 1e-6
        assert front <= (rq.engine_s[r] - rq.handler_s[r]) * 1e3 + 1e-6
        pre = http + front + tp.parts_ms[i, os_cols].sum()
        assert abs(pre - (rq.engine_s[r] - rq.arrival_s[r]) * 1e3) < 1e-6
    assert tp.parts_ms[:, col].sum() > 0


def test_client_boundary_ttft_is_the_streaming_clients_less_the_two_hops(served, merged):
    """docs/ttft.md, "The client boundary": per request, the client's TTFT (its first token
    chunk's arrival less its send: what vllm bench serve measures) is tracekit's
    client-boundary TTFT (HTTP receipt to the first chunk's write) plus what only the
    client sees: before the server's first byte, its send (connecting included: no server
    process is there yet), and after the write, the socket hop to its read. Both are >= 0
    on one clock, so tracekit's is never above the client's; the hop after the write is a
    loopback hop (the client-gap test above measures the same hop for every chunk)."""
    from tracekit.attribution.client_ttft import client_ttft_partition

    t0_s = merged.meta["t0_tick"] * merged.meta["seconds_per_tick"]
    ct = client_ttft_partition(merged)  # reconciles or raises
    row = {merged.request_ids[int(r)]: i for i, r in enumerate(ct.request)}
    client_ms, ours_ms, hops_ms, engine_ms = [], [], [], []
    for s in served["streams"]:
        if s.id == f"cmpl-{DUP_ID}":
            continue
        for k in range(s.n):
            i = row[s.name(k)]  # every streamed request has a client-boundary TTFT
            first_ns = min(t for j, t in zip(s.index, s.t_ns, strict=True) if j == k)
            send_s, first_s = s.t_send_ns * 1e-9 - t0_s, first_ns * 1e-9 - t0_s
            client_ms.append((first_s - send_s) * 1e3)
            ours_ms.append(ct.ttft_ms[i])
            engine_ms.append(ct.engine_ttft_ms[i])
            # client - ours = (receipt - send) + (first read - write): the two hops
            hops_ms.append(((ct.arrival_s[i] - send_s) * 1e3, (first_s - ct.write_s[i]) * 1e3))
    client, ours = np.array(client_ms), np.array(ours_ms)
    hops, margin = np.array(hops_ms), client - ours
    print(f"client TTFT ms median {np.median(client):.3f}; tracekit client boundary median "
          f"{np.median(ours):.3f}, engine boundary median {np.median(engine_ms):.3f}; "
          f"client - client boundary ms: median {np.median(margin):.3f}, max "
          f"{margin.max():.3f} (send -> receipt median {np.median(hops[:, 0]):.3f}, write -> "
          f"read median {np.median(hops[:, 1]):.3f}); engine boundary short by median "
          f"{np.median(client - np.array(engine_ms)):.3f} ms")  # fmt: skip
    assert len(client) == len(served["bodies"]) - len(DUP_TOKENS) + N_SIBLINGS - 1
    assert np.all(hops >= 0)  # causality on one clock: never above what the client measured
    # the socket hop after the write, on one host's loopback (the client's loop reads a
    # dozen streams at once: a median, as for the client gaps)
    assert np.median(hops[:, 1]) < 2.0
    assert np.all(ours >= np.array(engine_ms))


def test_vllm_bench_serve_sees_the_client_boundary_plus_two_hops(served, merged):
    """vLLM's own benchmark client against tracekit's client boundary, request by request
    (docs/ttft.md, "The client boundary"). For the bench's request k (id bench-K, so
    tracekit's cmpl-bench-K-0), on the one CLOCK_MONOTONIC both read (time.perf_counter):
    S its start (stamped before the send), R_j its read of chunk j (R_0 = S + its TTFT,
    R_j = R_{j-1} + its j-th ITL), A tracekit's arrival (the server read the request's first
    byte) and W_j tracekit's write of chunk j (stamped just before the send's system call).
    The client's window contains the server's: S <= A and W_j <= R_j, so

    - the bench's TTFT R_0 - S = ours (W_0 - A) + (A - S) + (R_0 - W_0): never below ours,
      by the send before the server's first byte (a new connection included) and the
      socket hop after the write, both >= 0 (checked per request, to 1 us of rounding);
    - each bench ITL R_j - R_{j-1} = ours (W_j - W_{j-1}) + hop_j - hop_{j-1}, with
      hop_j = R_j - W_j >= 0 a loopback hop (checked per chunk): the two differ by the
      change of that hop only, and the hop's median is a loopback hop's (< 2 ms, as for the
      httpx client above: the bench's event loop reads 6 streams at once);
    - one chunk of the bench (its TTFT, then one ITL a chunk) is one chunk written;
    - the engine boundary's TTFT ends at the engine core's first token, before the API
      server wrote the chunk that carries it: below the client boundary's, every request.

    The values are `tracekit ttft --boundary client --format jsonl`'s, what a user
    compares with the bench."""
    import json
    import subprocess

    bench = served["bench"]
    assert bench["completed"] == BENCH_PROMPTS and bench["failed"] == 0
    t0_s = merged.meta["t0_tick"] * merged.meta["seconds_per_tick"]
    r = subprocess.run([sys.executable, "-m", "tracekit", "ttft", served["dir"], "--boundary",
                        "client", "--format", "jsonl"], capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    ours = {x["request"]: x for x in map(json.loads, r.stdout.splitlines())}
    ce = merged.client_emissions
    eps_s = 1e-6  # float rounding of the bench's seconds and the run clock's origin
    send, hop0, hops, itl_d, rows = [], [], [], [], []
    for k in range(BENCH_PROMPTS):
        rec = ours[_bench_name(k)]
        start_s = bench["start_times"][k] - t0_s  # S on the run's clock
        read_s = start_s + bench["ttfts"][k] + np.cumsum([0.0, *bench["itls"][k]])  # R_j
        mine = ce.request == merged.request_ids.index(_bench_name(k))
        write_s = np.sort(ce.t_s[mine])  # W_j
        assert len(write_s) == len(read_s)  # one bench chunk, one chunk written
        assert abs(write_s[0] - rec["first_chunk"]) < 1e-9
        assert start_s <= rec["arrival"] + eps_s  # S <= A
        assert np.all(write_s <= read_s + eps_s)  # W_j <= R_j
        assert bench["ttfts"][k] * 1e3 >= rec["ttft_ms"] - eps_s * 1e3
        assert rec["engine_ttft_ms"] < rec["ttft_ms"]
        send.append((rec["arrival"] - start_s) * 1e3)
        hop0.append((read_s[0] - write_s[0]) * 1e3)
        hops.append((read_s - write_s) * 1e3)
        itl_d.append(np.asarray(bench["itls"][k]) * 1e3 - np.diff(write_s) * 1e3)
        rows.append((bench["ttfts"][k] * 1e3, rec["ttft_ms"], rec["engine_ttft_ms"]))
    hop_ms, d_ms = np.concatenate(hops), np.abs(np.concatenate(itl_d))
    b, c, e = np.array(rows).T
    print(f"vllm bench serve TTFT ms median {np.median(b):.3f}; tracekit client boundary "
          f"{np.median(c):.3f} (below by median {np.median((b - c) / b) * 100:.1f}%), engine "
          f"boundary {np.median(e):.3f} (below by median {np.median((b - e) / b) * 100:.1f}%); "
          f"send -> receipt ms median {np.median(send):.3f}, max {max(send):.3f}; write -> "
          f"read ms median {np.median(hop_ms):.3f} (first chunk {np.median(hop0):.3f}), max "
          f"{hop_ms.max():.3f}; |bench ITL - client ITL| ms median {np.median(d_ms):.4f}, "
          f"max {d_ms.max():.3f} over {len(d_ms)} ITLs")  # fmt: skip
    assert np.median(hop_ms) < 2.0


def test_one_request_id_twice_stays_two_requests(served, merged, tmp_path):
    import json
    import subprocess
    import sys

    dup = f"cmpl-{DUP_ID}-0"
    assert dup in merged.request_ids and dup + "~2" in merged.request_ids
    cli = [sys.executable, "-m", "tracekit"]
    run = str(tmp_path / "run.npz")
    for args in (["merge", served["dir"], "-o", run], ["check", run],
                 ["analyze", run, "--format", "jsonl"]):  # fmt: skip
        r = subprocess.run([*cli, *args], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
    # the id the client saw (cmpl-dup-1) selects both requests' client gaps
    r = subprocess.run([*cli, "gaps", served["dir"], "--boundary", "client", "--request",
                        f"cmpl-{DUP_ID}", "--format", "jsonl"], capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    recs = [json.loads(x) for x in r.stdout.splitlines()]
    ce = merged.client_emissions
    chunks = {n: int(np.sum(ce.request == merged.request_ids.index(n))) for n in (dup, dup + "~2")}
    assert collections.Counter(x["request"] for x in recs) == {n: c - 1 for n, c in chunks.items()}
    for x in recs:
        assert abs(sum(x["parts"].values()) - x["gap_ms"]) < 1e-6


def test_gaps_boundary_client_and_the_client_id(served, merged):
    import json
    import subprocess
    import sys

    s = next(x for x in served["streams"] if x.n == 1 and not x.chat)
    cli = [sys.executable, "-m", "tracekit", "gaps", served["dir"], "--format", "jsonl"]
    out = {}
    for boundary in ("engine", "client"):
        r = subprocess.run([*cli, "--boundary", boundary, "--request", s.id],
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stderr
        out[boundary] = [json.loads(x) for x in r.stdout.splitlines()]
    assert {x["request"] for x in out["client"]} == {s.name(0)}
    assert len(out["client"]) == len(s.t_ns) - 1  # one gap between each two chunks
    em = merged.emissions
    assert len(out["engine"]) == int(np.sum(em.request == merged.request_ids.index(s.name(0)))) - 1
    r = subprocess.run([*cli, "--request", "cmpl-nope"], capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    errors = [x for x in r.stderr.splitlines() if x.startswith("tracekit: error:")]
    assert r.returncode == 2 and len(errors) == 1 and "'cmpl-nope'" in errors[0]


def test_preemptions_equal_vllm_metrics_counter(served, merged):
    assert served["preemptions"] >= 1, "4 KV blocks were meant to force preemption"
    assert len(merged.evictions) == served["preemptions"]
    # each with exactly one cause, recorded in the engine core (recovered from its parts)
    # and kept by the merge: KV full, with the blocks it held (4 in all) and its tokens
    pe = merged.preemptions
    assert len(pe) == served["preemptions"]
    assert set(pe.reason.tolist()) == {PREEMPT_REASON_CODES["kv_full"]}
    assert set((pe.num_free_blocks + pe.num_used_blocks).tolist()) <= {4, 5}
    assert (pe.num_computed_tokens_lost > 0).all()


def test_one_clock_is_proved_by_paired_stamps(merged):
    for p in merged.meta["processes"]:
        fit = p.get("clock_fit")
        if fit is None:
            assert p["role"] == "engine_core"  # the reference
            continue
        assert fit["method"].startswith("one clock")
        assert fit["pairs"] > 10 and fit["violations"] == 0
        lo, hi = fit["bound_s"]
        assert lo <= 0 <= hi
    # one pair a process, each against the engine core (the merge stays linear in
    # processes): the worker-to-API-server offset is the difference of the two
    pairs = {(c["a"].split("-")[0], c["b"].split("-")[0]) for c in merged.meta["clock_pairs"]}
    assert pairs == {("engine_core", "api_server"), ("engine_core", "worker")}


def test_every_gap_reconciles_at_both_boundaries(merged):
    from tracekit.attribution.client import client_partition
    from tracekit.attribution.itl import partition
    from tracekit.attribution.reference import client_partition_reference

    p = partition(merged)  # check=True raises on a gap whose parts miss its length
    assert len(p) > 0 and p.reconcile_max_err_ms < 1e-6
    cp = client_partition(merged)  # the same check at the client boundary
    assert len(cp) == len(merged.client_emissions) - len(merged.request_ids)
    assert cp.reconcile_err_ms.max() < 1e-6
    ref = client_partition_reference(merged)
    assert np.allclose(cp.parts_ms, ref.parts_ms, atol=1e-6)
    # the frontend's own causes were measured, not left to the residual
    for label in ("hop", "output", "sse_write"):
        assert cp.column(label).sum() > 0, label


def test_analyze_report_and_trace_read_the_directory(served, tmp_path):
    import json
    import subprocess
    import sys

    cli = [sys.executable, "-m", "tracekit"]
    r = subprocess.run([*cli, "analyze", served["dir"], "--format", "jsonl"],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    client = json.loads(r.stdout)["client"]
    assert set(client["itl_ms"]) >= {"per_chunk", "per_token", "per_engine_step"}
    bench_chunks = sum(1 + len(x) for x in served["bench"]["itls"])  # a TTFT, then ITLs
    assert client["chunks"] == sum(len(s.t_ns) for s in served["streams"]) + bench_chunks
    trace = str(tmp_path / "t.json")
    r = subprocess.run([*cli, "trace", served["dir"], "-o", trace], capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    from tracekit.render.perfetto import read_trace, validate_trace

    events = read_trace(trace)
    assert validate_trace(events) == []
    names = {e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert {"engine", "requests"} <= names
    assert any(n.startswith("api_server") for n in names)
    assert any(n.startswith("worker") for n in names)
    report = str(tmp_path / "r.html")
    r = subprocess.run([*cli, "report", served["dir"], "-o", report], capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert r.returncode == 0, r.stderr
    with open(report, encoding="utf-8") as fh:
        assert "Client boundary" in fh.read()


def test_sigkilled_parts_rebuild_with_recover_and_merge_keeps_them(served, merged, tmp_path):
    from tracekit.log.parts import recover
    from tracekit.log.reader import load

    core = next(p for p in merged.meta["processes"] if p["role"] == "engine_core")
    # its parts folder, whether it was killed (read from it) or stopped first (from OUT)
    folder = core["path"] if core["recovered"] else core["path"] + ".parts"
    copy = str(tmp_path / "core.npz.parts")
    shutil.copytree(folder, copy)
    out = recover(copy)
    log = load(out)
    assert len(log.steps) == len(merged.steps) > 0
    assert len(log.emissions) == len(merged.emissions)
    assert os.path.isdir(folder)  # the merge read the parts in place


def test_speculative_decoding_acceptance_equals_vllm_metrics(served, merged):
    from tracekit.attribution.client import spec_acceptance

    acc = spec_acceptance(merged)
    assert served["spec"]["draft"] > 0, "the ngram proposer was meant to draft"
    assert acc["drafted"] == served["spec"]["draft"]
    assert acc["accepted"] == served["spec"]["accepted"]
    # drafts checked and acceptance per draft position, against the same /metrics
    assert acc["drafts"] == served["spec"]["drafts"] > 0
    per_pos = served["spec"]["per_pos"]
    assert per_pos, "vLLM exports acceptance per position with speculative decoding"
    want = [per_pos.get(str(k), 0.0) for k in range(max(map(int, per_pos)) + 1)]
    assert acc["accepted_per_pos"] == want[: len(acc["accepted_per_pos"])]
    assert not any(want[len(acc["accepted_per_pos"]) :])  # no position left out
    # multi-token emissions at both boundaries, and the proposer's and verifier's windows
    assert merged.emissions.num_tokens.max() > 1
    assert merged.client_emissions.num_tokens.max() > 1
    assert "verify" in merged.labels and "draft" in merged.labels
    worker = next(i for i, p in enumerate(merged.meta["processes"]) if p["role"] == "worker")
    ps = merged.proc_segments
    assert np.any((ps.process == worker) & (ps.label == merged.labels.index("draft")))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OS evidence: Linux only")
def test_every_process_records_os_evidence(served, merged):
    """The plugin's recorders run on wall time, so every process records OS evidence
    (docs/capture.md): the engine core at its steps' ends (the merged run keeps them, and
    its partitions have the OS causes), the API server at its `with segment()` windows'
    ends (threads without steps); the worker's reader is on too."""
    from tracekit.attribution.itl import partition
    from tracekit.log.processes import process_logs
    from tracekit.log.rawlog import OS_SEGMENT_END, OS_SEGMENT_START, OS_STEP_END, OS_STEP_START

    logs = {p.identity["role"]: p.log for p in process_logs(served["dir"])}
    for role, log in logs.items():
        assert log.meta["os_evidence"]["recorded"] is True, role
    core = merged.os_samples
    steps = (core.kind == OS_STEP_START) | (core.kind == OS_STEP_END)
    assert steps.sum() >= 2 * (len(merged.steps) - 1)  # the last step may be cut by SIGKILL
    assert (core.runqueue_ns[steps] >= 0).all()
    assert "os_runqueue" in partition(merged).labels
    api = logs["api_server"].os_samples
    seg = (api.kind == OS_SEGMENT_START) | (api.kind == OS_SEGMENT_END)
    assert seg.sum() > 0 and seg.sum() % 2 == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="OS evidence: Linux only")
def test_the_api_servers_os_intervals_follow_its_segments_and_the_client_gaps_take_them(merged):
    """proc_os (docs/partition.md, "Unrecorded windows", rule 5): the API server's OS
    intervals run from sample to sample of its event loop, taken at its windows' start and
    end, each stamped right after its counters were read (docs/partition.md, "When the
    counters are read"): one marked inside a segment starts inside a window it recorded
    with `segment()` and ends at or after that window's end; one marked between segments
    starts after a window's end and ends after a later window's start. The client partition
    takes the OS's shares from them: its frontend OS columns, exclusive and reconciled,
    never more than the intervals hold."""
    from tracekit.attribution.client import client_partition

    po, ps = merged.proc_os, merged.proc_segments
    api = [i for i, p in enumerate(merged.meta["processes"]) if p["role"] == "api_server"]
    assert len(po) > 0 and set(po.process.tolist()) <= set(api)
    assert {0, 1} <= set(po.in_segment.tolist())
    for k in set(po.process.tolist()):
        mine = ps.process == k
        # (its windows: the sampled segments and the chunks' write windows, which carry
        # ticks measured elsewhere and may begin inside a segment)
        s0, s1 = ps.t_start_s[mine], ps.t_end_s[mine]
        rows = np.flatnonzero(po.process == k)
        for i in rows.tolist():
            a, b = float(po.t_start_s[i]), float(po.t_end_s[i])
            if po.in_segment[i]:  # sampled inside a window, next after that window's end
                assert ((s0 <= a) & (a <= s1) & (s1 <= b)).any(), (a, b)
            else:  # sampled after a window's end, next inside a later window
                assert (s1 <= a).any() and ((a <= s0) & (s0 <= b)).any(), (a, b)
    assert np.all(po.runqueue_s + po.offcpu_s <= po.t_end_s - po.t_start_s + 1e-12)
    cp = client_partition(merged)  # reconciles or raises
    rq, bl = cp.column("frontend_os_runqueue"), cp.column("frontend_os_blocked")
    assert np.all(rq >= 0) and np.all(bl >= 0)
    # a gap's OS share is at most what the intervals over its frontend part hold (off-CPU
    # time: those inside a segment)
    for i in np.flatnonzero((rq + bl) > 0).tolist():
        x, b = cp.engine_s[i], cp.t1_s[i]
        over = (po.t_end_s > x) & (po.t_start_s < b)
        assert rq[i] <= po.runqueue_s[over].sum() * 1e3 + 1e-9
        assert bl[i] <= po.offcpu_s[over & (po.in_segment == 1)].sum() * 1e3 + 1e-9
    seg = po.in_segment == 1
    print(
        f"API server OS intervals: {len(po)} ({int(seg.sum())} in segments), run queue "
        f"{po.runqueue_s.sum() * 1e3:.3f} ms ({po.runqueue_s[seg].sum() * 1e3:.3f} in "
        f"segments), off CPU in segments {po.offcpu_s[seg].sum() * 1e3:.3f} ms; client gaps: "
        f"frontend_os_runqueue {rq.sum():.3f} ms, frontend_os_blocked {bl.sum():.3f} ms over "
        f"{len(cp)} gaps"
    )


def test_analyze_of_the_directory_in_slices_has_the_whole_runs_figures(
    served, merged, monkeypatch
):
    """`analyze DIR` read in slices (a slice budget of 20 emissions: the run is "long"),
    the client boundary included (its API server's OS intervals, the killed engine core's
    unrecorded time): the whole merged run's figures, figure for figure, the engine
    boundary's TTFT (its API server's windows begun before a request's arrival, in an
    earlier part) and the client boundary's (docs/reports.md, "The client boundary in
    slices")."""
    from test_sliced_server import assert_same

    from tracekit.analysis.figures import analyze
    from tracekit.analysis.stream_server import analyze_server_path, is_long_server_run

    whole = analyze(merged).to_dict()
    monkeypatch.setenv("TRACEKIT_SLICE_EMISSIONS", "20")
    assert is_long_server_run(served["dir"])
    got = analyze_server_path(served["dir"]).to_dict()
    assert whole["client"]["chunks"] and got["client"] is not None
    assert_same(whole, got)
    for k in ("gaps", "chunks", "p99_ms", "ttft_p50_ms", "ttft_p99_ms"):
        assert whole["client"][k] == got["client"][k], k
