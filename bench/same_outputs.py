"""Do two checkouts of tracekit give byte-identical outputs on the same runs?

    python bench/same_outputs.py --baseline ../tracekit-previous raw/*.npz raw/serve
    python bench/same_outputs.py --baseline ../tracekit-previous --demo baseline,+gc.freeze

Each command below runs once with this checkout's `tracekit` and once with the baseline's
(`python -m tracekit` with PYTHONPATH set to each checkout), on the same inputs, and their
output bytes are compared: `analyze --format jsonl`, `gaps --format jsonl`, `ttft
--format jsonl`, `compare`, `report` (the HTML file) and `trace` (the decompressed Chrome
JSON). A directory of process logs (a `vllm serve` run) is merged by each checkout first
and the merged files are compared too. `--demo RUNGS` first records short demo ladder rungs
with this checkout (the recorder is not under test here: both checkouts read the same files).

Prints one line per output, `same` or `DIFFERENT` (with the first differing byte), and
exits 1 if any output differs. A layout change or refactor must leave every line `same`.
"""

from __future__ import annotations

import argparse
import gzip
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(checkout: str, args: list[str], cwd: str) -> bytes:
    env = {**os.environ, "PYTHONPATH": checkout, "PYTHONHASHSEED": "0"}
    p = subprocess.run(
        [sys.executable, "-m", "tracekit", *args], cwd=cwd, env=env, capture_output=True
    )
    if p.returncode not in (0, 1):
        raise SystemExit(
            f"{checkout}: tracekit {' '.join(args)} exited {p.returncode}:\n"
            f"{p.stderr.decode(errors='replace')[-2000:]}"
        )
    return p.stdout


def first_difference(a: bytes, b: bytes) -> str:
    n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    return f"at byte {n} of {len(a)} vs {len(b)}: {a[n : n + 60]!r} vs {b[n : n + 60]!r}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", required=True, help="the other checkout (its repo root)")
    ap.add_argument(
        "--demo",
        default="",
        metavar="RUNGS",
        help="first record these demo ladder rungs (comma-separated, seed 1, 300 "
        "steps) to compare on, e.g. baseline,+gc.freeze",
    )
    ap.add_argument("inputs", nargs="*", help="raw logs (.npz) and process-log directories")
    args = ap.parse_args()
    base = os.path.abspath(args.baseline)
    work = tempfile.mkdtemp(prefix="tk-same-")
    logs = [os.path.abspath(p) for p in args.inputs if not os.path.isdir(p)]
    dirs = [os.path.abspath(p) for p in args.inputs if os.path.isdir(p)]
    if args.demo:
        rungs = os.path.join(work, "demo")
        subprocess.run(
            [
                sys.executable,
                "-m",
                "tracekit",
                "demo",
                "ladder",
                "--seeds",
                "1",
                "--steps",
                "300",
                "--rungs",
                args.demo,
                "--out",
                rungs,
            ],
            env={**os.environ, "PYTHONPATH": HERE},
            check=True,
            capture_output=True,
        )
        logs += sorted(os.path.join(rungs, f) for f in os.listdir(rungs) if f.endswith(".npz"))
    if not logs and not dirs:
        ap.error("no inputs: give raw logs, process-log directories, or --demo N")

    differ = 0

    def same(what: str, a: bytes, b: bytes) -> None:
        nonlocal differ
        ok = a == b
        differ += not ok
        print(
            f"{'same' if ok else 'DIFFERENT'}  {what} ({len(a)} bytes)"
            + ("" if ok else "\n    " + first_difference(a, b))
        )

    for i, d in enumerate(dirs):  # each checkout merges; the merged logs are compared
        outs = []
        for name, co in (("this", HERE), ("baseline", base)):
            out = os.path.join(work, f"merged-{i}-{name}.npz")
            run(co, ["merge", d, "-o", out], work)
            outs.append(out)
        with open(outs[0], "rb") as fa, open(outs[1], "rb") as fb:
            same(f"merge {d}", fa.read(), fb.read())
        logs.append(outs[0])

    for log in logs:
        name = os.path.basename(log)
        for cmd in (
            ["analyze", "--format", "jsonl"],
            ["gaps", "--format", "jsonl"],
            ["ttft", "--format", "jsonl"],
        ):
            same(
                f"{' '.join(cmd[:1])} {name}",
                run(HERE, [*cmd, log], work),
                run(base, [*cmd, log], work),
            )
        traces = []
        for co in (HERE, base):
            out = os.path.join(work, f"t-{len(traces)}.json.gz")
            run(co, ["trace", log, "-o", out], work)
            with gzip.open(out, "rb") as fh:
                traces.append(fh.read())
        same(f"trace {name}", *traces)
    same("compare", run(HERE, ["compare", *logs], work), run(base, ["compare", *logs], work))
    pages = []
    for co in (HERE, base):
        out = os.path.join(work, f"r-{len(pages)}.html")
        run(co, ["report", *logs, "-o", out], work)
        with open(out, "rb") as fh:
            pages.append(fh.read())
    same("report", *pages)
    print(f"{differ} of the outputs differ" if differ else "every output is byte-identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
