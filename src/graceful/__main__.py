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
    stack imported) once the server shut down — only where that loses nothing.

    If a non-daemon thread is still alive (a ``concurrent.futures`` worker finishing its
    job, an application thread) the normal exit runs, which joins it.  Otherwise atexit
    handlers run, logging is shut down, and every open writable file object is flushed
    (``os._exit`` skips the finalisation that would flush their buffers).
    """
    import atexit
    import gc
    import io
    import logging
    import os
    import threading

    main_thread = threading.main_thread()
    if any(t is not main_thread and not t.daemon for t in threading.enumerate()):
        sys.exit(code)
    atexit._run_exitfuncs()
    logging.shutdown()
    for obj in gc.get_objects():
        try:
            # isinstance() of a dead weakref.proxy raises ReferenceError (websockets'
            # logger adapters leave such proxies in garbage cycles).
            if isinstance(obj, io.IOBase) and not obj.closed and obj.writable():
                obj.flush()
        except (OSError, ValueError, ReferenceError):
            pass
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def entry_point() -> None:
    """The ``graceful`` console script."""
    _exit(main())


if __name__ == "__main__":
    entry_point()
