"""``graceful {run,demo}`` — also ``python -m graceful``."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ._cli.version import version_text

if TYPE_CHECKING:
    import click

USAGE = """usage: graceful {run,demo} ... | --version

  run MODULE:APP   serve an ASGI app with graceful shutdown (graceful run --help)
  demo             a simulated rolling restart, stock vs graceful (graceful demo --help)

shell completion (click's): eval "$(_GRACEFUL_COMPLETE=bash_source graceful)"
  (zsh_source, fish_source for zsh and fish)
"""

#: The variable of click's shell completion for the ``graceful`` script.
COMPLETE_VAR = "_GRACEFUL_COMPLETE"


#: The packages ``--version`` reports beside graceful, when installed.
def _completion() -> int:
    """Answer the shell's completion request (click's protocol, ``_GRACEFUL_COMPLETE``):
    the subcommands, then ``graceful run``'s options (ours and uvicorn's) and choices,
    ``graceful demo``'s options."""
    import click

    from ._cli.command import build_command

    @click.group(name="graceful")
    @click.version_option(message=version_text())
    def group() -> None:
        pass  # pragma: no cover - completion only

    group.add_command(build_command(), "run")
    group.add_command(_demo_command(), "demo")
    try:
        group.main(prog_name="graceful", complete_var=COMPLETE_VAR)
    except SystemExit as exc:
        return int(exc.code or 0)
    return 0  # pragma: no cover - click's main exits


def _demo_command() -> click.Command:
    """``graceful demo``'s argparse options as a click command, for completion."""
    import click

    try:
        from ._demo import build_parser
    except ImportError:  # without the demo extra: no options to complete
        return click.Command("demo", help="a simulated rolling restart")
    params: list[click.Parameter] = []
    for action in build_parser()._actions:
        flags = [f for f in action.option_strings if f.startswith("--")]
        if not flags or flags == ["--help"]:
            continue
        params.append(click.Option(flags, is_flag=action.nargs == 0, help=action.help))
    return click.Command("demo", params=params, help="a simulated rolling restart")


def main(argv: Sequence[str] | None = None) -> int:
    """Dispatch to a subcommand; each owns its own argument parser."""
    args = list(sys.argv[1:] if argv is None else argv)
    if argv is None and COMPLETE_VAR in os.environ:
        return _completion()
    if args[:1] == ["--version"]:
        print(version_text())
        return 0
    if not args or args[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "run":
        try:
            from ._cli.run import main as run_main
        except ImportError as exc:  # a base install: no server, so no click either
            print(
                f"graceful run: error: no server is installed ({exc}): pip install "
                "'graceful-drain[uvicorn]' (or [hypercorn], [aiohttp])",
                file=sys.stderr,
            )
            return 2

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
