"""Render ``docs/configuration.md`` from the option declarations in ``graceful._options``.

    python tools/gen_configuration.py          # rewrite the page
    python tools/gen_configuration.py --check  # exit 1 if the page is out of date

The page is never edited by hand: every option is declared once in
``src/graceful/_options/_table.py`` (``OPTIONS``) and everything here is read from those
declarations — the flag, the variable, the default as ``--help`` shows it, the values the
option's parser accepts (taken from the parser's own refusal of a value no parser
accepts, so a new parser documents itself), the help line, where the value goes and
what gunicorn does with it.  ``tests/test_docs.py`` fails when the committed page differs
from what this script renders.

The "Under gunicorn" section is marked as a snippet section, and ``docs/gunicorn.md``
includes it, so the gunicorn page and this one cannot disagree.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"
COMMAND = "python tools/gen_configuration.py"

#: Headings and introductions of the known targets (where an option's value goes); an
#: unknown target still gets a section, titled by its name.
TARGETS: dict[str, tuple[str, str]] = {
    "run": (
        "The server and its processes",
        "Read by `graceful run` itself.",
    ),
    "policy": (
        "Shutdown policy",
        "How long the server keeps accepting after SIGTERM ([choosing a policy](policies.md)); "
        "passed to `graceful.policy_from_name()`. A policy option left unset takes the chosen "
        "policy's own default.",
    ),
    "coordinator": (
        "Deadlines",
        "Passed to `graceful.ShutdownCoordinator`.",
    ),
    "middleware": (
        "Health endpoints and websockets",
        "Passed to `graceful.asgi.GracefulMiddleware` ([ASGI middleware](asgi.md)).",
    ),
    "uvicorn": (
        "uvicorn",
        "Passed to `uvicorn.Config` ([uvicorn and graceful run](uvicorn.md)).",
    ),
}
#: Targets the gunicorn workers build from ``GRACEFUL_*`` (see ``gunicorn_values``).
GUNICORN_TARGETS = ("policy", "coordinator", "middleware")
#: ``--help`` points at sections of its epilog; the page points at the pages that say it.
SEE_ALSO: dict[str, str] = {
    "workers": "[`--workers`](reference.md#-workers-n)",
    "policies": "[choosing a policy](policies.md)",
}
#: A value no parser accepts: its refusal says what the parser does accept.
_PROBE = "\x00"


def _cell(text: object) -> str:
    """Text safe inside a Markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _code(text: object) -> str:
    return f"`{text}`" if text != "" else ""


def _attr(opt: Any, *names: str, default: Any = None) -> Any:
    """The first of ``names`` that ``opt`` has (declarations may grow new fields)."""
    for name in names:
        value = getattr(opt, name, None)
        if value is not None:
            return value
    return default


def allowed_values(opt: Any) -> str:
    """What the option accepts, in the words of its parser's error message."""
    choices = _attr(opt, "choices")
    parse = _attr(opt, "parse")
    if choices:
        text = ", ".join(f"`{c}`" for c in choices)
        try:  # uvicorn's --http and --loop also take import strings
            parse("package.module:attribute")
        except Exception:
            return text
        return f"{text} or an import string `module:attribute`"
    if parse is None:
        return ""
    try:
        parse(_PROBE)
    except ValueError as exc:
        reason = " ".join(str(exc).split())
    except Exception:  # a parser that does not speak ValueError: say nothing
        return ""
    else:
        return "any text"
    reason = re.sub(r",? got .*$", "", reason)
    if "; expected " in reason:
        reason = reason.split("; expected ", 1)[1]
    reason = re.sub(r"^(must be |one of )+", "", reason)
    if re.match(r"(one of )?[\w.-]+(, [\w.-]+)+$", reason):
        reason = ", ".join(f"`{v}`" for v in reason.removeprefix("one of ").split(", "))
    return reason


def default_text(config: Any, opt: Any) -> str:
    help_default = getattr(config, "help_default", None)
    if help_default is not None:
        return str(help_default(opt))
    return str(_attr(opt, "default", default="none"))


def option_text(opt: Any) -> str:
    """The flag and the kind of value; the choices themselves are in the values column
    (a ``{a,b,c}`` metavar has nowhere to wrap in a table cell)."""
    flag = _attr(opt, "flag", default="--" + opt.name.replace("_", "-"))
    if _attr(opt, "switch"):
        return f"`{flag}`, `--no-{flag[2:]}`"
    metavar = _attr(opt, "metavar", default="")
    if metavar.startswith("{"):
        metavar = "CHOICE"
    return f"`{flag} {metavar}`".replace(" `", "`")


def _target(opt: Any) -> str:
    target = _attr(opt, "target")
    if target is None:
        to = _attr(opt, "to", default=("other",))
        target = to[0]
    return str(target)


def help_text(opt: Any) -> str:
    """The help line, its references to ``--help``'s epilog made links."""

    def link(match: re.Match[str]) -> str:
        target = SEE_ALSO.get(match[1])
        return f" (see {target})" if target else ""

    return re.sub(r" \(see '([^']+)' below\)", link, str(_attr(opt, "help", default="")))


def _command(text: str) -> str:
    """``-k X for h11`` as code followed by its condition."""
    command, sep, condition = text.partition(" for ")
    return _code(command) + (f" for {condition}" if sep else "")


def gunicorn_text(opt: Any) -> str:
    """What the gunicorn workers do with the option's variable."""
    owner = _attr(opt, "gunicorn")
    if owner is not None:
        return f"ignored, with a warning: use {_command(owner)}"
    if _target(opt) in GUNICORN_TARGETS:
        return "honoured"
    return "not used"


def servers_text(config: Any, opt: Any) -> str | None:
    """The ``graceful run --server`` choices that take the option, if declared."""
    servers = _attr(opt, "servers")
    if servers is None:
        return None
    if tuple(servers) == tuple(getattr(config, "SERVERS", ())):
        return "all"
    return ", ".join(servers)


def python_text(config: Any, opt: Any) -> str:
    """The option's keyword in the Python API's run functions, if they take it."""
    python_options = getattr(config, "python_options", None)
    if python_options is None or opt not in python_options():
        return ""
    return _code(opt.python)


def _table(config: Any, options: Iterable[Any]) -> list[str]:
    options = list(options)
    with_servers = any(servers_text(config, o) is not None for o in options)
    with_python = any(python_text(config, o) for o in options)
    header = ["option", "variable"]
    if with_python:
        header.append("Python")
    header += ["default", "values", "what"]
    if with_servers:
        header.append("servers")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for opt in options:
        cells = [option_text(opt), _code(opt.env)]
        if with_python:
            cells.append(python_text(config, opt))
        cells += [
            default_text(config, opt),
            allowed_values(opt),
            help_text(opt),
        ]
        if with_servers:
            cells.append(servers_text(config, opt) or "all")
        lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return lines


def _error_examples(config: Any) -> list[str]:
    """One-line errors of ``graceful run``, produced by the real checks."""
    names = {o.name for o in config.OPTIONS}
    attempts: list[tuple[dict[str, str], dict[str, str]]] = []
    if "idle" in names:
        attempts.append(({}, {config.option("idle").env: "abc"}))
    if {"grace_period", "kill_margin"} <= names:
        attempts.append(({"grace_period": "1"}, {}))
    lines = []
    for given, environ in attempts:
        try:
            config.resolve(given, environ)
        except config.ConfigError as exc:
            lines.append(f"graceful run: error: {exc}")
    return lines


def _python_intro(config: Any) -> list[str]:
    """How the Python API takes the options (the "Python" column), if it does."""
    python_options = getattr(config, "python_options", None)
    if python_options is None:
        return []
    return [
        "In Python, `graceful.uvicorn.run()` and `serve()`, `graceful.hypercorn.run()` and",
        "`graceful.aiohttp.run_app()` take graceful's own options as keyword arguments by",
        "the names in the *Python* column, checked by the same code as the command line:",
        "a bad value is a `TypeError` or `ValueError` naming the keyword, the value and",
        "what is allowed. There, `GRACEFUL_*` variables are not read (except",
        "`GRACEFUL_GRACE_PERIOD`, which every coordinator reads when given no grace",
        "period). The server's own settings (`host`, `port`, `log_level`, …) keep the",
        "server's names: `uvicorn.Config`'s, hypercorn's `Config`, `run_app`'s.",
        "",
        "```python",
        '--8<-- "examples/uvicorn_run.py:run"',
        "```",
        "",
    ]


def render() -> str:
    """The page, from the declarations in the installed or checked-out ``graceful``."""
    sys.path.insert(0, str(ROOT / "src"))
    try:
        from graceful import _options as config
    finally:
        sys.path.pop(0)
    options = list(config.OPTIONS)
    out = [
        "---",
        "hide:",
        "  - toc",  # the tables need the width
        "---",
        "",
        f"<!-- Generated from src/graceful/_options/_table.py by {COMMAND}: do not edit. -->",
        "",
        "# Configuration",
        "",
        "Every option of `graceful run` is also an environment variable: `--drain-timeout 20`",
        "is `GRACEFUL_DRAIN_TIMEOUT=20`.  The command line wins over the environment, which",
        "wins over the default; `graceful run --help` lists the same options.  The",
        "[gunicorn workers](gunicorn.md) read the same variables ([below](#under-gunicorn)).",
        "",
        *_python_intro(config),
        "A bad value — from the command line or the environment — is one line naming the",
        "option as it was given, and exit status 2, before anything starts:",
        "",
        "```text",
        *_error_examples(config),
        "```",
        "",
        "A `GRACEFUL_*` variable that is no option is ignored with one warning at start-up",
        "that names the closest option:",
        "",
        "```text",
        *(f"WARNING graceful: {w}" for w in config.unknown_variables({"GRACEFUL_IDEL": "3"})),
        "```",
        "",
    ]
    targets: dict[str, list[Any]] = {}
    for opt in options:
        targets.setdefault(_target(opt), []).append(opt)
    order = [t for t in TARGETS if t in targets] + [t for t in targets if t not in TARGETS]
    for target in order:
        title, intro = TARGETS.get(target, (target, ""))
        out += [f"## {title}", ""]
        if intro:
            out += [intro, ""]
        out += [*_table(config, targets[target]), ""]

    honoured = [o for o in options if gunicorn_text(o) == "honoured"]
    owned = [o for o in options if _attr(o, "gunicorn") is not None]
    out += [
        "## Under gunicorn",
        "",
        "<!-- --8<-- [start:gunicorn] -->",
        "The graceful gunicorn workers (uvicorn, hypercorn and aiohttp) read these variables",
        "and check them once, in the master, before any worker boots:",
        "",
        ", ".join(f"`{o.env}`" for o in honoured) + ".",
        "",
    ]
    if owned:
        out += [
            "gunicorn owns the following settings; their variables are ignored under gunicorn,",
            "with a warning:",
            "",
            "| variable | under gunicorn use |",
            "|---|---|",
            *(f"| `{o.env}` | {_cell(_command(o.gunicorn))} |" for o in owned),
            "",
        ]
    out += ["<!-- --8<-- [end:gunicorn] -->", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    page = render()
    if args.check:
        current = PAGE.read_text() if PAGE.exists() else ""
        if current != page:
            print(f"{PAGE.relative_to(ROOT)} is out of date; run: {COMMAND}", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
