"""`load`: one raw log from a file, whichever layout it is in, validated.

Reads a run's parts folder (`tracekit.log.parts`: what a recorder writes, read in place,
stopped or not) through the pointer file a clean stop writes beside it or the folder
itself, the one-file tracekit layout (`tracekit.log.rawlog`, versions 1 to 4) and the
published layout (`tracekit.log.published`) through the bounded archive reader
(`tracekit.log.archive`), shortens over-long names, and validates the result
(`tracekit.log.validate`). This module sits above them so that none of them needs
another's loader.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from dataclasses import replace

from tracekit.errors import LogError, UsageError
from tracekit.log.archive import read_npz
from tracekit.log.parts import PARTS_SUFFIX, POINTER_MEMBER, merge_parts, pointed_parts
from tracekit.log.published import PUBLISHED_MEMBERS, from_published
from tracekit.log.rawlog import V1_MEMBERS, RawLog, from_v1
from tracekit.log.validate import validate_log

#: The default longest label, cause, counter name or request id kept whole at load.
MAX_NAME_CHARS = 1000
#: environment variable that changes it
NAME_CHARS_ENV = "TRACEKIT_MAX_LABEL_CHARS"


def load(
    path: str | os.PathLike[str],
    *,
    validate: bool = True,
    max_inflate_mb: float | None = None,
    max_label_chars: int | None = None,
) -> RawLog:
    """Read a raw log (a run's parts folder or the pointer file naming it, a one-file log,
    or the published layout). Raises `LogError` naming file and field. A recorder's `OUT`
    that does not exist while ``OUT.parts/`` does (a process killed before its stop wrote
    `OUT`) reads that folder.

    Reading is bounded by the file: `max_inflate_mb` (default: `tracekit.log.archive`'s limit
    proportional to the file size) bounds what its arrays may inflate to, and names longer
    than `max_label_chars` (default `MAX_NAME_CHARS`, or $TRACEKIT_MAX_LABEL_CHARS) are
    shortened, with a warning, so that no output repeats a huge string per gap."""
    path = os.fspath(path)
    if not os.path.exists(path):
        parts = path + PARTS_SUFFIX
        if os.path.isfile(os.path.join(parts, "meta.json")):  # killed before its stop wrote
            path = parts  # OUT, or at the instant between final.json and OUT: the run is here
        else:
            raise LogError(path, "file", "does not exist")
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "meta.json")):
            raise LogError(path, "file", "is a directory, not a run's parts folder (no meta.json)")
        log = merge_parts(path, max_inflate_mb=max_inflate_mb)
        return _checked(log, [], max_label_chars, validate)
    arrays, ignored = read_npz(path, _layout_members, max_inflate_mb=max_inflate_mb)
    if POINTER_MEMBER in arrays:  # a clean stop's OUT: the run is its parts folder
        log = merge_parts(pointed_parts(path, arrays), max_inflate_mb=max_inflate_mb)
        return _checked(log.with_path(path), ignored, max_label_chars, validate)
    if "schema" in arrays:
        log = from_v1(path, arrays)
    elif "steps" in arrays or "segs" in arrays:
        log = from_published(path, arrays)
    else:
        raise LogError(
            path, "schema", "no 'schema' array and not the published layout: not a tracekit log"
        )
    return _checked(log, ignored, max_label_chars, validate)


def _checked(
    log: RawLog, ignored: list[str], max_label_chars: int | None, validate: bool
) -> RawLog:
    """The log with its unknown members named, long names shortened, validated."""
    if ignored:
        shown = ", ".join(repr(n) for n in ignored[:5]) + (", ..." if len(ignored) > 5 else "")
        log = replace(
            log,
            warnings=(*log.warnings, f"ignored {len(ignored)} unknown archive member(s): {shown}"),
        )
    log = shorten_names(log, max_label_chars)
    if validate:
        log = validate_log(log)
    return log


def shorten_names(log: RawLog, max_label_chars: int | None = None) -> RawLog:
    """The log with names longer than `max_label_chars` (default as `load`'s) shortened,
    with the warning `load` gives."""
    return _shorten_names(log, _max_name_chars(max_label_chars))


def _max_name_chars(given: int | None) -> int:
    what, value = "max_label_chars", given
    if value is None:
        env = os.environ.get(NAME_CHARS_ENV, "").strip()
        if not env:
            return MAX_NAME_CHARS
        what = f"${NAME_CHARS_ENV}"
        try:
            value = int(env)
        except ValueError:
            raise UsageError(f"{what}={env!r}: expected a whole number of characters") from None
    if value < 1:
        raise UsageError(f"{what}={value!r}: expected at least 1 character")
    return value


def shorten_name(name: str, max_chars: int) -> str:
    """`name` if it has at most `max_chars` characters, else its first `max_chars` followed
    by its length and a hash: deterministic (a label and its cause_map key shorten alike)
    and distinct for distinct names (two long labels sharing a prefix stay two)."""
    if len(name) <= max_chars:
        return name
    import hashlib  # deferred: only a name that needs a digest (its OpenSSL load is ~4 ms)

    digest = hashlib.sha1(name.encode("utf-8", "surrogatepass")).hexdigest()[:10]
    return f"{name[:max_chars]}...[{len(name)} chars, sha1 {digest}]"


def _shorten_names(log: RawLog, max_chars: int) -> RawLog:
    """The log with over-long labels, causes, counter names and request ids shortened."""
    long_fields = [
        f
        for f, names in (
            ("labels", log.labels),
            ("request_ids", log.request_ids),
            ("counter_names", log.counter_names),
            ("cause_map", [*log.cause_map, *log.cause_map.values()]),
        )
        if any(len(n) > max_chars for n in names)
    ]
    if not long_fields:
        return log

    def cut(names: Sequence[str]) -> tuple[str, ...]:
        return tuple(shorten_name(n, max_chars) for n in names)

    return replace(
        log,
        labels=cut(log.labels),
        request_ids=cut(log.request_ids),
        counter_names=cut(log.counter_names),
        cause_map={
            shorten_name(k, max_chars): shorten_name(v, max_chars) for k, v in log.cause_map.items()
        },
        warnings=(
            *log.warnings,
            f"{', '.join(long_fields)}: names longer than {max_chars} characters shortened "
            f"(--max-label-chars or ${NAME_CHARS_ENV} keeps more)",
        ),
    )


def _layout_members(keys: Collection[str]) -> set[str]:
    """The archive members a log's layout defines: v1 (with its ``extra.*``) or published."""
    if POINTER_MEMBER in keys:
        return {POINTER_MEMBER}
    if "schema" in keys:
        return {k for k in keys if k in V1_MEMBERS or k.startswith("extra.")}
    return {k for k in keys if k in PUBLISHED_MEMBERS}
