"""`tracekit analyze` of a real TorchRec DLRM run (torchrec 1.8.0, FBGEMM CPU TBE, 2 gloo ranks,
table-wise): the policies derive for its tables, and analyses/planner.py's planner inputs are
what the job fed and load into TorchRec's own planner.

tests/torchrec_job.py is recorded once per module (4 steps, lookups every 2nd step) and analysed
once; it writes the ids each rank fed, so the pooling factors are checked against them. The
planner is also checked on a tiny run of tracekit's own trainer, where every bag holds `--pooling`
ids.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from analyses import attribution, exchange, planner
from analyses.analyze import analyze
from analyses.context import Options, open_context
from analyses.policies import replication
from tests.recorded import REPO, TINY, record
from tests.torchrec_env import torchrec_python  # noqa: F401

JOB = REPO / "tests" / "torchrec_job.py"
TABLES = {"t0": ["f0", "f1"], "t1": ["f2"], "t2": ["f3"]}  # as in the job
BATCH, ROWS, DIM, RANKS = 8, 200, 16, 2
LOOKUP_EVERY = 2
EMBEDDING_A2A = "op = 'all_to_all_single' AND tag NOT LIKE 'SplitsAllToAll%'"  # input and output dist


@pytest.fixture(scope="module")
def recorded(torchrec_python: Path, tmp_path_factory: pytest.TempPathFactory):
    """recorded(sharding) -> (run_dir, what each rank fed, analyze's summary), each plan recorded and
    analysed once."""
    runs: dict[str, tuple[Path, list[dict], dict]] = {}

    def get(sharding: str) -> tuple[Path, list[dict], dict]:
        if sharding not in runs:
            tmp = tmp_path_factory.mktemp(sharding)
            code, run_dir = record(tmp, str(torchrec_python), "-m", "torch.distributed.run", "--standalone",
                                   "--nproc-per-node", str(RANKS), str(JOB), "--sharding", sharding,
                                   "--out", str(tmp / "fed"), options=("--lookup-every", str(LOOKUP_EVERY)))
            assert code == 0, json.loads((run_dir / "manifest.json").read_text())
            fed = [json.loads((tmp / "fed" / f"rank={r}.json").read_text()) for r in range(RANKS)]
            # bytes, not the default time objective: which replicas pay for their sync in time depends on
            # the step time this run happened to measure (once 0.18 s against 0.009 s: 82 rows chosen)
            runs[sharding] = run_dir, fed, analyze(run_dir, Options(objective="bytes"))
        return runs[sharding]

    return get


@pytest.fixture
def analysed(recorded) -> tuple[Path, list[dict], dict]:
    """The table-wise run most tests read."""
    return recorded("table_wise")


def sampled_steps(fed: list[dict]) -> list[str]:
    return [batch for batch in fed[0] if batch != "eval" and int(batch) % LOOKUP_EVERY == 0]


@pytest.mark.slow
def test_the_attribution_sees_the_batch_of_every_rank(analysed) -> None:
    """The lengths all-to-all carries a length per feature and sample: t0's two features count twice."""
    run_dir, _, _ = analysed
    with open_context(run_dir) as ctx:
        assert attribution.features(ctx) == {t: len(fs) for t, fs in TABLES.items()}
        assert set(attribution.batches(ctx)["b"].cast(pl.Int64)) == {BATCH}
        assert attribution.attributed(ctx).exact


@pytest.mark.slow
def test_replication_and_tiers_predict_the_recorded_exchange(analysed) -> None:
    """Random ids of 200-row tables: replicating nothing (the sweep's first point) predicts the
    exchange the run did, replayed from its lookups: every byte of the input and output dist on the
    sampled steps, and the part that crossed ranks; on one node tiers are replication. (Whether a row
    pays for its sync is borderline here: the sync comes from every step's accesses, the exchange
    from the sampled steps.)"""
    run_dir, fed, summary = analysed
    policy = json.loads((run_dir / "policy.json").read_text())
    assert policy["model"] == {"tables": [{"name": t, "num_rows": ROWS, "dim": DIM} for t in TABLES],
                               "world_size": RANKS}
    steps = sampled_steps(fed)
    with open_context(run_dir) as ctx:
        recorded, crossing = ctx.sql(f"""
            SELECT sum(bytes_out)::DOUBLE, sum(bytes_out - splits_out[rank + 1])::DOUBLE
            FROM train_comms WHERE {EMBEDDING_A2A} AND step IN ({", ".join(steps)})""").fetchall()[0]
    for name in ("replication", "tiers"):
        assert name in summary["policies"], summary["not_derived"]
    nothing = pl.read_parquet(run_dir / "analysis" / "replication_sweep.parquet").filter(hot_rows=0).row(0, named=True)
    assert nothing["a2a_bytes_per_step"] == pytest.approx(recorded / len(steps))
    assert nothing["a2a_remote_bytes_per_step"] == pytest.approx(crossing / len(steps))
    replicated, tiers = policy["replication"]["predicted"], policy["tiers"]["predicted"]
    assert tiers["tier1_rows"] == replicated["hot_rows"]
    for key in ("a2a_bytes_per_step", "a2a_remote_bytes_per_step"):
        assert tiers[key] == pytest.approx(replicated[key]), key
    check = pl.read_parquet(run_dir / "analysis" / "costmodel_check.parquet").filter(check="bytes_out")
    assert check["diff"].to_list() == [0.0] * 4, check


@pytest.mark.slow
def test_replication_frees_what_the_fed_ids_say_at_every_hot_set(analysed) -> None:
    """Replication's replay of TorchRec's exchange, at hot sets of 0 to every row (an order by a hash, so
    every table is cut somewhere), against the bytes counted from what the job fed: a hot id leaves
    the input dist, a bag whose every id is hot leaves the output dist forward and backward, lengths
    stay; what is left is the recorded exchange less that, per sampled step."""
    run_dir, fed, _ = analysed
    steps = sampled_steps(fed)
    with open_context(run_dir) as ctx:
        s = exchange.baseline(ctx)
        curve = replication.curve(ctx, s, "tk_test_order", 'hash(r.tid, r."row")')
        recorded = ctx.sql(f"""SELECT sum(bytes_out)::DOUBLE FROM train_comms
                               WHERE {EMBEDDING_A2A} AND step IN ({", ".join(steps)})""").fetchall()[0][0]
    order = curve.order.sort("pos")
    n = order.height
    read = {(t, v) for per_rank in fed for step in steps for t, fs in TABLES.items() for f in fs
            for v in per_rank[step][f]["values"]}
    assert read <= set(zip(order["table_name"], order["row"]))  # every row read (on every step: more)
    for k in (0, n // 5, n // 2, n - 1, n):
        hot = set(zip(order["table_name"][:k], order["row"][:k]))
        freed = 0
        for per_rank in fed:
            for step in steps:
                for table, features in TABLES.items():
                    for f in features:
                        values, start = per_rank[step][f]["values"], 0
                        for length in per_rank[step][f]["lengths"]:
                            bag = values[start:start + length]
                            start += length
                            hits = sum((table, v) in hot for v in bag)
                            freed += s.id_bytes * hits + (2 * DIM * 4 if bag and hits == len(bag) else 0)
        assert curve.a2a_out[k] == pytest.approx((recorded - freed) / len(steps)), k


def fed_pooling(fed: list[dict]) -> dict[str, float]:
    """Per table, ids per bag per feature the job fed on the sampled training steps."""
    steps = sampled_steps(fed)
    return {table: sum(len(per_rank[step][f]["values"]) for per_rank in fed for step in steps for f in features)
            / (len(steps) * len(fed) * BATCH * len(features)) for table, features in TABLES.items()}


@pytest.mark.slow
def test_pooling_factors_are_what_the_job_fed(analysed) -> None:
    run_dir, fed, _ = analysed
    frame = pl.read_parquet(run_dir / "analysis" / "planner.parquet")
    expected = fed_pooling(fed)
    for row in frame.iter_rows(named=True):
        assert row["pooling_factor"] == pytest.approx(expected[row["table_name"]]), row
        assert (row["num_embeddings"], row["embedding_dim"], row["n_features"]) == (ROWS, DIM, len(TABLES[row["table_name"]]))
    written = json.loads((run_dir / "analysis" / "torchrec_constraints.json").read_text())
    assert {t: c["pooling_factors"] for t, c in written.items()} == {
        t: [pytest.approx(expected[t], abs=1e-6)] * len(fs) for t, fs in TABLES.items()}


@pytest.mark.slow
def test_a_data_parallel_run_has_no_exchange_and_the_same_pooling_factors(recorded) -> None:
    """Every table replicated: no input dist to count samples by, so each rank's bags in `lookups`
    do; the cost model and the embedding policies say why they have nothing to model."""
    run_dir, fed, summary = recorded("data_parallel")
    frame = pl.read_parquet(run_dir / "analysis" / "planner.parquet")
    expected = fed_pooling(fed)
    assert {t: p for t, p in frame.select("table_name", "pooling_factor").unique().iter_rows()} == {
        t: pytest.approx(v) for t, v in expected.items()}
    assert "costmodel" not in summary["analyses"] and any("no sharded table" in n for n in summary["notes"])
    assert {"replication", "tiers"} <= summary["not_derived"].keys()


@pytest.mark.slow
def test_cache_load_factors_grow_with_the_target_hit_rate(analysed) -> None:
    run_dir, _, summary = analysed
    frame = pl.read_parquet(run_dir / "analysis" / "planner.parquet").sort("table_name", "target_hit_rate")
    assert frame["target_hit_rate"].to_list() == list(planner.TARGET_HIT_RATES) * len(TABLES)
    assert ((frame["cache_load_factor"] > 0) & (frame["cache_load_factor"] <= 1)).all()
    assert (frame["hit_rate"] >= frame["target_hit_rate"]).all()
    for _, part in frame.group_by("table_name"):
        assert part["cache_load_factor"].is_sorted(), part
    written = json.loads((run_dir / "analysis" / "torchrec_constraints.json").read_text())
    default = frame.filter(target_hit_rate=planner.DEFAULT_HIT_RATE)
    assert {t: c["cache_params"]["load_factor"] for t, c in written.items()} == dict(
        default.select("table_name", "cache_load_factor").iter_rows())
    assert summary["analyses"]["planner"]["tables"].keys() == TABLES.keys()


PLAN = '''
import json, sys, torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
from torchrec.distributed.planner import Topology
topology = Topology(world_size=2, compute_device="cpu")
exec(sys.stdin.read())  # the snippet `tracekit planner` prints: constraints, planner
tables = {"t0": ["f0", "f1"], "t1": ["f2"], "t2": ["f3"]}
ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=t, embedding_dim=16, num_embeddings=200, feature_names=fs)
                                     for t, fs in tables.items()], device=torch.device("meta"))
plan = planner.plan(ebc, [EmbeddingBagCollectionSharder()])
print(json.dumps({"constraints": {t: [type(c).__name__, c.pooling_factors, type(c.cache_params).__name__,
                                      c.cache_params.load_factor] for t, c in constraints.items()},
                  "plan": {t: p.cache_params.load_factor for t, p in plan.plan[""].items()},
                  "stats": {t: [type(c.cache_params.stats).__name__, c.cache_params.stats.expected_lookups,
                                [c.cache_params.stats.expected_miss_rate(x) for x in (0.05, 0.2, 0.5)]]
                            for t, c in constraints.items()}}))
'''


@pytest.mark.slow
def test_the_snippet_loads_the_constraints_into_torchrecs_planner(analysed, torchrec_python: Path) -> None:
    """The printed snippet builds real ParameterConstraints and CacheParams, with the trace's LRU curve
    as TorchRec's EmbeddingOffloadStats (its miss rates at the simulated load factors those of the
    replay), and TorchRec's planner plans with them on a CPU topology, each table's sharding carrying
    its load factor (the caching kernel itself is CUDA-only: on CPU the planner picks the fused kernel)."""
    run_dir, _, _ = analysed
    path = run_dir / "analysis" / "torchrec_constraints.json"
    written = json.loads(path.read_text())
    proc = subprocess.run([str(torchrec_python), "-c", PLAN], input=planner.snippet(str(path)), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["constraints"] == {t: ["ParameterConstraints", c["pooling_factors"], "CacheParams",
                                      c["cache_params"]["load_factor"]] for t, c in written.items()}
    assert out["plan"] == {t: c["cache_params"]["load_factor"] for t, c in written.items()}
    # the cache statistics TorchRec's planner estimates with: the trace's LRU curve, in its own class
    curves = json.loads((run_dir / "analysis" / "torchrec_cache_stats.json").read_text())["tables"]
    for t, (kind, lookups, misses) in out["stats"].items():
        assert kind == "EmbeddingOffloadStats" and lookups == round(curves[t]["expected_lookups"])
        assert misses == pytest.approx([curves[t]["expected_miss_rate"][lf] for lf in ("0.05", "0.2", "0.5")],
                                       abs=1e-5)


@pytest.mark.slow
def test_planner_command_prints_the_snippet(analysed) -> None:
    from click.testing import CliRunner

    from tracekit.app.cli import cli

    run_dir, _, _ = analysed
    r = CliRunner().invoke(cli, ["planner", str(run_dir), "--json"])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.output)
    assert summary["tables"]["t0"]["n_features"] == 2 and "ParameterConstraints(" in summary["snippet"]
    r = CliRunner().invoke(cli, ["planner", str(run_dir)])
    assert r.exit_code == 0, r.output
    assert r.output.startswith("t0: 200 rows x 16, 2 feature(s), pooling factor ") and planner.snippet(
        summary["constraints"]) in r.output


# --- tracekit's own trainer ---

def test_the_trainers_pooling_factor_is_its_bag_size(tmp_path: Path) -> None:
    """Every bag of the TINY trainer holds --pooling 3 ids, one feature per table: the pooling factor
    is exactly 3 (from `lookups` over `steps.samples`), and the planner's load factors come from
    the cache curves of the same run."""
    code, run_dir = record(tmp_path, sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(REPO / "train.py"), *TINY, options=("--lookup-every", "2"))
    assert code == 0
    with open_context(run_dir) as ctx:
        result = planner.compute(ctx)
    frame = result.tables["planner"]
    assert frame["pooling_factor"].to_list() == [3.0] * 4 * len(planner.TARGET_HIT_RATES)
    assert set(frame["n_features"]) == {1}
    assert result.summary["pooling_source"].endswith("/ (steps.samples x features)")
    assert ((frame["cache_load_factor"] > 0) & (frame["cache_load_factor"] <= 1)).all()
    assert json.loads((run_dir / "analysis" / "torchrec_constraints.json").read_text())["t0"]["pooling_factors"] == [3.0]


@pytest.mark.parametrize(("hits", "target", "expected"), [
    ([0.5, 0.95], 0.9, (0.5, 0.95, "simulated")),  # the smallest load factor that reaches it
    ([0.5, 0.95], 0.975, (0.75, 0.975, "interpolated")),  # beyond: the line to (1.0, 1.0)
    ([0.5, 0.5], 0.9, (0.9, 0.9, "interpolated")),
])
def test_a_load_factor_reaches_its_target_on_the_lru_curve(hits, target, expected) -> None:
    load_factor, hit_rate, source = planner.load_factor_for([0.1, 0.5], hits, target)
    assert (load_factor, hit_rate, source) == (pytest.approx(expected[0]), pytest.approx(expected[1]), expected[2])
