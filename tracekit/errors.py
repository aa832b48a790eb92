"""The errors tracekit raises, in one place. Each is one line the CLI prints as it is:

- `LogError`: a raw log that cannot be read or is not valid (names file, field, problem);
- `UsageError`: a bad option value (a --window, a request id the run does not have);
- `InternalError`: a bug in tracekit, never in the input (`ReconcileError`: a partition
  whose parts do not sum to the gap).

The CLI exits with `exit_code`: 2 for bad input or usage, 3 for a bug in tracekit.
"""

from __future__ import annotations

#: Exit codes of the `tracekit` command (its --help repeats them).
EXIT_BAD_INPUT = 2
EXIT_INTERNAL = 3


class TracekitError(Exception):
    """Base class: an error the CLI reports as one line, with exit code `exit_code`."""

    exit_code = EXIT_BAD_INPUT


class LogError(TracekitError):
    """A raw log that cannot be read or is not valid.

    `str(err)` is the one line the CLI prints: ``FILE: FIELD: what is wrong (how to fix)``.
    """

    def __init__(self, path: str, field: str, problem: str) -> None:
        self.path = path
        self.field = field
        self.problem = problem
        super().__init__(one_line(f"{path}: {field}: {problem}"))

    def __reduce__(self):  # pickled back from `--jobs` worker processes
        return (type(self), (self.path, self.field, self.problem))


class UsageError(TracekitError):
    """An option value that does not fit the run (``--window 5:1``, an unknown request)."""


class InternalError(TracekitError):
    """A bug in tracekit, never in the input: reported as such, exit code 3."""

    exit_code = EXIT_INTERNAL


class ReconcileError(InternalError):
    """A partition whose parts do not sum to the gap: a bug in tracekit, never in the log."""


def one_line(text: str) -> str:
    """`text` with line breaks and other control characters escaped, so that an error about
    a hostile file (a newline in its name or in an archive member's) stays one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)
