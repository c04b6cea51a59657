"""How long `tracekit report` takes on the criteo-kaggle preset run of `make demo`, and how big the page is.

    python bench/report_speed.py [RUN ...]     # default: runs/demo/base and the policy runs beside it

Three runs, the median printed with the machine (target: ≤ 10 s and ≤ 8 MB). The run
must be analysed already (`make demo` does it), so this times the report alone.
"""

from __future__ import annotations

import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from reports import write_report  # noqa: E402

REPEATS = 3


def main(argv: list[str]) -> int:
    demo = REPO / "runs" / "demo"
    runs = argv or [str(demo / name) for name in ("base", "replication", "schedule", "combined")
                    if (demo / name / "manifest.json").is_file()]
    if not runs:
        print("no run: `make demo` first, or name runs", file=sys.stderr)
        return 2
    times, size = [], 0
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(REPEATS):
            start = time.perf_counter()
            path = write_report(runs, Path(tmp) / "report.html")
            times.append(time.perf_counter() - start)
            size = path.stat().st_size
    print(f"report of {', '.join(runs)}")
    print(f"  {_cpu()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}")
    print(f"  time: median {statistics.median(times):.2f} s of {REPEATS} ({', '.join(f'{t:.2f}' for t in times)});"
          f" size {size / 1e6:.2f} MB")
    return 0


def _cpu() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next(line.split(":", 1)[1].strip() for line in lines if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.machine()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
