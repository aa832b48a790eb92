"""Raw log v1 round trip and the published layout, which must load unchanged."""

from __future__ import annotations

import numpy as np
import pytest
from logbuilder import LogBuilder

import tracekit
from tracekit.analysis.figures import analyze
from tracekit.errors import LogError
from tracekit.log.published import save_published


def sample_log():
    b = LogBuilder()
    t = 0.0
    for i in range(30):
        graph = 0 if i % 7 == 3 else (4 if i % 2 else 8)
        s = b.step(t, t + 12, n_decode=3 + i % 5, graph=graph, n_prefill=64 * (i % 3))
        b.seg(s, "tok", t, t + 0.5)
        if i % 3 == 0:
            b.seg(s, "prefill", t + 0.5, t + 4)
        if i == 11:
            b.seg(s, "swap", t + 4, t + 5)
        b.seg(s, "decode", t + 5, t + 11.5 + (i % 4))
        for r in range(3):
            if not (r == 1 and 10 <= i < 14):
                b.emit(r, t + 11.5 + (i % 4), s)
        t += 12 + (i % 4)
    b.evict(1, 10 * 12.0 + 4, 14 * 12 + 20.0)
    b.gc(50, 53, 0)
    b.gc(200, 290, 2)
    return b.build(config={"rung": "baseline", "seed": 1}, arrivals_ms=[-5, -3, -1])


def to_published(log, path):
    """`log` in the published method's .npz layout, request ids 100, 101, ..."""
    return save_published(log, path, first_id=100)


def test_round_trip_keeps_every_table(tmp_path):
    log = sample_log()
    path = log.save(tmp_path / "run.npz")
    back = tracekit.load(path)
    for table in ("steps", "segments", "gc_pauses", "emissions", "evictions", "requests"):
        for col, a in getattr(log, table).columns().items():
            np.testing.assert_array_equal(getattr(getattr(back, table), col), a, err_msg=col)
    assert back.labels == log.labels and back.request_ids == log.request_ids
    assert back.config == log.config and back.wall_s == log.wall_s
    with np.load(path, allow_pickle=False) as z:
        assert str(z["schema"]) == "tracekit.rawlog" and int(z["schema_version"]) == 5
        assert "steps.t_start_s" in z.files  # units in the names


def test_published_layout_loads_unchanged_and_analyses_the_same(tmp_path):
    log = sample_log()
    path = tmp_path / "baseline__s1.npz"
    to_published(log, path)
    pub = tracekit.load(path)
    assert pub.source == "published" and pub.rung == "baseline" and pub.seed == 1
    assert pub.request_ids == ("100", "101", "102")
    a, b = analyze(log).to_dict(), analyze(pub).to_dict()
    for key in a:
        if key not in ("path", "warnings", "evictions"):
            assert a[key] == b[key], key
    # who evicted whom: the same figures; the published layout names requests by number
    for w in (*a["evictions"]["worst"], *b["evictions"]["worst"]):
        w.pop("victim")
    assert a["evictions"] == b["evictions"]


def test_published_figures_by_hand():
    # the figures of design.md on the sample, computed here the obvious way
    log = sample_log()
    a = analyze(log)
    em = log.emissions
    gaps = []
    for r in range(3):
        t = np.sort(em.t_s[em.request == r])
        gaps += list(np.diff(t) * 1e3)
    gaps = np.array(gaps)
    assert a.gaps == len(gaps) and a.tokens == len(em)
    assert a.itl_p99 == pytest.approx(np.percentile(gaps, 99))
    assert a.itl_p999 == pytest.approx(np.percentile(gaps, 99.9))
    assert a.tok_per_s == pytest.approx(len(em) / log.wall_s)
    assert a.preemptions == 0 and a.eager_steps == 4 and a.max_decode_B == 7
    assert a.gc_counts == {"0": 1, "1": 0, "2": 1}
    assert a.gen2_startup_ms == [] and a.gen2_serving_ms == [90.0]
    assert sum(a.tail_share.values()) == pytest.approx(1.0)
    assert sum(a.all_share.values()) == pytest.approx(1.0)
    assert sum(b.count for b in a.hist) == a.gaps
    assert a.skipped_steps_without_eviction == 0  # request 1's skipped steps have an eviction
    assert a.evicted_context_ms["forward"] > 0
    assert a.reconcile_max_err_ms <= 1e-9


def test_skipped_steps_without_an_eviction_are_counted():
    b = LogBuilder()
    for i in range(4):
        s = b.step(10 * i, 10 * i + 10)
        b.seg(s, "decode", 10 * i, 10 * i + 9)
        if i != 2:  # request 0 silently skips step 2: no eviction explains it
            b.emit(0, 10 * i + 9, s)
    assert analyze(b.build()).skipped_steps_without_eviction == 1


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: d.pop("steps"), "steps"),
        (lambda d: d.update(segs=np.zeros((3, 5))), "segs"),
        (lambda d: d.update(wall=np.array("x")), "wall"),
        (lambda d: d.update(emissions=np.array([[999.0, 0.1, 0]])), "emissions"),
    ],
)
def test_published_layout_errors_name_the_field(tmp_path, mutate, field):
    log = sample_log()
    path = tmp_path / "p.npz"
    to_published(log, path)
    with np.load(path) as z:
        d = dict(z)
    mutate(d)
    np.savez(path, **d)
    with pytest.raises(LogError) as e:
        tracekit.load(path)
    assert e.value.field == field and str(path) in str(e.value)


def test_save_published_refuses_a_label_the_layout_has_no_code_for(tmp_path):
    from dataclasses import replace

    log = replace(sample_log(), labels=("tok", "swap", "prefill", "schedule"))
    with pytest.raises(ValueError, match=r"\['schedule'\] have no code"):
        save_published(log, tmp_path / "x.npz")
    assert not (tmp_path / "x.npz").exists()
