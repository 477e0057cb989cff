"""Render ``tests/faults/.results.json`` into ``docs/reliability.md``.

    python -m pytest tests/faults        # writes tests/faults/.results.json
    python tests/faults/render.py        # writes docs/reliability.md

Options: ``render.py [RESULTS_JSON] [OUTPUT_MD]``.
"""

from __future__ import annotations

import collections
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

#: Sections in reading order (test modules); unknown modules come last.  Each section's
#: heading and text are its module's docstring.
SECTIONS = [
    "test_accept_edge",
    "test_load",
    "test_keepalive",
    "test_clients",
    "test_deadlines",
    "test_signals",
    "test_workers",
    "test_wsgi_workers",
    "test_bad_input",
]

INTRO = """\
# Reliability: the fault suite

What happens to clients when a graceful-drain server is stopped in the worst possible
way. Every case in `tests/faults/` starts a real server as a subprocess on 127.0.0.1
(`graceful run`, or gunicorn with one of graceful's workers), drives it with
real clients over raw sockets and real signals, and checks two things: what **every
client saw**, and what **the app handled** — the test apps log `handled <id>` for each
response they produced, and a request the app handled whose response never reached its
client counts as a loss.

Every client outcome is one of:

* **answered** — a complete response (its status is shown);
* **refused** — the connect was refused: nothing was sent, so a client or load balancer
  can always retry;
* **lost** — the request was sent and no complete response came back (a reset, a close,
  or nothing in time). The client cannot know whether it was processed. **Losses must
  be 0.**

Races are made likely, not waited for: to queue work at the exact moment of the
signal, the server is stopped with SIGSTOP, connections and requests pile up in the
kernel, SIGTERM is sent (and seen pending in `/proc`), then SIGCONT — the signal and the
burst reach the event loop in the same wake-up. Every wait is on a log line, a process
state, a socket or a process exit, bounded by a timeout; no test sleeps "long enough".

Run it with `python -m pytest tests/faults` (about {minutes} on a 2-core machine), then
`python tests/faults/render.py` to regenerate this page. A case marked **xfail** is a
known defect reproduced reliably: the test is right and the product is wrong (the reason
says what is wrong); the mark is strict, so the suite turns red the moment a fix lands,
as a reminder to remove it.
"""

#: Hand-written sections after the cases, in this order: files beside this one (the
#: listener seal's rules; the gunicorn workers beside the stock ones, as
#: ``benchmarks/gunicorn_edges.py`` printed it).
APPENDICES = ["gunicorn_edges.md", "seal_rules.md"]

#: (situation, exit status): what the signal, deadline, workers and bad-input cases assert.
EXIT_STATUSES = [
    ("SIGTERM or SIGINT: drained, or cut at the drain deadline", "0"),
    ("a second SIGTERM/SIGINT: escalation to stopping (in-flight requests get 503)", "0"),
    ("SIGQUIT: stop at once (in-flight requests get 503)", "0"),
    (
        "a third SIGTERM/SIGINT: exit at once",
        "1 (in a signal storm, 0 if stopping finished before the third was handled)",
    ),
    (
        "the app would not stop by the kill deadline: hard exit",
        "0 if stopping had finished (the interpreter's teardown was what hung: a warning "
        "when nothing was left), 1 if not (an error)",
    ),
    (
        "SIGHUP, single process (not handled: default action)",
        "killed by SIGHUP (-1, 129 in a shell)",
    ),
    ("a bad option or `GRACEFUL_*` variable", "2"),
    ("the app could not start", "3"),
    ("`--workers N` parent after SIGTERM/SIGINT/SIGQUIT", "0 if every worker exited 0, else 1"),
]


def _text(text: str) -> str:
    """reStructuredText literals (docstrings) as Markdown ones."""
    return text.replace("``", "`")


def _cell(text: str) -> str:
    return _text(text).replace("|", "\\|").replace("\n", " ").strip() or "—"


def _result(entry: dict[str, Any]) -> str:
    outcome = entry["outcome"]
    if outcome == "pass":
        return "pass"
    if outcome == "xfail":
        return f"**xfail**: {entry.get('reason', '')}"
    if outcome == "xpass":
        return "**XPASS** (fixed? remove the xfail mark)"
    return f"**{outcome.upper()}**"


def render(results: dict[str, dict[str, Any]]) -> str:
    by_module: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for entry in results.values():
        by_module[entry["module"]].append(entry)
    order = [m for m in SECTIONS if m in by_module]
    order += sorted(m for m in by_module if m not in SECTIONS)
    counts = collections.Counter(e["outcome"] for e in results.values())
    total_s = sum(e.get("duration_s", 0.0) for e in results.values())
    pythons = sorted({e.get("python", "?") for e in results.values()})
    dates = sorted(e.get("when", "") for e in results.values())
    minutes = f"{max(1, round(total_s / 60 + 0.49))} min"

    out = [INTRO.replace("{minutes}", minutes)]
    out.append(
        f"**{len(results)} cases: {counts['pass']} pass, {counts['xfail']} xfail (known "
        f"defects)"
        + "".join(f", {counts[k]} {k}" for k in ("fail", "xpass", "skip") if counts.get(k))
        + f".** Last run: Python {', '.join(pythons)}, {dates[0][:10] if dates else '?'}"
        f"{' to ' + dates[-1][:10] if dates and dates[-1][:10] != dates[0][:10] else ''}.\n"
    )
    for module in order:
        entries = sorted(by_module[module], key=lambda e: e.get("index", 0))
        out.append(f"## {entries[0]['section']}\n")
        about = entries[0].get("about", "")
        if about:
            out.append(f"{_text(about)}\n")
        out.append("| case | what the clients saw | result |")
        out.append("|---|---|---|")
        for entry in entries:
            out.append(
                f"| {_cell(entry['case'])} | {_cell(entry.get('saw', ''))} | "
                f"{_cell(_result(entry))} |"
            )
        out.append("")
    for name in APPENDICES:
        path = HERE / name
        if path.exists():
            out.append(path.read_text().rstrip() + "\n")
    out.append("## Exit statuses\n")
    out.append("What the signal, deadline, workers and bad-input cases assert:\n")
    out.append("| situation | exit status of `graceful run` |")
    out.append("|---|---|")
    out.extend(f"| {_cell(what)} | {_cell(status)} |" for what, status in EXIT_STATUSES)
    out.append("")
    xfails = [e for e in results.values() if e["outcome"] in ("xfail", "xpass", "fail")]
    if xfails:
        out.append("## Known defects\n")
        out.append("Each is a strict xfail above; the reason says what is wrong.\n")
        reasons: dict[str, list[str]] = collections.defaultdict(list)
        for entry in xfails:
            reasons[entry.get("reason") or f"{entry['outcome']}"].append(entry["case"])
        for reason, cases in reasons.items():
            out.append(f"* {_text(reason)}" + (f" ({len(cases)} cases)" if len(cases) > 1 else ""))
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str]) -> int:
    source = Path(argv[0]) if argv else HERE / ".results.json"
    target = Path(argv[1]) if len(argv) > 1 else ROOT / "docs" / "reliability.md"
    if not source.exists():
        print(f"{source} not found: run python -m pytest tests/faults first", file=sys.stderr)
        return 2
    results = json.loads(source.read_text())
    target.write_text(render(results))
    print(f"wrote {target} ({len(results)} cases)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
