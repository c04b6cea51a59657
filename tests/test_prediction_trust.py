"""Predictions a user can trust, on real 2-rank trainer runs: a figure estimated from
sampled lookups carries an interval that holds the exact figure of the fully recorded run; a policy
that cannot pay is written `recommended: false` and one that can is recommended; a policy file
`analyze` wrote on a 2-node cluster run is applied by train.py as it is."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pyarrow.parquet as pq
import pytest

from analyses import exchange
from analyses.analyze import analyze
from analyses.context import Options, open_context
from tests.recorded import REPO, record
from tests.test_cluster import needs_cluster

TRAINER = ["--tables", "4", "--rows", "2000", "--dim", "8", "--bottom-mlp", "16,8", "--top-mlp", "16,1",
           "--batch-size", "64", "--samples", "16384", "--zipf", "1.0", "--eval-fraction", "0", "--steps", "48",
           "--log-every", "1000"]
EVERY = 4


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("full")
    code, run = record(tmp, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                       str(REPO / "train.py"), *TRAINER, options=("--lookup-every", "1"))
    assert code == 0
    return run


def subsampled(run: Path, target: Path, every: int) -> Path:
    """A copy of `run` as if recorded with --lookup-every `every`: lookups of other steps dropped."""
    shutil.copytree(run, target, ignore=shutil.ignore_patterns("analysis", "policy*"))
    for part in (target / "lookups").rglob("*.parquet"):
        table = pq.read_table(part)
        keep = pl.from_arrow(table)["step"].to_numpy() % every == 0
        pq.write_table(table.filter(keep), part)  # the schema (and its metadata) unchanged
    manifest = json.loads((target / "manifest.json").read_text())
    manifest.setdefault("collector_settings", {})["lookup_every"] = every
    (target / "manifest.json").write_text(json.dumps(manifest))
    return target


def exact_remote(run: Path, hot: pl.DataFrame) -> float:
    """The remote all-to-all bytes per step of the fully recorded run with `hot` replicated."""
    with open_context(run) as ctx:
        s = exchange.baseline(ctx)
        ctx.con.register("hot_frame", hot.select("table_name", pl.col("row").cast(pl.Int64)).to_arrow())
        ctx.sql(f"""CREATE TEMP TABLE tk_hot_order AS SELECT n.tid, h."row", (row_number() OVER () - 1)::BIGINT AS pos
                    FROM hot_frame h JOIN {s.attribution.tables.names} n USING (table_name)""")
        saved = exchange.replication_savings(ctx, "tk_hot_order", hot.height)
        return exchange.curve_totals(s, saved, hot.height)[1]


def test_a_figure_from_sampled_lookups_has_an_interval_holding_the_exact_one(full_run: Path, tmp_path: Path) -> None:
    sampled = subsampled(full_run, tmp_path / "sampled", EVERY)
    options = Options(policies=("replication",), inter_bw=1e6, budget_fraction=0.02)  # a slow link: rows pay
    section = analyze(sampled, options)["policies"]["replication"]
    low, high = section["intervals"]["a2a_remote_bytes_per_step"]
    hot = pl.read_parquet(sampled / "policy" / "hot_rows.parquet")
    assert hot.height > 0
    exact = exact_remote(full_run, hot)
    assert low <= exact <= high, (low, exact, high)
    assert high - low > 0  # an estimate, said so
    # on the fully recorded run the same figure is exact: no interval
    whole = analyze(full_run, options)["policies"]["replication"]
    assert "a2a_remote_bytes_per_step" not in whole.get("intervals", {})


def test_replication_that_cannot_pay_is_not_recommended(full_run: Path) -> None:
    # loopback: bytes cost next to nothing, every added collective costs its latency
    analyze(full_run, Options(policies=("replication",)))
    policy = json.loads((full_run / "policy.json").read_text())
    assert policy["replication"]["recommended"] is False, policy["replication"]
    assert policy["replication"]["reason"]


@needs_cluster
def test_the_policy_file_of_a_cluster_run_applies_as_written(tmp_path: Path) -> None:
    """At 20mbit the exchange dominates the step: replicating hot rows pays, and one of replication
    and the FAE schedule is recommended; tiers (tier 2 across nodes) and lag (inference) are written
    but skipped, each with a line."""
    run = tmp_path / "base"
    heavier = [*TRAINER, "--dim", "32", "--bottom-mlp", "32,32", "--batch-size", "256", "--steps", "16"]
    cluster = [sys.executable, "-m", "tracekit", "cluster", "--nodes", "2", "--ranks-per-node", "1", "--link",
               "20mbit"]
    r = subprocess.run([*cluster, "--record", str(run), "--", sys.executable, "train.py", *heavier], cwd=REPO,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    analyze(run)
    policy = json.loads((run / "policy.json").read_text())
    assert "tiers" in policy and "lag" in policy
    recommended = [name for name in ("replication", "tiers", "schedule") if policy[name]["recommended"]]
    assert recommended in (["replication"], ["schedule"]), {n: policy[n].get("reason") for n in policy}
    r = subprocess.run([*cluster, "--", sys.executable, "train.py", *heavier, "--policy", str(run / "policy.json")],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "lag" in r.stdout + r.stderr  # skipped, with a line saying so
