"""A run's log on disk: numbered parts, written once while the run records, never rewritten.

While a run records to ``OUT``, its completed events go to ``OUT.parts/`` (docs/design.md,
"The run's log on disk"):

- ``meta.json``: written at start (schema, clock, start tick, pid, config so far);
- ``part-000001.tkp``, ``part-000002.tkp``, ...: each the rows the recorder flushed since
  the previous part (a `tracekit.log.flush.FlushedRows`, compact: `tracekit.log.partfile`),
  written to a temporary name and renamed into place, so a part is either whole or absent,
  whatever kills the process (fsynced after its rename: a power loss may leave the last
  parts empty or torn, and `merge_parts` ends the run before the first of them,
  docs/capture.md). Folders written before this format hold ``part-NNNNNN.npz`` parts,
  read alike;
- ``index``: one line appended per part once it is in place (`append_index`);
- ``final.json`` (and ``extras.npz`` when arrays were attached): written at a clean stop,
  what only the stop knows. Then ``OUT`` itself is written: a small `.npz` naming the
  folder (`write_pointer`), so that ``OUT`` opens the run. Stopping costs the same
  whatever the run's length: nothing is merged or copied.

`merge_parts` turns a parts folder into a `RawLog` (seconds from engine start, evictions
paired with their readmissions, first token per request), and `recover` writes a killed
run's folder as one `.npz`. A `kill -9` loses at most the events recorded since the last
flush (the recorder flushes at a bounded interval).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from tracekit.errors import LogError, TracekitError
from tracekit.formats import json_safe
from tracekit.fsio import atomic_open, atomic_write
from tracekit.labels import DEFAULT_CAUSE_MAP
from tracekit.log.archive import InflateLimitError, open_regular, read_npz
from tracekit.log.flush import (
    KEYS,
    OPTIONAL_TABLES,
    TABLES,
    UNKNOWN_TICK,
    FlushedRows,
    column_index,
    columns,
    empty_rows,
    pair_evictions,
    to_table,
)
from tracekit.log.merged_tables import apply_merged, merged_tables_of
from tracekit.log.partfile import encode_part, read_part_file
from tracekit.log.rawlog import (
    Admissions,
    Counters,
    Coverage,
    Emissions,
    Evictors,
    GcPauses,
    OsSamples,
    Preemptions,
    PrefillChunks,
    RawLog,
    Requests,
    Segments,
    Steps,
    Waits,
    warnings_of,
)
from tracekit.log.request_names import RequestNames, removed_name
from tracekit.log.validate import validate_log

PARTS_SUFFIX = ".parts"
#: A part's file name: its flush number, six digits or more, and its format (``.tkp``:
#: `tracekit.log.partfile`; ``.npz``: folders written before it). Parts are listed by
#: matching names (never by a glob pattern built from the folder's path, which may hold ``[``).
PART_NAME = re.compile(r"part-(\d{6,})\.(tkp|npz)")
PART_SUFFIX = ".tkp"
#: The file a recording process keeps in its parts folder: its pid, one line.
LOCK_NAME = "lock"
#: Written by `recover` into the folder it merged: the log it wrote, one line.
RECOVERED_NAME = "recovered"


def parts_dir_for(out: str) -> str:
    return out + PARTS_SUFFIX


def part_paths(parts_dir: str) -> list[str]:
    """The folder's part files in flush order (a number written in both formats, which no
    recorder does, is a `LogError`)."""
    found = [(int(n[5:-4]), n) for n in os.listdir(parts_dir) if _is_part_name(n)]
    found.sort()
    for (a, x), (b, y) in zip(found, found[1:], strict=False):
        if a == b:
            raise LogError(parts_dir, y, f"part {a} is there twice ({x} and {y}); move one away")
    folder = os.path.join(parts_dir, "")  # each path as os.path.join(parts_dir, name) is
    return [folder + n for _, n in found]


def _is_part_name(name: str) -> bool:
    """`PART_NAME.fullmatch(name)`, without a regex: a folder of a long run holds thousands
    of parts, listed by every reader of it (a slice of it, a task of its index pass)."""
    return (
        name.startswith("part-")
        and name.endswith((".tkp", ".npz"))
        and len(name) >= 15
        and name[5:-4].isdecimal()
    )


def part_number(path: str) -> int:
    """The flush number of a part (a path `part_paths` listed)."""
    m = PART_NAME.fullmatch(os.path.basename(path))
    if m is None:
        raise ValueError(f"{path}: not a part's name")
    return int(m.group(1))


def write_part(
    parts_dir: str, number: int, rows: Mapping[str, np.ndarray], *, fsync: bool = True
) -> str:
    """Write one flush as ``part-NNNNNN.tkp``, whole or not at all (`fsio.atomic_open`).
    `fsync=False`: renamed into place as soon as written (a kill loses nothing of it), not
    yet durable against a power loss (the caller syncs it: `fsio.Syncer`)."""
    path = os.path.join(parts_dir, f"part-{number:06d}{PART_SUFFIX}")
    data = encode_part(rows)
    with atomic_open(path, fsync=fsync) as fh:
        fh.write(data)
    return path


def read_part(path: str, *, max_inflate_mb: float | None = None) -> FlushedRows:
    """One part's flush, either format, as the recorder handed it over (bounded by the
    file's size: `tracekit.log.archive`). Raises `LogError` (or an `OSError`) for a part
    that is not whole."""
    if path.endswith(".npz"):
        z, _ = read_npz(
            path, lambda names: [n for n in names if n in KEYS], max_inflate_mb=max_inflate_mb
        )
        return FlushedRows(z)
    return FlushedRows(read_part_file(path, max_inflate_mb=max_inflate_mb))


def lock_owner(parts_dir: str) -> int | None:
    """The pid of the process recording into `parts_dir`, if it is still running."""
    try:  # a FIFO or device named `lock` is no recorder's lock (and is never read)
        with open_regular(os.path.join(parts_dir, LOCK_NAME)) as fh:
            pid = int(fh.read(32).strip() or b"0")
    except (OSError, ValueError, LogError):
        return None
    if pid <= 0:
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # alive, another user's
        return pid
    return pid


def read_meta(parts_dir: str) -> dict[str, Any]:
    """The folder's ``meta.json``, checked: each bad value is a one-line `LogError`."""
    meta_path = os.path.join(parts_dir, "meta.json")
    with open_regular(meta_path) as fh:  # a FIFO is refused, never waited on
        raw = fh.read(1 << 24)
    try:
        meta = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise LogError(parts_dir, "meta.json", f"unreadable ({e})") from None
    if not isinstance(meta, dict) or not _is_int(meta.get("t0_tick")):
        raise LogError(parts_dir, "meta.json", "not a recorder's meta (no integer t0_tick)")
    check_meta(meta, parts_dir)
    return meta


def check_meta(meta: Mapping[str, Any], where: str) -> None:
    """Raise a `LogError` naming the field for a meta value the merge cannot use."""

    def bad(field: str, problem: str) -> LogError:
        return LogError(where, f"meta.json: {field}", problem)

    spt = meta.get("seconds_per_tick", 1e-9)
    if isinstance(spt, bool) or not isinstance(spt, (int, float)) or not 0 < spt < 1e3:
        raise bad("seconds_per_tick", f"{spt!r:.60} is not a positive number of seconds")
    if not isinstance(meta.get("config", {}), dict):
        raise bad("config", "not a JSON object")
    cm = meta.get("cause_map", {})
    if not isinstance(cm, dict) or not all(isinstance(v, str) for v in cm.values()):
        raise bad("cause_map", "not an object of label -> cause names")
    if not isinstance(meta.get("warnings", []), list):
        raise bad("warnings", "not a list")


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and abs(x) < 2**63


def merge_parts(
    parts_dir: str,
    *,
    final: Mapping[str, Any] | None = None,
    max_inflate_mb: float | None = None,
) -> RawLog:
    """Read a parts folder into one `RawLog`. `final` overrides meta known only at stop
    (by default, the folder's ``final.json`` where a clean stop wrote one);
    `max_inflate_mb` bounds each part's arrays (`tracekit.log.archive`).

    A part that cannot be read (damaged on disk, or empty or torn by a power loss before
    its fsync) or missing (a later part's name survived a power loss, its own did not) ends
    the run at the flush before it, with a warning naming it; a readable part whose
    contents contradict the run (request ids that overlap or skip, bad vocabularies) is a
    `LogError` naming the part and the field."""
    return merge_parts_kept(parts_dir, final=final, max_inflate_mb=max_inflate_mb)[0]


def merge_parts_kept(
    parts_dir: str,
    keep: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    *,
    final: Mapping[str, Any] | None = None,
    max_inflate_mb: float | None = None,
) -> tuple[RawLog, list[str]]:
    """`merge_parts`, each part passed through `keep` (a parsed part in, the part to keep
    out: fewer rows, say) as soon as it is read, so that memory holds only what `keep`
    keeps; and the paths of the parts the run was read from (those before the first one
    missing or unreadable)."""
    meta = read_meta(parts_dir)
    if final is None:
        final = read_final(parts_dir, max_inflate_mb=max_inflate_mb)
    for _ in range(5):  # parts removed by retention while they were read: read again
        paths = part_paths(parts_dir)
        parts, warnings, head_gone = _read_parts(paths, max_inflate_mb, keep)
        if not head_gone:
            break
    warnings += index_warnings(parts_dir, paths, warnings)
    start = retained_start(parts_dir, paths, parts, warnings)
    log = merge_flushed(meta, parts, final=final, path=parts_dir, warnings=warnings, retained=start)
    return log, paths[: len(parts)]


def _read_parts(
    paths: list[str],
    max_inflate_mb: float | None,
    keep: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> tuple[list[dict[str, Any]], list[str], bool]:
    """The parts in order, parsed (each through `keep`), and the warnings; the run ends at
    the first part missing or unreadable. The flag: a part vanished while it was read,
    before any other was read (retention removed the head of the folder: the caller lists
    the folder again)."""
    warnings: list[str] = []
    parts: list[dict[str, Any]] = []
    for i, p in enumerate(paths):
        # a power loss kept a later part's name but not the next one's
        if i and part_number(p) != part_number(paths[i - 1]) + 1:
            warnings.append(missing_part_warning(paths, i))
            break
        try:
            part = read_flushed_part(p, max_inflate_mb)
        except DamagedPart as e:
            if isinstance(e.cause, FileNotFoundError) and not parts:
                return parts, warnings, True
            # Later parts refer to its steps and requests by index, so the run ends here.
            warnings.append(unreadable_part_warning(paths, i, e.cause))
            break
        parts.append(part if keep is None else keep(part))  # `keep`'s errors: never damage
    return parts, warnings, False


class DamagedPart(Exception):
    """A part damaged on disk (`read_flushed_part`); `cause`: what reading it raised."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.cause = cause


def read_flushed_part(path: str, max_inflate_mb: float | None = None) -> dict[str, Any]:
    """The part at `path`, read whole before any of it is used (bounded:
    `tracekit.log.archive`) and parsed (`parse_flushed`). Every reader of a parts folder
    tells damage from error this one way:

    - `DamagedPart`: the file is damaged on disk, torn, corrupt, gone, or a member is
      missing or of the wrong shape (a kill cannot do this: parts are renamed into place
      whole; a power loss can, before the part's fsync, docs/capture.md): the run ends
      before it, with `unreadable_part_warning`;
    - `InflateLimitError`: over the limit the user set, an error, not a damaged part;
    - `LogError` from the parse: readable contents that contradict the run, naming the field.
    """
    try:
        z = read_part(path, max_inflate_mb=max_inflate_mb)
    except InflateLimitError:
        raise
    except Exception as e:
        raise DamagedPart(e) from None
    try:
        return parse_flushed(z, path)
    except LogError:
        raise
    except Exception as e:
        raise DamagedPart(e) from None


def missing_part_warning(paths: list[str], i: int) -> str:
    """The warning of a run that ends before ``paths[i]``: the part before it is missing."""
    return (
        f"part-{part_number(paths[i - 1]) + 1:06d}{os.path.splitext(paths[i])[1]} is "
        "missing; the run ends at the flush before it "
        f"({len(paths) - i} later part(s) left out, still on disk)"
    )


def unreadable_part_warning(paths: list[str], i: int, damaged: BaseException) -> str:
    """The warning of a run that ends before ``paths[i]``, which could not be read."""
    return (
        f"{os.path.basename(paths[i])} is unreadable ({type(damaged).__name__}: "
        f"{str(damaged)[:100]}); the run ends at the flush before it "
        f"({len(paths) - i} part(s) left out, still on disk)"
    )


@dataclass(frozen=True)
class Retained:
    """Where a run whose first parts were removed (`Recorder(retain_s=)`, or by hand)
    starts: its first part's number, the requests and steps the removed parts named, and
    the tick its rows are complete from (the removed part before it's flush)."""

    first_part: int
    num_requests: int
    first_step: int
    from_tick: int | None


def retained_start(
    parts_dir: str, paths: list[str], parts: list[dict[str, Any]], warnings: list[str]
) -> Retained | None:
    """None for a run read from its first part; else where it starts (the first part must
    say which step it begins with: parts written before `first_step` cannot be read
    without the ones before them, a `LogError`)."""
    if not paths or part_number(paths[0]) == 1 or not parts:
        return None
    first = parts[0]
    number = part_number(paths[0])
    if first["first_step"] is None:
        raise LogError(
            parts_dir, os.path.basename(paths[0]), f"the folder starts at part {number} and "
            "this part does not say which step it begins with (written before retention): "
            "the parts before it are needed",
        )  # fmt: skip
    entries, _ = read_index(parts_dir, numbers=(number - 1, number - 1))
    before = [e.flush_tick for e in entries if e.number == number - 1]
    warnings.append(retention_warning(number, first["request_ids_start"]))
    return Retained(number, first["request_ids_start"], first["first_step"],
                    before[0] if before else None)  # fmt: skip


def retention_warning(first_part: int, num_removed_requests: int) -> str:
    """The warning of a run read from part `first_part`, the parts before it removed."""
    return (
        f"parts 1..{first_part - 1} were removed (retention): the run is read from part "
        f"{first_part}; {num_removed_requests} request(s) named only in them are "
        "'(removed N)', their arrivals unknown"
    )


def index_warnings(parts_dir: str, paths: list[str], warned: list[str]) -> list[str]:
    """What the folder's index says that its parts do not: torn lines, parts it lists that
    are not on disk (a power loss before their names were durable, or a hand that removed
    them), unless a missing part was already named."""
    last = part_number(paths[-1]) if paths else 0
    try:  # only the part after the last on disk: a huge index costs nothing more
        entries, out = read_index(parts_dir, numbers=(last + 1, last + 1))
    except (OSError, LogError) as e:
        return [f"{INDEX_NAME} is unreadable ({e}); the parts are read without it"]
    if entries and not warned:
        out.append(
            f"{INDEX_NAME} lists part {last + 1}, after the last one on disk (part {last}): "
            f"the run ends at part {last}"
        )
    return out


# -- what a clean stop writes: final.json, extras.npz, the pointer OUT ------------------

FINAL_NAME = "final.json"
EXTRAS_NAME = "extras.npz"
#: The one member of the pointer file ``OUT``: JSON naming the parts folder beside it.
POINTER_MEMBER = "tracekit_parts_log"


def write_final(parts_dir: str, final: Mapping[str, Any]) -> None:
    """What only the stop knows (config, device figures, warnings; attached arrays in
    ``extras.npz``), written whole (`fsio.atomic_write`): the folder is a stopped run."""
    extras = dict(final.get("extras", {}))
    if extras:
        with atomic_open(os.path.join(parts_dir, EXTRAS_NAME)) as fh:
            np.savez(fh, **extras)  # type: ignore[arg-type]  # kwargs could be allow_pickle
    rest = {k: v for k, v in final.items() if k != "extras"}
    atomic_write(os.path.join(parts_dir, FINAL_NAME), json.dumps(json_safe(rest)).encode())


def read_final(parts_dir: str, *, max_inflate_mb: float | None = None) -> dict[str, Any] | None:
    """The folder's ``final.json`` (and ``extras.npz``), checked; None where the run did not
    stop cleanly (killed, or still recording)."""
    path = os.path.join(parts_dir, FINAL_NAME)
    if not os.path.lexists(path):
        return None
    with open_regular(path) as fh:
        raw = fh.read(1 << 24)
    try:
        final = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise LogError(parts_dir, FINAL_NAME, f"unreadable ({e})") from None
    if not isinstance(final, dict):
        raise LogError(parts_dir, FINAL_NAME, "not a JSON object")
    if not isinstance(final.get("config", {}), dict):
        raise LogError(parts_dir, f"{FINAL_NAME}: config", "not a JSON object")
    if not isinstance(final.get("warnings", []), list):
        raise LogError(parts_dir, f"{FINAL_NAME}: warnings", "not a list")
    extras_path = os.path.join(parts_dir, EXTRAS_NAME)
    if os.path.lexists(extras_path):
        z, _ = read_npz(extras_path, lambda names: list(names), max_inflate_mb=max_inflate_mb)
        final["extras"] = dict(z)
    return final


def write_pointer(out: str, parts_dir: str) -> None:
    """``OUT``: a small `.npz` whose one member names the parts folder beside it (its base
    name only: the two move together), written whole."""
    if os.path.dirname(os.path.abspath(parts_dir)) != os.path.dirname(os.path.abspath(out)):
        raise ValueError(f"{parts_dir}: not beside {out}")
    doc = {"format": "tracekit parts log", "parts": os.path.basename(parts_dir.rstrip(os.sep))}
    with atomic_open(out) as fh:
        np.savez(fh, **{POINTER_MEMBER: np.array(json.dumps(doc))})  # type: ignore[arg-type]


def pointed_parts(path: str, members: Mapping[str, np.ndarray]) -> str:
    """The parts folder a pointer file (its members read) names; a `LogError` if it names
    anything but a folder beside it that holds a run."""
    try:
        doc = json.loads(str(np.asarray(members[POINTER_MEMBER])))
        name = doc["parts"]
    except (ValueError, RecursionError, KeyError, TypeError) as e:
        raise LogError(path, POINTER_MEMBER, f"unreadable ({type(e).__name__})") from None
    if not isinstance(name, str) or not name or os.sep in name or name in (".", ".."):
        raise LogError(path, POINTER_MEMBER, f"names {name!r:.80}, not a folder beside it")
    parts_dir = os.path.join(os.path.dirname(os.path.abspath(path)), name)
    if not os.path.isfile(os.path.join(parts_dir, "meta.json")):
        raise LogError(
            path, "parts", f"its run is in {name}/ beside it, which is missing or not a run's "
            "parts folder (move the two together)"
        )  # fmt: skip
    return parts_dir


# -- the index: a line per part, appended once it is in place ---------------------------

INDEX_NAME = "index"


def append_index(parts_dir: str, path: str, rows: FlushedRows) -> None:
    """Add a part to the folder's index: number, bytes, flush tick, open tick (or -),
    emissions, and a CRC of the line (a line torn by a power loss is known as such).
    One `write` of one line to a file opened for appending: a kill leaves it whole."""
    fields = [
        str(part_number(path)),
        str(os.stat(path).st_size),
        str(rows.scalar("flush_tick", 0)),
        str(opened) if (opened := rows.scalar("open_tick")) is not None else "-",
        str(len(rows.table("emissions"))),
    ]
    body = " ".join(fields)
    line = f"{body} {zlib.crc32(body.encode()):08x}\n".encode()
    fd = os.open(os.path.join(parts_dir, INDEX_NAME), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


@dataclass(frozen=True)
class IndexEntry:
    number: int
    num_bytes: int
    flush_tick: int
    open_tick: int | None
    num_emissions: int


#: The longest index line read whole (a line is ~60 bytes; a longer one is corrupt).
_MAX_INDEX_LINE = 256
#: Torn or corrupt index lines named one by one; beyond, counted.
_MAX_INDEX_WARNINGS = 5


def read_index(
    parts_dir: str, *, numbers: tuple[int, int] = (0, 2**63 - 1)
) -> tuple[list[IndexEntry], list[str]]:
    """The index's whole lines for the parts numbered in `numbers` (inclusive), and a
    warning for the lines that are not whole (torn, corrupt). Read line by line, each line
    at most `_MAX_INDEX_LINE` bytes: memory holds only the entries asked for, whatever the
    file's size."""
    path = os.path.join(parts_dir, INDEX_NAME)
    if not os.path.lexists(path):
        return [], []
    lo, hi = numbers
    entries: list[IndexEntry] = []
    bad: list[int] = []
    with open_regular(path) as fh:
        for i, line in enumerate(iter(lambda: fh.readline(_MAX_INDEX_LINE), b"")):
            if line == b"\n":
                continue
            entry = _index_entry(line)
            if entry is None:
                bad.append(i + 1)
            elif lo <= entry.number <= hi:
                entries.append(entry)
    out = [f"{INDEX_NAME} line {n} is torn or corrupt (ignored)" for n in bad[:_MAX_INDEX_WARNINGS]]
    if len(bad) > _MAX_INDEX_WARNINGS:
        out.append(f"{INDEX_NAME}: {len(bad) - _MAX_INDEX_WARNINGS} more torn or corrupt line(s)")
    return entries, out


def _index_entry(line: bytes) -> IndexEntry | None:
    """One whole index line (ending in a newline, its CRC right), else None."""
    if not line.endswith(b"\n"):
        return None
    fields = line[:-1].split(b" ")
    try:
        body, crc = b" ".join(fields[:-1]), int(fields[-1], 16)
        vals = [None if x == b"-" else int(x) for x in fields[:-1]]
    except ValueError:
        return None
    if zlib.crc32(body) != crc or len(vals) != 5 or None in vals[:3] + vals[4:]:
        return None
    n, size, flush, opened, emitted = vals
    return IndexEntry(n, size, flush, opened, emitted)  # type: ignore[arg-type]


def parse_flushed(z: Mapping[str, np.ndarray], where: str) -> dict[str, Any]:
    """One flush (a part on disk, or `FlushedRows` in memory): its rows and vocabularies,
    checked. Raises on anything missing or damaged; a `LogError` for values a reader can
    name."""

    def bad(field: str, problem: str) -> LogError:
        return LogError(where, field, problem)

    tables = {}
    for k, cols in TABLES.items():
        if k in OPTIONAL_TABLES and k not in z:
            continue  # written before the table existed
        a = np.asarray(z[k])
        if a.dtype.kind not in ("f" if k == "counters" else "iu"):
            raise bad(k, f"dtype {a.dtype} (expected {'float' if k == 'counters' else 'int'}64)")
        if a.size % len(cols):
            raise bad(k, f"{a.size} values do not make rows of {len(cols)}")
        if a.size:
            tables[k] = a.reshape(-1, len(cols))
    scalars = {}
    for k in ("request_ids_start", "flush_tick"):
        a = np.asarray(z[k])
        if a.shape != () or a.dtype.kind not in "iu":
            raise bad(k, "not one integer")
        scalars[k] = int(a)
    if scalars["request_ids_start"] < 0:
        raise bad("request_ids_start", f"{scalars['request_ids_start']} is negative")
    try:
        config = json.loads(str(np.asarray(z["config"])))
    except (ValueError, RecursionError) as e:
        raise bad("config", f"not JSON ({e})") from None
    if not isinstance(config, dict):
        raise bad("config", "not a JSON object")
    stop_tick = None
    if "stop_tick" in z:
        a = np.asarray(z["stop_tick"])
        if a.shape != () or a.dtype.kind not in "iu":
            raise bad("stop_tick", "not one integer")
        stop_tick = int(a)
    open_tick = None
    if "open_tick" in z:
        a = np.asarray(z["open_tick"])
        if a.shape != () or a.dtype.kind not in "iu":
            raise bad("open_tick", "not one integer")
        open_tick = int(a)
    first_step = None
    if "first_step" in z:
        a = np.asarray(z["first_step"])
        if a.shape != () or a.dtype.kind not in "iu" or int(a) < 0:
            raise bad("first_step", "not one step number (an integer >= 0)")
        first_step = int(a)
    dropped = 0
    if "dropped_rows" in z:
        a = np.asarray(z["dropped_rows"])
        if a.shape != () or a.dtype.kind not in "iu" or int(a) < 0:
            raise bad("dropped_rows", "not one count of values (an integer >= 0)")
        dropped = int(a)
    return {
        "where": where,
        "tables": {**tables, **merged_tables_of(z, where)},
        "labels": [str(x) for x in np.asarray(z["labels"]).reshape(-1)],
        "counter_names": [str(x) for x in np.asarray(z["counter_names"]).reshape(-1)],
        "request_ids_start": scalars["request_ids_start"],
        "request_ids": [str(x) for x in np.asarray(z["request_ids"]).reshape(-1)],
        "config": config,
        "flush_tick": scalars["flush_tick"],
        "stop_tick": stop_tick,
        "open_tick": open_tick,
        "dropped_rows": dropped,
        "first_step": first_step,
    }


@dataclass
class _Folded:
    """What a run's flushes say together, folded in flush order (`_fold_flushes`)."""

    chunks: dict[str, list[np.ndarray]]
    labels: list[str]
    request_ids: list[str] | RequestNames
    counter_names: list[str]
    config: dict[str, Any]
    last_tick: int  # the last flush's tick
    complete_tick: int  # rows are complete up to here (the coverage's end)
    wall_ticks: int | None  # from t0 to the stop tick, where a flush saw the stop
    clean_stop: bool
    dropped: int  # values dropped while the disk stayed full


def removed_names(n: int) -> list[str]:
    """``(removed 0)`` .. ``(removed n-1)``: the names of requests named only in removed
    parts, made as asked (a log read from a later part holds them as `RequestNames`,
    which makes one only when it is read)."""
    return [removed_name(i) for i in range(n)]


def _held_ids(ids: list[str] | RequestNames) -> Sequence[str]:
    """A log's ids as it holds them: a tuple, or `RequestNames` as made (a log read from a
    later part: the ids of the parts before it made only when read)."""
    return ids if isinstance(ids, RequestNames) else tuple(ids)


def check_request_rows(part: Mapping[str, Any], n_named: int) -> None:
    """A flush's rows name only requests named so far (in this flush or before it)."""
    for k in ("requests", "emissions", "events"):
        rows = part["tables"].get(k)
        req = None if rows is None else rows[:, column_index(k, "request")]
        bad = None if req is None else (req < 0) | (req >= n_named)
        if req is not None and bad is not None and bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise LogError(
                part["where"],
                f"{k}.request",
                f"row {i}: request {int(req[i])} is not one of the {n_named} named so far",
            )


def _fold_flushes(
    meta: Mapping[str, Any], parts: list[dict[str, Any]], retained: Retained | None = None
) -> _Folded:
    """The flushes in order: their rows, the names they add, and how far the run got.
    `retained`: the run starts at a later part (the requests the removed ones named are
    ``(removed N)``)."""
    f = _Folded(
        chunks={k: [] for k in TABLES},
        labels=[],
        # a log read from a later part: its earlier requests' names made only when read
        request_ids=[] if retained is None else RequestNames(retained.num_requests),
        counter_names=[],
        config=dict(meta.get("config", {})),
        last_tick=meta["t0_tick"],
        complete_tick=meta["t0_tick"],
        wall_ticks=None,
        clean_stop=False,
        dropped=0,
    )
    for part in parts:
        for k, rows in part["tables"].items():  # a merged server run's tables too
            f.chunks.setdefault(k, []).append(rows)
        f.labels, f.counter_names = part["labels"], part["counter_names"]
        start, new_ids = part["request_ids_start"], part["request_ids"]
        if start != len(f.request_ids):  # each flush names the ids new since the last one
            raise LogError(
                part["where"],
                "request_ids_start",
                f"{start}, but the parts before it name {len(f.request_ids)} request id(s) "
                f"({'overlapping' if start < len(f.request_ids) else 'skipping'} them)",
            )
        f.request_ids += new_ids
        check_request_rows(part, len(f.request_ids))
        f.config = part["config"]
        f.last_tick = max(f.last_tick, part["flush_tick"])
        # the last flush's rows are complete up to its tick, or up to the start of a
        # window still open then (its row would have come in a later flush)
        opened = part.get("open_tick")
        f.complete_tick = part["flush_tick"] if opened is None else min(part["flush_tick"], opened)
        f.dropped += part["dropped_rows"]
        if part["stop_tick"] is not None:
            f.clean_stop = True
            f.wall_ticks = part["stop_tick"] - meta["t0_tick"]
            f.complete_tick = part["stop_tick"]
    return f


def _requests_of(
    rq: Mapping[str, np.ndarray],
    emissions: Emissions,
    n_req: int,
    secs: Callable[[np.ndarray], np.ndarray],
) -> Requests:
    """Per request: arrival (where known), prompt and budget, and its first emission."""
    arrival = np.full(n_req, np.nan)
    prompt = np.full(n_req, -1, dtype=np.int64)
    max_new = np.full(n_req, -1, dtype=np.int64)
    if len(rq["request"]):
        known = rq["arrival_tick"] != UNKNOWN_TICK
        arrival[rq["request"][known]] = secs(rq["arrival_tick"][known])
        prompt[rq["request"]] = rq["prompt_tokens"]
        max_new[rq["request"]] = rq["max_new_tokens"]
    first = np.full(n_req, np.nan)
    if len(emissions):
        order = np.lexsort((emissions.t_s, emissions.request))
        r = emissions.request[order]
        head = np.ones(len(r), dtype=bool)
        head[1:] = r[1:] != r[:-1]
        first[r[head]] = emissions.t_s[order][head]
    return Requests(
        arrival_s=arrival, prompt_tokens=prompt, max_new_tokens=max_new, first_token_s=first
    )


def _merged_meta(
    meta: Mapping[str, Any],
    final: Mapping[str, Any] | None,
    clean_stop: bool,
    warnings: list[str],
) -> dict[str, Any]:
    """The run's meta: the recorder's, whether it was interrupted, the warnings, and what
    only stop knew (`final`, less its config, extras and warnings)."""
    out_meta = {k: v for k, v in meta.items() if k not in ("config", "cause_map", "schema")}
    out_meta["interrupted"] = final is None and not clean_stop
    if warnings:
        out_meta["warnings"] = list(out_meta.get("warnings", [])) + warnings
    if final:
        out_meta.update(
            {k: v for k, v in final.items() if k not in ("config", "extras", "warnings")}
        )
    return out_meta


def merge_flushed(
    meta: Mapping[str, Any],
    parts: list[dict[str, Any]],
    *,
    final: Mapping[str, Any] | None = None,
    path: str = "<memory>",
    warnings: list[str] | None = None,
    retained: Retained | None = None,
) -> RawLog:
    """The one `RawLog` of a run's parsed flushes (`parse_flushed`), in flush order: what both
    the parts on disk and a run kept in memory become. `final`: what is known only at
    stop (config, device calibration, ``extras``, ``warnings``)."""
    f = _fold_flushes(meta, parts, retained)
    if retained is not None:
        _renumber_steps(f.chunks, retained.first_step)
    config = f.config
    warnings = list(warnings or [])
    if f.dropped:
        warnings.append(
            f"{f.dropped} recorded value(s) were dropped: the disk stayed full longer than "
            "the recorder could hold rows in memory"
        )
    if final:
        config = dict(final.get("config", config))
        warnings += [str(w) for w in final.get("warnings", ())]
    t0 = int(meta["t0_tick"])
    scale = float(meta.get("seconds_per_tick", 1e-9))

    def table(k: str) -> np.ndarray:
        if not f.chunks[k]:
            return empty_rows(k)
        return np.concatenate(f.chunks[k]).astype(empty_rows(k).dtype, copy=False)

    def secs(ticks: np.ndarray) -> np.ndarray:
        return (ticks - t0).astype(np.float64) * scale

    steps = to_table(Steps, "steps", table("steps"), secs)
    segments = to_table(Segments, "segments", table("segments"), secs)
    gcs = to_table(GcPauses, "gc_pauses", table("gc_pauses"), secs)
    emissions = to_table(Emissions, "emissions", table("emissions"), secs)
    rq = columns("requests", table("requests"))
    requests = _requests_of(rq, emissions, len(f.request_ids), secs)
    evictions = pair_evictions(table("events"), secs)
    ct = columns("counters", table("counters"))
    counters = Counters(
        name=ct["name"].astype(np.int64), t_s=(ct["t_tick"] - t0) * scale, value=ct["value"].copy()
    )
    admissions, prefill_chunks, waits = _ttft_tables(
        table("admissions"),
        to_table(PrefillChunks, "prefill_chunks", table("prefill_chunks"), secs),
        to_table(Waits, "waits", table("waits"), secs),
        secs,
    )
    os_samples = to_table(OsSamples, "os_samples", table("os_samples"), secs)
    preemptions = to_table(Preemptions, "preemptions", table("preemptions"), secs)
    evictors = to_table(Evictors, "evictors", table("evictors"), secs)
    wall_ticks = f.wall_ticks
    if wall_ticks is None:  # an interrupted run: its wall time is what was flushed
        wall_ticks = f.last_tick - t0
    # the span this process's rows cover: from its start to the end of its complete rows (a
    # last flush with its stop tick: to the stop). Clean: stop() wrote the log (`final`); a
    # log recovered from parts is not, even if stop() flushed before the kill landed
    run_meta = _merged_meta(meta, final, f.clean_stop, warnings)
    coverage = Coverage(
        process=np.zeros(1, dtype=np.int64),
        t_start_s=np.array([_covered_from(retained, f.chunks, t0) * scale]),
        t_end_s=np.array([(wall_ticks if f.clean_stop else f.complete_tick - t0) * scale]),
        is_clean_stop=np.array([int(final is not None)], dtype=np.int64),
    )
    log = RawLog(
        steps=steps,
        segments=segments,
        gc_pauses=gcs,
        emissions=emissions,
        evictions=evictions,
        requests=requests,
        counters=counters,
        admissions=admissions,
        prefill_chunks=prefill_chunks,
        waits=waits,
        os_samples=os_samples,
        coverage=coverage,
        preemptions=preemptions,
        evictors=evictors,
        labels=tuple(f.labels),
        request_ids=_held_ids(f.request_ids),
        counter_names=tuple(f.counter_names),
        cause_map=meta.get("cause_map", dict(DEFAULT_CAUSE_MAP)),
        config=config,
        wall_s=wall_ticks * scale,
        meta=run_meta,
        path=path,
        # as the one-file log of this run reads, each once (as `validate_log` leaves them: a
        # merged run's final says it was interrupted and carries the line that says so)
        warnings=tuple(dict.fromkeys(warnings_of(run_meta))),
        extras=dict((final or {}).get("extras", {})),
    )
    # a merged server run's parts: the other processes' rows, the joined requests
    merged = {k: np.concatenate(v) for k, v in f.chunks.items() if k not in TABLES and v}
    return apply_merged(log, merged, retained.first_step if retained else 0)


def _renumber_steps(chunks: dict[str, list[np.ndarray]], first_step: int) -> None:
    """Rows of a run read from a later part name steps by their number in the whole run:
    renumber them from that part's first step (a column ``step`` of any table; -1, no
    step, stays). An emission reading a removed step's device work (``device_step``, only
    in the first steps read) is taken as reading its own step's: no gap ends at such an
    emission (its request's previous emission was removed with its part)."""
    for k, rows_list in chunks.items():
        cols = TABLES.get(k, ())  # a merged table's steps: `apply_merged` renumbers them
        if "step" not in cols:
            continue
        for i, read in enumerate(rows_list):
            rows = rows_list[i] = read.copy()  # a part's arrays may be read-only
            if "step" in cols:
                c = rows[:, cols.index("step")]
                c[c >= 0] -= first_step
            if "device_step" in cols:
                d = rows[:, cols.index("device_step")]
                d[d >= 0] -= first_step
                lost = d < 0
                d[lost] = rows[lost, cols.index("step")]


def _covered_from(retained: Retained | None, chunks: dict[str, list[np.ndarray]], t0: int) -> int:
    """Ticks from the run's start to where its rows are complete from: 0, or for a run read
    from a later part the flush before it (from the index), else its first step's start."""
    if retained is None:
        return 0
    if retained.from_tick is not None:
        return retained.from_tick - t0
    steps = [r[:, 0] for r in chunks["steps"] if len(r)]
    return int(min(int(s.min()) for s in steps)) - t0 if steps else 0


def _ttft_tables(
    ad: np.ndarray, prefill: PrefillChunks, waits: Waits, secs: Callable[[np.ndarray], np.ndarray]
) -> tuple[Admissions, PrefillChunks, Waits]:
    """The TTFT tables. A request admitted twice keeps its first admission (the first time
    the scheduler took it is what the row means)."""
    c = columns("admissions", ad)
    req, t = c["request"], c["t_tick"]
    if len(ad):
        order = np.lexsort((t, req))
        req, t = req[order], t[order]
        head = np.ones(len(req), dtype=bool)
        head[1:] = req[1:] != req[:-1]
        req, t = req[head], t[head]
    admissions = Admissions(request=req.copy(), t_s=secs(t))
    return admissions, prefill, waits


def recover_target(parts_dir: str, out: str | None, *, force: bool = False) -> str:
    """Where `recover` writes an interrupted run's log (`out`, default the run's own name
    beside its folder), once the refusals pass: a folder a live process is still recording
    into, and an existing `out` (say the complete log of a clean stop that was killed while
    removing its parts) unless `force`."""
    parts_dir = parts_dir.rstrip("/") or parts_dir
    if out is None:
        out = (
            parts_dir[: -len(PARTS_SUFFIX)]
            if parts_dir.endswith(PARTS_SUFFIX)
            else parts_dir + ".npz"
        )
    owner = lock_owner(parts_dir)
    if owner is not None and owner != os.getpid():
        raise TracekitError(
            f"{parts_dir}: still being recorded by process {owner}; recover it once that "
            "process has ended"
        )
    if os.path.lexists(out) and not force:
        raise TracekitError(
            f"{out}: already exists (maybe the complete log of this run); write the "
            "recovered log elsewhere with -o NEW.npz, or pass --force to replace it"
        )
    return out


def mark_recovered(parts_dir: str, out: str) -> None:
    """Say in the folder that its parts are recovered into `out`: a later recorder on this
    path then refuses the folder as recovered, not as lost (never emptied either way)."""
    with contextlib.suppress(OSError):
        atomic_write(os.path.join(parts_dir, RECOVERED_NAME), f"{out}\n".encode())


def recover(
    parts_dir: str,
    out: str | None = None,
    *,
    remove_parts: bool = False,
    force: bool = False,
    max_inflate_mb: float | None = None,
) -> str:
    """Merge an interrupted run's parts into one `.npz` (`tracekit.analysis.recover`
    recovers a run longer than one slice in place, in bounded memory).

    Never destroys a log: the refusals of `recover_target`; the merged log is validated
    before anything is written."""
    parts_dir = parts_dir.rstrip("/") or parts_dir
    out = recover_target(parts_dir, out, force=force)
    log = validate_log(merge_parts(parts_dir, max_inflate_mb=max_inflate_mb))
    log.save(out)
    if remove_parts:
        shutil.rmtree(parts_dir, ignore_errors=True)
    else:
        mark_recovered(parts_dir, out)
    return out
