"""DCT-MP and quantized output all-to-all, measured (bench/RESULTS.md §10): bytes on the wire and eval AUC.

    .venv/bin/python bench/dct_mp.py [--steps 200] [--keep 0.03,0.05]

Criteo Kaggle tables times 0.01, batch 2048 per rank, 2 gloo ranks. Each variant is recorded
(`tracekit record`, lookups and gradient statistics off) and its output all-to-all bytes per
training step are read from the comms table (all_to_all_single calls tagged `output_fwd` and
`output_bwd`, or `output_fwd_coded` and `output_bwd_coded` when compressed: forward rows and backward
gradients, self-sends included, summed over ranks); eval AUC and logloss come from train.py's JSON
summary. Variants: fp32 (today's exchange), --a2a-dtype bf16, fp16 and fp8, and DCT-MP at each
keep ratio of --keep (compression.mp).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import duckdb

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tracekit.dlrm.config import TrainConfig  # noqa: E402
from tracekit.dlrm.data import open_dataset  # noqa: E402
from tracekit.dlrm.output_codec import OutputCodec  # noqa: E402
from tracekit.dlrm.train import build_tables  # noqa: E402
from tracekit.policy import new_policy, write_policy  # noqa: E402
from tracekit.tags import OUTPUT_BWD, OUTPUT_BWD_CODED, OUTPUT_FWD, OUTPUT_FWD_CODED  # noqa: E402

OUTPUT_TAGS = ", ".join(f"'{t}'" for t in (OUTPUT_FWD, OUTPUT_BWD, OUTPUT_FWD_CODED, OUTPUT_BWD_CODED))


def _policy(folder: Path, keep: float) -> Path:
    """compression.mp at `keep` for the bench's model, in `folder` (kept apart from the run directories)."""
    cfg = TrainConfig(preset="criteo-kaggle", scale=0.01)
    dataset = open_dataset(cfg.data, tables=cfg.tables, rows=cfg.rows_for_data(), num_dense=cfg.dense, pooling=cfg.pooling,
                           samples=cfg.samples, seed=cfg.seed, zipf=None, drift=0.0, preset=cfg.preset, scale=cfg.scale)
    tables = [{"name": t.name, "num_rows": t.rows, "dim": t.dim} for t in build_tables(cfg, dataset)]
    policy = new_policy(source_run="bench/dct_mp.py", model={"tables": tables, "world_size": 2})
    policy["compression"] = {"mp": {"keep_ratio": keep, "predicted": {}, "why": "bench/dct_mp.py"}}
    return write_policy(folder / "policy.json", policy)


def _output_bytes(run_dir: Path, steps: int) -> tuple[float, str]:
    con = duckdb.connect()
    rows = con.execute(f"""
        SELECT sum(bytes_out)::DOUBLE / {steps}, string_agg(DISTINCT dtype, ',')
        FROM read_parquet('{run_dir}/comms/**/*.parquet', hive_partitioning=true)
        WHERE phase = 'train' AND op = 'all_to_all_single' AND tag IN ({OUTPUT_TAGS})""").fetchone()
    return rows[0], rows[1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--keep", default="0.03,0.05", help="DCT-MP keep ratios (of dim 64: 0.03 keeps 2, 0.05 keeps 4)")
    p.add_argument("--out", type=Path, default=Path("/tmp/tracekit-bench-dct-mp"))
    args = p.parse_args()
    train = [str(REPO / "train.py"), "--preset", "criteo-kaggle", "--scale", "0.01", "--batch-size", "2048",
             "--steps", str(args.steps), "--log-every", "1000", "--json"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    variants = {"fp32": [], "bf16": ["--a2a-dtype", "bf16"], "fp16": ["--a2a-dtype", "fp16"],
                "fp8": ["--a2a-dtype", "fp8"]}
    keeps = {}
    for keep in (float(k) for k in args.keep.split(",")):
        name = f"dct-mp keep {keep:g}"
        keeps[name] = keep
        variants[name] = ["--policy", str(_policy(args.out / "policies" / name.replace(" ", "-"), keep))]
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.machine())
    print(f"machine: {cpu}, {os.cpu_count()} cores, gloo on CPU, 2 ranks; "
          f"criteo-kaggle x0.01, batch 2048/rank, {args.steps} steps, dim 64")
    base = None
    for name, extra in variants.items():
        run_dir = args.out / name.replace(" ", "-")
        proc = subprocess.run([sys.executable, "-m", "tracekit", "record", "-o", str(run_dir), "--force",
                               "--lookup-every", "0", "--grad-every", "0", "--", *torchrun, *train, *extra],
                              cwd=REPO, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{name}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
        summary = json.loads(next(line for line in reversed(proc.stdout.splitlines()) if line.startswith("{")))
        out, dtypes = _output_bytes(run_dir, args.steps)
        base = base or out
        codec = OutputCodec(extra[1] if extra and extra[0] == "--a2a-dtype" else "fp32", keeps.get(name))
        print(f"{name:>18}: output a2a {out:>13,.0f} B/step ({base / out:5.1f}x fewer; {codec.describe(64)}; "
              f"wire dtype {dtypes})  train loss {summary['train_loss']:.4f}  eval auc {summary['eval_auc']:.4f}  "
              f"logloss {summary['eval_logloss']:.4f}  "
              f"samples/s {summary['samples_per_s']:,.0f}", flush=True)


if __name__ == "__main__":
    main()
