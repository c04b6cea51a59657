"""The rank-side calibration a run's analysis starts from: `python -m tracekit.dlrm.calibrate --run
RUN` (tracekit/dlrm/calibrate.py, which imports torch) in a subprocess, where RUN has no
analysis/calibration.json yet, torch is importable and this host recorded RUN; `tracekit analyze`
and `tracekit optimize` call it first, analyses.network reads the file.

    note = calibrate_if_missing(Path("runs/base"))   # None: done (or there already); else why not
"""

from __future__ import annotations

import importlib.util
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from tracekit.errors import TracekitError
from tracekit.schema import CALIBRATION_PATH
from tracekit.store import read_manifest

CALIBRATE_TIMEOUT_S = 120  # analyze's calibration subprocess; it takes ~5-20 s on a 2-core machine


def calibrate_if_missing(run_dir: Path) -> str | None:
    """analyze's first step: `python -m tracekit.dlrm.calibrate --run RUN` where RUN has no calibration,
    torch is importable and this host recorded RUN. Returns a note saying why it did not run or failed
    (None when it ran, or RUN had one already); analyze goes on either way."""
    if (run_dir / CALIBRATION_PATH).is_file():
        return None
    try:
        hosts = read_manifest(run_dir).get("hosts") or []
    except TracekitError:
        return None  # analyze says what is wrong with the run
    host = socket.gethostname()
    rerun = f"`tracekit calibrate {shlex.quote(str(run_dir))}` on the host that recorded it writes it"
    if importlib.util.find_spec("torch") is None:
        return f"rank-side costs not calibrated: torch is not importable here; {rerun}"
    if host not in hosts:
        return f"rank-side costs not calibrated: {host} did not record this run ({', '.join(hosts) or 'no host'}); {rerun}"
    try:
        done = subprocess.run([sys.executable, "-m", "tracekit.dlrm.calibrate", "--run", str(run_dir)],
                              capture_output=True, text=True, timeout=CALIBRATE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"rank-side calibration stopped after {CALIBRATE_TIMEOUT_S} s; {rerun}"
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return f"rank-side calibration failed (exit code {done.returncode}: {last}); {rerun}"
    return None
