"""TorchRec's default plan against the plan tracekit derives from the trace (bench/RESULTS.md §26), on the three
job shapes of bench/torchrec_shapes.py, on the loopback and on emulated 2-node clusters.

For each shape and link: `tracekit optimize --check-all` records the job as TorchRec's planner
shards it, derives a plan (analyses/torchrec_plans.py) and re-runs the unchanged job with it; its
compare gives the predicted bytes and step against the measured ones. Then --repeats alternating
pairs of recorded runs (the job's own plan, then the derived one, each through `record --plan`,
traced alike; with --qcomms the derived plan with quantized comms too) give the job's own samples/s: the speedup is the median of the pairs' ratios. From
the repo root (needs the TorchRec venv, and root for the clusters):

    .venv/bin/python bench/torchrec_plans.py [--shapes wide,small-hot,long-bags] [--links loopback,200mbit,1gbit]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tracekit import manifest  # noqa: E402
from tracekit.torchrec_plan import from_manifest, read_plan, write_plan  # noqa: E402

TORCHREC_PYTHON = ROOT / "bench" / ".venv-torchrec" / "bin" / "python"
TRACEKIT = [str(ROOT / ".venv" / "bin" / "python"), "-m", "tracekit"]


def job(shape: str, steps: int, link: str) -> list[str]:
    script = [str(ROOT / "bench" / "torchrec_shapes.py"), "--shape", shape, "--steps", str(steps), "--json"]
    if link == "loopback":
        return [str(TORCHREC_PYTHON), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *script]
    return [str(TORCHREC_PYTHON), *script]


def where(link: str) -> list[str]:
    return [] if link == "loopback" else ["--cluster", "2x1", "--link", link]


def recorded(run_dir: Path, command: list[str], link: str, plan: Path) -> float:
    """samples/s the job printed, recorded with `plan`."""
    if link == "loopback":
        argv = [*TRACEKIT, "record", "--force", "-o", str(run_dir), "--plan", str(plan), "--", *command]
    else:
        argv = [*TRACEKIT, "cluster", "--nodes", "2", "--link", link, "--force", "--record", str(run_dir), "--plan",
                str(plan), "--", *command]
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    line = next(line for line in done.stdout.splitlines()[::-1] if line.startswith("{"))
    return json.loads(line)["samples_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="wide,small-hot,long-bags")
    p.add_argument("--links", default="loopback,200mbit")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--qcomms", action="store_true", help="each pair also runs the quantized-comms plan")
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "tracekit-torchrec-plans")
    args = p.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}; 2 gloo ranks; bench/torchrec_shapes.py "
          f"--steps {args.steps}; {args.repeats} alternating pairs")
    rows = []
    for shape in args.shapes.split(","):
        for link in args.links.split(","):
            out = args.out / f"{shape}-{link}"
            command = job(shape, args.steps, link)
            done = subprocess.run([*TRACEKIT, "optimize", "--check-all", "--json", *where(link), "-o", str(out), "--",
                                   *command], cwd=ROOT, capture_output=True, text=True, timeout=3600)
            if done.returncode != 0:
                raise SystemExit(f"optimize {shape} {link} failed:\n{done.stderr[-3000:]}")
            derived = read_plan(out / "base" / "torchrec_plan.json")
            own = out / "own_plan.json"
            write_plan(own, from_manifest(manifest.read(out / "base")))
            summary = json.loads(done.stdout) if done.stdout.strip() else {"rows": [], "notes": []}
            checks = {(r["section"], r["figure"]): r for r in summary["rows"]
                      if r["section"] in ("torchrec_plan", "torchrec_plan.qcomms")}
            pairs, qcomms = [], []
            for i in range(args.repeats):
                base = recorded(out / f"pair{i}-own", command, link, own)
                plan = recorded(out / f"pair{i}-derived", command, link, out / "base" / "torchrec_plan.json")
                pairs.append(plan / base)
                if args.qcomms:
                    lossy = recorded(out / f"pair{i}-qcomms", command, link, out / "base" / "torchrec_plan.qcomms.json")
                    qcomms.append(lossy / base)
            rows.append({"shape": shape, "link": link, "derived": {t: [v["sharding_type"], v["ranks"]]
                                                                    for t, v in derived["tables"].items()},
                         "recommended": derived.get("recommended"), "why": derived.get("why"),
                         "checks": {" ".join(k): (v["predicted"], v["measured"]) for k, v in checks.items()},
                         "speedups": pairs, "speedup": statistics.median(pairs),
                         "qcomms_speedups": qcomms, "qcomms_speedup": statistics.median(qcomms) if qcomms else None})
            r = rows[-1]
            print(f"\n{shape} on {link}: derived {r['derived']} (recommended {r['recommended']}: {r['why']})")
            for figure, (predicted, measured) in r["checks"].items():
                print(f"  {figure}: predicted {predicted}, measured {measured}")
            print(f"  speedup of the derived plan over TorchRec's (samples/s, pair by pair): "
                  f"{', '.join(f'{x:.3f}' for x in pairs)}; median {r['speedup']:.3f}")
            if qcomms:
                print(f"  the same with quantized comms (fp16 forward, bf16 backward; lossy, see torchrec_qcomms.py): "
                      f"{', '.join(f'{x:.3f}' for x in qcomms)}; median {r['qcomms_speedup']:.3f}")
    (args.out / "summary.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
