"""`tracekit export` and `fleet` on raw logs of a long run read in slices (docs/reports.md,
"Reading a long run in slices"): each says so on stderr, and the fleet rollup over the
export is the whole run's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SLICES = "TRACEKIT_SLICE_EMISSIONS"
WHOLE = "100000000"  # more emissions than the demo run: read whole


def test_the_command_says_it_reads_in_slices_and_fleet_inherits_it(demo_run, tmp_path):
    """`tracekit export` and `fleet` on raw logs say on stderr which run they read in
    slices; the fleet rollup is the whole run's (pooled percentiles and counts exactly:
    the same gaps; the tail's shares, sums of parts, to float rounding: a slice's prefix
    sums start at the slice)."""

    def run(budget: str, *args: str) -> tuple[str, str]:
        env = {**os.environ, SLICES: budget}
        r = subprocess.run([sys.executable, "-m", "tracekit", *args], capture_output=True,
                           text=True, cwd=REPO, env=env, timeout=600)  # fmt: skip
        assert r.returncode == 0, r.stderr
        return r.stdout, r.stderr

    _, err = run("700", "export", demo_run, "-o", str(tmp_path / "ds"))
    assert "read in slices (bounded memory)" in err
    _, err = run(WHOLE, "export", demo_run, "-o", str(tmp_path / "ds-whole"))
    assert "read in slices" not in err
    sliced, err = run("700", "fleet", demo_run, "--by", "rung", "--format", "jsonl")
    assert "read in slices (bounded memory)" in err
    whole, _ = run(WHOLE, "fleet", demo_run, "--by", "rung", "--format", "jsonl")
    a, b = json.loads(whole), json.loads(sliced)
    assert a["pooled"] == b["pooled"]
    share_a, share_b = a["pooled_tail"].pop("share"), b["pooled_tail"].pop("share")
    assert a["pooled_tail"] == b["pooled_tail"] and list(share_a) == list(share_b)
    for label, x in share_a.items():
        assert abs(x - share_b[label]) <= 1e-12, label
    assert a["gaps"] == b["gaps"] > 0
