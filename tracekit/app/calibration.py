"""The rank-side calibration of a run (tracekit/dlrm/calibrate.py, which imports torch) as a command:
its inputs read from the run (analyses.run_sizes), its file written into it, and the subprocess
`python -m tracekit.app.calibration --run RUN` that `tracekit analyze` and `tracekit optimize` start
where RUN has no analysis/calibration.json yet, torch is importable and this host recorded RUN. They
start it once the analysis holds the rows' counts (analyses.row_totals, so that the calibration reads
them rather than the accesses again) and wait for it where the time model first reads its file
(analyses.network); it measures CPU time, so running beside the analysis moves its figures no more
than they move between runs alone (bench/RESULTS.md §37).

    result = calibrate(read_inputs("runs/base"))   # tracekit.dlrm.calibrate.calibrate
    write(Path("runs/base"), result)               # RUN/analysis/calibration.json
    job = pending(Path("runs/base"))   # a Calibration to run; a note saying why none can; None: done
    job.start(row_totals)              # in the background
    note = job.wait()                  # None: written; else why not
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tracekit import manifest
from tracekit.errors import TracekitError
from tracekit.files import write_text
from tracekit.schema import CALIBRATION_PATH

if TYPE_CHECKING:
    from tracekit.dlrm.calibration_inputs import Inputs

CALIBRATE_TIMEOUT_S = 120  # the subprocess; it takes ~10-25 s on a 2-core machine


class Calibration:
    """The calibration subprocess of one run: started once, waited for once (its note kept), stopped
    if the analysis ends first."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self._process: subprocess.Popen | None = None
        self._stderr = None
        self._started = 0.0
        self._note: str | None = None
        self._done = False

    def start(self, row_totals: Path | None = None) -> None:
        """Start the subprocess; with `row_totals`, it reads the rows' counts from there."""
        if self._process is not None or self._done:
            return
        command = [sys.executable, "-m", "tracekit.app.calibration", "--run", str(self.run_dir)]
        if row_totals is not None:
            command += ["--row-totals", str(row_totals)]
        self._stderr = tempfile.TemporaryFile()
        self._started = time.monotonic()
        self._process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=self._stderr)

    def wait(self) -> str | None:
        """Wait for the subprocess (started here if it was not) and return None where it wrote the file,
        else why not; again: the same answer."""
        if self._done:
            return self._note
        self.start()
        left = CALIBRATE_TIMEOUT_S - (time.monotonic() - self._started)
        try:
            code = self._process.wait(timeout=max(left, 0.0))
        except subprocess.TimeoutExpired:
            self.stop()
            self._note = f"rank-side calibration stopped after {CALIBRATE_TIMEOUT_S} s; {_rerun(self.run_dir)}"
            return self._finish()
        if code != 0:
            self._stderr.seek(0)
            last = (self._stderr.read().decode(errors="replace").strip().splitlines() or ["no output"])[-1]
            self._note = f"rank-side calibration failed (exit code {code}: {last}); {_rerun(self.run_dir)}"
        return self._finish()

    def stop(self) -> None:
        """Kill the subprocess if it still runs (the analysis ended before it was waited for)."""
        if self._process is not None and self._process.poll() is None:
            self._process.kill()
            self._process.wait()
        if not self._done:
            self._note = self._note or "rank-side calibration stopped: the analysis ended first"
            self._finish()

    def _finish(self) -> str | None:
        self._done = True
        if self._stderr is not None:
            self._stderr.close()
        return self._note


def pending(run_dir: Path) -> Calibration | str | None:
    """A Calibration to run where RUN has none, torch is importable and this host recorded RUN; a note
    saying why none can run; None where RUN has its calibration (or analyze will say what is wrong
    with the run)."""
    if (run_dir / CALIBRATION_PATH).is_file():
        return None
    try:
        hosts = manifest.read(run_dir).hosts
    except TracekitError:
        return None
    host = socket.gethostname()
    if importlib.util.find_spec("torch") is None:
        return f"rank-side costs not calibrated: torch is not importable here; {_rerun(run_dir)}"
    if host not in hosts:
        return (f"rank-side costs not calibrated: {host} did not record this run ({', '.join(hosts) or 'no host'}); "
                f"{_rerun(run_dir)}")
    return Calibration(run_dir)


def _rerun(run_dir: Path) -> str:
    return f"`tracekit calibrate {shlex.quote(str(run_dir))}` on the host that recorded it writes it"


def read_inputs(run_dir: str | os.PathLike, row_totals: str | os.PathLike | None = None) -> Inputs:
    """The calibration's inputs from the run at `run_dir` (analyses.run_sizes): the rows' counts from
    `row_totals` where given (the Parquet file analyze keeps, analyses.row_totals), else the accesses."""
    from analyses.run_sizes import run_sizes
    from tracekit.dlrm.calibration_inputs import make_inputs

    sizes = run_sizes(run_dir, row_totals)
    return make_inputs(sizes.tables, sizes.samples, sizes.row_counts, world_size=sizes.world_size,
                       optimizer=sizes.optimizer, omp_threads=sizes.omp_threads, run=sizes.run)


def write(run_dir: str | os.PathLike, result: dict) -> Path:
    """Write `result` to RUN/analysis/calibration.json atomically (temporary file, then rename)."""
    return write_text(Path(run_dir) / CALIBRATION_PATH, json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    from tracekit.dlrm.calibrate import REPEATS, calibrate

    parser = argparse.ArgumentParser(prog="python -m tracekit.app.calibration",
                                     description="Calibration: the seconds each policy's code path adds on a rank "
                                                 "per training step, measured on this machine.")
    parser.add_argument("--run", required=True, help="the recorded run whose sizes are calibrated")
    parser.add_argument("--json", action="store_true", help="print the JSON on stdout")
    parser.add_argument("--repeats", type=int, default=REPEATS, help="timings per point (medians)")
    parser.add_argument("--row-totals", help="the rows' counts analyze keeps (RUN/analysis/increments/"
                                             "row_totals.parquet), read instead of the accesses")
    args = parser.parse_args(argv)
    try:
        result = calibrate(read_inputs(args.run, args.row_totals), repeats=args.repeats,
                           progress=lambda what: print(f"calibrating: {what}", file=sys.stderr, flush=True))
    except TracekitError as err:
        print(f"calibrate: error: {err}", file=sys.stderr)
        return 1
    path = write(args.run, result)
    print(json.dumps(result) if args.json else f"wrote {path} in {result['seconds']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
