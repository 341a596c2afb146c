"""Numbers as panel text: bars, byte sizes, percentages, and "n/a" for what the engine does not report."""

from __future__ import annotations

from textual.widgets import Static

NA = "n/a"
EIGHTHS = " ▏▎▍▌▋▊▉█"


def bar(fraction: float, width: int) -> str:
    """A horizontal bar of `width` cells filled to `fraction` (0..1), with eighth-cell resolution."""
    fraction = min(max(fraction, 0.0), 1.0)
    eighths = round(fraction * width * 8)
    full, rest = divmod(eighths, 8)
    text = "█" * full + (EIGHTHS[rest] if rest else "")
    return text.ljust(width)


def size(n: int | float | None) -> str:
    """Bytes in binary units (KiB, MiB, GiB)."""
    if n is None:
        return NA
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return NA


def count(n: int | None) -> str:
    """A token count, compact (1.2k, 3.4M)."""
    if n is None:
        return NA
    if n >= 1_000_000:
        return f"{n / 1e6:.1f}M"
    if n >= 10_000:
        return f"{n / 1e3:.0f}k"
    return str(n)


def pct(x: float | None) -> str:
    return NA if x is None else f"{100 * x:.0f}%"


def num(x: float | None, digits: int = 1, unit: str = "") -> str:
    return NA if x is None else f"{x:.{digits}f}{unit}"


class FigureText(Static):
    """Panel text that asks for a new layout only when its number of lines changes (a layout pass costs a
    whole-screen reflow; redrawing the same lines does not)."""

    def __init__(self, text: str = "", **kwargs) -> None:
        super().__init__(text, **kwargs)
        self.line_count = text.count("\n")

    def show(self, text: str) -> None:
        lines = text.count("\n")
        self.update(text, layout=lines != self.line_count)
        self.line_count = lines
