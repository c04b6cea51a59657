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

root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.gettempdir()) / "tracekit-torchrec-plans"
errors = []
for d in sorted(root.iterdir()):
    if not d.is_dir(): continue
    out = []
    with open_context(d / "base") as ctx:
        r = torchrec_plans.compute(ctx)
        sm = r.summary
        if not sm: print(d.name, r.notes); continue
        base = sm["baseline"]["step_time_s"]
    for name, key in (("torchrec_plan", sm["predicted"]), ("torchrec_plan_qcomms", sm["qcomms"]["predicted"])):
        run = d / name
        if not run.is_dir(): continue
        with open_context(run) as c2:
            m = network.step_time(c2).median_s
        p = key["step_time_s"]
        errors.append(p / m - 1)
        out.append(f"{name}: {p * 1e3:.1f} / {m * 1e3:.1f} ms ({(p / m - 1) * 100:+.1f}%)")
    print(f"{d.name}: base {base * 1e3:.1f} ms, recommended {sm['recommended']}; " + "; ".join(out))
if errors:
    within = sum(abs(e) <= 0.1 for e in errors)
    print(f"step within 10%: {within} of {len(errors)}; median abs. error "
          f"{sorted(abs(e) for e in errors)[len(errors) // 2] * 100:.1f}%")
