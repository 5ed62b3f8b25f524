"""A small SVG chart writer for the self-contained HTML report: axes with nice ticks (linear or log),
polygons, polylines, rectangles, markers and text, each with an optional ``<title>`` (the browser shows
it on hover, no JavaScript needed). Everything is escaped; nothing refers to anything outside the file.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from lightning_memplan.report.escape import html_text as escape

__all__ = ["Chart", "nice_ticks"]

#: Room around the plot area for tick labels and axis titles, pixels (left, right, top, bottom).
_MARGINS = (72, 16, 30, 44)


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering [lo, hi] (steps of 1, 2 or 5 times a power of ten)."""
    if hi <= lo:
        hi = lo + 1.0
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    start = math.floor(lo / step) * step
    ticks = []
    v = start
    while v <= hi + step * 1e-9:
        if v >= lo - step * 1e-9:
            ticks.append(round(v, 12))
        v += step
    return ticks


def _fmt(v: float) -> str:
    return f"{v:.1f}".rstrip("0").rstrip(".")


class Chart:
    """One SVG chart of ``width`` x ``height`` pixels mapping data ranges onto its plot area.

    Args:
        x_range, y_range: data extents (``y_range`` bottom first). log_y: logarithmic y axis (values
            must be > 0). title: drawn at the top.
    """

    def __init__(
        self,
        width: int,
        height: int,
        x_range: tuple[float, float],
        y_range: tuple[float, float],
        *,
        log_y: bool = False,
        title: str = "",
        margins: tuple[int, int, int, int] = _MARGINS,
    ) -> None:
        self.width, self.height, self.log_y = width, height, log_y
        self.left, self.right, self.top, self.bottom = margins
        x0, x1 = x_range
        self.x_range = (x0, x1 if x1 > x0 else x0 + 1)
        y0, y1 = y_range
        if log_y:
            y0 = max(y0, 1e-12)
            y1 = max(y1, y0 * 10)
        self.y_range = (y0, y1 if y1 > y0 else y0 + 1)
        self.parts: list[str] = []
        if title:
            self.text(width / 2, 18, title, anchor="middle", size=14, weight="bold")

    # ------------------------------------------------------------------------------ coordinates
    def x(self, v: float) -> float:
        x0, x1 = self.x_range
        return self.left + (v - x0) / (x1 - x0) * (self.width - self.left - self.right)

    def y(self, v: float) -> float:
        y0, y1 = self.y_range
        if self.log_y:
            v = max(v, y0)
            frac = (math.log10(v) - math.log10(y0)) / (math.log10(y1) - math.log10(y0))
        else:
            frac = (v - y0) / (y1 - y0)
        return self.height - self.bottom - frac * (self.height - self.top - self.bottom)

    # ------------------------------------------------------------------------------ primitives
    @staticmethod
    def _title(title: str | None) -> str:
        return f"<title>{escape(title)}</title>" if title else ""

    def polygon(self, points: Sequence[tuple[float, float]], *, fill: str, title: str | None = None,
                opacity: float = 0.85) -> None:
        pts = " ".join(f"{self.x(a):.1f},{self.y(b):.1f}" for a, b in points)
        self.parts.append(f'<polygon points="{pts}" fill="{fill}" fill-opacity="{opacity}">{self._title(title)}</polygon>')

    def polyline(self, points: Sequence[tuple[float, float]], *, stroke: str, width: float = 1.8,
                 dash: str | None = None, title: str | None = None) -> None:
        pts = " ".join(f"{self.x(a):.1f},{self.y(b):.1f}" for a, b in points)
        extra = f' stroke-dasharray="{dash}"' if dash else ""
        self.parts.append(
            f'<polyline points="{pts}" fill="none" stroke="{stroke}" stroke-width="{width}"{extra}>'
            f"{self._title(title)}</polyline>"
        )

    def rect(self, x0: float, y0: float, x1: float, y1: float, *, fill: str, title: str | None = None,
             opacity: float = 0.85, stroke: str | None = None) -> None:
        """Data-space rectangle from (x0, y0) to (x1, y1)."""
        px0, px1 = sorted((self.x(x0), self.x(x1)))
        py0, py1 = sorted((self.y(y0), self.y(y1)))
        line = f' stroke="{stroke}" stroke-width="1"' if stroke else ""
        self.parts.append(
            f'<rect x="{px0:.1f}" y="{py0:.1f}" width="{max(px1 - px0, 0.5):.1f}" height="{max(py1 - py0, 0.5):.1f}" '
            f'fill="{fill}" fill-opacity="{opacity}"{line}>{self._title(title)}</rect>'
        )

    def marker(self, x: float, y: float, *, fill: str, r: float = 4.5, shape: str = "circle",
               title: str | None = None, stroke: str = "#222", px: tuple[float, float] | None = None) -> None:
        cx, cy = px if px is not None else (self.x(x), self.y(y))
        t = self._title(title)
        if shape == "diamond":
            pts = f"{cx:.1f},{cy - r:.1f} {cx + r:.1f},{cy:.1f} {cx:.1f},{cy + r:.1f} {cx - r:.1f},{cy:.1f}"
            self.parts.append(f'<polygon points="{pts}" fill="{fill}" stroke="{stroke}">{t}</polygon>')
        elif shape == "cross":
            self.parts.append(
                f'<g stroke="{fill}" stroke-width="3"><line x1="{cx - r:.1f}" y1="{cy - r:.1f}" x2="{cx + r:.1f}" '
                f'y2="{cy + r:.1f}"/><line x1="{cx - r:.1f}" y1="{cy + r:.1f}" x2="{cx + r:.1f}" y2="{cy - r:.1f}"/>'
                f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="{r + 2:.1f}" fill="transparent" stroke="none">{t}</circle></g>'
            )
        else:
            self.parts.append(f'<circle cx="{cx:.1f}" cy="{cy:.1f}" r="{r}" fill="{fill}" stroke="{stroke}">{t}</circle>')

    def text(self, x: float, y: float, text: str, *, anchor: str = "start", size: int = 11,
             color: str = "#222", weight: str = "normal", rotate: float | None = None) -> None:
        """Text at pixel position (x, y)."""
        rot = f' transform="rotate({rotate} {x:.1f} {y:.1f})"' if rotate is not None else ""
        self.parts.append(
            f'<text x="{x:.1f}" y="{y:.1f}" font-size="{size}" text-anchor="{anchor}" fill="{color}" '
            f'font-weight="{weight}"{rot}>{escape(text)}</text>'
        )

    def hline(self, v: float, *, stroke: str, label: str = "", dash: str = "6 4", label_at: str = "end") -> None:
        py = self.y(v)
        self.parts.append(
            f'<line x1="{self.left}" y1="{py:.1f}" x2="{self.width - self.right}" y2="{py:.1f}" stroke="{stroke}" '
            f'stroke-width="1.5" stroke-dasharray="{dash}">{self._title(label)}</line>'
        )
        if label and label_at == "start":
            self.text(self.left + 4, py - 4, label, size=10, color=stroke)
        elif label:
            self.text(self.width - self.right - 4, py - 4, label, anchor="end", size=10, color=stroke)

    def vline(self, v: float, *, stroke: str, label: str = "", dash: str = "3 3", title: str | None = None) -> None:
        px = self.x(v)
        self.parts.append(
            f'<line x1="{px:.1f}" y1="{self.top}" x2="{px:.1f}" y2="{self.height - self.bottom}" stroke="{stroke}" '
            f'stroke-width="1" stroke-dasharray="{dash}">{self._title(title or label)}</line>'
        )
        if label:
            self.text(px + 3, self.top + 11, label, size=10, color=stroke)

    def axes(self, *, x_label: str, y_label: str, y_format: Callable[[float], str] = _fmt,
             x_format: Callable[[float], str] = _fmt, x_ticks: Sequence[float] | None = None,
             y_scale: float = 1.0) -> None:
        """Frame, grid, ticks and axis titles (draw last so the frame sits on top); ``y_scale``: bytes per
        display unit, so linear ticks fall on round numbers of that unit."""
        x0, x1 = self.x_range
        y0, y1 = self.y_range
        grid = []
        if self.log_y:
            u0, u1 = y0 / y_scale, y1 / y_scale  # 1, 2, 5 x 10^k of the display unit
            decades = range(math.floor(math.log10(u0)), math.ceil(math.log10(u1)) + 1)
            ticks = [m * 10.0**k * y_scale for k in decades for m in (1, 2, 5)]
            ticks = [t for t in ticks if y0 <= t <= y1] or [y0, y1]
            if len(ticks) > 9:
                ticks = [t for t in ticks if round(t / y_scale / 10 ** math.floor(math.log10(t / y_scale))) == 1]
        else:
            ticks = [t * y_scale for t in nice_ticks(y0 / y_scale, y1 / y_scale)]  # round in display units
        for t in ticks:
            py = self.y(t)
            grid.append(f'<line x1="{self.left}" y1="{py:.1f}" x2="{self.width - self.right}" y2="{py:.1f}" stroke="#e3e3e3"/>')
            grid.append(f'<text x="{self.left - 5}" y="{py + 4:.1f}" font-size="10" text-anchor="end" fill="#444">{escape(y_format(t))}</text>')
        for t in x_ticks if x_ticks is not None else nice_ticks(x0, x1, 6):
            px = self.x(t)
            grid.append(f'<line x1="{px:.1f}" y1="{self.height - self.bottom}" x2="{px:.1f}" y2="{self.height - self.bottom + 4}" stroke="#444"/>')
            grid.append(f'<text x="{px:.1f}" y="{self.height - self.bottom + 15}" font-size="10" text-anchor="middle" fill="#444">{escape(x_format(t))}</text>')
        self.parts.insert(0, "".join(grid))
        w, h = self.width - self.left - self.right, self.height - self.top - self.bottom
        self.parts.append(f'<rect x="{self.left}" y="{self.top}" width="{w}" height="{h}" fill="none" stroke="#888"/>')
        self.text(self.left + w / 2, self.height - 8, x_label, anchor="middle", size=11)
        self.text(14, self.top + h / 2, y_label, anchor="middle", size=11, rotate=-90)

    def legend(self, items: Sequence[tuple[str, str]], *, x: float | None = None, y: float | None = None) -> None:
        """Colour swatches with labels, in a row under the title (pixel position ``x``, ``y``)."""
        px = x if x is not None else self.left + 4
        py = y if y is not None else self.top + 4
        for label, color in items:
            self.parts.append(f'<rect x="{px:.1f}" y="{py:.1f}" width="10" height="10" fill="{color}"/>')
            self.text(px + 13, py + 9, label, size=10)
            px += 13 + 6.2 * len(label) + 12

    def svg(self, *, css_class: str = "chart") -> str:
        return (
            f'<svg class="{css_class}" width="{self.width}" height="{self.height}" '
            f'viewBox="0 0 {self.width} {self.height}" role="img" font-family="sans-serif">' + "".join(self.parts) + "</svg>"
        )
