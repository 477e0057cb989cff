"""``graceful {run,demo}`` — also ``python -m graceful``."""

from __future__ import annotations

import sys
from collections.abc import Sequence

USAGE = """usage: graceful {run,demo} ...

  run MODULE:APP   serve an ASGI app with graceful shutdown (graceful run --help)
  demo             a simulated rolling restart, stock vs graceful (graceful demo --help)
"""


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a subcommand; each owns its own argument parser."""
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "run":
        from ._run import main as run_main

        return run_main(rest)
    if command == "demo":
        import importlib

        try:
            demo = importlib.import_module("graceful._demo")
        except ImportError as exc:
            print(f"graceful demo: {exc} (pip install 'graceful-drain[demo]')", file=sys.stderr)
            return 2
        return int(demo.main(rest) or 0)
    print(f"graceful: unknown command {command!r}\n{USAGE}", file=sys.stderr, end="")
    return 2


def _exit(code: int) -> None:
    """Exit without the interpreter's module teardown (tens of milliseconds with a web
    stack imported) once the server shut down: atexit handlers still run, streams and
    logging are flushed."""
    import atexit
    import logging
    import os

    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def entry_point() -> None:
    """The ``graceful`` console script."""
    _exit(main())


if __name__ == "__main__":
    entry_point()
