"""The demo's timeline: requests per second to each backend, failures, A's phase changes.

Why a timeline
--------------
The table says how many requests failed; the timeline says *when*, and that is what
explains them: the stock server's failures sit exactly in the propagation delay, after
SIGTERM and before the balancer forgot A, while a graceful A keeps serving through it and
drains once the traffic has moved to C.  A's phase marks come from the events A itself
wrote (see :mod:`graceful._demo._scenario`), so they sit where the changes happened.

SVG is written by hand so that ``--plot timeline.svg`` needs nothing beyond the demo
extra; PNG needs matplotlib, asked for only when a ``.png`` is wanted.
"""

from __future__ import annotations

from collections import Counter
from html import escape
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._scenario import Outcome

BIN_S = 0.25
COLORS = {"A": "#d62728", "B": "#1f77b4", "C": "#2ca02c"}
WIDTH, PANEL, LEFT, RIGHT, TOP = 900, 190, 60, 20, 30


def _series(outcome: Outcome) -> tuple[dict[str, list[float]], list[float], float]:
    tally = outcome.tally
    end = max([t for t, _ in tally.served] + [t for t, _ in tally.failures] + [1.0])
    bins = int(end / BIN_S) + 1
    rates: dict[str, list[float]] = {}
    for name in ("A", "B", "C"):
        counts = Counter(int(t / BIN_S) for t, n in tally.served if n == name)
        rates[name] = [counts[i] / BIN_S for i in range(bins)]
    return rates, [t for t, _ in tally.failures], end


def _title(outcome: Outcome) -> str:
    return f"{outcome.kind.name}: {outcome.tally.requests} requests, {outcome.tally.failed} failed"


def svg(outcomes: list[Outcome]) -> str:
    height = TOP + PANEL * len(outcomes) + 20
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'font-family="sans-serif" font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{LEFT}" y="18" font-size="14">Rolling restart timeline: requests/s per '
        "backend (A is terminated), failures (red ticks), A's phase changes</text>",
    ]
    for row, outcome in enumerate(outcomes):
        rates, failures, end = _series(outcome)
        y0 = TOP + row * PANEL
        plot_h = PANEL - 50
        peak = max([max(r, default=0) for r in rates.values()] + [1.0])
        width = WIDTH - LEFT - RIGHT

        def x(t: float, width: int = width, end: float = end) -> float:
            return LEFT + width * t / end

        def y(v: float, y0: int = y0, plot_h: int = plot_h, peak: float = peak) -> float:
            return y0 + 20 + plot_h * (1 - v / peak)

        title = escape(_title(outcome))
        out.append(f'<text x="{LEFT}" y="{y0 + 14}" font-weight="bold">{title}</text>')
        out.append(
            f'<rect x="{LEFT}" y="{y0 + 20}" width="{width}" height="{plot_h}" '
            'fill="none" stroke="#999"/>'
        )
        out.append(f'<text x="4" y="{y0 + 28}">{peak:.0f}/s</text>')
        for name, series in rates.items():
            points = " ".join(
                f"{x(i * BIN_S + BIN_S / 2):.1f},{y(v):.1f}" for i, v in enumerate(series)
            )
            out.append(
                f'<polyline fill="none" stroke="{COLORS[name]}" stroke-width="1.5" '
                f'points="{points}"><title>backend {name}</title></polyline>'
            )
            out.append(
                f'<text x="{WIDTH - RIGHT - 60 + 20 * "ABC".index(name)}" y="{y0 + 14}" '
                f'fill="{COLORS[name]}">{name}</text>'
            )
        for t in failures:
            out.append(
                f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{y0 + 20 + plot_h}" '
                f'y2="{y0 + 10 + plot_h}" stroke="red"/>'
            )
        marks = [(outcome.sigterm_at, "SIGTERM")]
        if outcome.terminating is not None:
            marks += [(t, phase) for t, phase, _ in outcome.terminating.phases]
            if outcome.terminating.ended_at is not None:
                marks.append((outcome.terminating.ended_at, outcome.terminating.ended))
        for i, (t, label) in enumerate(marks):
            out.append(
                f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{y0 + 20}" y2="{y0 + 20 + plot_h}" '
                'stroke="#555" stroke-dasharray="3,3"/>'
            )
            out.append(
                f'<text x="{x(t) + 2:.1f}" y="{y0 + 32 + 11 * (i % 4)}" fill="#555">'
                f"{escape(label)}</text>"
            )
        out.append(
            f'<text x="{LEFT}" y="{y0 + 34 + plot_h}">0 s</text>'
            f'<text x="{WIDTH - RIGHT - 30}" y="{y0 + 34 + plot_h}">{end:.1f} s</text>'
        )
    out.append("</svg>")
    return "\n".join(out)


def write_plot(outcomes: list[Outcome], path: str) -> None:
    """Write the timeline to ``path`` (.svg by hand, .png with matplotlib)."""
    if path.endswith(".svg"):
        with open(path, "w", encoding="utf-8") as f:
            f.write(svg(outcomes))
        return
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit(
            "--plot FILE.png needs matplotlib (pip install matplotlib); "
            "or use --plot FILE.svg, which needs nothing"
        ) from None
    fig, axes = plt.subplots(len(outcomes), 1, figsize=(10, 2.4 * len(outcomes)), squeeze=False)
    for ax, outcome in zip(axes[:, 0], outcomes, strict=True):
        rates, failures, _end = _series(outcome)
        for name, series in rates.items():
            ax.plot([i * BIN_S for i in range(len(series))], series, label=name,
                    color=COLORS[name])  # fmt: skip
        for t in failures:
            ax.axvline(t, color="red", alpha=0.3, linewidth=0.8)
        if outcome.terminating is not None:
            for t, phase, _ in outcome.terminating.phases:
                ax.axvline(t, color="#555", linestyle="--", linewidth=0.8)
                ax.text(t, ax.get_ylim()[1] * 0.9, phase, fontsize=7)
        ax.set_title(_title(outcome), fontsize=9)
        ax.set_ylabel("req/s")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds")
    fig.tight_layout()
    fig.savefig(path)
