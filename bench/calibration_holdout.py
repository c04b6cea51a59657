"""The replication cost model (tracekit/dlrm/calibrate.py) against a point off its grid, per sync kind:
a wall-clock figure, so a benchmark's, not a test's.

    .venv/bin/python bench/calibration_holdout.py [--runs 5] [--repeats 15]

Records the tests' TINY trainer once (one process), then per run and sync kind: measures the
calibration's grid of (hot rows K, batch) points, fits the model on them, measures a point between the
grid's (the second and third K and batch) and sets the model's prediction beside it with the tolerance
3 · (the fit's residual + the point's noise). Prints one line per run and sync kind and the medians.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.recorded import TINY, record  # noqa: E402
from tracekit.app.calibration import read_inputs  # noqa: E402
from tracekit.dlrm import calibrate  # noqa: E402
from tracekit.policy import REPLICATION_SYNCS  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--repeats", type=int, default=15, help="timings per point")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        code, run = record(Path(tmp), sys.executable, str(REPO / "train.py"), *TINY)
        assert code == 0, "the TINY trainer failed"
        inputs = read_inputs(run)
        grid = calibrate.replication_grid(inputs)
        ks, batches = sorted({k for k, _ in grid}), sorted({b for _, b in grid})
        k, b = (ks[1] + ks[2]) // 2, (batches[1] + batches[2]) // 2
        print(f"{platform.processor() or platform.machine()}, grid {len(grid)} points, held-out K {k}, batch {b}")
        errors: dict[str, list[float]] = {sync: [] for sync in REPLICATION_SYNCS}
        within: dict[str, int] = {sync: 0 for sync in REPLICATION_SYNCS}
        for r in range(args.runs):
            for sync in REPLICATION_SYNCS:
                points = [calibrate.measure_replication_point(inputs, sync, kk, bb, repeats=args.repeats, seed=i)
                          for i, (kk, bb) in enumerate(grid)]
                model = calibrate.replication_model(points)
                held = calibrate.measure_replication_point(inputs, sync, k, b, repeats=args.repeats, seed=99 + r)
                predicted = calibrate.predict_replication(model, ids=held["ids"], hot=held["hot"], rows=held["rows"])
                tolerance = 3 * (model["residual_s"] + held["noise_s"])
                ok = abs(predicted - held["extra_s"]) <= tolerance
                within[sync] += ok
                errors[sync].append(predicted / held["extra_s"] - 1)
                print(f"run {r + 1} {sync}: predicted {predicted * 1e6:.1f} µs, measured {held['extra_s'] * 1e6:.1f} µs "
                      f"({errors[sync][-1]:+.1%}), tolerance ±{tolerance * 1e6:.1f} µs: {'within' if ok else 'OUT'}")
        for sync in REPLICATION_SYNCS:
            print(f"{sync}: median error {statistics.median(errors[sync]):+.1%}, within tolerance {within[sync]}/{args.runs}")


if __name__ == "__main__":
    main()
