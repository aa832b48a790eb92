"""Recording from several threads at once gives intact, exactly counted rows.

Real threads, many iterations, a flush interval short enough that buffers are swapped and
parts written while every thread is appending. Each row carries its own identity (a step
number in its prefill tokens, a loop counter in a counter's value, a request number in its
prompt and max-new-token counts), so a torn, lost or doubled row shows.
"""

from __future__ import annotations

import sys
import threading

import numpy as np

import tracekit
from tracekit.capture.recorder import Recorder

NUM_STEPS = 1500
NUM_TOK = 2000  # per tokenizer thread
NUM_REQUESTS = 1500
BATCH = 4


def test_a_tokenizer_thread_beside_the_engine_loop_gives_intact_rows(tmp_path):
    out = tmp_path / "run.npz"
    rec = Recorder(out, config={"rung": "threads"}, flush_interval_s=0.002)
    start = threading.Barrier(4)
    errors: list[BaseException] = []

    def tokenizer(name: str) -> None:
        try:
            start.wait()
            for k in range(NUM_TOK):
                with rec.segment("tok"):
                    rec.counter(name, k)
                    with rec.segment("tok_inner"):  # nested on the same thread
                        pass
        except BaseException as e:  # noqa: BLE001 -- reported by the main thread
            errors.append(e)

    def arrivals() -> None:
        try:
            start.wait()
            for k in range(NUM_REQUESTS):
                rec.request(f"q{k}", prompt_tokens=k, max_new_tokens=k)
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads as often as the interpreter will
    try:
        with rec:
            threads = [
                threading.Thread(target=tokenizer, args=("tok_a",)),
                threading.Thread(target=tokenizer, args=("tok_b",)),
                threading.Thread(target=arrivals),
            ]
            for t in threads:
                t.start()
            start.wait()
            for i in range(NUM_STEPS):
                with rec.step():
                    rec.step_info(num_prefill_tokens=i)
                    with rec.segment("decode"):
                        pass
                    rec.emit([f"q{(i + j) % NUM_REQUESTS}" for j in range(BATCH)], [i + 1] * BATCH)
            for t in threads:
                t.join()
    finally:
        sys.setswitchinterval(old_interval)
    assert not errors, errors
    log = tracekit.load(out)
    # the loop emits for requests whose arrival the other thread has not recorded yet
    assert all(
        "before their request's arrival" in w  # a validation warning, or the recorder's
        or "told after the request's first emission" in w  # counts of a stamp race
        or "emission tick(s) before the request's arrival" in w
        for w in log.warnings
    ), log.warnings

    # steps: exactly 0..n-1, in order, each a proper interval
    st = log.steps
    assert np.array_equal(st.num_prefill_tokens, np.arange(NUM_STEPS))
    assert np.all(st.t_start_s <= st.t_end_s) and np.all(st.t_end_s[:-1] <= st.t_start_s[1:])

    # segments: every row an interval, labels by thread exactly as recorded
    sg = log.segments
    assert np.all(sg.t_start_s <= sg.t_end_s)
    label = np.array(log.labels)[sg.label]
    assert set(label) == {"tok", "tok_inner", "decode"}
    loop_thread = 0  # the thread that started the recorder
    dec = label == "decode"
    assert dec.sum() == NUM_STEPS and np.all(sg.thread[dec] == loop_thread)
    assert np.array_equal(sg.step[dec], np.arange(NUM_STEPS))  # recorded in step order
    s = sg.step[dec]
    assert np.all(st.t_start_s[s] <= sg.t_start_s[dec]) and np.all(sg.t_end_s[dec] <= st.t_end_s[s])
    tok_threads = set(sg.thread[~dec].tolist())
    assert len(tok_threads) == 2 and loop_thread not in tok_threads
    for th in tok_threads:
        mine = sg.thread == th
        assert np.all(sg.step[mine] == -1)  # off the loop: outside any step
        outer, inner = mine & (label == "tok"), mine & (label == "tok_inner")
        assert outer.sum() == inner.sum() == NUM_TOK
        # each inner window lies in its own outer one (rows of one thread stay in order)
        o, n = np.flatnonzero(outer), np.flatnonzero(inner)
        assert np.all(sg.t_start_s[o] <= sg.t_start_s[n]) and np.all(sg.t_end_s[n] <= sg.t_end_s[o])
        assert np.all(sg.t_end_s[o][:-1] <= sg.t_start_s[o][1:])

    # counters: each tokenizer's loop counter exactly 0..NUM_TOK-1, in time order
    ct = log.counters
    for name in ("tok_a", "tok_b"):
        mine = ct.name == log.counter_names.index(name)
        assert np.array_equal(ct.value[mine], np.arange(NUM_TOK))
        assert np.all(np.diff(ct.t_s[mine]) >= 0)

    # emissions: BATCH per step, each row's step, token count and time agree
    em = log.emissions
    assert len(em) == NUM_STEPS * BATCH
    assert np.array_equal(em.step, np.repeat(np.arange(NUM_STEPS), BATCH))
    assert np.array_equal(em.num_tokens, em.step + 1)
    assert np.all((st.t_start_s[em.step] <= em.t_s) & (em.t_s <= st.t_end_s[em.step]))
    expected = [f"q{(i + j) % NUM_REQUESTS}" for i in range(NUM_STEPS) for j in range(BATCH)]
    assert [log.request_ids[r] for r in em.request] == expected

    # requests: one id per request, each row's counts its own number (a request first seen
    # in an emission has no row of its own until its arrival is recorded: -1 then)
    assert len(log.request_ids) == len(set(log.request_ids)) == NUM_REQUESTS
    rq = log.requests
    k = np.array([int(r[1:]) for r in log.request_ids])
    assert np.array_equal(rq.prompt_tokens, k) and np.array_equal(rq.max_new_tokens, k)
    # an arrival told after the request's first emission is kept unknown (a first token
    # cannot come before its arrival), and the warnings count those
    late = int(np.isnan(rq.arrival_s).sum())
    told_late = [w for w in log.warnings if "told after the request's first emission" in w]
    assert (late > 0) == bool(told_late)
    assert not told_late or told_late[0].startswith(f"{late} ")
    assert np.all(np.isnan(rq.arrival_s) | (rq.arrival_s <= rq.first_token_s))
