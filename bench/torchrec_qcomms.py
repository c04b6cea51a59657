"""What TorchRec's quantized comms cost the model, and save in bytes (the target: the
output all-to-all's bytes exactly halved at fp16/bf16, held-out AUC and logloss within 0.002).

The job is bench/torchrec_shapes.py's criteo shape: real Criteo rows, 26 tables, trained on 9,000
rows and evaluated on the 1,000 held out. `tracekit optimize --check-all` records it under TorchRec's
default plan and writes the derived plan and its quantized-comms variant; then for each seed (the
model's initialisation) every variant below runs through `record --plan` on the same data, and the
job's own eval_auc / eval_logloss and tracekit's measured all-to-all bytes are read back:

    fp32          the derived plan as written (torchrec_plan.json)
    fp16/bf16     forward fp16, backward bf16 (torchrec_plan.qcomms.json, as analyze writes it)
    fp16/fp16, bf16/bf16   the same plan with both directions at one precision

The differences are taken seed by seed against fp32; the spread over seeds of fp32's own AUC says
how large a difference the seed alone makes. From the repo root (needs the TorchRec venv):

    .venv/bin/python bench/torchrec_qcomms.py [--seeds 0,1,2] [--steps 60]
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

from tracekit.torchrec_plan import read_plan, write_plan  # noqa: E402

TORCHREC_PYTHON = ROOT / "bench" / ".venv-torchrec" / "bin" / "python"
TRACEKIT = [str(ROOT / ".venv" / "bin" / "python"), "-m", "tracekit"]
VARIANTS = {"fp32": None, "fp16/bf16": ("fp16", "bf16"), "fp16/fp16": ("fp16", "fp16"), "bf16/bf16": ("bf16", "bf16")}


def job(steps: int, seed: int) -> list[str]:
    return [str(TORCHREC_PYTHON), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(ROOT / "bench" / "torchrec_shapes.py"), "--shape", "criteo", "--batch-size", "256", "--lr", "0.1",
            "--steps", str(steps), "--seed", str(seed), "--json"]


def tracekit(*argv: str) -> str:
    done = subprocess.run([*TRACEKIT, *argv], cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise SystemExit(f"tracekit {' '.join(argv)} failed:\n{done.stderr[-3000:]}")
    return done.stdout


def a2a_bytes(run_dir: Path) -> int:
    """Bytes every rank sent in the training steps' all-to-alls (the output dist's and the input's)."""
    out = tracekit("sql", "--format", "json", str(run_dir),
                   "SELECT sum(bytes_out) AS b FROM train_comms WHERE op LIKE 'all_to_all%'")
    return int(json.loads(out)[0]["b"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "tracekit-torchrec-qcomms")
    args = p.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    print(f"machine: {platform.processor() or platform.machine()}; 2 gloo ranks on the loopback; criteo shape, "
          f"{args.steps} + 5 steps of 512 samples, eval on 1,000 held-out rows; seeds {seeds}")
    tracekit("optimize", "--check-all", "--json", "-o", str(args.out / "optimize"), "--", *job(args.steps, seeds[0]))
    derived = read_plan(args.out / "optimize" / "base" / "torchrec_plan.json")
    plans = {}
    for name, precisions in VARIANTS.items():
        plan = {k: v for k, v in derived.items() if k not in ("qcomms", "predicted", "intervals", "why", "recommended")}
        if precisions:
            plan["qcomms"] = {"forward": precisions[0], "backward": precisions[1]}
        plans[name] = args.out / f"plan-{name.replace('/', '-')}.json"
        write_plan(plans[name], plan)
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    for seed in seeds:
        for name, path in plans.items():
            run_dir = args.out / f"seed{seed}-{name.replace('/', '-')}"
            stdout = tracekit("record", "--force", "-o", str(run_dir), "--plan", str(path), "--",
                              *job(args.steps, seed))
            printed = json.loads(next(line for line in stdout.splitlines()[::-1] if line.startswith("{")))
            results[name].append({"seed": seed, "auc": printed["eval_auc"], "logloss": printed["eval_logloss"],
                                  "a2a_bytes": a2a_bytes(run_dir)})
            print(f"  seed {seed} {name:>10}: eval AUC {printed['eval_auc']:.4f}, "
                  f"logloss {printed['eval_logloss']:.4f}, all-to-all bytes {results[name][-1]['a2a_bytes']:,}",
                  flush=True)
    base = results["fp32"]
    print(f"\nfp32 over seeds: AUC {min(r['auc'] for r in base):.4f}–{max(r['auc'] for r in base):.4f} "
          f"(the seed alone moves it by {max(r['auc'] for r in base) - min(r['auc'] for r in base):.4f})")
    print("variant      AUC change (seed by seed; max |·|)      logloss change (max |·|)     all-to-all bytes / fp32")
    summary = {}
    for name, rows in results.items():
        d_auc = [r["auc"] - b["auc"] for r, b in zip(rows, base)]
        d_loss = [r["logloss"] - b["logloss"] for r, b in zip(rows, base)]
        ratio = statistics.median(r["a2a_bytes"] / b["a2a_bytes"] for r, b in zip(rows, base))
        summary[name] = {"runs": rows, "auc_change": d_auc, "logloss_change": d_loss, "a2a_bytes_ratio": ratio}
        print(f"{name:>10}   {', '.join(f'{x:+.4f}' for x in d_auc)}; {max(map(abs, d_auc)):.4f}      "
              f"{', '.join(f'{x:+.4f}' for x in d_loss)}; {max(map(abs, d_loss)):.4f}      {ratio:.4f}")
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
