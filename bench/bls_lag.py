"""BLS with stragglers: measured makespans against the lag recurrence (bench/RESULTS.md §11).

    .venv/bin/python bench/bls_lag.py [--world 4] [--steps 200] [--bounds 0,1,2,4,8] [--probability 0.1]
                                      [--repeats 3] [--out DIR]

Every run is `train.py --inference` on the same model and data, recorded (the same tracing cost
for all), one gloo rank a process on CPU.
1. Balanced, synchronous collectives: its step time D becomes the straggler delay; from its trace,
   per rank and step, the compute c and the collectives' transfer x (analyses.policies.lag.work_matrix).
2. Balanced, lag bound max(--bounds), against the recurrence on the balanced c and x (the target: no
   gain, no loss; the exchange thread may gain what it overlaps).
3. Stragglers `--probability`:D, synchronous collectives: measured `sync`, and from its trace c and
   x; the recurrence at bound 0 replays it (a check of the model), and without a bound predicts the
   ideal: no synchronisation, each rank alone (its exchange overlapping its compute where a rank
   has a core or a GPU to spare, lag.overlaps). The ideal is also measured: a bound of every step.
4. Stragglers, each bound B (every rank meets the same delays: each draws on its own seeded
   generator): measured, predicted = the recurrence at B, its error, and the gap recovered =
   (sync − measured) / (sync − ideal), against the measured ideal and the predicted one.
With --unrecorded the makespans are measured untraced; the two synchronous runs also run recorded,
for the traces the recurrence replays.
Each repeat runs every variant once, in the same order, and predicts from its own traces; the
figures are medians over the repeats. The trace leaves out the first step (start-up); the
prediction fills it with each rank's median.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from analyses.context import open_context  # noqa: E402
from analyses.policies import lag  # noqa: E402
from analyses.timeline import compute as timeline  # noqa: E402
from tracekit import manifest  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--world", type=int, choices=(2, 4), default=4, help="ranks")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--bounds", default="0,1,2,4,8")
    p.add_argument("--probability", type=float, default=0.1)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--unrecorded", action="store_true",
                   help="measure makespans untraced (the two synchronous runs whose traces the recurrence replays "
                        "run once more, recorded)")
    p.add_argument("--out", type=Path, default=Path("/tmp/tracekit-bench-bls"))
    args = p.parse_args()
    bounds = [int(b) for b in args.bounds.split(",")]
    model = ["--preset", "criteo-kaggle", "--scale", "0.001", "--dim", "16", "--bottom-mlp", "64,16",
             "--top-mlp", "64,1", "--batch-size", "256", "--samples", str(args.steps * 256 * args.world),
             "--steps", str(args.steps), "--inference", "--json"]
    trace = Runner(args.out, args.world)
    run = Runner(args.out, args.world, record=not args.unrecorded)

    def traced(name: str, argv: list[str]) -> float:
        """A recorded run for its trace; its makespan, or an untraced run's with --unrecorded."""
        measured = trace(name, argv)["makespan_s"]
        return run(name, argv)["makespan_s"] if args.unrecorded else measured

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, gloo on CPU, "
          f"{args.world} ranks; criteo-kaggle x 0.001, dim 16, batch 256 per rank, {args.steps} iterations, "
          f"{'measured untraced' if args.unrecorded else 'recorded'}")

    largest = max(bounds)
    # the straggler delay: one balanced synchronous step, from a first run, the same for every repeat
    delay_ms = run("calibrate", model)["makespan_s"] / args.steps * 1e3
    straggler = f"{args.probability}:{delay_ms:.1f}"
    stragglers = [*model, "--straggler", straggler]
    repeats = []
    for r in range(args.repeats):  # each repeat runs every variant once, in the same order
        # 1-2. balanced: a bound against the synchronous collectives
        plain = traced(f"r{r}-balanced-sync", model)
        c_b, x_b = _work(args.out / f"r{r}-balanced-sync", args.steps)
        # the exchange thread overlaps the compute only where a rank has a core (or a GPU) to spare
        overlap = lag.overlaps(manifest.read(args.out / f"r{r}-balanced-sync"))
        balanced = run(f"r{r}-balanced-bound{largest}", [*model, "--lag-bound", str(largest)])["makespan_s"]
        # 3. stragglers, synchronous collectives: measured, and its trace's compute and transfer
        sync = traced(f"r{r}-sync", stragglers)
        c, x = _work(args.out / f"r{r}-sync", args.steps)
        # the ideal: no rank ever waits for another's progress (a bound of every step)
        ideal = run(f"r{r}-unbounded", [*stragglers, "--lag-bound", str(args.steps)])["makespan_s"]
        rows = {"sync": (sync, lag.replay(c, 0, x, overlap=overlap)), "ideal": (ideal, lag.replay(c, None, x, overlap=overlap)),
                "balanced-sync": (plain, lag.replay(c_b, 0, x_b, overlap=overlap)),
                f"balanced-bound{largest}": (balanced, lag.replay(c_b, largest, x_b, overlap=overlap))}
        # 4. stragglers, each bound
        for bound in bounds:
            rows[f"bound{bound}"] = (run(f"r{r}-bound{bound}", [*stragglers, "--lag-bound", str(bound)])["makespan_s"],
                                     lag.replay(c, bound, x, overlap=overlap))
        repeats.append({"rows": rows, "compute_s": float(c.mean()), "exchange_s": float(x.mean()), "overlap": overlap})

    def median(name: str, i: int) -> float | None:
        values = [rep["rows"][name][i] for rep in repeats if rep["rows"][name][i] is not None]
        return float(np.median(values)) if values else None

    def recovered(name: str, i: int) -> float | None:  # per repeat, then the median; i: the ideal measured (0) or predicted (1)
        gaps = [(rep["rows"]["sync"][0] - rep["rows"][name][0]) / (rep["rows"]["sync"][0] - rep["rows"]["ideal"][i])
                for rep in repeats if rep["rows"]["sync"][0] > rep["rows"]["ideal"][i]]
        return float(np.median(gaps)) if gaps else None

    overlap = repeats[0]["overlap"]
    print(f"step time D {delay_ms:.1f} ms (balanced, synchronous); stragglers {straggler} (PROB:DELAY_MS); "
          f"per step: compute {np.median([r['compute_s'] for r in repeats]) * 1e3:.2f} ms, exchange "
          f"{np.median([r['exchange_s'] for r in repeats]) * 1e3:.2f} ms (sync traces); the recurrence with the "
          f"exchange {'overlapping the compute' if overlap else 'in series with the compute (one core a rank)'}; "
          f"medians of {args.repeats} repeats")
    print(f"{'run':<22} {'measured s':>10} {'predicted s':>11} {'error':>7} {'gap recovered: of the measured ideal':>37} "
          f"{'of the predicted':>16}")
    table = []
    for name in repeats[0]["rows"]:
        measured, predicted = median(name, 0), median(name, 1)
        error = float(np.median([rep["rows"][name][0] / rep["rows"][name][1] - 1 for rep in repeats]))
        gaps = [recovered(name, i) if name.startswith("bound") else None for i in (0, 1)]
        table.append({"run": name, "measured_s": measured, "predicted_s": predicted, "error": error,
                      "gap_recovered": gaps[0], "gap_recovered_predicted_ideal": gaps[1]})
        print(f"{name:<22} {measured:10.3f} {predicted:11.3f} {error:+7.1%} "
              + " ".join(f"{'' if g is None else f'{g:.0%}':>{w}}" for g, w in zip(gaps, (37, 16))))
    b_sync, b_bound = median("balanced-sync", 0), median(f"balanced-bound{largest}", 0)
    print(f"balanced: bound {largest} against synchronous {b_bound / b_sync - 1:+.1%} (medians)")
    (args.out / "results.json").write_text(json.dumps({
        "world": args.world, "steps": args.steps, "cores": os.cpu_count(), "straggler": straggler,
        "repeats": repeats, "medians": table}, indent=1))


class Runner:
    """Run `train.py` on `world` ranks, recorded under out/NAME (or not, `record` False); returns the
    run's metrics (the manifest's, or the JSON line train.py prints)."""

    def __init__(self, out: Path, world: int, record: bool = True) -> None:
        self.out, self.world, self.record = out, world, record

    def __call__(self, name: str, argv: list[str]) -> dict:
        run_dir = self.out / name
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={self.world}",
                   "train.py", *argv]
        if self.record:
            command = [sys.executable, "-m", "tracekit", "record", "-o", str(run_dir), "--force", "--lookup-every", "0",
                       "--", *command]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"{name}: exit {done.returncode}\n{done.stderr[-4000:]}")
        if self.record:
            return manifest.read(run_dir).metrics
        return json.loads(done.stdout.strip().splitlines()[-1])


def _work(run_dir: Path, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """c and x (ranks × steps) from a recorded run's timeline, the warm-up steps filled."""
    with open_context(run_dir) as ctx:
        c, x, _, _ = lag.work_matrix(timeline(ctx).tables["timeline"])
    return _fill_warmup(c, steps), _fill_warmup(x, steps)


def _fill_warmup(m: np.ndarray, steps: int) -> np.ndarray:
    """ranks × replayed steps, padded to `steps` with each rank's median (the warm-up steps)."""
    missing = steps - m.shape[1]
    return np.hstack([np.repeat(np.median(m, axis=1, keepdims=True), missing, axis=1), m]) if missing > 0 else m


if __name__ == "__main__":
    main()
