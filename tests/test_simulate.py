"""`tracekit simulate`: the link model on hand-computed cases, and projections of a recorded trainer
run checked against the run's own bytes (comms) and its policy's replayed predictions; scaling to
another world size; the command line. The projection against runs measured on an emulated cluster
is in tests/test_cluster_simulate.py (it needs root)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from analyses.analyze import analyze
from analyses.context import Options, open_context
from analyses.network import WIRE_EFFICIENCY, exchange_time, ring_time
from analyses.projected_traffic import TIER2_TAG, scaled, with_compression, with_policy
from analyses.simulate import Target, comm_time, simulate
from analyses.step_traffic import Traffic
from tests.recorded import REPO, TINY, record
from tracekit.app.cli import cli
from tracekit.policy import load_policy

STEPS = 8


def test_exchange_time_takes_the_busiest_link() -> None:
    m = np.array([[0, 10, 30, 0],
                  [10, 0, 0, 50],
                  [20, 0, 0, 10],
                  [0, 0, 10, 0]], dtype=float)
    # node 0 = ranks 0, 1; node 1 = ranks 2, 3: node 0 sends 30 + 50 = 80 and receives 20 across
    assert exchange_time(m, 2, 2, inter=10.0, intra=1000.0) == pytest.approx(8.0)
    # within node 0, rank 0 and rank 1 each send 10: 10 / intra
    assert exchange_time(m, 2, 2, inter=1e9, intra=1.0) == pytest.approx(10.0)
    # one node: only the loopback counts; 4 nodes: rank 1 sends 60 (10 + 50)
    assert exchange_time(m, 1, 4, inter=1.0, intra=10.0) == pytest.approx(6.0)
    assert exchange_time(m, 4, 1, inter=10.0, intra=1.0) == pytest.approx(6.0)


def test_collectives_of_different_tags_are_timed_one_after_the_other() -> None:
    # the forward sends 0 -> 1 and the backward 1 -> 0: summed, each direction would carry 100 at once
    forward, backward = np.array([[0, 100], [0, 0]], float), np.array([[0, 0], [100, 0]], float)
    t = Traffic(2, {"fwd": forward, "bwd": backward}, 2, 0.0, 0, 0.0, 0, 0)
    link = 10 / WIRE_EFFICIENCY
    assert comm_time(t, Target(2, 1, inter_bw=link), intra=1e9, latency=0.0) == pytest.approx(20.0)
    assert comm_time(t, Target(2, 1, inter_bw=link), intra=1e9, latency=0.5) == pytest.approx(21.0)


def test_ring_time_is_the_slowest_ring_edge() -> None:
    # 4 ranks: 2(W-1)/W = 1.5 × S per rank over each edge
    assert ring_time(100.0, 2, 2, inter=10.0, intra=100.0) == pytest.approx(15.0)
    assert ring_time(100.0, 1, 4, inter=1.0, intra=100.0) == pytest.approx(1.5)
    assert ring_time(100.0, 1, 1, inter=1.0, intra=1.0) == 0.0


def test_compression_shrinks_the_float_exchange_and_moves_gradients_to_all_gathers() -> None:
    ids, rows = np.array([[0, 40], [40, 0]], float), np.array([[8, 800], [800, 8]], float)
    t = Traffic(2, {"ids": ids, "rows.forward": rows}, 2, ring=1000.0, ring_calls=2, gather=0.0, gather_calls=0,
                other_calls=0, float_tags=frozenset({"rows.forward"}))
    mp = with_compression(t, "compression.mp", {"predicted": {"ratio": 0.25}})
    assert np.array_equal(mp.exchange["ids"], ids) and np.array_equal(mp.exchange["rows.forward"], rows / 4)
    # Σ ranks: 2000 all-reduced, 100 sent instead: 50 per rank, gathered by the other
    dp = with_compression(t, "compression.dp", {"predicted": {"baseline_dp_bytes_per_step": 2000.0,
                                                              "dp_bytes_per_step": 100.0}})
    assert (dp.ring, dp.ring_calls, dp.gather, dp.gather_calls) == (0.0, 0.0, 50.0, 4.0)
    link = Target(2, 1, inter_bw=10 / WIRE_EFFICIENCY)
    assert comm_time(dp, link, intra=1e9, latency=0.0) == pytest.approx((40 + 800 + 50) / 10)



def test_tiers_across_nodes_keep_tier_2_inside_nodes_and_sync_the_copies_between_them() -> None:
    """2 nodes × 2 ranks: the main exchange scaled to its predicted bytes, the tier-2 exchange only
    between ranks of a node, tier 1's sync a ring of every rank, the node copies' a ring of the nodes;
    projected onto 8 × 8, the tier-2 exchange stays inside the nodes with its bytes per sample."""
    world = 4
    exchange = np.full((world, world), 100.0)  # 400 on the diagonal, 1200 remote
    base = Traffic(world, {"a2a": exchange}, 4, 0.0, 0, 0.0, 0, 0)
    section = {"topology": {"nodes": 2, "ranks_per_node": 2}, "tier1_sync": "dense_allreduce",
               "tier2_sync": "dense_allreduce",
               "predicted": {"a2a_bytes_per_step": 1000.0 + 160.0, "a2a_remote_bytes_per_step": 300.0 + 80.0,
                             "tier2_exchange_bytes_per_step": 160.0, "tier2_exchange_remote_bytes_per_step": 80.0,
                             "sync_bytes_per_step": 6 * 10.0 + 2 * 50.0, "tier2_sync_bytes_per_step": 2 * 50.0,
                             "tier1_bytes_per_rank": 10.0, "tier2_bytes_per_node": 50.0}}
    t = with_policy(base, section)
    main, near = t.exchange["a2a"], t.exchange[TIER2_TAG]
    assert np.trace(main) == pytest.approx(700.0) and main.sum() - np.trace(main) == pytest.approx(300.0)
    assert near.sum() == pytest.approx(160.0) and np.trace(near) == pytest.approx(80.0)
    assert near[0, 2] == near[1, 3] == 0 and near[0, 1] == pytest.approx(20.0)  # within nodes only
    assert (t.sync_ring, t.node_ring, t.node_wire) == (10.0, 50.0, 100.0)
    figures = t.figures()
    assert figures["sync_bytes_per_step"] == pytest.approx(160.0) and figures["a2a_bytes_per_step"] == pytest.approx(1160.0)
    link = Target(2, 2, inter_bw=1.0 / WIRE_EFFICIENCY)
    # the main exchange: each node sends 4 × 25 across; tier 2 is intra (free here); rings: 1.5 × 10, 1 × 50
    assert comm_time(t, link, intra=1e12, latency=0.0) == pytest.approx(100.0 + 15.0 + 50.0)
    big = scaled(t, 1.0, Target(8, 8, inter_bw=1.0), 1.0)
    node = np.arange(64) // 8
    assert big.exchange[TIER2_TAG][node[:, None] != node[None, :]].sum() == 0
    assert big.exchange[TIER2_TAG].sum() == pytest.approx(160.0 / 4 * 64)
    assert big.node_wire == pytest.approx(2 * 7 * 50.0) and big.node_ring == pytest.approx(50.0)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """TINY on 2 ranks, lookups on every step, analysed (replication derived at a 20% budget)."""
    tmp = tmp_path_factory.mktemp("sim")
    options = dict(zip(TINY[::2], TINY[1::2])) | {"--steps": str(STEPS)}
    code, run_dir = record(tmp, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           "2", str(REPO / "train.py"), *[x for kv in options.items() for x in kv],
                           options=("--lookup-every", "1"))
    assert code == 0
    analyze(run_dir, Options(budget_fraction=0.2, objective="bytes", policies=("replication",)))
    return run_dir


def _comms_per_step(run_dir: Path) -> dict[str, float]:
    with open_context(run_dir) as ctx:
        rows = ctx.sql("""SELECT op, sum(bytes_out)::DOUBLE / (SELECT count(DISTINCT step) FROM steps)
                          FROM train_comms GROUP BY op""").fetchall()
    return dict(rows)


def test_same_world_bytes_are_the_recorded_ones_and_the_policys_prediction(run: Path) -> None:
    policy = load_policy(run / "policy.json")
    measured = _comms_per_step(run)
    for topology, path in (((2, 1), run / "policy.json"), ((1, 2), run / "policy.json"), ((2, 1), None)):
        # with the policy's path its rows are replayed pair by pair; without, the exchange is scaled
        with open_context(run) as ctx:
            result = simulate(ctx, Target(*topology, inter_bw=12.5e6), policy, path)
        rows = {r["policy"]: r for r in result.tables["simulate"].iter_rows(named=True)}
        base = rows["baseline"]
        assert base["method"] == "replay"
        assert base["a2a_bytes_per_step"] == pytest.approx(measured["all_to_all_single"], rel=1e-12)
        assert base["allreduce_bytes_per_step"] == pytest.approx(measured["all_reduce"], rel=1e-12)
        predicted = policy["replication"]["predicted"]
        assert rows["replication"]["a2a_bytes_per_step"] == pytest.approx(predicted["a2a_bytes_per_step"], rel=1e-9)
        assert rows["replication"]["a2a_remote_bytes_per_step"] == pytest.approx(
            predicted["a2a_remote_bytes_per_step"], rel=1e-9)
        assert rows["replication"]["sync_bytes_per_step"] == predicted["sync_bytes_per_step"]
    # across two nodes every remote byte and the whole DDP ring cross the link
    with open_context(run) as ctx:
        two_nodes = simulate(ctx, Target(2, 1, inter_bw=12.5e6), policy).tables["simulate"].row(0, named=True)
    assert two_nodes["inter_node_bytes_per_step"] == pytest.approx(
        two_nodes["a2a_remote_bytes_per_step"] + two_nodes["allreduce_bytes_per_step"], rel=1e-12)


def test_step_time_is_compute_plus_the_link_time(run: Path) -> None:
    with open_context(run) as ctx:
        slow = simulate(ctx, Target(2, 1, inter_bw=1.25e6, latency_s=0.0)).tables["simulate"].row(0, named=True)
        fast = simulate(ctx, Target(2, 1, inter_bw=125e6, latency_s=0.0)).tables["simulate"].row(0, named=True)
        assert slow["compute_s"] == fast["compute_s"] > 0
        # at 2 ranks on 2 nodes each rank sends its remote exchange and one ring share (S) over its own link: the
        # replay (analyses/replay/) takes at least that long, and at most twice (gloo's all-to-all between
        # ranks that enter apart moves one way, then the other)
        one_way = (slow["a2a_remote_bytes_per_step"] + slow["allreduce_bytes_per_step"]) / 2 / (1.25e6 * WIRE_EFFICIENCY)
        assert 0.95 * one_way <= slow["comm_s"] <= 2.05 * one_way
        assert slow["step_time_s"] == pytest.approx(slow["compute_s"] + slow["comm_s"])
        assert slow["comm_share"] > fast["comm_share"]


def test_another_world_keeps_bytes_per_sample(run: Path) -> None:
    with open_context(run) as ctx:
        policy = load_policy(run / "policy.json")
        base = simulate(ctx, Target(1, 2, inter_bw=1e9), policy).tables["simulate"]
        big = simulate(ctx, Target(4, 2, inter_bw=1e9, batch=64), policy)
        assert any("scaled" in n for n in big.notes)
        rows = {r["policy"]: r for r in big.tables["simulate"].iter_rows(named=True)}
        b0 = base.row(0, named=True)
        assert rows["baseline"]["method"] == "scaled"
        per_sample = b0["a2a_bytes_per_step"] / (2 * b0["batch_per_device"])
        assert rows["baseline"]["a2a_bytes_per_step"] / (8 * 64) == pytest.approx(per_sample)
        baseline = rows["baseline"]
        assert baseline["a2a_remote_bytes_per_step"] == pytest.approx(baseline["a2a_bytes_per_step"] * 7 / 8)
        assert rows["baseline"]["allreduce_bytes_per_step"] / 8 == pytest.approx(b0["allreduce_bytes_per_step"] / 2)
        assert rows["baseline"]["compute_s"] == pytest.approx(b0["compute_s"] * 64 / b0["batch_per_device"])
        replicas = policy["replication"]["predicted"]["replica_bytes_per_rank"]
        # a dense ring of the replicas
        assert rows["replication"]["sync_bytes_per_step"] == pytest.approx(2 * 7 * replicas)


@pytest.mark.slow
def test_a_projection_to_4_ranks_has_the_bytes_a_4_rank_run_records(run: Path, tmp_path: Path) -> None:
    """The 2-rank run projected onto 1 node of 4 ranks at the same batch per rank, against TINY recorded
    on 4 ranks: the exchange's bytes per sample (pooling 3: the same ids per sample at any world size),
    the share of them that crosses ranks (table-wise, a rank owns one of 4 tables: 3/4 of each bag
    comes from another rank) and DDP's all-reduce of the same dense gradients on each rank."""
    options = dict(zip(TINY[::2], TINY[1::2])) | {"--steps": str(STEPS)}
    code, four = record(tmp_path, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                        "4", str(REPO / "train.py"), *[x for kv in options.items() for x in kv])
    assert code == 0
    with open_context(run) as ctx:
        projected = simulate(ctx, Target(1, 4, inter_bw=1e9, batch=int(options["--batch-size"]))).tables["simulate"]
    projected = projected.row(0, named=True)
    assert projected["method"] == "scaled"
    measured = _comms_per_step(four)
    with open_context(four) as ctx:
        remote = ctx.sql("""SELECT sum(bytes_out - splits_out[rank + 1])::DOUBLE / (SELECT count(DISTINCT step) FROM steps)
                            FROM train_comms WHERE op = 'all_to_all_single'""").fetchall()[0][0]
    assert projected["a2a_bytes_per_step"] == pytest.approx(measured["all_to_all_single"], rel=1e-12)
    assert projected["a2a_remote_bytes_per_step"] == pytest.approx(remote, rel=1e-12)
    assert projected["allreduce_bytes_per_step"] == pytest.approx(measured["all_reduce"], rel=1e-12)


def test_cli_prints_writes_and_reports(run: Path) -> None:
    r = CliRunner().invoke(cli, ["simulate", str(run), "--topology", "2x1", "--inter-bw", "200mbit", "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output)
    assert [row["policy"] for row in summary["rows"]] == ["baseline", "replication"]
    assert (run / "analysis" / "simulate.parquet").is_file() and (run / "analysis" / "simulate.json").is_file()
    assert "What-if: this run on 2x1" in (run / "report.html").read_text()
    r = CliRunner().invoke(cli, ["simulate", str(run), "--topology", "2x1", "--inter-bw", "200mbit", "--no-report"])
    assert r.exit_code == 0 and "speedup" in r.output


@pytest.mark.parametrize("args, message", [
    (["--topology", "2by1", "--inter-bw", "1gbit"], "--topology"),
    (["--topology", "2x1", "--inter-bw", "fast"], "--inter-bw"),
    (["--topology", "2x1", "--inter-bw", "1gbit", "--latency", "soon"], "--latency"),
    (["--topology", "2x1", "--inter-bw", "1gbit", "--policy", "nowhere.json"], "nowhere.json"),
])
def test_cli_refuses_bad_options_naming_them(run: Path, args: list[str], message: str) -> None:
    r = CliRunner().invoke(cli, ["simulate", str(run), *args])
    assert r.exit_code == 2 and message in r.output
