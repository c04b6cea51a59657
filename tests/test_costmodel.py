"""The SCARS cost model (analyses/costmodel.py): E[U] against Monte Carlo, the replayed baseline
against `comms` (built runs and real 2-rank trainer runs), the formula against the replay."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
import pytest

from analyses import costmodel, exchange
from analyses.context import Options, open_context
from analyses.policies import replication, schedule, tiers
from tests.recorded import REPO, TINY, record
from tests.test_attribution import build_run, table
from tracekit.policy import load_policy, new_policy, write_policy


def zipf(rows: int, alpha: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, rows + 1) ** alpha
    return weights / weights.sum()


def test_expected_distinct_rows_match_monte_carlo_one_hot() -> None:
    rng = np.random.default_rng(1)
    p = zipf(5000, 1.0)
    b = 512
    draws = rng.choice(len(p), size=(4000, b), p=p)
    measured = np.mean([len(np.unique(d)) for d in draws])
    assert abs(costmodel.expected_distinct(p, b) - measured) / measured < 0.01
    assert abs(b * p.sum() - measured) / measured > 0.1  # the naive b·Σp is far off: the test discriminates


def test_expected_distinct_rows_match_monte_carlo_independent_inclusion() -> None:
    rng = np.random.default_rng(2)
    p = np.clip(zipf(2000, 0.8) * 20, 0, 0.9)  # multi-hot: each sample holds row i with probability p_i
    b = 64
    measured = np.mean([np.count_nonzero((rng.random((b, len(p))) < p).any(axis=0)) for _ in range(1500)])
    assert abs(costmodel.expected_distinct(p, b) - measured) / measured < 0.01


def one_hot_run(path: Path, *, steps: int = 60, b: int = 128, rows: int = 1000, seed: int = 0,
                world: int = 2, sharding: str = "table") -> None:
    rng = np.random.default_rng(seed)
    p = zipf(rows, 1.1)
    owner = (lambda t: t % world) if sharding == "table" else (lambda t: None)
    tables = [table(f"t{t}", rows, dim=8, owner=owner(t), world=world) for t in range(2)]
    batches = [[{f"t{t}": [[int(x)] for x in rng.choice(rows, size=b, p=p)] for t in range(2)}
                for _ in range(world)] for _ in range(steps)]
    build_run(path, tables, world, batches, ar_bw=1e9)  # one link: the all-reduce as fast as the all-to-all


def test_formula_and_replay_agree_on_iid_lookups(tmp_path: Path) -> None:
    one_hot_run(tmp_path / "run")
    with open_context(tmp_path / "run") as ctx:
        result = costmodel.compute(ctx)
    check = result.tables["costmodel_check"]
    distinct = check.filter(pl.col("check") == "distinct_rows")
    assert distinct.height == 2 and (distinct["rel_diff"].abs() < 0.02).all(), distinct
    remote = check.filter(pl.col("check") == "remote_rows")
    assert (remote["rel_diff"].abs() < 0.05).all(), remote
    assert result.summary["baseline_matches_comms"] is True
    assert result.summary["batch_per_device"] == 128


def _assert_replay_equals_comms(run: Path) -> pl.DataFrame:
    with open_context(run) as ctx:
        frame = exchange.comms_replay(ctx)
    assert frame.height > 0
    for column in ("bytes_out", "bytes_in", "splits_out", "splits_in"):
        pred, rec = frame[f"{column}_pred"], frame[f"{column}_comms"]
        assert pred.null_count() == 0 and rec.null_count() == 0, frame
        assert (pred == rec).all(), frame.filter(pred != rec)
    return frame


def test_baseline_replay_equals_comms_on_built_runs(tmp_path: Path) -> None:
    tables = [table("a", 30, owner=0, world=3), table("s", 12, kind="sequence", owner=1, world=3),
              table("r", 40, owner=None, world=3)]
    batch = [{"a": [[1, 2], [3]], "s": [[4, 5, 6], [7]], "r": [[0, 39], [20]]},
             {"a": [[5], [6], [7]], "s": [[1], [2, 3], []], "r": [[13, 14], [], [27]]},
             {"a": [[9, 9]], "s": [[8, 8]], "r": [[35]]}]
    build_run(tmp_path / "run", tables, 3, [batch, batch])
    frame = _assert_replay_equals_comms(tmp_path / "run")
    assert set(frame["collective"]) == set(exchange.COLLECTIVES)
    with open_context(tmp_path / "run") as ctx:
        s = exchange.baseline(ctx)
    # by hand: lengths 4·T_o·b_q summed over pairs, T = (2, 2, 1) tables on ranks 0..2, b = (2, 3, 1)
    assert s.base["input_lengths"][0] == 4 * (2 + 2 + 1) * (2 + 3 + 1)
    assert s.base["input_ids"][0] == 8 * (8 + 9 + 7)  # ids of a, s, r
    # pooled rows (4 floats): one per sample of a, one per sample and shard of r; one per id of s
    assert s.base["output_fwd"][0] == s.base["output_bwd"][0] == 16 * (6 + 6 * 3) + 16 * 9


def test_replay_detects_a_wrong_byte_count(tmp_path: Path) -> None:
    one_hot_run(tmp_path / "run", steps=2)
    part = next((tmp_path / "run" / "lookups" / "rank=0").glob("*.parquet"))
    lookups = pq.read_table(part)
    pq.write_table(lookups.slice(1), part)  # one lookup lost; the schema metadata stays
    with open_context(tmp_path / "run") as ctx:
        replay = exchange.comms_replay(ctx)
        assert (replay["bytes_out_pred"] != replay["bytes_out_comms"]).any()  # a lost lookup shows
        assert costmodel.compute(ctx).summary["baseline_matches_comms"] is False


def test_cost_model_tables_hold_every_policy(tmp_path: Path) -> None:
    one_hot_run(tmp_path / "run", steps=20)
    with open_context(tmp_path / "run", Options(inter_bw=1e9)) as ctx:
        derived = {m.__name__.rsplit(".", 1)[1]: m.derive(ctx) for m in (replication, tiers, schedule)}
        result = costmodel.compute(ctx, derived)
        model = result.tables["costmodel"]
        assert set(model["policy"]) == {"baseline", "dedup_fetch", "replication", "tiers", "schedule"}
        replayed = model.filter((pl.col("policy") == "replication") & (pl.col("method") == "replay"))
        assert set(replayed["collective"]) == {*exchange.COLLECTIVES, "sync"}
        base = model.filter(pl.col("policy") == "baseline")
        assert base["bytes_per_step"].sum() == result.summary["baseline_a2a_bytes_per_step"]
        # time from bytes (analyses.network): each call's α plus its busiest link's bytes at β = 1/1e9
        s = exchange.baseline(ctx)
        alpha = result.summary["network"]["alpha_s"].get("all_to_all_single", 0.0)
        assert base["time_s"].sum() == pytest.approx(4 * alpha + sum(s.busiest.values()) / 1e9)
        replication_rows = model.filter(pl.col("policy") == "replication")
        assert replication_rows.filter(pl.col("method") == "expected").height == 2
        assert result.summary["network"]["source"].startswith("β from --intra-bw/--inter-bw")
        alone = costmodel.compute(ctx).tables["costmodel"]
        assert alone["policy"].unique().sort().to_list() == ["baseline", "dedup_fetch"]


@pytest.mark.slow
@pytest.mark.parametrize(("sharding", "sequence_tables"), [("table", 0), ("table", 2), ("row", 0), ("row", 2)])
def test_baseline_bytes_equal_a_recorded_trainer_run(tmp_path: Path, sharding: str, sequence_tables: int) -> None:
    code, run_dir = record(tmp_path, sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(REPO / "train.py"), *TINY, "--sharding", sharding,
                           "--sequence-tables", str(sequence_tables), options=("--lookup-every", "2"))
    assert code == 0
    frame = _assert_replay_equals_comms(run_dir)
    assert dict(zip(frame["collective"], frame["tag"])) == exchange.TRAINER_TAGS
    assert sorted(set(frame["step"])) == [0, 2]
    with open_context(run_dir) as ctx:
        result = costmodel.compute(ctx)
        assert result.summary["baseline_matches_comms"] is True
        policy = new_policy(source_run=str(run_dir), model=ctx.model.policy_model())
        rows = {}
        for module in (replication, tiers, schedule):
            derived = module.derive(ctx)
            assert derived.as_json() is not None, derived.reason
            policy[derived.name] = derived.as_json()
            rows.update(derived.rows)
        loaded = load_policy(write_policy(tmp_path / "policy.json", policy, rows))
        assert set(loaded) >= {"replication", "tiers", "schedule"}
