"""The errors tracekit raises on bad input: each names the file, the field and what is wrong."""

from __future__ import annotations


class TracekitError(Exception):
    """Base class: an error the CLI reports as one line and exit code 2."""


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


def one_line(text: str) -> str:
    """`text` with line breaks and other control characters escaped, so that an error about
    a hostile file (a newline in its name or in an archive member's) stays one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)


class ReconcileError(TracekitError):
    """A partition whose parts do not sum to the gap: a bug in tracekit, never in the log."""
