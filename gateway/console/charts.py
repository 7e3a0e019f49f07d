"""Charts drawn on the server: the geometry of an SVG line chart (one line a series, axis labels,
a point with its value per non-zero value), which `templates/_chart.html` draws autoescaped. No
script and no style attribute in the SVG (the console's CSP): presentation attributes only."""

from __future__ import annotations

from dataclasses import dataclass

WIDTH, HEIGHT = 560, 150
LEFT, RIGHT, TOP, BOTTOM = 48, 20, 8, 22
# one colour a tier, the same in every chart (and its legend)
COLOURS = {"priority": "#b3261e", "default": "#2453a6", "flex": "#2e7d32"}
OTHER = ("#8e44ad", "#e67e22", "#607d8b")


def colour(name: str, i: int = 0) -> str:
    return COLOURS.get(name, OTHER[i % len(OTHER)])


def nice_top(top: float) -> float:
    """The axis' top: 1, 2 or 5 times a power of ten, at least `top` (1 for an empty chart)."""
    if top <= 0:
        return 1.0
    step = 1.0
    while step * 10 <= top:
        step *= 10
    while step > top:
        step /= 10
    return next(m * step for m in (1, 2, 5, 10) if m * step >= top)


def short(v: float) -> str:
    if v >= 1_000_000:
        return f"{v / 1_000_000:g}M"
    if v >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:g}"


@dataclass(frozen=True, slots=True)
class Line:
    name: str
    colour: str
    points: str                                   # the polyline's "x,y x,y ..."
    dots: list[tuple[float, float, str]]          # (x, y, hover text) of each non-zero value


@dataclass(frozen=True, slots=True)
class Chart:
    title: str
    width: int
    height: int
    left: int
    right: int
    top_y: float
    zero_y: float
    top_label: str
    x_labels: list[tuple[float, str]]
    lines: list[Line]


def line_chart(title: str, labels: list[str], series: dict[str, list[float]], unit: str = "") -> Chart:
    """`series`: name -> one value a label (the x axis: `labels`, every sixth one written)."""
    n = max(len(labels), 2)
    top = nice_top(max((v for vs in series.values() for v in vs), default=0.0))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(i: int) -> float:
        return round(LEFT + plot_w * i / (n - 1), 1)

    def y(v: float) -> float:
        return round(TOP + plot_h * (1 - v / top), 1)

    lines = [Line(name, colour(name, k), " ".join(f"{x(i)},{y(v)}" for i, v in enumerate(values)),
                  [(x(i), y(v), f"{name}, {labels[i]}: {v:g}{unit}") for i, v in enumerate(values) if v])
             for k, (name, values) in enumerate(series.items())]
    x_labels = [(x(i), label) for i, label in enumerate(labels) if i % 6 == 0 or i == len(labels) - 1]
    return Chart(title, WIDTH, HEIGHT, LEFT, WIDTH - RIGHT, y(top), y(0), short(top) + unit, x_labels, lines)
