"""The time-window options of the reading commands (`--window`, `--around`, `--width`), on
the command line: declared once here, read by every command that takes them, refused in
one line by a command they make no sense for (docs/reports.md, "Windows: part of a long
run"). The window itself (parsing, choosing, selecting) is `tracekit.analysis.window`.

Part of the `cli` stage: it imports nothing from `tracekit.cli`, which imports it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import click

from tracekit.errors import UsageError, one_line

if TYPE_CHECKING:  # the analysis stage loads per command, never for `tracekit --help`
    from tracekit.analysis.window import Window, WindowOptions

#: where a command's window options wait in click's context until the command reads them
_KEY = "tracekit.window"

_OPTIONS = (  # (option, type, metavar, help)
    ("--window", str, "FROM..TO", "Only the gaps ending in [FROM, TO) and the TTFTs whose "
     "first token lands in it, partitioned as in the whole run: seconds from engine start "
     "(..30, 600.. open) or wall-clock times (docs/reports.md, \"Windows\")."),
    ("--around", str, "worst|pNN", "A window centred on the end of the worst gap, or of the "
     "gap at the NN-th ITL percentile (p99, p99.9); of each run, with several runs."),
    ("--width", click.FloatRange(min=0, min_open=True), "S", "--around's width (default 2 s)."),
)  # fmt: skip


def _store(ctx: click.Context, param: click.Parameter, value: Any) -> None:
    if value is not None:
        ctx.meta.setdefault(_KEY, {})[param.name] = value


def window_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Add --window, --around and --width to a command; `view()` reads them."""
    for name, kind, meta, text in reversed(_OPTIONS):
        fn = click.option(name, type=kind, default=None, metavar=meta, help=text,
                          expose_value=False, callback=_store)(fn)  # fmt: skip
    return fn


def no_window_options(why: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Take --window, --around and --width only to refuse them in one line (exit 2),
    saying `why` the command has no window: never a silent no-op, never click's usage
    screen."""

    def refuse(ctx: click.Context, param: click.Parameter, value: Any) -> None:
        if value is not None:
            raise UsageError(f"--{param.name}: {ctx.info_name} {why}")

    def add(fn: Callable[..., Any]) -> Callable[..., Any]:
        for name, kind, meta, _ in reversed(_OPTIONS):
            fn = click.option(name, type=kind, default=None, metavar=meta, hidden=True,
                              expose_value=False, callback=refuse)(fn)  # fmt: skip
        return fn

    return add


def view() -> WindowOptions:
    """The running command's --window/--around/--width, as a `WindowOptions` (for every
    run of the command). --width without --around is refused: it sizes --around's
    window and nothing else."""
    from tracekit.analysis.window import DEFAULT_WIDTH_S, WindowOptions  # deferred: per command

    given = click.get_current_context().meta.get(_KEY, {})
    if "width" in given and "around" not in given:
        raise UsageError(
            f"--width {given['width']:g} without --around: --width sizes the window --around "
            "centres on a gap (give --around worst|pNN, or --window FROM..TO)"
        )
    return WindowOptions(given.get("window"), given.get("around"),
                         given.get("width", DEFAULT_WIDTH_S))  # fmt: skip


def say_window(run: str, win: Window | None) -> Window | None:
    """Print which window a command shows (stderr), and pass it on."""
    if win is not None:
        click.echo(f"tracekit: {one_line(run)}: {win.describe()}", err=True)
    return win


def say_windows(paths: list[str], windows: list[dict[str, Any] | None]) -> None:
    """Print which window each run of a many-run command shows (stderr): with `--around`
    or wall-clock times, each run has its own."""
    from tracekit.analysis.window import Window  # deferred: per command

    for path, w in zip(paths, windows, strict=True):
        if w is not None:
            win = Window(
                float("-inf") if w["from_s"] is None else w["from_s"],
                float("inf") if w["to_s"] is None else w["to_s"],
                w["how"],
            )
            say_window(path, win)


__all__ = ["no_window_options", "say_window", "say_windows", "view", "window_options"]
