"""Do two checkouts of tracekit record the same runs into byte-identical logs?

    python bench/same_recording.py --baseline ../tracekit-previous
    python bench/same_recording.py --baseline ../tracekit-previous --steps 200 --rungs baseline

A change to the recorder's hot path must not change what it records. Each checkout records
the same runs in a subprocess (`PYTHONPATH` set to it), on a deterministic clock: a fake
clock that advances a fixed 1 ms per read (so the logs are equal only if both checkouts
read the clock the same number of times, in the same order, and write the same rows), with
automatic garbage collection off (a collection is timed with two clock reads, and when it
comes depends on allocations) and no flush before the end (when a flush can go ahead
depends on the writer thread's progress, and a flush reads the clock). The runs:

- `scripted`: every recording call of the API, by id and by handle (`request`, `admit`,
  `admit_handle`, `prefill`, `prefill_handles` with a few and with many handles, `wait`,
  `wait_handles`, `emit` and `emit_handles` with and without counts and `reads_step`,
  `evict`, `readmit`, segments, `add_segment`, `counter`, `step_info`), batch 64-512;
- each demo ladder rung given (`--rungs`, seed 1, `--steps` steps on the step clock).

Then, per run: every table of the two logs compared byte for byte (the metadata that
names the process, its start time and the checkout are left out), and this checkout's
`analyze`, `gaps` and `ttft` (`--format jsonl`) on each log compared byte for byte.
Prints one line per comparison, `same` or `DIFFERENT`, and exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: Run in each checkout: records the runs into argv[1] (a directory).
RECORD = r"""
import gc, os, sys, time
import numpy as np

gc.disable()


class Clock:
    def __init__(self):
        self.t = 10**12

    def __call__(self):
        self.t += 1_000_000  # 1 ms a read
        return self.t


out, steps, rungs = sys.argv[1], int(sys.argv[2]), [r for r in sys.argv[3].split(",") if r]
import tracekit

# one flush, at stop: a flush during the run reads the clock when the writer lets it
tracekit.Recorder.__init__.__kwdefaults__["flush_interval_s"] = 1e6
rec = tracekit.Recorder(
    os.path.join(out, "scripted.npz"), clock=Clock(), gc=False, handle_signals=False,
    config={"run": "scripted"},
)
rng = np.random.default_rng(0)
with rec:
    ids = [f"q{i}" for i in range(600)]
    handles = [rec.request(r, prompt_tokens=100 + i, max_new_tokens=50) for i, r in enumerate(ids)]
    segs = [rec.segment(lb) for lb in ("schedule", "prefill", "decode", "sample")]
    nxt = len(ids)
    for s in range(120):
        batch = (64, 256, 512)[s % 3]
        new = [f"q{nxt + j}" for j in range(4)]
        nxt += 4
        t_early = rec.now()  # before the new requests arrive: their emission is clamped
        new_h = [rec.request(r, prompt_tokens=64, max_new_tokens=8, arrival_tick=rec.now() - 5)
                 for r in new]
        with rec.step():
            with segs[0]:
                if s % 2:
                    for h in new_h:
                        rec.admit_handle(h)
                    rec.prefill_handles(new_h, np.full(4, 32, dtype=np.int64))
                    rec.wait_handles(np.array(handles[batch:batch + 32]), "kv_blocks")
                else:
                    for r in new:
                        rec.admit(r, at_tick=rec.now())
                        rec.prefill(r, 32)
                    rec.wait(ids[batch:batch + 16], "max_num_seqs")
                    rec.wait(ids[batch + 16:batch + 32], "token_budget")
            if s % 10 == 5:
                rec.prefill_handles(handles[520:540], list(range(1, 21)))  # many: numpy path
            with segs[1]:
                pass
            with segs[2]:
                if s % 7 == 3:
                    rec.evict(ids[s], mode="swap")
                if s % 7 == 4:
                    rec.readmit(ids[s - 1])
            rec.add_segment("detok", rec.now(), rec.now() + 3)
            with segs[3]:
                run = np.array(handles[:batch], dtype=np.int64)
                if s % 4 == 0:
                    rec.emit_handles(run)
                elif s % 4 == 1:
                    rec.emit_handles(run, rng.integers(1, 4, batch), reads_step=max(s - 1, 0))
                elif s % 4 == 2:
                    rec.emit(ids[:batch])
                else:
                    rec.emit(ids[:batch], [2] * batch, at_tick=rec.now())
            rec.emit_handles(new_h)
            if s % 6 == 1:  # an emission stamped before its request's arrival: clamped to it
                rec.emit_handles([rec.request(f"x{s}", prompt_tokens=3)], at_tick=t_early)
            rec.counter("kv_free", 1000 - s)
            rec.step_info(num_decode=batch, graph_size=batch if s % 5 else 0)
    if hasattr(rec, "finish"):  # finished requests write no row: the logs stay equal
        for r in ids[:32]:
            rec.finish(r)
        for h in handles[32:64]:
            rec.finish_handle(h)

if rungs:
    time.process_time_ns = Clock()  # the demo's CPU timer, made deterministic
    from demo_engine.cli import run_one

    for rung in rungs:
        run_one(rung, 1, out, steps=steps, timer="cpu", quiet=True)
"""


def record(checkout: str, out: str, steps: int, rungs: str) -> None:
    os.makedirs(out, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": checkout, "PYTHONHASHSEED": "0"}
    p = subprocess.run(
        [sys.executable, "-c", RECORD, out, str(steps), rungs],
        cwd=checkout,
        env=env,
        capture_output=True,
    )
    if p.returncode:
        raise SystemExit(f"{checkout}: recording failed:\n{p.stderr.decode()[-3000:]}")


def single_file(path: str) -> str:
    """The log at `path` as one `.npz` (beside it): a run recorded as parts (`OUT` naming
    `OUT.parts/`) is read by this checkout's `load` and saved whole, so both checkouts'
    runs are compared table by table, and the analyses read the same kind of file."""
    import numpy as np

    with np.load(path, allow_pickle=False) as z:
        if "tracekit_parts_log" not in z.files:
            return path
    out = path[: -len(".npz")] + ".whole.npz"
    env = {**os.environ, "PYTHONPATH": HERE, "PYTHONHASHSEED": "0"}
    code = "import sys, tracekit; tracekit.load(sys.argv[1]).save(sys.argv[2])"
    p = subprocess.run([sys.executable, "-c", code, path, out], env=env, capture_output=True)
    if p.returncode:
        raise SystemExit(f"reading {path} failed:\n{p.stderr.decode()[-3000:]}")
    return out


def tables(path: str) -> dict[str, bytes]:
    """Every array of a saved log as bytes, but the metadata of the process that wrote it."""
    import json

    import numpy as np

    out = {}
    with np.load(path, allow_pickle=False) as z:
        for k in sorted(z.files):
            a = z[k]
            if a.dtype.kind == "U" and k.startswith("meta"):  # JSON: drop what names the run
                try:
                    m = json.loads(str(a))
                except ValueError:
                    out[k] = a.tobytes()
                    continue
                for key in ("pid", "started_unix_s", "clock", "version", "tracekit_version"):
                    m.pop(key, None)
                out[k] = json.dumps(m, sort_keys=True).encode()
            else:
                out[k] = a.dtype.str.encode() + repr(a.shape).encode() + a.tobytes()
    return out


def analysis(log: str, cmd: str, work: str) -> bytes:
    """This checkout's `tracekit CMD --format jsonl` on `log`, read from one path (the
    output names the file)."""
    import shutil

    at = os.path.join(work, "cmp", os.path.basename(log))
    os.makedirs(os.path.dirname(at), exist_ok=True)
    shutil.copyfile(log, at)
    env = {**os.environ, "PYTHONPATH": HERE, "PYTHONHASHSEED": "0"}
    p = subprocess.run(
        [sys.executable, "-m", "tracekit", cmd, "--format", "jsonl", at],
        env=env,
        capture_output=True,
    )
    if p.returncode not in (0, 1):
        raise SystemExit(f"tracekit {cmd} {log} exited {p.returncode}: {p.stderr.decode()[-800:]}")
    return p.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="the other checkout (its repo root)")
    ap.add_argument("--steps", type=int, default=150, help="demo engine steps per rung")
    ap.add_argument("--rungs", default="baseline,+compact history", help="demo rungs, or ''")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="tk-same-rec-")
    dirs = {}
    for name, co in (("this", HERE), ("baseline", os.path.abspath(args.baseline))):
        dirs[name] = os.path.join(work, name)
        record(co, dirs[name], args.steps, args.rungs)
    differ = 0
    logs = sorted(f for f in os.listdir(dirs["this"]) if f.endswith(".npz"))
    if sorted(f for f in os.listdir(dirs["baseline"]) if f.endswith(".npz")) != logs:
        print("DIFFERENT  the two checkouts wrote different files")
        return 1
    for log in logs:
        a, b = (single_file(os.path.join(dirs[n], log)) for n in ("this", "baseline"))
        ta, tb = tables(a), tables(b)
        bad = sorted(k for k in set(ta) | set(tb) if ta.get(k) != tb.get(k))
        differ += bool(bad)
        size = sum(len(v) for v in ta.values())
        print(f"{'DIFFERENT' if bad else 'same'}  tables of {log} ({len(ta)} arrays, {size} bytes)"
              + (f": {', '.join(bad)}" if bad else ""))  # fmt: skip
        for cmd in ("analyze", "gaps", "ttft"):
            xa, xb = analysis(a, cmd, work), analysis(b, cmd, work)
            differ += xa != xb
            print(f"{'same' if xa == xb else 'DIFFERENT'}  {cmd} {log} ({len(xa)} bytes)")
    print(f"{differ} comparison(s) differ" if differ else "every log and analysis is identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
