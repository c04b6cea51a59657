"""Model-quality predictions against a held-out seed (bench/RESULTS.md §32b): each lossy section's predicted eval AUC
change, from `tracekit optimize`'s calibration runs, against a run the calibration did not see.

    .venv/bin/python bench/quality_accuracy.py [--workloads NAME,...] [--out runs/quality_accuracy] [--resume]

For each workload (bench/prediction_accuracy.py's eight, at their step counts, and the Criteo
Kaggle layout x 0.01 at 400 steps), with `tracekit record`'s default recording settings:
1. the baseline is recorded and analysed with analyze's defaults (the quality budget an eval AUC loss of
   0.002);
2. every lossy section analyze derived (compression.dp, compression.mp, schedule: analyses.quality.LOSSY),
   not only those it would recommend on time, but one optimize would not re-run (a schedule under 1%
   all-hot samples: tracekit.app.optimize._why_not), is calibrated as `tracekit optimize` does it
   (tracekit/quality_runs.calibrate: seeds 0, 1, 2, each against its own baseline; DCT's keep ratios
   from the most compressive up until one keeps the budget), and the baseline is analysed again;
3. the held-out check: the baseline and each lossy section at the setting analyze then chose are run at
   seed HELD_OUT, which no calibration run used, and the section's measured eval AUC change against that
   baseline is set beside its prediction (the calibration seeds' mean, their range its interval).

The table: per workload and section, the setting, the predicted change [interval], whether it keeps the
budget at the interval's worst end, whether analyze recommends the section (time and quality), the
held-out change, and the targets: predicted within TOLERANCE of measured; a recommended section's
measured change within the budget. Eval is on EVAL_FRACTION of the samples, held out of training (the
prediction-accuracy bench uses 2%, which is ~600 samples on its smallest workload: an AUC measured on
so few moves by more than the budget between seeds). Rows go to OUT/results.jsonl as they are measured;
the table to OUT/table.md for bench/RESULTS.md. The runs measure no time, so this bench may share the
machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from analyses import quality  # noqa: E402
from tracekit import manifest  # noqa: E402
from tracekit.app.cluster import Cluster  # noqa: E402
from tracekit.figures import AUC_CHANGE  # noqa: E402
from tracekit.app.optimize import _why_not, _write_sections, record  # noqa: E402
from tracekit.policy import read_policy  # noqa: E402
from tracekit.app.quality_runs import SEEDS, calibrate  # noqa: E402
from prediction_accuracy import (WORKLOADS, Workload, cluster_unavailable, default_lookup_every, machine,  # noqa: E402
                                 named)

EVAL_FRACTION = 0.1
HELD_OUT = SEEDS  # the calibration runs seeds 0 .. SEEDS-1
TOLERANCE = 0.002  # the target: predicted cost within 0.002 AUC of the measured
KAGGLE = Workload("kaggle-x0.01", ("--preset", "criteo-kaggle", "--scale", "0.01"), 512, 2, "1gbit", 400,
                  "Criteo Kaggle layout x 0.01, dim 64 (bench/RESULTS.md §32's workload)")
ALL = (*WORKLOADS, KAGGLE)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default=",".join(w.name for w in ALL), help="comma-separated names")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "quality_accuracy", help="runs, results.jsonl, table.md")
    p.add_argument("--resume", action="store_true", help="keep OUT/results.jsonl's workloads; run only the others")
    args = p.parse_args()
    chosen = named(p, args.workloads, ALL)
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.jsonl"
    done = {}
    if args.resume and results.is_file():
        done = {r["workload"]: r for r in map(json.loads, results.read_text().splitlines())}
    elif results.exists():
        results.unlink()
    err = Console(stderr=True)
    header = machine()
    err.print(header)
    problem = cluster_unavailable()
    for w in chosen:
        if w.name in done:
            continue
        t0 = time.monotonic()
        row = ({"workload": w.name, "status": "skipped", "error": f"tracekit cluster cannot run here: {problem}"}
               if w.link and problem else measure(w, args.out / w.name, lambda what: err.print(f"{w.name}: {what}")))
        row.update(seconds=time.monotonic() - t0, steps=w.steps)
        with open(results, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        done[w.name] = row
    rows = [done[w.name] for w in ALL if w.name in done]
    Console(width=220).print(rich_table(rows))
    lines = [f"Measured {datetime.date.today()}: {header}; eval on {EVAL_FRACTION:.0%} of the samples; "
             f"calibration seeds 0-{SEEDS - 1}, held-out seed {HELD_OUT}.", "",
             *(f"- `{w.name}`: {w.world} ranks, {w.link or 'loopback'}, batch {w.batch} per rank, {w.steps} steps, "
               f"`{' '.join(w.args)}` ({done[w.name]['seconds'] / 60:.1f} min)" for w in ALL if w.name in done),
             "", markdown(rows), "", *summary(rows)]
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(summary(rows)))


def measure(w: Workload, folder: Path, say) -> dict:
    """Steps 1-3 of the module docstring for one workload: its row, with one entry per lossy section."""
    folder.mkdir(parents=True, exist_ok=True)
    lookup_every, topology = default_lookup_every(), Cluster(w.world, 1, w.link) if w.link else None
    samples = math.ceil(w.steps * w.batch * w.world * 1.05 / (1 - EVAL_FRACTION))
    train = ["train.py", *w.args, "--batch-size", str(w.batch), "--steps", str(w.steps), "--samples", str(samples),
             "--eval-fraction", str(EVAL_FRACTION), "--log-every", "1000"]
    command = ([sys.executable, *train] if w.link else
               [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={w.world}", *train])

    def run(run_dir: Path, run_command: list[str], log: Path) -> int:
        return record(run_dir, run_command, log, lookup_every=lookup_every, cluster=topology)

    def metrics(name: str, run_command: list[str]) -> dict | None:
        code = run(folder / name, run_command, folder / f"{name}.log")
        return manifest.read(folder / name).metrics or {} if code == 0 else None

    base, row = folder / "base", {"workload": w.name, "status": "ok", "sections": []}
    say("recording the baseline")
    if run(base, command, folder / "base.log") != 0:
        return {**row, "status": "failed", "error": f"the baseline failed; see {folder / 'base.log'}"}
    if not analyze(base, folder / "analyze.log"):
        return {**row, "status": "failed", "error": f"analyze failed; see {folder / 'analyze.log'}"}
    policy = read_policy(base / "policy.json")
    labels = [label for label in quality.LOSSY if label in policy.sections]
    row["derived"] = labels
    row["not_run"] = {label: why for label in labels
                      if (why := _why_not(replace(policy.sections[label], recommended=True, reason=None)))}
    labels = [label for label in labels if label not in row["not_run"]]
    if not labels:
        return row
    say(f"calibrating {', '.join(labels)}")
    row["notes"] = calibrate(command, base, folder, quality.Budget(), record=run, progress=say, labels=labels)
    if not analyze(base, folder / "analyze-calibrated.log"):
        return {**row, "status": "failed", "error": f"analyze failed; see {folder / 'analyze-calibrated.log'}"}
    policy = read_policy(base / "policy.json")
    held = [*command, "--seed", str(HELD_OUT)]
    say(f"the baseline at the held-out seed {HELD_OUT}")
    baseline = metrics(f"heldout-baseline-seed{HELD_OUT}", held)
    for label in labels:
        section = policy.sections[label]
        body = section.to_json()
        predicted = (body.get("predicted") or {}).get(AUC_CHANGE)
        interval = (body.get("intervals") or {}).get(AUC_CHANGE)
        entry = {"section": label, "setting": float(getattr(section, quality.SETTING[label])),
                 "predicted": predicted, "interval": interval, "recommended": section.recommended,
                 "reason": section.reason, "within_budget": predicted is not None and quality.Budget().exceeded_by(
                     {AUC_CHANGE: predicted}, {AUC_CHANGE: interval} if interval else None) is None}
        if predicted is not None and baseline is not None:
            forced = replace(policy, sections={**policy.sections, label: replace(section, recommended=True, reason=None)})
            path = _write_sections(base / "policy.json", forced, [label], f"heldout-{label}")
            say(f"{label} at the held-out seed {HELD_OUT}")
            measured = metrics(f"heldout-{label.replace('.', '-')}-seed{HELD_OUT}", [*held, "--policy", str(path)])
            entry["measured"] = None if measured is None else quality.changes(measured, baseline)[AUC_CHANGE]
        row["sections"].append(entry)
    return row


def analyze(run: Path, log: Path) -> bool:
    with open(log, "w") as out:
        code = subprocess.call([sys.executable, "-m", "tracekit", "analyze", str(run), "--no-report"], cwd=REPO,
                               stdout=out, stderr=subprocess.STDOUT)
    return code == 0 and (run / "policy.json").is_file()


# the table ---------------------------------------------------------------------------------------

COLUMNS = ("workload", "steps", "section", "setting", "predicted AUC change [seeds 0-2]", "keeps budget",
           "recommended", f"measured, seed {HELD_OUT}", "pred − meas", "within 0.002", "rec. within budget")


def cells(row: dict, s: dict) -> list[str]:
    interval = s.get("interval")
    predicted = "not measured" if s["predicted"] is None else (
        f"{s['predicted']:+.4f}" + (f" [{interval[0]:+.4f}, {interval[1]:+.4f}]" if interval else ""))
    measured = s.get("measured")
    gap = None if measured is None or s["predicted"] is None else s["predicted"] - measured
    rec = "yes" if s["recommended"] else f"no: {(s.get('reason') or '')[:90]}"
    return [row["workload"], str(row["steps"]), s["section"], f"{s['setting']:.4g}", predicted,
            "yes" if s["within_budget"] else "no", rec, "" if measured is None else f"{measured:+.4f}",
            "" if gap is None else f"{gap:+.4f}", "" if gap is None else "✓" if abs(gap) <= TOLERANCE else "✗",
            "" if not s["recommended"] or measured is None else "✓" if measured >= -quality.AUC_BUDGET else "✗"]


def entries(rows: list[dict]):
    for row in rows:
        if not row.get("sections"):
            yield row, None
        for s in row.get("sections", []):
            yield row, s


def markdown(rows: list[dict]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for row, s in entries(rows):
        out = cells(row, s) if s else [row["workload"], str(row["steps"]), "—", "", "", "", "", "", "", "", ""]
        if not s:
            out[4] = row.get("error") or "no lossy section derived"
        lines.append("| " + " | ".join(c.replace("|", "/") for c in out) + " |")
    return "\n".join(lines)


def rich_table(rows: list[dict]) -> Table:
    table = Table(*COLUMNS, title="lossy sections: predicted model-quality change against a held-out seed")
    for row, s in entries(rows):
        table.add_row(*(cells(row, s) if s else [row["workload"], str(row["steps"]), "—",
                                                 row.get("error") or "no lossy section derived"] + [""] * 7))
    return table


def summary(rows: list[dict]) -> list[str]:
    checked = [(r, s) for r, s in entries(rows) if s and s.get("measured") is not None and s["predicted"] is not None]
    near = [(r, s) for r, s in checked if abs(s["predicted"] - s["measured"]) <= TOLERANCE]
    rec = [(r, s) for r, s in checked if s["recommended"]]
    kept = [(r, s) for r, s in rec if s["measured"] >= -quality.AUC_BUDGET]
    name = lambda pairs: ", ".join(f"{r['workload']} {s['section']}" for r, s in pairs) or "none"  # noqa: E731
    return [f"- predicted within {TOLERANCE} AUC of the held-out seed: {len(near)} of {len(checked)} "
            f"(not: {name([p for p in checked if p not in near])})",
            f"- recommended lossy sections within the budget at the held-out seed: {len(kept)} of {len(rec)} "
            f"(not: {name([p for p in rec if p not in kept])})"]


if __name__ == "__main__":
    main()
