"""Re-price a finished `bench/torchrec_plans.py` output with the analyses as they are now, without re-running it:
per shape and link, the derived plan's and its quantized-comms variant's predicted step against the median
step of their measured re-runs (analyses.network's), and whether the plan is recommended.

    .venv/bin/python bench/torchrec_plans_repredict.py [/tmp/tracekit-torchrec-plans]
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from analyses import network, torchrec_plans  # noqa: E402
from analyses.context import open_context  # noqa: E402



def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.gettempdir()) / "tracekit-torchrec-plans"
    errors = []
    for case in sorted(d for d in root.iterdir() if d.is_dir()):
        with open_context(case / "base") as ctx:
            result = torchrec_plans.compute(ctx)
        summary = result.summary
        if not summary:
            print(f"{case.name}: no plan ({'; '.join(result.notes)})")
            continue
        rows = []
        for run, predicted in (("torchrec_plan", summary["predicted"]),
                               ("torchrec_plan_qcomms", summary["qcomms"]["predicted"])):
            if not (case / run).is_dir():
                continue
            with open_context(case / run) as ctx:
                measured = network.step_time(ctx).median_s
            step = predicted["step_time_s"]
            errors.append(step / measured - 1)
            rows.append(f"{run}: {step * 1e3:.1f} / {measured * 1e3:.1f} ms ({(step / measured - 1) * 100:+.1f}%)")
        print(f"{case.name}: base {summary['baseline']['step_time_s'] * 1e3:.1f} ms, recommended "
              f"{summary['recommended']}; " + "; ".join(rows))
    if errors:
        print(f"step within 10%: {sum(abs(e) <= 0.1 for e in errors)} of {len(errors)}; median abs. error "
              f"{sorted(abs(e) for e in errors)[len(errors) // 2] * 100:.1f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
