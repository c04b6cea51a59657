"""DCT-DP measured (bench/RESULTS.md §9): DDP's gradient bytes on the wire with and without compression.dp,
and the eval AUC after the same steps.

    .venv/bin/python bench/dct_dp.py [--steps 200] [--samples N] [--keep 0.005,0.001,0.005:10] [--refresh-every 1000]
        [--reuse] [--out DIR]
    .venv/bin/python bench/dct_dp.py --from-analyze [--steps 1000 --samples 5000000] [--reuse] [--out DIR]

--from-analyze runs the loop a user runs instead of hand-written policies (bench/RESULTS.md §21): `tracekit record`
of the baseline with default settings, `tracekit analyze` with default settings, then the trainer with
the compression.dp section analyze wrote, alone in a file as `tracekit optimize` writes
policy.compression.dp.json; it prints the section, its predicted gradient bytes (and interval)
against the measured ones, the ratio to the baseline's and both AUCs.

Preset criteo-kaggle x 0.01, the default MLPs (512,256,64 and 512,256,1; ~0.5 M dense parameters),
batch 2048 per rank, 2 gloo ranks. Each run is recorded (`tracekit record --lookup-every 0
--grad-every 0`): the baseline (train.py's `_sum_allreduce_hook`, one all-reduce per bucket) and
one run per keep ratio with a policy holding only compression.dp (error feedback on). The bytes are
the training `comms` rows of the DP gradient exchange (tag `_sum_allreduce_hook`, or `dct_dp`: the
counts and the encoded payloads), per step, summed over ranks' bytes_out (DESIGN.md §5); the AUC is
the manifest's eval_auc (rank 0, the held-out 10%).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import polars as pl  # noqa: E402

from tracekit.dlrm import config as config_mod  # noqa: E402
from tracekit.dlrm.compression import LABEL  # noqa: E402
from tracekit.dlrm.data import open_dataset  # noqa: E402
from tracekit.dlrm.train import build_tables  # noqa: E402
from tracekit.app.optimize import reruns  # noqa: E402
from tracekit.policy import SECTIONS, load_policy, new_policy, section_part, write_policy  # noqa: E402
from tracekit.run import open_run  # noqa: E402

WORLD = 2
BASE_TAG = "_sum_allreduce_hook"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--samples", type=int, default=None,
                   help="training samples to generate (the preset's ~0.95M last 231 steps of 4,096)")
    p.add_argument("--keep", default="0.005,0.001",
                   help="keep ratios to run, comma-separated; KEEP:REFRESH for another refresh_every")
    p.add_argument("--reuse", action="store_true", help="read runs already recorded under --out, do not re-run them")
    p.add_argument("--refresh-every", type=int, default=1000)
    p.add_argument("--out", type=Path, default=Path("/tmp/tracekit-bench-dct-dp"))
    p.add_argument("--from-analyze", action="store_true",
                   help="derive compression.dp with record + analyze (default settings) and apply what analyze wrote")
    args = p.parse_args()
    train_args = ["--preset", "criteo-kaggle", "--scale", "0.01", "--batch-size", "2048", "--steps", str(args.steps),
                  *(["--samples", str(args.samples)] if args.samples else []),
                  "--log-every", "1000"]
    train = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}", "train.py",
             *train_args]
    print(f"machine: {_cpu()}, {os.cpu_count()} cores, gloo on CPU, {WORLD} ranks; "
          f"{' '.join(train_args)}", flush=True)
    if args.from_analyze:
        return _from_analyze(args.out, train, args.reuse)
    runs = {"baseline": _record(args.out / "base", train, args.reuse)}
    for spec in args.keep.split(","):
        keep, _, refresh = spec.partition(":")
        keep, refresh = float(keep), int(refresh or args.refresh_every)
        name = f"keep{keep:g}-refresh{refresh}"
        policy = _policy(args.out / "policies" / f"{name}.json", train_args, keep, refresh)
        runs[name] = _record(args.out / name, [*train, "--policy", str(policy)], args.reuse)
    base_bytes = runs["baseline"]["dp_bytes_per_step"]
    for name, r in runs.items():
        ratio = base_bytes / r["dp_bytes_per_step"] if r["dp_bytes_per_step"] else float("inf")
        print(f"{name:>24}: DP bytes/step {r['dp_bytes_per_step']:>12,.0f} ({ratio:6.1f}x fewer)  "
              f"calls/step {r['calls_per_step']:.1f}  ops {r['ops']}  eval AUC {r['eval_auc']:.4f} "
              f"(vs baseline {r['eval_auc'] - runs['baseline']['eval_auc']:+.4f})  "
              f"samples/s {r['samples_per_s']:,.0f} (traced, indicative)", flush=True)
    print(json.dumps(runs))


def _from_analyze(out: Path, train: list[str], reuse: bool) -> None:
    """record (defaults) -> analyze (defaults) -> the trainer with the compression.dp section analyze wrote."""
    base_dir, dp_dir = out / "analyzed-base", out / "analyzed-dp"
    base = _record(base_dir, train, reuse, default_settings=True)
    if not (reuse and (base_dir / "policy.json").exists()):
        proc = subprocess.run([sys.executable, "-m", "tracekit", "analyze", str(base_dir), "--no-report"],
                              cwd=REPO, capture_output=True, text=True)
        print(proc.stderr[-3000:] + proc.stdout[-3000:], flush=True)
        if proc.returncode:
            sys.exit(f"tracekit analyze {base_dir} failed (exit {proc.returncode})")
    policy = load_policy(base_dir / "policy.json")
    section = section_part(policy, "compression.dp")
    if section is None:
        sys.exit(f"analyze derived no compression.dp: see {base_dir}/analysis")
    print("compression.dp as analyze wrote it:\n" + json.dumps(section, indent=1), flush=True)
    plans, notes = reruns(base_dir / "policy.json")
    by_name = {plan.name: plan.policy for plan in plans}
    path = by_name.get("compression.dp")
    if path is None:  # not recommended here: the same one-section file, applied anyway, and said so
        print("; ".join(notes) + "\nanalyze did not recommend compression.dp: applying its section anyway "
              "(recommended set true in a copy)", flush=True)
        single = {k: v for k, v in policy.items() if k not in (*SECTIONS, "combined")}
        single["compression"] = {"dp": {**section, "recommended": True}}
        single["compression"]["dp"].pop("reason", None)
        path = write_policy(base_dir / "policy.compression.dp.applied.json", single)
    dp = _record(dp_dir, [*train, "--policy", str(path)], reuse)
    predicted = section["predicted"]["dp_bytes_per_step"]
    low, high = section.get("intervals", {}).get("dp_bytes_per_step", [predicted, predicted])
    measured, baseline = dp["dp_bytes_per_step"], base["dp_bytes_per_step"]
    print(f"keep {section['keep_ratio']:g}, refresh_every {section['refresh_every']} (from {path.name})\n"
          f"DP bytes/step: predicted {predicted:,.0f} [{low:,.0f}, {high:,.0f}], measured {measured:,.0f} "
          f"({measured / predicted - 1:+.1%}); baseline {baseline:,.0f}: {baseline / measured:.1f}x fewer "
          f"(predicted {baseline / predicted:.1f}x)\n"
          f"eval AUC: baseline {base['eval_auc']:.4f}, DCT-DP {dp['eval_auc']:.4f} "
          f"({dp['eval_auc'] - base['eval_auc']:+.4f})", flush=True)
    print(json.dumps({"baseline": base, "dct_dp": dp, "section": section, "policy": str(path)}))


def _policy(path: Path, train_args: list[str], keep: float, refresh_every: int) -> Path:
    cfg = config_mod.from_args(train_args)
    dataset = open_dataset(cfg.data, tables=cfg.tables, rows=cfg.rows_for_data(), num_dense=cfg.dense,
                           pooling=cfg.pooling, samples=cfg.samples, seed=cfg.seed,
                           zipf=cfg.zipf if cfg.zipf is None or len(cfg.zipf) > 1 else cfg.zipf[0],
                           drift=cfg.drift, preset=cfg.preset, scale=cfg.scale)
    tables = build_tables(cfg, dataset)
    policy = new_policy(source_run="bench/dct_dp.py", model={
        "tables": [{"name": t.name, "num_rows": t.rows, "dim": t.dim} for t in tables], "world_size": WORLD})
    policy["compression"] = {"dp": {"keep_ratio": keep, "refresh_every": refresh_every, "error_feedback": True,
                                    "predicted": {}, "why": f"bench/dct_dp.py: keep {keep:g}"}}
    return write_policy(path, policy)


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _record(run_dir: Path, command: list[str], reuse: bool, *, default_settings: bool = False) -> dict:
    if not (reuse and (run_dir / "manifest.json").exists()):
        _run(run_dir, command, default_settings)
    run = open_run(run_dir)
    comms = run.scan("comms").filter((pl.col("phase") == "train") & pl.col("tag").is_in([BASE_TAG, LABEL])).collect()
    steps = run.scan("steps").filter(pl.col("rank") == 0).select(pl.col("step").n_unique()).collect().item()
    metrics = run.manifest.metrics or {}
    return {"dp_bytes_per_step": comms["bytes_out"].sum() / steps, "calls_per_step": comms.height / steps,
            "ops": dict(comms.group_by("op").len().iter_rows()), "steps": steps,
            "eval_auc": metrics.get("eval_auc"), "samples_per_s": metrics.get("samples_per_s")}


def _run(run_dir: Path, command: list[str], default_settings: bool = False) -> None:
    settings = ["--dct-replay"] if default_settings else ["--lookup-every", "0", "--grad-every", "0"]
    proc = subprocess.run([sys.executable, "-m", "tracekit", "record", "-o", str(run_dir), "--force", *settings,
                           "--", *command], cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"recording {run_dir} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


if __name__ == "__main__":
    main()
