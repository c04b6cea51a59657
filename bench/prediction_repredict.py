"""Score the current analyses on a finished `bench/prediction_accuracy.py` output without re-running it.

    .venv/bin/python bench/prediction_repredict.py runs/prediction_accuracy [--out OUT.jsonl]

Each recorded baseline (OUT/<workload>/<mode>/base) is analysed again with the analyses as they are now
(`tracekit analyze --no-report`, its own calibration kept); each section's row of results.jsonl keeps its
measured figures and gets its predicted step time, interval, speedup and decision from the new policy.json
(the combined run: the policy's `combined` prediction). Byte predictions are left as they were. The rows go to
OUT (default: results.repredicted.jsonl beside the input) and the table (bench/prediction_table.py) is
printed, so a change to the time model is checked on runs nobody tuned it for in minutes, not an hour.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.prediction_accuracy import checks, decision, rel_err  # noqa: E402
from bench.prediction_table import markdown_table  # noqa: E402
from tracekit.figures import STEP_TIME  # noqa: E402
from tracekit.policy import section_part  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", type=Path, help="a prediction_accuracy.py output folder")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--no-analyze", action="store_true", help="read the bases' policy.json as they are")
    args = p.parse_args()
    rows = {}
    for line in (args.results / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["key"]] = row  # the last row of a key wins, as in the bench
    predicted: dict[tuple[str, str], dict] = {}
    for row in rows.values():
        if row["kind"] != "analyze" or row.get("status") != "ok":
            continue
        base = args.results / row["workload"] / row["mode"] / "base"
        if args.no_analyze:
            predicted[row["workload"], row["mode"]] = json.loads((base / "policy.json").read_text())
            continue
        r = subprocess.run([sys.executable, "-m", "tracekit", "analyze", str(base), "--no-report"], cwd=REPO,
                           capture_output=True, text=True)
        if r.returncode != 0:
            print(f"{base}: analyze failed: {r.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
            continue
        policy = json.loads((base / "policy.json").read_text())
        predicted[row["workload"], row["mode"]] = policy
        print(f"{row['workload']} ({row['mode']}): analysed again", file=sys.stderr)
    for row in rows.values():
        policy = predicted.get((row["workload"], row["mode"]))
        if row["kind"] != "section" or policy is None or row["section"] == "baseline":
            continue
        section = _section(policy, row["section"])
        figure = (row.get("figures") or {}).get(STEP_TIME)
        if section is None or figure is None:
            continue
        step = (section.get("predicted") or {}).get(STEP_TIME)
        low, high = (section.get("intervals") or {}).get(STEP_TIME) or (None, None)
        figure.update(predicted=step, predicted_low=low, predicted_high=high, err=rel_err(step, figure["measured"]),
                      in_interval=None if low is None or figure["measured"] is None else low <= figure["measured"] <= high)
        base = (policy.get("baseline") or {}).get(STEP_TIME)
        row["predicted_speedup"] = base / step if base and step else None
        if row["section"] != "combined":
            row["recommended"] = bool(section.get("recommended"))
        row["checks"] = checks(row, row["mode"])
        row["decision"] = decision(row["recommended"], row.get("verdict"))
    out = args.out or args.results / "results.repredicted.jsonl"
    out.write_text("".join(json.dumps(row) + "\n" for row in rows.values()))
    names = list(dict.fromkeys(row["workload"] for row in rows.values()))
    print(markdown_table(list(rows.values()), (names, ("default", "every1"))))
    return 0


def _section(policy: dict, label: str) -> dict | None:
    """The policy's section `label`; for `combined`, its prediction."""
    if label == "combined":
        combined = policy.get("combined") or {}
        return {"predicted": combined.get("predicted"), "intervals": combined.get("intervals"), "recommended": True}
    return section_part(policy, label)


if __name__ == "__main__":
    raise SystemExit(main())
