"""Run every benchmark, one after the other (``nox -s bench``).

    python benchmarks/run.py [--quick]

``--quick`` shortens each one (fewer repeats, shorter runs) for a smoke check.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

FULL = {
    "tracking.py": [],
    "instructions.py": [],
    "exit_latency.py": ["--repeats", "5"],
    "overhead.py": ["--duration", "5", "--repeats", "5"],
    "scale.py": ["--connections", "10000", "--repeats", "3"],
    "rollout.py": ["--repeats", "3"],
}
QUICK = {
    "tracking.py": ["--requests", "200000", "--repeats", "3"],
    "instructions.py": ["--calls", "2000"],
    "exit_latency.py": ["--repeats", "2"],
    "overhead.py": ["--duration", "2", "--repeats", "1"],
    "scale.py": ["--connections", "2000", "--repeats", "1"],
    "rollout.py": ["--repeats", "1", "--delays", "1.5", "--mixes", "fresh"],
}


def main() -> int:
    plan = QUICK if "--quick" in sys.argv[1:] else FULL
    status = 0
    for script, options in plan.items():
        print(f"\n$ python benchmarks/{script} {' '.join(options)}", flush=True)
        status |= subprocess.run([sys.executable, str(HERE / script), *options]).returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
