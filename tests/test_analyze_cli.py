"""`tracekit analyze` and `tracekit sql` as a user runs them: on a recorded run of the reference
trainer and of a user script, with --json, and on every kind of bad input (one line, exit 2)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import polars as pl
import pytest
from click.testing import CliRunner

from tests.recorded import REPO, TINY, record
from tracekit.app.cli import cli
from tracekit.policy import load_policy

EVAL_TINY = [*TINY[:TINY.index("--eval-fraction")], "--eval-fraction", "0.0625", "--steps", "6"]


@pytest.fixture(scope="module")
def trainer_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("trainer")
    code, run_dir = record(tmp, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           "2", str(REPO / "train.py"), *EVAL_TINY, options=("--lookup-every", "1", "--grad-every", "1"))
    assert code == 0
    return run_dir


def analyze(*args: str):
    return CliRunner().invoke(cli, ["analyze", *args])


@pytest.mark.slow
def test_analyze_writes_tables_and_a_valid_policy_and_prints_a_summary(trainer_run: Path) -> None:
    r = analyze(str(trainer_run))
    assert r.exit_code == 0, r.output
    for heading in ("skew:", "traffic:", "timeline:", "cache:", "cost model:", "policies (policy.json)", "replication"):
        assert heading in r.output, heading
    written = {p.stem for p in (trainer_run / "analysis").glob("*.parquet")}
    assert {"skew", "coverage", "traffic_by_op", "traffic_matrix", "timeline", "cache_mrc", "costmodel",
            "replication_sweep", "lag_makespan"} <= written, written
    policy = load_policy(trainer_run / "policy.json")  # validates, row lists included
    assert policy["model"]["world_size"] == 2 and [t["name"] for t in policy["model"]["tables"]] == ["t0", "t1", "t2", "t3"]
    assert {"replication", "tiers", "schedule", "lag"} <= set(policy)
    # the baseline is the training steps' traffic exactly: every rank's bytes_out over the training steps
    comms = pl.read_parquet(trainer_run / "comms" / "**" / "*.parquet", hive_partitioning=True)
    a2a = comms.filter(pl.col("phase") == "train", pl.col("op") == "all_to_all_single")["bytes_out"].sum()
    assert policy["baseline"]["a2a_bytes_per_step"] == pytest.approx(a2a / 6, rel=1e-12)
    # and the report beside it, and the summary the report reads what was not derived from
    assert f"report: {trainer_run / 'report.html'}" in r.output
    assert "<html" in (trainer_run / "report.html").read_text()[:2000].lower()
    summary = json.loads((trainer_run / "analysis" / "summary.json").read_text())
    derived = {name for name in ("replication", "tiers", "schedule", "compression", "lag") if name in policy}
    assert set(summary["policies"]) == derived and {"replication", "tiers", "lag"} <= derived
    assert set(summary["policies"]) | set(summary["not_derived"]) == {"replication", "tiers", "schedule",
                                                                      "compression", "lag"}  # each said, or why not


@pytest.mark.slow
def test_analyze_json_and_sql_see_the_same_figures(trainer_run: Path) -> None:
    r = analyze(str(trainer_run), "--json", "--policies", "replication,lag", "--budget", "5%")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert set(summary["policies"]) == {"replication", "lag"}
    assert summary["analyses"]["costmodel"]["baseline_matches_comms"] is True
    r = CliRunner().invoke(cli, ["sql", str(trainer_run), "SELECT table_name, lookups FROM skew ORDER BY table_name",
                                 "--format", "json"])
    assert r.exit_code == 0, r.output
    from_sql = {row["table_name"]: row["lookups"] for row in json.loads(r.stdout)}
    assert from_sql == {t: s["lookups"] for t, s in summary["analyses"]["skew"]["tables"].items()}
    assert sum(from_sql.values()) == 6 * 64 * 3 * 4  # 6 steps x 64 samples x pooling 3 x 4 tables: training only


USER_SCRIPT = """
import torch, tracekit
emb = torch.nn.EmbeddingBag(1000, 8, mode="sum")
opt = torch.optim.SGD(emb.parameters(), lr=0.1)
for step in range(20):
    emb(torch.randint(0, 1000, (64, 2)) ** 1).sum().backward()
    opt.step()
"""


@pytest.mark.slow
def test_a_user_scripts_run_gets_what_can_be_derived_and_the_reasons(tmp_path: Path) -> None:
    script = tmp_path / "user.py"
    script.write_text(USER_SCRIPT)
    code, run_dir = record(tmp_path, sys.executable, str(script))
    assert code == 0
    r = analyze(str(run_dir), "--json")
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert "skew" in summary["analyses"] and "cache" in summary["analyses"]
    assert any(note.startswith("traffic: not computed, the run has no comms table") for note in summary["notes"])
    assert summary["not_derived"], "a one-process run without collectives cannot derive every policy"
    assert all(isinstance(reason, str) and reason for reason in summary["not_derived"].values())


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    r = analyze(str(tmp_path / "nope"))
    assert r.exit_code == 2 and "does not exist" in r.output and "Traceback" not in r.output, r.output
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "manifest.json").write_text(json.dumps({"status": "completed"}))
    r = analyze(str(empty))
    assert r.exit_code == 2 and "holds no trace rows" in r.output, r.output
    broken = tmp_path / "broken"
    (broken / "accesses" / "rank=0").mkdir(parents=True)
    (broken / "manifest.json").write_text(json.dumps({"status": "completed"}))
    (broken / "accesses" / "rank=0" / "part-00000.parquet").write_bytes(b"PAR1 truncated")
    r = analyze(str(broken))
    assert r.exit_code == 2 and "part-00000.parquet is not a readable Parquet file" in r.output, r.output
    assert len(r.output.strip().splitlines()) == 1, r.output
    for args, message in ((["--budget", "lots"], "expected a size"), (["--topology", "2by2"], "expected NODESxRANKS"),
                          (["--policies", "magic"], "unknown policy magic"), (["--inter-bw", "fast"], "expected a rate")):
        r = analyze(str(broken), *args)
        assert r.exit_code == 2 and message in r.output, r.output
    r = CliRunner().invoke(cli, ["sql", str(broken), "SELECT 1"])
    assert r.exit_code == 2 and "is not a readable Parquet file" in r.output, r.output


def test_sql_csv_writes_list_columns_as_lists(trainer_run: Path) -> None:
    r = CliRunner().invoke(cli, ["sql", str(trainer_run), "SELECT splits_out, bytes_out FROM comms WHERE op = "
                                 "'all_to_all_single' ORDER BY seq LIMIT 3", "--format", "csv"])
    assert r.exit_code == 0, r.output
    lines = r.stdout.splitlines()
    assert lines[0] == "splits_out,bytes_out"
    for line in lines[1:]:
        splits, total = line.rsplit(",", 1)
        assert sum(int(x) for x in splits.strip('"[]').split(", ")) == int(total)


def test_a_one_rank_run_is_analysed_and_printed(tmp_path: Path) -> None:
    """A world-1 run with a process group (as bench/gpu_check.sh records the Kaggle layout on one GPU) has
    lookups and comms but no embedding exchange: the cost model says so instead of the console failing on figures it lacks."""
    code, run_dir = record(tmp_path, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           "1", str(REPO / "train.py"), *TINY, options=("--lookup-every", "1"))
    assert code == 0
    r = analyze(str(run_dir))
    assert r.exit_code == 0, r.output
    assert "Traceback" not in r.output and "skew:" in r.output
    summary = json.loads((run_dir / "analysis" / "summary.json").read_text())
    assert any("one rank: every table is local, no embedding exchange to model" in note for note in summary["notes"])
