"""The demo's timeline: requests per second to each backend, failures, A's phase changes.

Why a timeline
--------------
The table says how many requests failed; the timeline says *when*, and that is what
explains them: the stock server's failures sit exactly in the propagation delay, after
SIGTERM and before the balancer forgot A (the shaded band), while a graceful A keeps
serving through it and drains once the traffic has moved to C.  A's phase marks come
from the events A itself wrote (see ``graceful._demo._scenario``), so they sit where
the changes happened.  Time runs from the start of the load and is counted from
SIGTERM, the moment every scenario shares, so panels of different servers line up.

SVG is written by hand so that ``--plot timeline.svg`` needs nothing beyond the demo
extra; PNG needs matplotlib (in no extra: ``pip install matplotlib``), asked for only
when a ``.png`` is wanted.  The SVG is small (a polyline per backend, a line per mark)
and machine-readable: each series is a ``<polyline class="series" data-backend="A">``,
each mark a ``<g class="mark" data-label="draining">``, each failure a
``<line class="failure">`` — the integration test reads them with
``xml.etree.ElementTree``, and ``docs/img/`` keeps one per policy.
"""

from __future__ import annotations

import math
from collections import Counter
from html import escape
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._scenario import Outcome

BIN_S = 0.25
COLORS = {"A": "#d62728", "B": "#1f77b4", "C": "#2ca02c"}
LEGEND = {"A": "A (terminated)", "B": "B", "C": "C (new)"}
WIDTH, PANEL, LEFT, RIGHT, TOP = 900, 200, 60, 20, 42
LABEL_ROW_H, LABEL_CHAR_W = 11, 6.2  # marks' labels: row height, approximate glyph width


def _span(outcome: Outcome) -> tuple[float, float]:
    """The plotted stretch: the load, from its start to its stop, in whole ``BIN_S``.

    Requests in flight when the load stops (long ones) still finish and are counted in
    the table, but a rate after the stop would only show the clients leaving.
    """
    tally = outcome.tally
    start = outcome.load_started_at
    end = outcome.load_stopped_at
    if end is None:  # not stopped (an outcome built by hand): up to the last result
        end = max([t for t, _ in tally.served] + [t for t, _ in tally.failures] + [start])
    bins = max(4, int((end - start) / BIN_S))  # a partial last bin would look like a drop
    return start, start + bins * BIN_S


def time_range(outcomes: list[Outcome]) -> tuple[float, float]:
    """Seconds from SIGTERM that every panel shows: the widest of them, so that panels
    (and, given the same ``--plot-range``, plots) share one time axis."""
    spans = [_span(o) for o in outcomes]
    return (
        min(s - o.sigterm_at for o, (s, _) in zip(outcomes, spans, strict=True)),
        max(e - o.sigterm_at for o, (_, e) in zip(outcomes, spans, strict=True)),
    )


def _series(outcome: Outcome) -> tuple[dict[str, list[float]], list[float], float, float]:
    """Requests/s to each backend per ``BIN_S`` over the load, failure times, the span."""
    tally = outcome.tally
    start, end = _span(outcome)
    bins = round((end - start) / BIN_S)
    rates: dict[str, list[float]] = {}
    for name in ("A", "B", "C"):
        counts = Counter(int((t - start) / BIN_S) for t, n in tally.served if n == name)
        rates[name] = [counts[i] / BIN_S for i in range(bins)]
    failures = [t for t, _ in tally.failures if start <= t <= end]
    return rates, failures, start, end


def _marks(outcome: Outcome) -> list[tuple[float, str]]:
    """SIGTERM, A's phase changes (its own events) and how A ended, in time order."""
    a = outcome.terminating
    phases = [] if a is None else [(t, phase) for t, phase, _ in a.phases]
    # A graceful A enters "accepting" (shutdown requested) the moment SIGTERM arrives:
    # one mark for both.
    sigterm = "SIGTERM: accepting" if any(p == "accepting" for _, p in phases) else "SIGTERM"
    marks = [(outcome.sigterm_at, sigterm)]
    if a is not None:
        marks += [(t, phase) for t, phase in phases if phase != "accepting"]
        if a.ended_at is not None:
            marks.append((a.ended_at, a.ended))
    return sorted(marks, key=lambda mark: mark[0])


def _label_rows(xs_and_labels: list[tuple[float, str]]) -> list[int]:
    """A row for each label so that none overlaps the one before it in its row."""
    row_ends: list[float] = []
    rows = []
    for x, label in xs_and_labels:
        width = LABEL_CHAR_W * len(label) + 6
        row = next((i for i, end in enumerate(row_ends) if end <= x), len(row_ends))
        if row == len(row_ends):
            row_ends.append(0.0)
        row_ends[row] = x + width
        rows.append(row)
    return rows


def _title(outcome: Outcome) -> str:
    return f"{outcome.kind.name}: {outcome.tally.requests} requests, {outcome.tally.failed} failed"


def svg(
    outcomes: list[Outcome],
    *,
    subtitle: str = "",
    seconds: tuple[float, float] | None = None,
) -> str:
    """The timeline of each outcome, one panel each, as an SVG document.

    ``subtitle`` (the scenario's settings) follows the title; ``seconds`` is the time
    axis, from SIGTERM (default: ``time_range`` of ``outcomes``).
    """
    seconds = time_range(outcomes) if seconds is None else seconds
    panels = [_panel(o, seconds) for o in outcomes]
    height = TOP + sum(h for _, h in panels) + 10
    title = "Rolling restart" + (f": {subtitle}" if subtitle else "")
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" font-family="sans-serif" font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
        f'<text x="{LEFT}" y="16" font-size="13">{escape(title)}</text>',
        f'<text x="{LEFT}" y="32" fill="#555">requests/s per backend; red ticks: failed '
        "requests; dashed: SIGTERM and A's phase changes; grey: the balancer still sends "
        "A new connections</text>",
    ]
    y0 = TOP
    for lines, panel_height in panels:
        out.append(f'<g transform="translate(0 {y0})">')
        out += lines
        out.append("</g>")
        y0 += panel_height
    out.append("</svg>")
    return "\n".join(out) + "\n"


def _panel(outcome: Outcome, seconds: tuple[float, float]) -> tuple[list[str], int]:
    """A panel's elements (its top at 0) and its height: the plot, then the time axis,
    then the marks' labels, each in the first row where it overlaps no other."""
    y0 = 0
    rates, failures, load_start, _ = _series(outcome)
    start, end = outcome.sigterm_at + seconds[0], outcome.sigterm_at + seconds[1]
    plot_top, plot_h, width = y0 + 20, PANEL - 55, WIDTH - LEFT - RIGHT
    peak = max([max(r, default=0) for r in rates.values()] + [1.0])

    def x(t: float) -> float:
        return LEFT + width * (t - start) / (end - start)

    def y(v: float) -> float:
        return plot_top + plot_h * (1 - v / peak)

    bottom = plot_top + plot_h
    name = escape(outcome.kind.name, quote=True)
    out = [f'<g class="panel" data-server="{name}">']
    out.append(
        f'<text x="{LEFT}" y="{y0 + 14}" font-weight="bold">{escape(_title(outcome))}</text>'
    )
    if outcome.forgotten_at is not None:
        out.append(
            f'<rect class="propagation" x="{x(outcome.sigterm_at):.1f}" y="{plot_top}" '
            f'width="{x(outcome.forgotten_at) - x(outcome.sigterm_at):.1f}" height="{plot_h}" '
            'fill="#eee"><title>propagation delay: the balancer still routes new connections '
            "to A</title></rect>"
        )
    out.append(
        f'<rect x="{LEFT}" y="{plot_top}" width="{width}" height="{plot_h}" fill="none" '
        'stroke="#999"/>'
    )
    out.append(f'<text x="{LEFT - 4}" y="{plot_top + 8}" text-anchor="end">{peak:.0f}/s</text>')
    out.append(f'<text x="{LEFT - 4}" y="{bottom}" text-anchor="end">0</text>')
    # Seconds from SIGTERM, a tick per second.
    for second in range(math.ceil(start - outcome.sigterm_at), int(end - outcome.sigterm_at) + 1):
        tx = x(outcome.sigterm_at + second)
        label = "SIGTERM" if second == 0 else f"{second:+d} s"
        out.append(
            f'<line x1="{tx:.1f}" x2="{tx:.1f}" y1="{bottom}" y2="{bottom + 4}" stroke="#999"/>'
            f'<text x="{tx:.1f}" y="{bottom + 15}" text-anchor="middle" fill="#555">{label}</text>'
        )
    for backend, series in rates.items():
        centres = [(load_start + i * BIN_S + BIN_S / 2, v) for i, v in enumerate(series)]
        points = " ".join(f"{x(t):.1f},{y(v):.1f}" for t, v in centres if start <= t <= end)
        out.append(
            f'<polyline class="series" data-backend="{backend}" fill="none" '
            f'stroke="{COLORS[backend]}" stroke-width="1.5" points="{points}">'
            f"<title>backend {LEGEND[backend]}, requests/s</title></polyline>"
        )
    legend_x = WIDTH - RIGHT - sum(LABEL_CHAR_W * (len(v) + 2) + 20 for v in LEGEND.values())
    for backend, label in LEGEND.items():
        out.append(
            f'<text x="{legend_x:.0f}" y="{y0 + 14}" fill="{COLORS[backend]}">— {label}</text>'
        )
        legend_x += LABEL_CHAR_W * (len(label) + 2) + 20
    for t in (t for t in failures if start <= t <= end):
        out.append(
            f'<line class="failure" x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{bottom}" '
            f'y2="{bottom - 10}" stroke="red"/>'
        )
    # The marks' labels go under the time axis, not over the series: a dotted leader
    # from each mark down to its label, labels of close marks in rows of their own.
    marks = [(t, label) for t, label in _marks(outcome) if start <= t <= end]
    rows = _label_rows([(x(t), label) for t, label in marks])
    labels_top = bottom + 22
    for (t, label), label_row in zip(marks, rows, strict=True):
        safe = escape(label, quote=True)
        label_y = labels_top + LABEL_ROW_H * (label_row + 1)
        out.append(
            f'<g class="mark" data-label="{safe}" data-t="{t - outcome.sigterm_at:.3f}">'
            f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{plot_top}" y2="{bottom}" '
            'stroke="#555" stroke-dasharray="3,3"/>'
            f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{bottom + 18}" y2="{label_y - 8}" '
            'stroke="#bbb" stroke-dasharray="1,2"/>'
            f'<text x="{x(t) + 2:.1f}" y="{label_y}" fill="#333">{escape(label)}</text></g>'
        )
    out.append("</g>")
    label_rows = max(rows, default=-1) + 1
    return out, int(labels_top + LABEL_ROW_H * label_rows + 14)


def write_plot(
    outcomes: list[Outcome],
    path: str,
    *,
    subtitle: str = "",
    seconds: tuple[float, float] | None = None,
) -> None:
    """Write the timeline to ``path`` (.svg by hand, .png with matplotlib); ``seconds``
    is the time axis from SIGTERM (default: the widest panel's)."""
    seconds = time_range(outcomes) if seconds is None else seconds
    if path.endswith(".svg"):
        with open(path, "w", encoding="utf-8") as f:
            f.write(svg(outcomes, subtitle=subtitle, seconds=seconds))
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
        rates, failures, start, _end = _series(outcome)
        zero = outcome.sigterm_at
        for name, series in rates.items():
            ax.plot([start - zero + i * BIN_S + BIN_S / 2 for i in range(len(series))], series,
                    label=LEGEND[name], color=COLORS[name])  # fmt: skip
        if outcome.forgotten_at is not None:
            ax.axvspan(0, outcome.forgotten_at - zero, color="#eee")
        for t in failures:
            ax.axvline(t - zero, color="red", alpha=0.3, linewidth=0.8)
        for t, label in _marks(outcome):
            ax.axvline(t - zero, color="#555", linestyle="--", linewidth=0.8)
            ax.text(t - zero, ax.get_ylim()[1] * 0.9, label, fontsize=7)
        ax.set_xlim(*seconds)
        ax.set_title(_title(outcome), fontsize=9)
        ax.set_ylabel("req/s")
        ax.legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("seconds from SIGTERM")
    if subtitle:
        fig.suptitle(f"Rolling restart: {subtitle}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
