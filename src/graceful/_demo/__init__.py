"""``graceful demo``: a Kubernetes rolling restart on loopback, stock vs graceful.

Why a demo in the library
-------------------------
The failure graceful-drain prevents only shows under a real restart: real processes,
real sockets, real signals, a balancer that learns of the restart late.  A claim like
"zero failed requests" is worth what it costs to check, so the check ships with the
library and takes one command and half a minute.  It is built from parts that each
explain themselves:

* ``graceful._demo._scenario`` — the rolling restart, and why it is staged so;
* ``graceful._demo._balancer`` — the L4 balancer that is late to forget a backend;
* ``graceful._demo._clients`` — the load, and what counts as a failure;
* ``graceful._demo._backend`` — graceful backends that report their phases as events;
* ``graceful._demo._report`` and ``graceful._demo._plot`` — progress, table, plot;
* ``graceful._demo._kube``, ``graceful._demo._kubelet``,
  ``graceful._demo._kuberollout`` and ``graceful._demo._kubedemo`` — ``--kubernetes``:
  the same rollout through a real kube-apiserver, endpointslice controller and kube-proxy;
* ``graceful._demo.app`` — the tiny ASGI app uvicorn and hypercorn backends serve, and
  ``graceful._demo.aiohttp_app``, the same endpoints for aiohttp.

The default run is stock uvicorn and each policy on uvicorn; ``--servers`` adds stock
and graceful hypercorn, aiohttp, granian and gunicorn's WSGI workers.  This module is
only the command line; ``benchmarks/rollout.py`` drives the same scenario over a matrix
of delays and client mixes.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ._scenario import Outcome

# The scenario and the report are imported where the command needs them: every backend
# and Kubernetes pod of the demo imports this package (``graceful._demo.app``), and
# neither needs them (about 25 ms of each one's start).

__all__ = ("build_parser", "main")


def build_parser() -> argparse.ArgumentParser:
    """The ``graceful demo`` argument parser (ranges are checked by ``parse``)."""
    from ._scenario import POLICIES, SERVERS

    parser = argparse.ArgumentParser(
        prog="graceful demo",
        description="A simulated Kubernetes rolling restart on loopback: the stock server "
        "and each graceful policy, side by side.",
    )
    parser.add_argument(
        "--servers",
        default=",".join(SERVERS),
        help="comma-separated, from: uvicorn, graceful:POLICY, hypercorn, "
        "graceful-hypercorn:POLICY, aiohttp, graceful-aiohttp:POLICY, granian, "
        "graceful-granian:POLICY, gunicorn-sync, graceful-sync:POLICY, gunicorn-gthread, "
        "graceful-gthread:POLICY; POLICY: "
        f"{', '.join(POLICIES)} (default: %(default)s)",
    )
    parser.add_argument(
        "--propagation-delay",
        type=float,
        default=1.5,
        help="seconds the balancer keeps routing to the terminating backend",
    )
    parser.add_argument(
        "--grace-period",
        type=float,
        default=None,
        help="seconds from SIGTERM to SIGKILL (default: 6; with --kubernetes 15, the pod's "
        "terminationGracePeriodSeconds)",
    )
    parser.add_argument(
        "--idle", type=float, default=1.0, help="accept-until-idle's idle window, seconds"
    )
    parser.add_argument("--warmup", type=float, default=1.5, help="load before SIGTERM, s")
    parser.add_argument("--tail", type=float, default=0.5, help="load after A ended, s")
    parser.add_argument("--keepalive-clients", type=int, default=4)
    parser.add_argument("--fresh-clients", type=int, default=4)
    parser.add_argument("--long-requests", type=int, default=2)
    parser.add_argument("--long-request-s", type=float, default=2.0)
    parser.add_argument("--websockets", type=int, default=0, help="websocket echo clients")
    parser.add_argument("--plot", default=None, help="write the timeline to FILE.svg or .png")
    parser.add_argument(
        "--plot-range",
        default=None,
        metavar="FROM,TO",
        help="the timeline's time axis, seconds from SIGTERM (default: the widest "
        "panel's; give the same to plots that are to be compared)",
    )
    parser.add_argument(
        "--json", default=None, metavar="FILE", help="also write the outcomes to FILE as JSON"
    )
    parser.add_argument(
        "--kubernetes",
        action="store_true",
        help="the rollout through a real control plane instead (kube-apiserver, the "
        "endpointslice controller, kube-proxy; root, binaries from tools/kube/build.sh)",
    )
    parser.add_argument(
        "--sync-period",
        type=float,
        default=5.0,
        help="with --kubernetes: kube-proxy's --iptables-min-sync-period, s",
    )
    return parser  # fmt: skip


def parse(argv: Sequence[str]) -> argparse.Namespace:
    """Parse and check the options; ``args.kinds`` are the servers to run, in order."""
    from ._scenario import ALL_SERVERS

    parser = build_parser()
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.servers.split(",") if n.strip()]
    unknown = [n for n in names if n not in ALL_SERVERS]
    if unknown or not names:
        parser.error(f"--servers: unknown {unknown!r}; choose from {', '.join(ALL_SERVERS)}")
    args.kinds = [ALL_SERVERS[n] for n in names]
    for kind in args.kinds:
        for module in kind.needs:
            if importlib.util.find_spec(module) is None:
                install = "flask" if module == "flask" else f"'graceful-drain[{module}]'"
                parser.error(f"--servers: {kind.name} needs {module}: pip install {install}")
    if args.grace_period is None:
        args.grace_period = 15.0 if args.kubernetes else 6.0
    for name in ("propagation_delay", "grace_period", "idle", "warmup", "tail", "long_request_s"):
        value = getattr(args, name)
        if not (0 <= value < 600):
            parser.error(f"--{name.replace('_', '-')}: must be 0 to 600 seconds, got {value}")
    for name in ("keepalive_clients", "fresh_clients", "long_requests", "websockets"):
        if not 0 <= getattr(args, name) <= 200:
            parser.error(f"--{name.replace('_', '-')}: must be 0 to 200")
    if not 0.1 <= args.sync_period <= 60:
        parser.error(f"--sync-period: must be 0.1 to 60 seconds, got {args.sync_period}")
    if args.kubernetes and (args.plot or args.json or args.websockets):
        parser.error("--kubernetes takes no --plot, --json or --websockets")
    if args.plot and not args.plot.endswith((".svg", ".png")):
        parser.error(f"--plot: must end in .svg or .png, got {args.plot!r}")
    if args.plot_range is not None:
        try:
            low, high = (float(v) for v in args.plot_range.split(","))
        except ValueError:
            parser.error(f"--plot-range: must be FROM,TO in seconds, got {args.plot_range!r}")
        if not -600 < low < 0 < high < 600:
            parser.error(
                f"--plot-range: FROM must be below 0 and TO above, got {args.plot_range!r}"
            )
        args.plot_range = (low, high)
    return args


async def _run(args: argparse.Namespace) -> list[Outcome]:
    from ._report import Progress
    from ._scenario import run_scenario

    outcomes = []
    with Progress(name_width=max(len(kind.name) for kind in args.kinds)) as progress:
        for kind in args.kinds:
            outcomes.append(await run_scenario(kind, args, progress))
            progress.done(kind)
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``graceful demo``."""
    args = parse(list(sys.argv[2:] if argv is None else argv))
    try:
        import rich  # noqa: F401
    except ImportError:
        print("graceful demo needs rich: pip install 'graceful-drain[demo]'", file=sys.stderr)
        return 2
    if args.kubernetes:
        from ._kubedemo import main as kubernetes_demo

        return kubernetes_demo(args)
    from ._report import print_table, write_json

    outcomes = asyncio.run(_run(args))
    print_table(outcomes, args)
    if args.json:
        write_json(outcomes, args.json)
    if args.plot:
        from ._plot import write_plot

        settings = (
            f"propagation delay {args.propagation_delay:g} s, grace period {args.grace_period:g} s"
        )
        if any(kind.policy == "accept-until-idle" for kind in args.kinds):
            settings += f", idle window {args.idle:g} s"
        write_plot(outcomes, args.plot, subtitle=settings, seconds=args.plot_range)
        print(f"timeline written to {args.plot}")
    return 0
