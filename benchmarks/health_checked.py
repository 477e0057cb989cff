"""A rolling restart behind a balancer that only health-checks, side by side.

    python benchmarks/health_checked.py [--repeats 3]

The scenario of ``tests/balancers/test_health_checked_rollout.py``: an L4 balancer that
health-checks ``/readyz`` every 2 s on a new connection, marks a backend down after 3
failures and up after 2 successes, never retries; one request every 1.5 s over two
backends (one per backend every 3 s).  Printed per server: failed requests and the old
backend's exit after its SIGTERM (min / median / max over the repeats).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.balancers.test_health_checked_rollout import SETUPS, _rolling_restart


def spread(values: list[float], fmt: str = "{:g}") -> str:
    return " / ".join(fmt.format(v) for v in (min(values), statistics.median(values), max(values)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print("| server | failed requests | of | exit after SIGTERM, s |")
    print("|---|---|---|---|")
    for setup in SETUPS:
        failed: list[float] = []
        total: list[float] = []
        exits: list[float] = []
        for _ in range(args.repeats):
            traffic, old = _rolling_restart(setup)
            failed.append(len(traffic.failures))
            total.append(len(traffic.failures) + traffic.served)
            exits.append(old.exited_at - old.signalled_at)
        print(
            f"| {setup} | {spread(failed)} | {spread(total)} | {spread(exits, '{:.1f}')} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
