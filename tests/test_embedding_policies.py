"""Replication, tiers and schedule (analyses/policies/): bytes replayed by hand on small built
runs, the choice of the budget, and every section through tracekit.policy's validator."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from analyses import exchange
from analyses.context import Options, open_context
from analyses.policies import replication, schedule, tiers
from tests.test_costmodel import one_hot_run
from tests.test_attribution import build_run, table
from tracekit.policy import load_policy, new_policy, write_policy
from tracekit.topology import Topology



def mixed_run(path: Path) -> None:
    """Table-wise on 2 ranks, dim 4 (16-byte rows): a one-hot on rank 0, b two ids per bag and s a
    sequence table on rank 1; the same batch twice."""
    tables = [table("a", 10, owner=0), table("b", 10, owner=1), table("s", 10, kind="sequence", owner=1)]
    batch = [{"a": [[1], [1], [2], [1]], "b": [[5, 6], [5, 5], [5, 6], [6, 6]], "s": [[7], [7, 8], [], [7]]},
             {"a": [[1], [2], [2], [1]], "b": [[5, 5], [6, 6], [5, 5], [5, 6]], "s": [[8], [7], [7, 7], []]}]
    build_run(path, tables, 2, [batch, batch])


def hot_order(ctx, rows: list[tuple[str, int]]) -> None:
    ids = {name: i for i, name in enumerate(t.name for t in ctx.model.tables)}
    values = ", ".join(f"({ids[name]}, {row}, {pos})" for pos, (name, row) in enumerate(rows))
    ctx.sql(f'CREATE OR REPLACE TEMP TABLE tk_test_order AS SELECT * FROM (VALUES {values}) v(tid, "row", pos)')


def test_items_leave_the_exchange_as_the_layout_says(tmp_path: Path) -> None:
    mixed_run(tmp_path / "run")
    with open_context(tmp_path / "run") as ctx:
        hot_order(ctx, [("a", 1), ("b", 5), ("s", 7)])
        saved = exchange.replication_savings(ctx, "tk_test_order", 3)
        remote = sum(saved[f"{c}_rem"][3] for c in exchange.COLLECTIVES)
        everything = sum(saved[f"{c}_out"][3] for c in exchange.COLLECTIVES)
        # remote: rank 1's two bags [1] of a (8 + 2·16 each); rank 0's all-hot bag [5, 5] of b (16 + 32)
        # and the hot id of its two bags [5, 6] (8 each: the bag stays, its cold id goes); rank 0's three
        # ids 7 of s (8 + 2·16 each)
        assert remote == 2 * 40 + 48 + 2 * 8 + 3 * 40
        # and what ranks hand themselves: rank 0's three bags [1]; rank 1's two [5, 5] and one [5, 6];
        # rank 1's three 7s
        assert everything == remote + 3 * 40 + 2 * 48 + 8 + 3 * 40
        assert saved["input_lengths_out"][3] == 0  # lengths keep their size: a bag served here is sent as -1
        assert saved["input_ids_rem"][1] == 2 * 8  # a:1 alone frees only a's bags


def test_a_row_wise_bag_leaves_with_all_its_partial_bags(tmp_path: Path) -> None:
    tables = [table("r", 10, owner=None)]  # rows 0-4 on rank 0, 5-9 on rank 1
    batch = [{"r": [[1, 7], [2]]}, {"r": [[3], [8, 9]]}]
    build_run(tmp_path / "run", tables, 2, [batch])
    with open_context(tmp_path / "run") as ctx:
        s = exchange.baseline(ctx)
        hot_order(ctx, [("r", 1), ("r", 2), ("r", 3), ("r", 7), ("r", 8), ("r", 9)])
        saved = exchange.replication_savings(ctx, "tk_test_order", 6)
        # every bag hot: the whole recorded exchange leaves, empty partial bags included, but the
        # lengths (2 ranks × 2 owners × 2 samples × 4 bytes)
        assert s.base_out == 336
        assert sum(saved[f"{c}_out"][6] for c in exchange.COLLECTIVES) == 336 - 32
        # remote: each bag's partial bag on the other rank (rows 2·16) and its remote ids (7 and 3)
        assert s.base_remote == 4 * 36 + 2 * 8
        assert sum(saved[f"{c}_rem"][6] for c in exchange.COLLECTIVES) == 4 * 32 + 2 * 8
        assert sum(saved[f"{c}_out"][1] for c in exchange.COLLECTIVES) == 8  # row 1 alone: [1, 7] stays, id 1 goes


def test_replica_sync_follows_the_touched_rows(tmp_path: Path) -> None:
    mixed_run(tmp_path / "run")
    with open_context(tmp_path / "run") as ctx:
        s = exchange.baseline(ctx)
        rows = ctx.frame(f"""SELECT n.table_name, r."row", r.rb, r.steps, r.src_steps FROM {s.tables.rows} r
                             JOIN {s.attribution.tables.names} n USING (tid) ORDER BY n.table_name, r."row" """)
        hot = rows.filter(pl.struct("table_name", "row").is_in([{"table_name": "a", "row": 1},
                                                                {"table_name": "b", "row": 5},
                                                                {"table_name": "s", "row": 7}]))
        assert hot["steps"].to_list() == [2, 2, 2] and hot["src_steps"].to_list() == [4, 4, 4]
        dense, sparse = exchange.sync_bytes(s.world, s.id_bytes, hot["rb"].to_numpy(), hot["steps"].to_numpy(),
                                             hot["src_steps"].to_numpy(), s.sampled_steps)
        # per step: every hot row touched by both ranks; sparse = W(W−1)·8 (the counts) + (W−1)·8·Σ u_r
        # + 2(W−1)·16·|U|
        assert sparse[-1] == 2 * 1 * 8 + 1 * 8 * 6 + 2 * 1 * 16 * 3
        assert dense[-1] == 2 * 1 * 16 * 3


def test_replication_picks_the_least_time_point_of_its_sweep(tmp_path: Path) -> None:
    one_hot_run(tmp_path / "run", steps=30, rows=400)
    with open_context(tmp_path / "run", Options(inter_bw=1e6)) as ctx:
        result = replication.derive(ctx)
        section, sweep = result.as_json(), result.tables["replication_sweep"]
        benefit = sweep.filter(pl.col("ordering") == "benefit")
        chosen = sweep.filter(pl.col("chosen"))
        assert chosen.height == 1 and chosen["point"].item() == "optimum"
        assert chosen["step_time_s"].item() == benefit["step_time_s"].min()
        assert 0 < chosen["hot_rows"].item() < benefit["hot_rows"].max()  # neither nothing nor everything
        assert section["predicted"]["a2a_bytes_per_step"] == chosen["a2a_bytes_per_step"].item()
        assert section["predicted"]["sync_bytes_per_step"] == chosen["sync_bytes_per_step"].item()
        assert section["sync"] == chosen["sync"].item()
        hot = result.rows["hot_rows"]
        assert hot.columns == ["table_name", "row", "count", "benefit_bytes"]
        assert hot.height == chosen["hot_rows"].item()
        assert sweep.filter(pl.col("point") == "hugectr").height == 1
        h = result.evidence["hugectr"]
        assert h["rows"] % 2 == 0 and h["threshold"] == pytest.approx(256 * 30 * (2 * 0.01 / (128 * 127)) ** 0.5)
        # the step time: the recorded steps replayed with the chosen rows' exchange and sync (analyses/replay/;
        # no rank work calibrated here), below the measured 0.1 s on this 1 MB/s link
        assert section["predicted"]["step_time_s"] == pytest.approx(chosen["step_time_s"].item())
        assert section["predicted"]["step_time_s"] < 0.1
        low, high = section["intervals"]["step_time_s"]
        assert low < section["predicted"]["step_time_s"] < high


def test_a_budget_caps_the_replica(tmp_path: Path) -> None:
    one_hot_run(tmp_path / "run", steps=10)
    with open_context(tmp_path / "run", Options(budget_bytes=3 * 32)) as ctx:
        result = replication.derive(ctx)
        assert result.as_json()["budget_bytes_per_rank"] == 96
        assert result.as_json()["predicted"]["replica_bytes_per_rank"] <= 96 and result.rows["hot_rows"].height == 3
        assert result.tables["replication_sweep"].filter(pl.col("chosen"))["point"].item() == "budget"


def test_policies_say_why_they_cannot_be_derived(tmp_path: Path) -> None:
    one_hot_run(tmp_path / "run", steps=2, world=1)
    with open_context(tmp_path / "run") as ctx:
        for module in (replication, tiers, schedule):
            result = module.derive(ctx)
            assert result.section is None and "one rank" in result.reason


def four_rank_run(path: Path) -> None:
    """Table t on rank 0 and u on rank 1 (16-byte rows); each of 4 ranks looks up t:0 and u:0 in
    each of its 40 samples, two steps."""
    tables = [table("t", 10, owner=0, world=4), table("u", 10, owner=1, world=4)]
    batch = [{"t": [[0]] * 40, "u": [[0]] * 40} for _ in range(4)]
    build_run(path, tables, 4, [batch, batch])


def test_tiers_move_inter_node_bytes_inside_nodes(tmp_path: Path) -> None:
    four_rank_run(tmp_path / "run")
    with open_context(tmp_path / "run", Options(topology=Topology(2, 2), budget_bytes=16, intra_bw=1e9, inter_bw=1e6)) as ctx:
        section = tiers.derive(ctx).as_json()
        p = section["predicted"]
        pair = 40 * (4 + 8 + 2 * 16)  # a source's 40 one-hot bags of a table: lengths, ids, rows both ways
        assert p["baseline_intra_bytes_per_step"] == 2 * pair  # ranks 1 -> 0 (t) and 0 -> 1 (u)
        assert p["baseline_inter_bytes_per_step"] == 4 * pair  # ranks 2 and 3 to both owners
        # 16 bytes per rank: one tier-1 row, or both rows in tier 2, t:0's copy on local index 0 and
        # u:0's on 1 of each node (one 16-byte block per rank)
        assert (p["tier1_rows"], p["tier2_rows"]) == (0, 2) and p["memory_bytes_per_rank"] == 16
        # main exchange: every bag leaves, its lengths stay (4 bytes × 40 samples per source and owner)
        # tier-2 exchange, per node: lengths 4·40 per (source, rank of the node); ids and units to the
        # copy's rank, half of them the source's own
        tier2 = 2 * (4 * 160 + 4 * 40 * (8 + 2 * 16))
        assert p["tier2_exchange_bytes_per_step"] == tier2
        assert p["inter_bytes_per_step"] == 4 * 160
        assert p["intra_bytes_per_step"] == 2 * 160 + tier2 / 2
        assert p["a2a_bytes_per_step"] == 8 * 160 + tier2
        # the node copies' sync: each block (one row) among 2 node copies, dense 2(N−1)·16 per block
        # beats sparse (N(N−1)·8 + (N−1)·8·2 + 2(N−1)·16 per block)
        assert p["tier2_sync_bytes_per_step"] == p["sync_inter_bytes_per_step"] == 2 * 2 * 16
        assert section["tier2_sync"] == "dense_allreduce"
        assert p["sync_intra_bytes_per_step"] == 0


def test_on_one_node_tiers_are_replication(tmp_path: Path) -> None:
    one_hot_run(tmp_path / "run", steps=20, rows=300)
    with open_context(tmp_path / "run") as ctx:
        rep, tier = replication.derive(ctx), tiers.derive(ctx)
        assert tier.as_json()["topology"] == {"nodes": 1, "ranks_per_node": 2}
        assert tier.as_json()["predicted"]["tier2_rows"] == 0 and "reduce to replicating" in tier.as_json()["why"]
        assert tier.as_json()["predicted"]["tier1_rows"] == rep.as_json()["predicted"]["hot_rows"]
        for key in ("a2a_bytes_per_step", "a2a_remote_bytes_per_step", "sync_bytes_per_step"):
            assert tier.as_json()["predicted"][key] == pytest.approx(rep.as_json()["predicted"][key])
        assert set(tier.rows["tiers"]["tier"]) == {1}


def hot_rows(result) -> pl.DataFrame:
    """The row list the schedule section names."""
    return result.rows[Path(result.as_json()["hot_rows"]).stem]


def schedule_run(path: Path) -> None:
    tables = [table("a", 10, owner=0), table("b", 10, owner=1)]
    batch = [{"a": [[1], [1], [2], [1]], "b": [[5], [6], [5], [5]]},
             {"a": [[1], [2], [1], [1]], "b": [[5], [5], [5], [6]]}]
    build_run(path, tables, 2, [batch, batch])


def test_schedule_counts_samples_whose_every_id_is_hot(tmp_path: Path) -> None:
    schedule_run(tmp_path / "run")
    with open_context(tmp_path / "run", Options(budget_bytes=32)) as ctx:
        result = schedule.derive(ctx)
        section = result.as_json()
        assert hot_rows(result).select("table_name", "row").rows() == [("a", 1), ("b", 5)]
        # hot samples (a:1 and b:5): rank 0's 1st and 4th, rank 1's 1st and 3rd
        assert section["hot_sample_fraction"] == 0.5
        p = section["predicted"]
        # the hot rows are replicated in every step: each cold sample sends its two lengths entries and
        # its one cold bag (id and rows, 8 + 2·16); hot steps send nothing. Per step on average, 4 cold
        # samples, of which two send their cold bag to the other rank and two only a lengths entry
        assert p["a2a_bytes_per_step"] == 4 * (2 * 4 + 8 + 2 * 16)
        assert p["a2a_remote_bytes_per_step"] == 2 * (4 + 8 + 2 * 16) + 2 * 4
        # the replicas are synchronised every step: dense 2(W−1)·32 beats sparse 2·8 + 8·4 + 2·16·2
        assert p["sync_bytes_per_step"] == 64 and section["sync"] == "dense_allreduce"
        assert result.evidence["hot_step_sync"] == "dense_allreduce"
        assert p["switch_bytes"] == 2 * 1 * 32
        sweep = result.tables["schedule_sweep"]
        assert sweep.filter(pl.col("chosen"))["hot_sample_fraction"].item() == 0.5


def test_a_cold_sequence_id_makes_its_whole_batch_cold(tmp_path: Path) -> None:
    tables = [table("a", 10, owner=0), table("s", 10, kind="sequence", owner=1)]
    batch = [{"a": [[1], [1]], "s": [[7], [7]]}, {"a": [[1], [1]], "s": [[7], [8]]}]
    build_run(tmp_path / "run", tables, 2, [batch])
    with open_context(tmp_path / "run", Options(budget_bytes=32)) as ctx:
        result = schedule.derive(ctx)
    assert hot_rows(result).select("table_name", "row").rows() == [("a", 1), ("s", 7)]
    # which of rank 1's samples holds the 8 is not on record: both count cold
    assert result.as_json()["hot_sample_fraction"] == 0.5
    # rank 1's two cold samples send their lengths (2 tables each) and the one cold lookup, s:8 (its
    # own); of that only a's lengths entries cross to rank 0
    p = result.as_json()["predicted"]
    assert p["a2a_bytes_per_step"] == 2 * 2 * 4 + (8 + 2 * 16)
    assert p["a2a_remote_bytes_per_step"] == 2 * 4


def test_every_section_passes_the_policy_validator(tmp_path: Path) -> None:
    mixed_run(tmp_path / "run")
    with open_context(tmp_path / "run", Options(budget_fraction=0.2)) as ctx:
        policy = new_policy(source_run=str(tmp_path / "run"), model=ctx.model.policy_model())
        rows = {}
        derived = [module.derive(ctx) for module in (replication, tiers, schedule)]
        for result in derived:
            assert result.section is not None, result.reason
            policy[result.name] = result.as_json()
            rows.update(result.rows)
        target = write_policy(tmp_path / "out" / "policy.json", policy, rows)
        loaded = load_policy(target)
        assert set(loaded) >= {"replication", "tiers", "schedule"}
        assert json.loads(target.read_text())["schedule"]["kind"] == "fae"
        for result in derived:
            for name, frame in result.rows.items():
                assert pl.read_parquet(tmp_path / "out" / "policy" / f"{name}.parquet").equals(frame)


def test_without_a_budget_the_schedule_sizes_its_hot_set_by_its_own_merit(tmp_path: Path) -> None:
    schedule_run(tmp_path / "run")
    with open_context(tmp_path / "run", Options(objective="bytes")) as ctx:
        result = schedule.derive(ctx)
        sweep = result.tables["schedule_sweep"]
        curve = replication.count_curve(ctx)
        s = exchange.baseline(ctx)
    chosen = sweep.filter(pl.col("chosen"))
    # the hot set is the K of fewest network bytes: remote all-to-all left (the hot samples' steps
    # send nothing) plus the replicas' sync, over every K of the count order within FAE's share of
    # the tables (2 × 10 rows of 16 bytes), not replication's budget
    assert sweep["merit"].is_not_nan().all()
    allowed = sweep.filter(pl.col("budget_bytes") <= schedule.FAE_HOT_SHARE * 20 * 16)
    assert chosen["merit"].item() == allowed["merit"].min() and allowed.height < sweep.height
    k = chosen["hot_rows"].item()
    assert k == hot_rows(result).height and result.as_json()["budget_bytes_per_rank"] == int(curve.replica_bytes[k])
    fraction = chosen["hot_sample_fraction"].item()
    expected = curve.a2a_rem[k] - fraction * s.base["input_lengths"][1] + curve.sync[k]
    assert chosen["merit"].item() == pytest.approx(expected)
