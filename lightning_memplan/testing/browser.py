"""Open an HTML file in a real headless browser (Debian's ``chromium``) for the report tests: the DOM
after its scripts ran, the console messages, every network request the page made, and a screenshot.

Network requests are read from Chromium's net log (``--log-net-log``): a request whose network
isolation key is the page's ``file://`` site was made by the page (the browser's own background
requests, component updates and the like, have other keys). Host resolution is mapped to nothing
(``--host-resolver-rules``), so even a page that tried could not reach anything.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["REPORT_SECTIONS", "BrowserRun", "check_report_page", "find_chromium", "open_in_browser"]

#: The section headings every memory report page has.
REPORT_SECTIONS = ("Step timeline", "Across the run", "Across ranks", "Tables")

_CANDIDATES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
_FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run", "--disable-extensions",
    "--disable-background-networking", "--disable-component-update", "--disable-sync", "--disable-default-apps",
    "--enable-logging=stderr", "--v=0", "--host-resolver-rules=MAP * ~NOTFOUND",
)
_CONSOLE = re.compile(r":CONSOLE[:(]\d*\)?\]? ?(.*)$")


@dataclass(frozen=True, kw_only=True)
class BrowserRun:
    """Attributes: dom (serialised after the scripts ran); console (messages the page logged, errors
    included); requests (URLs the page requested that are not ``file:``/``data:``/``about:``);
    screenshot (path, or ``None``)."""

    dom: str
    console: tuple[str, ...]
    requests: tuple[str, ...]
    screenshot: Path | None


def find_chromium() -> str | None:
    """Path of a Chromium executable on ``PATH``, or ``None``."""
    for name in _CANDIDATES:
        path = shutil.which(name)
        if path:
            return path
    return None


def _page_requests(net_log: Path) -> list[str]:
    try:
        data = json.loads(net_log.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        # Chromium may leave the log without its closing bracket when killed; read what is there.
        text = net_log.read_text(encoding="utf-8", errors="replace").rstrip().rstrip(",")
        data = json.loads(text + ("]}" if not text.endswith("}") else ""))
    urls = []
    for event in data.get("events", ()):
        params = event.get("params") or {}
        url, key = params.get("url"), str(params.get("network_isolation_key", ""))
        if url and key.startswith("file://") and not url.startswith(("file:", "data:", "about:")):
            urls.append(url)
    return sorted(set(urls))


def open_in_browser(
    html: str | os.PathLike[str], *, screenshot: str | os.PathLike[str] | None = None,
    window: tuple[int, int] = (1000, 2400), timeout: float = 90.0,
) -> BrowserRun:
    """Load ``html`` in headless Chromium (raises ``FileNotFoundError`` when there is none)."""
    exe = find_chromium()
    if exe is None:
        raise FileNotFoundError("no chromium executable on PATH (apt-get install chromium)")
    url = Path(html).resolve().as_uri()
    with tempfile.TemporaryDirectory(prefix="memplan-chromium-") as tmp:
        net_log = Path(tmp) / "net.json"
        common = [exe, *_FLAGS, f"--user-data-dir={tmp}/profile", f"--window-size={window[0]},{window[1]}"]
        proc = subprocess.run(
            [*common, f"--log-net-log={net_log}", "--dump-dom", url],
            capture_output=True, text=True, timeout=timeout, check=False,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"chromium --dump-dom {url} exited {proc.returncode}: {proc.stderr[-2000:]}")
        console = [m.group(1) for line in proc.stderr.splitlines() if (m := _CONSOLE.search(line))]
        requests = _page_requests(net_log)
        shot = None
        if screenshot is not None:
            shot = Path(screenshot).resolve()
            proc2 = subprocess.run(
                [*common, f"--screenshot={shot}", url], capture_output=True, text=True, timeout=timeout, check=False
            )
            if proc2.returncode != 0 or not shot.is_file():
                raise RuntimeError(f"chromium --screenshot {url} exited {proc2.returncode}: {proc2.stderr[-2000:]}")
            console += [m.group(1) for line in proc2.stderr.splitlines() if (m := _CONSOLE.search(line))]
    return BrowserRun(dom=proc.stdout, console=tuple(console), requests=tuple(requests), screenshot=shot)


def check_report_page(
    path: str | os.PathLike[str], screenshot: str | os.PathLike[str], *, sections: tuple[str, ...] = REPORT_SECTIONS
) -> BrowserRun:
    """Open the report page ``path`` and assert it rendered ``sections`` (one chart each at least), that
    its switcher script ran (every view but the selected one of a group hidden), that it logged nothing
    to the console and requested nothing, and that the screenshot was taken."""
    run = open_in_browser(path, screenshot=screenshot)
    assert run.console == (), run.console
    assert run.requests == (), run.requests
    for title in sections:
        assert f">{title}</h2>" in run.dom, title
    assert run.dom.count("<svg") >= len(sections) - 1
    assert run.dom.count('style="display: none;"') >= run.dom.count("<select data-group=")
    assert run.screenshot is not None and run.screenshot.stat().st_size > 20_000
    return run
