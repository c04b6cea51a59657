"""`tracekit simulate`: the target's links priced on hand-computed cases; the exchange at another world
size to the byte, against real runs of the trainer on 4 ranks (the baseline, and the replication file
`--write-policy` wrote for that target) and against the trainer's own routing run offline at 16 and 64
ranks; step times that answer to bytes; the command line. The projection against runs on an emulated
cluster is in tests/test_cluster_simulate.py (it needs root)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from analyses.analyze import analyze
from analyses.context import Options, open_context
from analyses.network import WIRE_EFFICIENCY
from analyses.replay.target import TargetLinks
from analyses.simulate import Target, exchange_on, project, simulate
from tests.recorded import REPO, TINY, record
from tracekit import tags
from tracekit.app.cli import cli
from tracekit.dlrm.data import open_dataset
from tracekit.dlrm.sharding import route
from tracekit.placement import ShardingPlan, TableSpec
from tracekit.policy import read_policy

STEPS = 8
BATCH = 32
ROW_BYTES = 8 * 4  # TINY's dim 8, fp32
LINK = 12.5e9  # 100gbit


def test_an_exchange_takes_its_busiest_link() -> None:
    m = np.array([[0, 10, 30, 0],
                  [10, 0, 0, 50],
                  [20, 0, 0, 10],
                  [0, 0, 10, 0]], dtype=float)
    # node 0 = ranks 0, 1; node 1 = ranks 2, 3: node 0 sends 30 + 50 = 80 across and receives 20
    assert TargetLinks(2, 2, inter=10.0, intra=1000.0, latency_s=0.0).exchange_s(m) == pytest.approx(8.0)
    assert TargetLinks(2, 2, inter=10.0, intra=1000.0, latency_s=0.0, duplex=False).exchange_s(m) == pytest.approx(10.0)
    # within node 0 rank 0 and rank 1 each send 10: 10 / intra
    assert TargetLinks(2, 2, inter=1e9, intra=1.0, latency_s=0.0).exchange_s(m) == pytest.approx(10.0)
    # one node: only the ranks' links; 4 nodes: rank 1 sends 60 (10 + 50); the latency once
    assert TargetLinks(1, 4, inter=1.0, intra=10.0, latency_s=0.0).exchange_s(m) == pytest.approx(6.0)
    assert TargetLinks(4, 1, inter=10.0, intra=1.0, latency_s=0.5).exchange_s(m) == pytest.approx(6.5)


def test_a_ring_and_a_gather_take_their_slowest_edge() -> None:
    # 4 ranks: 2(W-1)/W = 1.5 × S a rank over each edge; across nodes the node link is the slowest edge
    assert TargetLinks(2, 2, inter=10.0, intra=100.0, latency_s=0.0).ring_s(100.0) == pytest.approx(15.0)
    assert TargetLinks(1, 4, inter=1.0, intra=100.0, latency_s=0.0).ring_s(100.0) == pytest.approx(1.5)
    assert TargetLinks(1, 1, inter=1.0, intra=1.0, latency_s=0.25).ring_s(100.0) == 0.25
    # an all-gather's edges carry every part but one: 3 × 10 of 4 equal parts
    assert TargetLinks(4, 1, inter=10.0, intra=1.0, latency_s=0.0).gather_s(10.0) == pytest.approx(3.0)


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """TINY on 2 ranks, lookups on every step, analysed (replication derived at a 20% budget)."""
    tmp = tmp_path_factory.mktemp("sim")
    code, run_dir = record(tmp, *_torchrun(2, STEPS), options=("--lookup-every", "1"))
    assert code == 0
    analyze(run_dir, Options(budget_fraction=0.2, objective="bytes", policies=("replication",)))
    return run_dir


def _torchrun(ranks: int, steps: int, *extra: str) -> list[str]:
    options = dict(zip(TINY[::2], TINY[1::2])) | {"--steps": str(steps), "--batch-size": str(BATCH)}
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            str(REPO / "train.py"), *[x for kv in options.items() for x in kv], *extra]


def _rows(result) -> dict[str, dict]:
    return {r["policy"]: r for r in result[0].tables["simulate"].iter_rows(named=True)}


def _measured(run_dir: Path) -> dict[str, dict]:
    """Per role (or tag): bytes a step Σ ranks, and the bytes from rank to rank a step."""
    with open_context(run_dir) as ctx:
        steps = ctx.sql("SELECT count(DISTINCT step) FROM steps").fetchall()[0][0]
        world = ctx.model.world_size
        out: dict[str, dict] = {}
        for role, op, rank, splits, bytes_out in ctx.sql(
                "SELECT coalesce(role, tag), op, rank, splits_out, bytes_out FROM train_comms").fetchall():
            entry = out.setdefault(role, {"op": op, "bytes": 0.0, "pairs": np.zeros((world, world))})
            entry["bytes"] += bytes_out / steps
            if splits is not None and len(splits) == world:
                entry["pairs"][rank] += np.array(splits, dtype=float) / steps
    return out


def test_at_the_recorded_world_the_bytes_are_the_recorded_ones_and_the_policys(run: Path) -> None:
    measured = _measured(run)
    policy = read_policy(run / "policy.json")
    with open_context(run, Options(replay_steps=0)) as ctx:
        rows = _rows(simulate(ctx, Target(2, 1, inter_bw=12.5e6), policy, run / "policy.json"))
    base = rows["baseline"]
    assert base["a2a_bytes_per_step"] == sum(v["bytes"] for k, v in measured.items() if k in tags.EXCHANGE)
    assert base["allreduce_bytes_per_step"] == measured["_sum_allreduce_hook"]["bytes"]
    predicted = policy.sections["replication"].prediction.figures
    for figure in ("a2a_bytes_per_step", "a2a_remote_bytes_per_step", "sync_bytes_per_step"):
        assert rows["replication"][figure] == pytest.approx(predicted[figure], rel=1e-12), figure
    # across two nodes every remote byte and the whole ring (one edge leaving each node) cross
    assert base["inter_node_bytes_per_step"] == pytest.approx(base["a2a_remote_bytes_per_step"]
                                                             + base["allreduce_bytes_per_step"], rel=1e-12)


@pytest.mark.slow
def test_projected_onto_4_ranks_the_bytes_are_a_4_rank_runs_to_the_byte(run: Path, tmp_path: Path) -> None:
    """The 2-rank run projected onto 4 ranks at its batch a rank, against the trainer run on 4 ranks over
    the same samples (STEPS / 2 steps): the baseline's bytes a step and from rank to rank, then those of
    the replication file `--write-policy` wrote for 4 ranks, which depend on which ids are hot in which
    samples, and its sync."""
    policies = tmp_path / "four"
    summary = project(run, Target(1, 4, inter_bw=LINK), write_dir=policies,
                      options=Options(objective="bytes", budget_fraction=0.2))
    written = policies / "policy.replication.json"
    assert str(written) in summary["written"] and read_policy(written).model["world_size"] == 4
    projected = {r["policy"]: r for r in summary["rows"]}
    assert projected["replication"]["hot_rows"] > 0
    for name, extra in (("baseline", ()), ("replication", ("--policy", str(written)))):
        code, four = record(tmp_path / name, *_torchrun(4, STEPS // 2, *extra), options=("--lookup-every", "1"))
        assert code == 0
        measured = _measured(four)
        with open_context(run, Options(replay_steps=0)) as ctx:
            x = exchange_on(ctx, Target(1, 4, inter_bw=LINK),
                            None if name == "baseline" else policies / "policy" / "hot_rows.parquet")
        for role in tags.EXCHANGE:
            np.testing.assert_array_equal(x.pairs[role], measured[role]["pairs"], err_msg=f"{name} {role}")
        row = projected[name]
        assert row["a2a_bytes_per_step"] == sum(measured[role]["bytes"] for role in tags.EXCHANGE), name
        if name == "replication":
            sync = measured[tags.REPLICA_SYNC]
            assert row["sync"] == "dense_allreduce" and sync["op"] == "all_reduce"
            assert row["sync_bytes_per_step"] == pytest.approx(2 * 3 / 4 * sync["bytes"], rel=1e-12)


@pytest.mark.parametrize("world, batch", [(16, 32), (64, 8)])
def test_bytes_at_16_and_64_ranks_are_the_trainers_routing_run_offline(run: Path, world: int, batch: int) -> None:
    """The recorded samples regrouped onto `world` ranks of `batch`, against tracekit/dlrm/sharding.py's
    `route` on each target rank's batch of the same samples (the dataset read as the trainer reads it),
    with no process group: the baseline, and with the hottest rows replicated as ShardedEmbeddings.forward
    serves them (their ids stay, a bag of them alone is sent as -1 and returns no row)."""
    with open_context(run, Options(replay_steps=0)) as ctx:
        target = Target(1, world, inter_bw=LINK, batch=batch)
        base = exchange_on(ctx, target)
        specs = [TableSpec(t.name, t.num_rows, t.dim, t.kind != "sequence") for t in ctx.model.tables]
    dataset = open_dataset("synthetic", tables=4, rows=500, num_dense=13, pooling=3, samples=4096, seed=0,
                           zipf=None, drift=0.0, preset=None, scale=1.0)
    plan = ShardingPlan.build(specs, world, "table")
    samples = BATCH * 2 * STEPS
    assert samples == world * batch  # the recording is one target step
    whole = dataset.batch(0, samples)
    counts = torch.bincount(whole.values + 500 * torch.repeat_interleave(torch.arange(4), whole.lengths.sum(dim=1)))
    hot_keys = torch.argsort(counts, descending=True)[:40]
    rows_file = run / "analysis" / "hot40.parquet"
    import polars as pl
    pl.DataFrame({"table_name": [f"t{int(k) // 500}" for k in hot_keys],
                  "row": [int(k) % 500 for k in hot_keys]}).write_parquet(rows_file)
    with open_context(run, Options(replay_steps=0)) as ctx:
        hot = exchange_on(ctx, target, rows_file)
    for projected, replicated in ((base, None), (hot, hot_keys)):
        expected = {role: np.zeros((world, world)) for role in tags.EXCHANGE}
        for q in range(world):
            b = dataset.batch(q * batch, (q + 1) * batch)
            lengths, values, served = b.lengths, b.values, None
            if replicated is not None:
                table = torch.repeat_interleave(torch.arange(4), b.lengths.sum(dim=1))
                is_hot = torch.isin(values + 500 * table, replicated)
                bag = torch.repeat_interleave(torch.arange(4 * batch), b.lengths.flatten())
                lengths = b.lengths - torch.bincount(bag[is_hot], minlength=4 * batch).view(4, batch)
                values = values[~is_hot]
                served = (lengths > 0) | (b.lengths == 0)
            r = route(plan, lengths, values, served)
            expected[tags.INPUT_LENGTHS][q] = np.array(r.lengths_splits) * 4
            expected[tags.INPUT_IDS][q] = np.array(r.values_splits) * 8
            expected[tags.OUTPUT_FWD][:, q] = np.array(r.rows_back) * ROW_BYTES
            expected[tags.OUTPUT_BWD][q] = np.array(r.rows_back) * ROW_BYTES
        for role in tags.EXCHANGE:
            np.testing.assert_array_equal(projected.pairs[role], expected[role], err_msg=f"{world} {role}")
    assert hot.bytes_out < base.bytes_out


def test_time_answers_to_bytes(run: Path) -> None:
    """On a link slow enough to make the step communication-bound, halving the output all-to-all's bytes
    is predicted faster by the wire time it saves (both directions of the exchange are synchronous calls
    on the step's path); and at 64 ranks on 8 nodes at 100gbit the baseline's communication is within 20%
    of the bound by hand: per call its busiest node link's bytes over the rate, plus the latency."""
    from analyses.target_exchange import exchange
    from analyses.target_time import Case, links_of, source, step_times

    with open_context(run, Options(replay_steps=0)) as ctx:
        target = Target(4, 4, inter_bw=2e6, batch=BATCH)
        src, links = source(ctx, target, []), links_of(target, [])
        x = exchange(src.routed)
        full = float(np.median(step_times(src, links, Case("baseline", x))))
        half = float(np.median(step_times(src, links, Case("halved", x, output_ratio=0.5))))
        saved = sum(links.exchange_s(x.pairs[role]) - links.exchange_s(x.pairs[role] * 0.5)
                    for role in (tags.OUTPUT_FWD, tags.OUTPUT_BWD))
        assert saved > 0.2 * full  # communication-bound: the test can fail
        assert full - half == pytest.approx(saved, rel=0.05)

        big = Target(8, 8, inter_bw=LINK, batch=BATCH, latency_s=20e-6)
        rows = _rows(simulate(ctx, big, derive=False))
    base = rows["baseline"]
    with open_context(run, Options(replay_steps=0)) as ctx:
        x = exchange_on(ctx, big)
    rate = LINK * WIRE_EFFICIENCY
    by_hand = 0.0
    for role in tags.EXCHANGE:  # the busiest node's link, out or in
        busiest = 0.0
        for n in range(8):
            mine = np.zeros(64, dtype=bool)
            mine[n * 8:(n + 1) * 8] = True
            busiest = max(busiest, x.pairs[role][mine][:, ~mine].sum(), x.pairs[role][~mine][:, mine].sum())
        by_hand += busiest / rate + 20e-6
    by_hand += 2 * 63 / 64 * base["allreduce_bytes_per_step"] / 64 / rate + 20e-6  # DDP's one bucket, a ring
    # the replay overlaps the async all-reduce with compute, as recorded: at most the bound, not far below
    assert base["comm_s"] == pytest.approx(by_hand, rel=0.2)


def test_a_recording_shorter_than_one_target_step_says_so_and_scales(run: Path) -> None:
    with open_context(run, Options(replay_steps=0)) as ctx:
        result = simulate(ctx, Target(32, 8, inter_bw=LINK, batch=BATCH), derive=False)
    assert any("cover 0.062 of one target step" in n for n in result[0].notes)
    base = _rows(result)["baseline"]
    assert base["method"] == "regrouped, scaled"
    # lengths are exact whatever the samples: 4 tables' int32 a sample, one table on each of 4 of the ranks
    with open_context(run, Options(replay_steps=0)) as ctx:
        x = exchange_on(ctx, Target(32, 8, inter_bw=LINK, batch=BATCH))
    assert x.pairs[tags.INPUT_LENGTHS].sum() == pytest.approx(256 * BATCH * 4 * 4)


def test_cli_derives_writes_and_reports(run: Path, tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["simulate", str(run), "--topology", "2x2", "--inter-bw", "200mbit", "--json",
                                 "--write-policy", str(tmp_path / "target"), "--objective", "bytes", "--curve"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output)
    assert summary["derived"] and [row["policy"] for row in summary["rows"]][:2] == ["baseline", "replication"]
    assert (tmp_path / "target" / "policy.replication.json").is_file()
    assert read_policy(tmp_path / "target" / "policy.replication.json").model["world_size"] == 4
    for name in ("simulate", "simulate_sweep", "simulate_scale"):
        assert (run / "analysis" / f"{name}.parquet").is_file(), name
    html = (run / "report.html").read_text()
    assert "What-if: this run on 2x2" in html and "against the world size" in html
    r = CliRunner().invoke(cli, ["simulate", str(run), "--topology", "2x1", "--inter-bw", "200mbit",
                                 "--policy", str(run / "policy.json"), "--no-report"])
    assert r.exit_code == 0 and "speedup" in r.output and "as written" in r.output


@pytest.mark.parametrize("args, message", [
    (["--topology", "2by1", "--inter-bw", "1gbit"], "--topology"),
    (["--topology", "2x1", "--inter-bw", "fast"], "--inter-bw"),
    (["--topology", "2x1", "--inter-bw", "1gbit", "--latency", "soon"], "--latency"),
    (["--topology", "2x1", "--inter-bw", "1gbit", "--sharding", "column"], "--sharding"),
    (["--topology", "2x1", "--inter-bw", "1gbit", "--compute-scale", "0"], "--compute-scale"),
    (["--topology", "2x1", "--inter-bw", "1gbit", "--policy", "nowhere.json"], "nowhere.json"),
])
def test_cli_refuses_bad_options_naming_them(run: Path, args: list[str], message: str) -> None:
    r = CliRunner().invoke(cli, ["simulate", str(run), *args])
    assert r.exit_code == 2 and message in r.output
