"""Hot-row replication as the reference trainer applies it (`--policy`, tracekit/dlrm/replicas.py):
it changes where rows are looked up and what travels, never what is computed, and it moves the
bytes the cost model predicted.

1. Exactness: replicating ~10% of every table's rows (the data's most frequent ids, so pooled bags
   are all hot, mixed and cold) gives the per-step losses and every table row of the run without
   the policy, at world 2 (five scenarios, both syncs), world 4 and world 1.
2. Bytes: a recorded 2-rank run is analysed and re-run with its policy, then with the other sync;
   the all-to-all and replica-sync bytes in `comms` equal the prediction, and every rank received
   from each peer what that peer sent it.
3. Refusals: train.py exits 2 with a line naming the file and what differs, before any process
   group starts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import duckdb
import polars as pl
import pytest
import torch

from analyses.analyze import analyze
from analyses.context import Options
from analyses.network import A2A
from analyses.exchange import TRAINER_TAGS
from tests.multiprocess import run_ranks
from tests.recorded import REPO, record
from tests.test_trainer_equivalence import SCENARIOS as EQUIVALENCE_SCENARIOS
from tests.test_trainer_equivalence import SMALL
from tracekit.dlrm import policies
from tracekit.dlrm.config import TrainConfig
from tracekit.dlrm.data import open_dataset
from tracekit.dlrm.replicas import SYNC_LABEL
from tracekit.dlrm.tables import init_rows
from tracekit.dlrm.train import build_tables, run
from tracekit.policy import REPLICATION_SYNCS
from tracekit.policy import new_policy, write_policy

SCENARIOS = {name: EQUIVALENCE_SCENARIOS[name] for name in
             ("table-sgd-pooled", "table-adagrad-sequence", "row-sgd-sequence", "row-adagrad-pooled", "ragged-tail")}
WORLD4 = ("table-sgd-pooled", "row-sgd-sequence")
HOT_FRACTION = 0.1


# exactness -------------------------------------------------------------------------------------

def _config(name: str, batch_size: int) -> TrainConfig:
    return TrainConfig(batch_size=batch_size, **{**SMALL, **SCENARIOS[name]})


def _dataset(cfg: TrainConfig):
    return open_dataset(cfg.data, tables=cfg.tables, rows=cfg.rows_for_data(), num_dense=cfg.dense, pooling=cfg.pooling,
                        samples=cfg.samples, seed=cfg.seed, zipf=cfg.zipf[0], drift=0.0, preset=None, scale=1.0)


def hot_rows(cfg: TrainConfig) -> pl.DataFrame:
    """The HOT_FRACTION most frequent rows of every table over the dataset's first 2048 samples."""
    dataset = _dataset(cfg)
    batch = dataset.batch(0, min(dataset.num_samples, 2048))
    names, rows, offset = [], [], 0
    for t, n in enumerate(batch.lengths.sum(dim=1).tolist()):
        ids, counts = torch.unique(batch.values[offset:offset + n], return_counts=True)
        offset += n
        keep = max(1, int(HOT_FRACTION * dataset.table_rows[t]))
        top = ids[torch.argsort(counts, descending=True, stable=True)][:keep]
        names += [dataset.table_names[t]] * top.numel()
        rows += sorted(top.tolist())
    return pl.DataFrame({"table_name": names, "row": rows})


def write_replication(path: Path, cfg: TrainConfig, world_size: int, sync: str, rows: pl.DataFrame) -> Path:
    """policy.json at `path` replicating `rows` (policy/hot_rows.parquet beside it) for cfg's model."""
    tables = build_tables(cfg, _dataset(cfg))
    policy = new_policy(source_run="tests/test_replication.py", model={
        "tables": [{"name": t.name, "num_rows": t.rows, "dim": t.dim} for t in tables], "world_size": world_size})
    policy["replication"] = {"kind": "hybrid", "rows": "policy/hot_rows.parquet",
                             "budget_bytes_per_rank": len(rows) * cfg.dim * 4, "sync": sync, "predicted": {},
                             "why": f"the {HOT_FRACTION:.0%} most frequent rows of every table"}
    return write_policy(path, policy, rows={"hot_rows": rows})


def _train(rank: int, world_size: int, cfg: TrainConfig, policy_path: Path | None):
    torch.set_num_threads(1)
    dataset = _dataset(cfg)
    policy = None if policy_path is None else policies.load(policy_path, build_tables(cfg, dataset),
                                                            world_size=world_size, local_world_size=world_size)
    result = run(cfg, dataset, rank=rank, world_size=world_size, device=torch.device("cpu"), policy=policy)
    return result.losses, result.weights


def _train_all(rank: int, world_size: int, jobs: list[tuple[TrainConfig, Path | None]]):
    return [_train(rank, world_size, cfg, path) for cfg, path in jobs]


def _train_world(tmp: Path, world_size: int, names, batch_size: int) -> dict:
    """Every scenario without a policy and with one per sync, in one set of spawned gloo ranks:
    {(scenario, sync or None): [(losses, weights) of each rank]}."""
    keys, jobs = [], []
    for name in names:
        cfg = _config(name, batch_size)
        rows = hot_rows(cfg)
        keys.append((name, None))
        jobs.append((cfg, None))
        for sync in REPLICATION_SYNCS:
            keys.append((name, sync))
            jobs.append((cfg, write_replication(tmp / name / sync / "policy.json", cfg, world_size, sync, rows)))
    per_rank = run_ranks(world_size, _train_all, jobs)
    return {key: [per_rank[r][i] for r in range(world_size)] for i, key in enumerate(keys)}


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> dict:
    return _train_world(tmp_path_factory.mktemp("world2"), 2, SCENARIOS, 32)


@pytest.fixture(scope="module")
def world4(tmp_path_factory) -> dict:
    return _train_world(tmp_path_factory.mktemp("world4"), 4, WORLD4, 16)


def assert_same_training(base: list, replicated: list, cfg: TrainConfig) -> None:
    """Per rank: the same per-step losses, the same rows in every local table, the same MLPs."""
    # row-wise Adagrad divides by sqrt of small accumulators: sums in another order drift further
    tol = dict(rtol=1e-4, atol=1e-5) if cfg.optimizer == "adagrad" else dict(rtol=1e-5, atol=1e-6)
    assert all(r[0] == replicated[0][0] for r in replicated), "every rank reports the same global losses"
    torch.testing.assert_close(torch.tensor(replicated[0][0]), torch.tensor(base[0][0]), rtol=1e-5, atol=1e-6)
    for rank, ((_, weights), (_, weights_rep)) in enumerate(zip(base, replicated)):
        assert weights_rep["tables"].keys() == weights["tables"].keys()
        for table, (start, full) in weights["tables"].items():
            start_rep, full_rep = weights_rep["tables"][table]
            assert start_rep == start
            torch.testing.assert_close(full_rep, full, **tol, msg=lambda m: f"rank {rank}, table {table}: {m}")
        for key, value in weights["dense"].items():
            torch.testing.assert_close(weights_rep["dense"][key], value, **tol,
                                       msg=lambda m: f"rank {rank}, {key}: {m}")


def rows_moved(tables: list, rows: pl.DataFrame, ranks: list, seed: int) -> int:
    """How many of `rows` (table_name, row) differ from their initial values in the tables the
    ranks' (losses, weights) end with."""
    moved = 0
    for t, spec in enumerate(tables):
        chosen = torch.tensor(rows.filter(pl.col("table_name") == spec.name)["row"].to_list())
        for _, weights in ranks:
            if spec.name in weights["tables"]:
                start, shard = weights["tables"][spec.name]
                mine = chosen[(chosen >= start) & (chosen < start + shard.shape[0])]
                moved += int((shard[mine - start] != init_rows(spec, t, mine, seed)).any(dim=1).sum())
    return moved


@pytest.mark.slow
@pytest.mark.parametrize("sync", REPLICATION_SYNCS)
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_world2_replication_changes_nothing_computed(name: str, sync: str, world2: dict) -> None:
    assert_same_training(world2[(name, None)], world2[(name, sync)], _config(name, 32))


@pytest.mark.slow
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_world2_hot_set_is_not_vacuous(name: str, world2: dict) -> None:
    """The hot set splits the first steps' pooled bags into all-hot, mixed and cold ones (sequence
    lookups into hot and cold), and the replicated run moved its replicated rows off their initial values."""
    cfg = _config(name, 32)
    dataset, rows = _dataset(cfg), hot_rows(cfg)
    tables = build_tables(cfg, dataset)
    batch = dataset.batch(0, min(dataset.num_samples, cfg.steps * 64))
    kinds = {"all-hot bags": 0, "mixed bags": 0, "cold bags": 0, "hot lookups": 0, "cold lookups": 0}
    offset = 0
    for t, spec in enumerate(tables):
        hot = torch.tensor(rows.filter(pl.col("table_name") == spec.name)["row"].to_list())
        lengths = batch.lengths[t]
        is_hot = torch.isin(batch.values[offset:offset + int(lengths.sum())], hot)
        offset += int(lengths.sum())
        if not spec.pooled:
            kinds["hot lookups"] += int(is_hot.sum())
            kinds["cold lookups"] += int((~is_hot).sum())
            continue
        hot_per_bag = torch.bincount(torch.repeat_interleave(torch.arange(lengths.numel()), lengths)[is_hot],
                                     minlength=lengths.numel())
        kinds["all-hot bags"] += int(((lengths > 0) & (hot_per_bag == lengths)).sum())
        kinds["mixed bags"] += int(((hot_per_bag > 0) & (hot_per_bag < lengths)).sum())
        kinds["cold bags"] += int(((lengths > 0) & (hot_per_bag == 0)).sum())
    if not cfg.sequence_tables:
        del kinds["hot lookups"], kinds["cold lookups"]
    assert min(kinds.values()) > 0, kinds

    assert rows_moved(tables, rows, world2[(name, REPLICATION_SYNCS[0])], cfg.seed) > 0, \
        "training must have updated replicated rows"


@pytest.mark.slow
@pytest.mark.parametrize("sync", REPLICATION_SYNCS)
@pytest.mark.parametrize("name", WORLD4)
def test_world4_replication_changes_nothing_computed(name: str, sync: str, world4: dict) -> None:
    assert_same_training(world4[(name, None)], world4[(name, sync)], _config(name, 16))


@pytest.mark.parametrize("sync", REPLICATION_SYNCS)
@pytest.mark.parametrize("name", ["table-sgd-pooled", "row-adagrad-pooled", "table-adagrad-sequence"])
def test_world1_policy_changes_nothing(name: str, sync: str, tmp_path: Path) -> None:
    """No process group at all, as `python train.py --policy ...` runs."""
    cfg = _config(name, 64)
    path = write_replication(tmp_path / "policy.json", cfg, 1, sync, hot_rows(cfg))
    threads = torch.get_num_threads()
    try:
        base = [_train(0, 1, cfg, None)]
        replicated = [_train(0, 1, cfg, path)]
    finally:
        torch.set_num_threads(threads)
    assert_same_training(base, replicated, cfg)


# bytes -----------------------------------------------------------------------------------------

STEPS = 24
BYTES_ARGS = ["--tables", "4", "--rows", "2000", "--dim", "8", "--bottom-mlp", "16,8", "--top-mlp", "16,1",
              "--batch-size", "64", "--samples", "4096", "--pooling", "2", "--zipf", "1.2", "--sequence-tables", "1",
              "--eval-fraction", "0", "--steps", str(STEPS)]
GATHERS = ("all_gather_single", "all_gather_into_tensor")


def _record_trainer(tmp: Path, *extra: str) -> Path:
    code, run_dir = record(tmp, sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(REPO / "train.py"), *BYTES_ARGS, *extra, options=("--lookup-every", "1"))
    assert code == 0, f"recording failed; see {run_dir}"
    return run_dir


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> dict:
    """A baseline, analysed (replication only, the budget least in network bytes so the choice does
    not hang on loopback timings), re-run with its policy and with the other sync.
    {kind: (run dir, predicted figures, sync)} for kind base, analysed, switched."""
    base = _record_trainer(tmp_path_factory.mktemp("base"))
    summary = analyze(base, Options(policies=("replication",), objective="bytes"))
    assert "replication" in summary["policies"], summary["not_derived"]
    policy = json.loads((base / "policy.json").read_text())
    section = policy["replication"]
    chosen = pl.read_parquet(base / "analysis" / "replication_sweep.parquet").filter(pl.col("chosen"))
    assert chosen.height == 1 and chosen["hot_rows"][0] == section["predicted"]["hot_rows"] > 0
    assert chosen["a2a_bytes_per_step"][0] == pytest.approx(section["predicted"]["a2a_bytes_per_step"], rel=1e-12)

    column = {"sparse_allreduce": "sparse_sync_bytes_per_step", "dense_allreduce": "dense_sync_bytes_per_step"}
    assert chosen[column[section["sync"]]][0] == pytest.approx(section["predicted"]["sync_bytes_per_step"], rel=1e-12)

    other = next(s for s in REPLICATION_SYNCS if s != section["sync"])
    # applied whether this tiny loopback run recommends it or not (as `optimize --check-all` does):
    # beside policy.json, so the same policy/hot_rows.parquet
    applied = {key: value for key, value in section.items() if key != "reason"} | {"recommended": True}
    checked, switched = base / "policy-checked.json", base / "policy-switched.json"
    checked.write_text(json.dumps({**policy, "replication": applied}))
    switched.write_text(json.dumps({**policy, "replication": {**applied, "sync": other}}))
    return {
        "base": (base, None, None),
        "analysed": (_record_trainer(tmp_path_factory.mktemp("analysed"), "--policy", str(checked)),
                     section["predicted"], section["sync"]),
        "switched": (_record_trainer(tmp_path_factory.mktemp("switched"), "--policy", str(switched)),
                     {**section["predicted"], "sync_bytes_per_step": chosen[column[other]][0]}, other),
    }


def test_steps_per_row_counted_as_distinct_steps(recorded: dict) -> None:
    """The replication sweep's steps per row, taken from accesses rows where one rank recorded the
    row, equal the distinct steps that read it, counted for every row."""
    from analyses.context import open_context
    from analyses.policies.replication import access_rows

    with open_context(recorded["base"][0]) as ctx:
        query = 'SELECT tid, "row", n_all, steps_all FROM {} ORDER BY tid, "row"'
        fast = ctx.frame(query.format(access_rows(ctx)))
        assert fast.height > 0 and fast.equals(ctx.frame(query.format(access_rows(ctx, count_distinct=True))))


def _comms(run_dir: Path) -> duckdb.DuckDBPyConnection:
    con = duckdb.connect()
    con.sql(f"CREATE VIEW comms AS SELECT * FROM read_parquet('{run_dir}/comms/**/*.parquet', hive_partitioning=true) "
            f"WHERE phase = 'train'")
    steps, = con.execute(f"SELECT count(DISTINCT step) FROM read_parquet('{run_dir}/steps/**/*.parquet', "
                         f"hive_partitioning=true) WHERE rank = 0").fetchone()
    assert steps == STEPS
    return con


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["analysed", "switched"])
def test_all_to_all_bytes_equal_the_prediction(kind: str, recorded: dict) -> None:
    run_dir, predicted, _ = recorded[kind]
    tags = ", ".join(f"'{t}'" for t in sorted(set(TRAINER_TAGS.values())))
    out, remote = _comms(run_dir).execute(
        f"SELECT sum(bytes_out), sum(bytes_out - splits_out[rank + 1]) FROM comms "
        f"WHERE op = '{A2A}' AND tag IN ({tags})").fetchone()
    assert out / STEPS == pytest.approx(predicted["a2a_bytes_per_step"], rel=1e-9)
    assert remote / STEPS == pytest.approx(predicted["a2a_remote_bytes_per_step"], rel=1e-9)
    base_out, = _comms(recorded["base"][0]).execute(
        f"SELECT sum(bytes_out) FROM comms WHERE op = '{A2A}' AND tag IN ({tags})").fetchone()
    assert out < base_out, "replicas must take lookups off the all-to-all"


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["analysed", "switched"])
def test_replica_sync_bytes_equal_the_prediction(kind: str, recorded: dict) -> None:
    """Wire bytes summed over ranks: all_reduce 2(W−1)/W · bytes_out (ring), all_to_all_single its
    bytes to the other ranks, an all-gather each rank's input to W−1 peers."""
    run_dir, predicted, sync = recorded[kind]
    gathers = ", ".join(f"'{op}'" for op in GATHERS)
    con = _comms(run_dir)
    ops = {op for op, in con.execute(f"SELECT DISTINCT op FROM comms WHERE tag = '{SYNC_LABEL}'").fetchall()}
    if sync == "dense_allreduce":
        assert ops == {"all_reduce"}, ops
    else:  # counts (all-gather), ids (all-to-all), the union's rows (all-reduce)
        assert ops - set(GATHERS) == {"all_reduce", A2A} and len(ops & set(GATHERS)) == 1, ops
    wire, = con.execute(
        f"SELECT sum(CASE WHEN op = 'all_reduce' THEN 2.0 * (group_size - 1) / group_size * bytes_out "
        f"WHEN op = '{A2A}' THEN bytes_out - splits_out[rank + 1] "
        f"WHEN op IN ({gathers}) THEN (group_size - 1) * bytes_out END) "
        f"FROM comms WHERE tag = '{SYNC_LABEL}'").fetchone()
    assert wire / STEPS == pytest.approx(predicted["sync_bytes_per_step"], rel=1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["base", "analysed", "switched"])
def test_every_peer_receives_what_was_sent(kind: str, recorded: dict) -> None:
    """The k-th all-to-all of a step on rank r sent splits_out[q] bytes to q; q's k-th all-to-all of
    that step (same group) received as much from r: splits_in[r]."""
    rows = _comms(recorded[kind][0]).execute(
        f'SELECT "group", step, rank, splits_out, splits_in FROM comms WHERE op = \'{A2A}\' '
        f'ORDER BY "group", step, rank, seq').fetchall()
    calls: dict[tuple, list] = {}
    for group, step, rank, out, into in rows:
        calls.setdefault((group, step, rank), []).append((out, into))
    checked = 0
    for (group, step, rank), mine in calls.items():
        for q in range(len(mine[0][0])):
            theirs = calls[(group, step, q)]
            assert len(theirs) == len(mine), f"step {step}: ranks {rank} and {q} made different numbers of calls"
            for k, ((out, _), (_, into)) in enumerate(zip(mine, theirs)):
                assert out[q] == into[rank], f"step {step}, all-to-all {k}: rank {rank} sent {out[q]} B to {q}, " \
                                             f"which received {into[rank]} B"
                checked += 1
    assert checked >= STEPS * 4 * 2 * 2


# refusals --------------------------------------------------------------------------------------

REFUSAL_ARGS = ["--tables", "3", "--rows", "500", "--dim", "8", "--bottom-mlp", "16,8", "--top-mlp", "16,1",
                "--batch-size", "16", "--samples", "512", "--pooling", "2", "--eval-fraction", "0", "--steps", "2"]
TINY_TABLES = [{"name": f"t{i}", "num_rows": 500, "dim": 8} for i in range(3)]
GOOD_ROWS = pl.DataFrame({"table_name": ["t0", "t1", "t2"], "row": [1, 2, 499]})


def _policy(folder: Path, *, world_size: int = 1, rows: pl.DataFrame = GOOD_ROWS, **sections) -> Path:
    policy = new_policy(source_run="tests/test_replication.py", model={"tables": TINY_TABLES, "world_size": world_size})
    policy["replication"] = {"kind": "hybrid", "rows": "policy/hot_rows.parquet", "budget_bytes_per_rank": 96,
                             "sync": "sparse_allreduce", "predicted": {}, "why": "test"}
    policy.update(sections)
    return write_policy(folder / "policy.json", policy, rows={"hot_rows": rows})


def _tiers(folder: Path, *, nodes: int, per_node: int) -> Path:
    """A valid policy with a tiers section for `nodes` × `per_node` ranks (tier 1: two rows)."""
    policy = _policy(folder, world_size=nodes * per_node)
    pl.DataFrame({"table_name": ["t0", "t1"], "row": [1, 2], "tier": [1, 1]}).write_parquet(
        folder / "policy" / "tiers.parquet")
    return _edit(policy, lambda p: p.update(tiers={"topology": {"nodes": nodes, "ranks_per_node": per_node},
                                                   "rows": "policy/tiers.parquet", "predicted": {}, "why": "test"}))


def _not_json(folder: Path) -> Path:
    (folder / "policy.json").write_text('{"schema": ')
    return folder / "policy.json"


def _rows_not_parquet(folder: Path) -> Path:
    policy = _policy(folder)
    (folder / "policy" / "hot_rows.parquet").write_text("table_name,row\nt0,1\n")
    return policy


def _edit(path: Path, change) -> Path:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))
    return path


@dataclass(frozen=True)
class Refusal:
    build: Callable[[Path], Path]  # writes the policy in a folder, returns policy.json
    says: str  # in the error line, beside the file's path
    args: tuple[str, ...] = ()  # train.py options that differ from REFUSAL_ARGS
    launch: str = "python"  # python | rank0-of-2 | torchrun (_train_py)
    names: str | None = None  # the file named, relative to policy.json's folder (None: policy.json)


def _rows(table_names: list[str], rows: list[int]) -> Callable[[Path], Path]:
    return lambda folder: _policy(folder, rows=pl.DataFrame({"table_name": table_names, "row": rows}))


TIERS_SAYS = "tiers.topology is 2 node(s) × 1 ranks, but this run has 1 node(s) × 2 ranks"
REFUSALS = {
    "other-rows": Refusal(_policy, "table t0: num_rows 500 in the policy, 400 in the model", ("--rows", "400")),
    "other-dim": Refusal(_policy, "table t0: dim 8 in the policy, 16 in the model",
                         ("--dim", "16", "--bottom-mlp", "16,16")),
    "other-tables": Refusal(_policy, "table t3 is in the model but not in the policy", ("--tables", "4")),
    "other-world-size": Refusal(lambda d: _policy(d, world_size=2), "world size 2 in the policy, 1 here"),
    "not-json": Refusal(_not_json, "not valid JSON"),
    "wrong-schema": Refusal(lambda d: _edit(_policy(d), lambda p: p.update(schema="tracekit.policy/9")),
                            "schema: expected \"tracekit.policy/1\" (or no schema field), got 'tracekit.policy/9'"),
    "unknown-sync": Refusal(lambda d: _edit(_policy(d), lambda p: p["replication"].update(sync="gossip")),
                            "replication.sync: expected one of sparse_allreduce, dense_allreduce"),
    "row-out-of-range": Refusal(_rows(["t0", "t1"], [3, 500]),
                                "row 500 of table t1 is out of range: the table has 500 rows",
                                names="policy/hot_rows.parquet"),
    "unknown-table": Refusal(_rows(["t0", "t7"], [3, 4]), "table 't7' is not in the model (tables: t0, t1, t2)",
                             names="policy/hot_rows.parquet"),
    "rows-not-parquet": Refusal(_rows_not_parquet, "not a row list (Parquet with table_name, row)",
                                names="policy/hot_rows.parquet"),
    "dct-dp-refresh": Refusal(lambda d: _policy(d, compression={"dp": {"keep_ratio": 0.01, "refresh_every": 0,
                                                                       "predicted": {}, "why": "test"}}),
                              "compression.dp: refresh_every must be a positive integer, got 0"),
    "tiers-topology": Refusal(lambda d: _tiers(d, nodes=2, per_node=1), TIERS_SAYS, launch="rank0-of-2"),
    "tiers-topology-torchrun": Refusal(lambda d: _tiers(d, nodes=2, per_node=1), TIERS_SAYS, launch="torchrun"),
}


def _train_py(policy: Path, extra: tuple[str, ...], launch: str) -> subprocess.CompletedProcess:
    """train.py with `policy`: as one process ("python"), as rank 0 of 2 with no rendezvous address
    ("rank0-of-2": only a check made before any process group can answer), or under torchrun."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TRACEKIT_") and k not in ("RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                                                           "MASTER_PORT")} | {"OMP_NUM_THREADS": "1"}
    command = [sys.executable]
    if launch == "rank0-of-2":
        env |= {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}
    elif launch == "torchrun":
        command += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    return subprocess.run([*command, str(REPO / "train.py"), *REFUSAL_ARGS, *extra, "--policy", str(policy)],
                          capture_output=True, text=True, timeout=120, cwd=REPO, env=env)


@pytest.fixture(scope="module")
def refusals(tmp_path_factory) -> dict:
    """Every case of REFUSALS, and an accepted policy, each its own train.py; two at a time."""
    jobs = {"accepted": (_policy(tmp_path_factory.mktemp("accepted")), (), "python"),
            "lag": (_policy(tmp_path_factory.mktemp("lag"), lag={"bound": 2, "predicted": {}, "why": "test"}), (),
                    "python")}
    for name, case in REFUSALS.items():
        jobs[name] = (case.build(tmp_path_factory.mktemp(name)), case.args, case.launch)
    with ThreadPoolExecutor(2) as pool:
        done = {name: pool.submit(_train_py, *job) for name, job in jobs.items()}
    return {name: (jobs[name][0], future.result()) for name, future in done.items()}


def test_a_matching_policy_is_applied(refusals: dict) -> None:
    _, proc = refusals["accepted"]
    assert proc.returncode == 0, proc.stderr
    assert "done: 2 steps" in proc.stdout


def test_a_lag_section_is_skipped_in_training_with_one_line(refusals: dict) -> None:
    policy, proc = refusals["lag"]
    assert proc.returncode == 0, proc.stderr
    assert "done: 2 steps" in proc.stdout
    lines = [line for line in proc.stdout.splitlines() if line.startswith("policy")]
    assert lines == [f"policy {policy}: applying replication",
                     "policy: skipped lag: inference-only (train.py --inference --policy FILE applies it)"], proc.stdout


@pytest.mark.parametrize("name", list(REFUSALS))
def test_a_policy_that_cannot_be_applied_is_refused(name: str, refusals: dict) -> None:
    policy, proc = refusals[name]
    case = REFUSALS[name]
    output = f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    named = str(policy if case.names is None else policy.parent / case.names)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("train.py: error: ")]
    assert len(lines) == 1, output  # rank 0 says it, once
    assert named in lines[0] and case.says in lines[0], output
    assert "done:" not in proc.stdout and "step 1/" not in proc.stdout, output
    if case.launch == "torchrun":  # torchrun fails and names rank 0's exit code
        assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, output
    else:
        assert proc.returncode == 2, output
