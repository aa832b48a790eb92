"""Screenshot the HTML report for the README: the top of the page (verdict, runs, groups)
and the ITL-over-time chart, as a real headless Chromium draws them at 1000 px wide.

    python docs/make_screenshot.py reports/ladder.html docs/report.png

Fails (exit 1) if the page logs a console error or throws, or a chart is not drawn.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from browser import open_page  # noqa: E402

WIDTH = 1000


def main() -> None:
    src, dst = sys.argv[1], sys.argv[2]
    url = pathlib.Path(os.path.abspath(src)).as_uri()
    probe = (
        "JSON.stringify({charts: Array.from(document.querySelectorAll('.chart'))"
        ".map(d => [d.id, d.querySelectorAll('.main-svg').length]),"
        " bottom: document.getElementById('tk-itl-time').getBoundingClientRect().bottom"
        " + window.scrollY, width: document.documentElement.scrollWidth})"
    )
    page = open_page(
        url,
        ready="document.body && document.body.getAttribute('data-charts')",
        expression=probe,
        width=WIDTH,
        height=2400,
        timeout_s=60,
    )
    info = json.loads(page.value)
    problems = page.console_errors + page.exceptions
    problems += [f"chart {c} not drawn" for c, svgs in info["charts"] if svgs < 1]
    if info["width"] > WIDTH:
        problems.append(f"the page is {info['width']} px wide, more than {WIDTH}")
    if problems:
        raise SystemExit("\n".join(problems))
    height = min(int(info["bottom"]) + 10, 2400)
    shot = open_page(
        url,
        ready="document.body && document.body.getAttribute('data-charts')",
        width=WIDTH,
        height=height,
        screenshot=True,
        timeout_s=60,
    )
    assert shot.screenshot_png is not None
    pathlib.Path(dst).write_bytes(shot.screenshot_png)
    print(f"wrote {dst}: {WIDTH}x{height}, charts {info['charts']}")


if __name__ == "__main__":
    main()
