"""Source-rank attribution (analyses/attribution.py): runs written with RunWriter whose lookups and
input-dist all-to-alls follow the trainer's layout (build_run, shared with the cost model and
policy tests), and real 2-rank trainer runs checked against the samples the trainer consumed."""

from __future__ import annotations

import shutil
import sys
from collections import Counter
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.manifests import write_manifest
from analyses import attribution
from analyses.context import Options, open_context
from tests.recorded import REPO, TINY, record
from tracekit.dlrm.data import open_dataset
from tracekit.run import open_run
from tracekit.store import RunWriter


def table(name: str, rows: int, *, dim: int = 4, kind: str = "pooled", owner: int | None = 0,
          world: int = 2, placement: str = "sharded") -> dict:
    """A manifest table: whole on `owner`, or row-wise over `world` ranks when owner is None."""
    if owner is None:
        block = -(-rows // world)
        shards = [{"rank": r, "first_row": r * block, "num_rows": min(rows, (r + 1) * block) - r * block}
                  for r in range(world)]
    else:
        shards = [{"rank": owner, "first_row": 0, "num_rows": rows}]
    return {"name": name, "num_rows": rows, "dim": dim, "dtype": "float32", "kind": kind, "placement": placement,
            "padding_idx": None, "shards": shards}


def _owner_of(t: dict, row: int) -> int:
    for s in t["shards"]:
        if s["first_row"] <= row < s["first_row"] + s["num_rows"]:
            return s["rank"]
    raise ValueError(row)


def exchange(tables: list[dict], world: int, batch: list[dict[str, list[list[int]]]]):
    """One step of the trainer's exchange. batch[q][table] = per sample of rank q its ids.
    Returns (lookups per owner: rows of (table, sample, pos, row, src, src_sample)), and per rank
    the four all-to-alls as (dtype, splits_out, splits_in))."""
    b = [len(next(iter(batch[q].values()))) if batch[q] else 0 for q in range(world)]
    on = {o: [t for t in tables if t["placement"] == "sharded" and any(s["rank"] == o for s in t["shards"])]
          for o in range(world)}
    lookups = {o: [] for o in range(world)}
    ids = [[0] * world for _ in range(world)]  # ids[q][o]
    rows_back = [[0] * world for _ in range(world)]  # rows o -> q, in bytes
    for o in range(world):
        for t in on[o]:
            seq_index, start = 0, 0
            for q in range(world):
                for k, bag in enumerate(batch[q][t["name"]]):
                    mine = [r for r in bag if _owner_of(t, r) == o]
                    ids[q][o] += len(mine)
                    for pos, r in enumerate(mine):
                        if t["kind"] == "pooled":
                            lookups[o].append((t["name"], start + k, pos, r, q, k))
                        else:
                            lookups[o].append((t["name"], seq_index, 0, r, q, None))  # sample not on record
                            seq_index += 1
                    rows_back[q][o] += 4 * t["dim"] * (1 if t["kind"] == "pooled" else len(mine))
                start += b[q]
    for o in range(world):  # unsharded tables: looked up where the sample is
        for t in (t for t in tables if t["placement"] != "sharded"):
            for k, bag in enumerate(batch[o][t["name"]]):
                lookups[o].extend((t["name"], k, pos, r, o, k) for pos, r in enumerate(bag))
    calls = {}
    for r in range(world):
        calls[r] = [
            ("torch.int32", [4 * len(on[o]) * b[r] for o in range(world)],
             [4 * len(on[r]) * b[q] for q in range(world)]),
            ("torch.int64", [8 * ids[r][o] for o in range(world)], [8 * ids[q][r] for q in range(world)]),
            ("torch.float32", [rows_back[q][r] for q in range(world)], [rows_back[r][o] for o in range(world)]),
        ]
        calls[r].append(("torch.float32", calls[r][2][2], calls[r][2][1]))
    return lookups, calls


TAGS = ["ShardedEmbeddings._input_dist", "ShardedEmbeddings._input_dist", "_AllToAll.forward", "_AllToAll.backward"]


def build_run(path: Path, tables: list[dict], world: int, steps: list[list[dict[str, list[list[int]]]]],
              *, sampled: set[int] | None = None, a2a_bw: float = 1e9, ar_bw: float = 1e8,
              step_s: float = 0.1) -> dict[tuple, list]:
    """A run directory holding the lookups (on `sampled` steps, default all) and comms of the
    trainer's exchange for `steps` (steps[s][q][table] = ids per sample), one all_reduce of 1 MB
    per step and a steps table. Returns the truth: (step, owner, table, sample, pos) ->
    [row, src, src_sample]."""
    truth = {}
    writers = {r: RunWriter(path, r) for r in range(world)}
    t = 0
    for s, batch in enumerate(steps):
        lookups, calls = exchange(tables, world, batch)
        for r in range(world):
            w = writers[r]
            rows = lookups[r]
            if (sampled is None or s in sampled) and rows:
                w.append("lookups", {"step": [s] * len(rows), "table_name": [x[0] for x in rows],
                                     "sample": [x[1] for x in rows], "pos": [x[2] for x in rows],
                                     "row": [x[3] for x in rows], "phase": ["train"] * len(rows),
                                     "feature": [0] * len(rows)})
                for x in rows:
                    truth[(s, r, x[0], x[1], x[2])] = [x[3], x[4], x[5]]
            n = 0
            for k, (dtype, out, inn) in enumerate(calls[r] if world > 1 else []):
                d = int(max(sum(out), 1) / a2a_bw * 1e9)
                w.append("comms", _comm(s, n, "all_to_all_single", dtype, out, inn, t, t + d, TAGS[k]))
                n += 1
            w.append("comms", _comm(s, n, "all_reduce", "torch.float32", [], [], t, t + int(2 * 1e6 / ar_bw * 1e9),
                                    "_sum_allreduce_hook", size=1_000_000, world=world))
            w.append("steps", {"step": [s], "t_start_ns": [t], "t_end_ns": [t + int(step_s * 1e9)], "samples": [0],
                               "loss": [0.5]})
        t += int(step_s * 1e9)
    for w in writers.values():
        w.close()
    write_manifest(path, {"schema_version": "1.1", "status": "completed", "world_size": world,
                          "ranks": list(range(world)), "tables": tables,
                          "collector_settings": {"lookup_every": 1}})
    return truth


def _comm(step, seq, op, dtype, out, inn, t0, t1, tag, size=None, world=2):
    if size is not None:
        out_b = in_b = size
        out, inn = [], []
    else:
        out_b, in_b = sum(out), sum(inn)
    return {"step": [step], "seq": [seq], "op": [op], "group": ["0"], "group_size": [world], "dtype": [dtype],
            "bytes_out": [out_b], "bytes_in": [in_b], "splits_out": [out], "splits_in": [inn], "t_start_ns": [t0],
            "t_end_ns": [t1], "tag": [tag], "async": [False], "phase": ["train"]}


def attributed_rows(run: Path, options: Options | None = None) -> tuple[dict, attribution.Attribution]:
    with open_context(run, options) as ctx:
        a = attribution.attributed(ctx)
        got = {(step, owner, name, sample, pos): [row, src, src_sample]
               for step, owner, name, kind, sample, pos, row, src, src_sample, gid in a.relation.fetchall()}
    return got, a


def test_pooled_sequence_and_replicated_lookups_get_their_source(tmp_path: Path) -> None:
    world = 3
    tables = [table("a", 30, owner=0, world=world), table("s", 12, kind="sequence", owner=1, world=world),
              table("r", 40, owner=None, world=world), table("d", 5, owner=0, world=world, placement="replicated")]
    step0 = [{"a": [[1, 2], [3]], "s": [[4, 5, 6], [7]], "r": [[0, 39], [20]], "d": [[1], [2]]},
             {"a": [[5], [6], [7]], "s": [[1], [2, 3], []], "r": [[13, 14], [], [27]], "d": [[0], [0], [4]]},
             {"a": [[9, 9]], "s": [[8, 8]], "r": [[35]], "d": [[3]]}]
    step1 = [{name: [[(q * 11 + k * 3) % rows, (q + k) % rows] for k in range(4)] for name, rows in
              (("a", 30), ("s", 12), ("r", 40), ("d", 5))} for q in range(world)]
    truth = build_run(tmp_path / "run", tables, world, [step0, step1])
    got, a = attributed_rows(tmp_path / "run")
    assert got == truth
    assert a.exact and not a.notes
    methods = {(o, t): m for o, t, m in a.methods.iter_rows()}
    assert methods[(1, "s")] == "ids" and methods[(0, "a")] == "bags" and methods[(0, "d")] == "own-rank"
    with open_context(tmp_path / "run") as ctx:
        batches = attribution.batches(ctx)
    assert batches.rows() == [(0, 0, 2), (0, 1, 3), (0, 2, 1), (1, 0, 4), (1, 1, 4), (1, 2, 4)]


def test_replays_use_at_most_replay_steps_of_the_recorded_steps_evenly_spaced(tmp_path: Path) -> None:
    world = 2
    tables = [table("a", 30, owner=0, world=world), table("b", 20, owner=1, world=world)]
    steps = [[{name: [[(q * 7 + k * 3 + s) % rows] for k in range(3)] for name, rows in (("a", 30), ("b", 20))}
              for q in range(world)] for s in range(5)]
    truth = build_run(tmp_path / "run", tables, world, steps)
    got, a = attributed_rows(tmp_path / "run", Options(replay_steps=2))
    assert got == {k: v for k, v in truth.items() if k[0] in (0, 3)}  # every 3rd of 5 steps: 2 of them
    assert any("use 2 of the 5 steps" in note for note in a.notes)
    for every in (0, 5):  # 0: all; a cap at least the steps recorded: all, without a note
        got, a = attributed_rows(tmp_path / "run", Options(replay_steps=every))
        assert got == truth and not a.notes


def test_several_sequence_tables_on_one_owner_are_apportioned_and_marked(tmp_path: Path) -> None:
    tables = [table("s1", 10, kind="sequence", owner=0), table("s2", 10, kind="sequence", owner=0),
              table("p", 10, owner=1)]
    batch = [{"s1": [[1, 2], [3]], "s2": [[4]], "p": [[1], [2]]} for _ in range(2)]
    batch[1] = {"s1": [[5]], "s2": [[6, 7, 8]], "p": [[3]]}
    batch[0]["s2"] = [[4], [9]]
    truth = build_run(tmp_path / "run", tables, 2, [batch])
    got, a = attributed_rows(tmp_path / "run")
    assert not a.exact and any("apportioned" in n for n in a.notes)
    seq = lambda d: Counter(v[1] for k, v in d.items() if k[2] in ("s1", "s2"))  # noqa: E731
    assert seq(got) == seq(truth)  # the ids per source are exact, their tables apportioned
    assert {k: v for k, v in got.items() if k[2] == "p"} == {k: v for k, v in truth.items() if k[2] == "p"}


def test_a_step_without_an_input_dist_leaves_the_source_unknown(tmp_path: Path) -> None:
    tables = [table("a", 10, owner=0), table("b", 10, owner=1)]
    build_run(tmp_path / "run", tables, 2, [[{"a": [[1]], "b": [[2]]}, {"a": [[3]], "b": [[4]]}]])
    comms = tmp_path / "run" / "comms"
    for part in comms.glob("*/*.parquet"):
        part.unlink()
    with open_context(tmp_path / "run") as ctx:
        a = attribution.attributed(ctx)
        assert {row[7] for row in a.relation.fetchall()} == {None}
    assert not a.exact and any("no source rank" in n for n in a.notes)


# real trainer runs ------------------------------------------------------------------------------

def trainer_truth(world: int, steps: list[int]) -> Counter:
    """(step, table, row, src, src_sample) -> count, from the samples the TINY trainer consumed."""
    dataset = open_dataset("synthetic", tables=4, rows=500, num_dense=13, pooling=3, samples=4096, seed=0,
                           zipf=None, drift=0.0, preset=None, scale=1.0)
    b = 32
    counts: Counter = Counter()
    for step in steps:
        for q in range(world):
            start = step * b * world + q * b
            batch = dataset.batch(start, start + b)
            offset = 0
            lengths = batch.lengths.tolist()
            values = batch.values.tolist()
            for t in range(4):
                for k in range(b):
                    for r in values[offset:offset + lengths[t][k]]:
                        counts[(step, f"t{t}", r, q, k)] += 1
                    offset += lengths[t][k]
    return counts


@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    """`run(sharding, sequence_tables)`: a 2-rank TINY trainer run (lookups every 2nd step), recorded
    once per module."""
    runs: dict[tuple[str, int], Path] = {}

    def run(sharding: str, sequence_tables: int) -> Path:
        if (sharding, sequence_tables) not in runs:
            code, run_dir = record(tmp_path_factory.mktemp(f"{sharding}{sequence_tables}"), sys.executable, "-m",
                                   "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                                   str(REPO / "train.py"), *TINY, "--sharding", sharding, "--sequence-tables",
                                   str(sequence_tables), options=("--lookup-every", "2"))
            assert code == 0
            runs[(sharding, sequence_tables)] = run_dir
        return runs[(sharding, sequence_tables)]

    return run


def without_sources(run_dir: Path, copy: Path) -> Path:
    """A copy of the run whose lookups have `src` and `src_sample` null, as a program that declares no
    `tracekit.sources` records them (the part files keep their schema metadata)."""
    shutil.copytree(run_dir, copy)
    for part in (copy / "lookups").glob("*/*.parquet"):
        data = pq.read_table(part)
        for column in ("src", "src_sample"):
            i = data.schema.get_field_index(column)
            data = data.set_column(i, data.schema.field(i), pa.nulls(data.num_rows, data.schema.field(i).type))
        pq.write_table(data, part)
    return copy


@pytest.mark.slow
@pytest.mark.parametrize(("sharding", "sequence_tables"), [("table", 2), ("row", 1), ("row", 2)])
def test_trainer_lookups_are_attributed_to_the_rank_that_sent_them(tmp_path: Path, trainer_runs, sharding: str,
                                                                   sequence_tables: int) -> None:
    """The positional rule, on the trainer's run with its recorded sources taken out."""
    run_dir = without_sources(trainer_runs(sharding, sequence_tables), tmp_path / "run")
    with open_context(run_dir) as ctx:
        a = attribution.attributed(ctx)
        rows = a.relation.fetchall()
        batches = attribution.batches(ctx)
    truth = trainer_truth(2, [0, 2])
    seq_tables = {f"t{t}" for t in range(sequence_tables)}
    pooled = Counter((s, n, r, src, ss) for s, o, n, k, _, _, r, src, ss, _ in rows if n not in seq_tables)
    assert pooled == Counter({k: v for k, v in truth.items() if k[1] not in seq_tables})
    assert {ss for s, o, n, k, _, _, r, src, ss, _ in rows if n in seq_tables} == {None}
    by_table = Counter((s, n, r, src) for s, o, n, k, _, _, r, src, ss, _ in rows if n in seq_tables)
    want_by_table: Counter = Counter()
    for (s, n, r, src, _), c in truth.items():
        if n in seq_tables:
            want_by_table[(s, n, r, src)] += c
    by_owner = Counter((s, o, src) for s, o, n, k, _, _, r, src, ss, _ in rows if n in seq_tables)
    owner = (lambda n, r: r // 250) if sharding == "row" else (lambda n, r: int(n[1:]) % 2)
    want_by_owner: Counter = Counter()
    for (s, n, r, src), c in want_by_table.items():
        want_by_owner[(s, owner(n, r), src)] += c
    assert by_owner == want_by_owner  # the ids per (step, owner, source) are exact
    if sharding == "table" or sequence_tables == 1:  # one sequence table per owner: exact per table
        assert by_table == want_by_table and a.exact
    else:  # several on one owner: their tables are apportioned
        assert not a.exact
    assert batches["b"].to_list() == [32] * 8


@pytest.mark.slow
@pytest.mark.parametrize(("sharding", "sequence_tables"), [("table", 2), ("row", 1), ("row", 2)])
def test_trainer_records_each_lookups_source_and_attribution_joins_it(tmp_path: Path, trainer_runs, sharding: str,
                                                                      sequence_tables: int) -> None:
    """The trainer declares its sources: every lookup's recorded `src` (and a pooled bag's `src_sample`)
    is the rank and sample it came from; attributed, every table is 'recorded' and exact (several
    sequence tables on one owner too), and wherever the positional rule is exact it gives the same."""
    run_dir = trainer_runs(sharding, sequence_tables)
    seq_tables = {f"t{t}" for t in range(sequence_tables)}
    truth = trainer_truth(2, [0, 2])
    recorded = open_run(run_dir).scan("lookups").filter(pl.col("phase") == "train").select(
        "step", "table_name", "row", "src", "src_sample").collect().rows()
    assert Counter(r for r in recorded if r[1] not in seq_tables) == Counter(
        {k: v for k, v in truth.items() if k[1] not in seq_tables})
    want_seq: Counter = Counter()
    for (s, n, r, src, _), c in truth.items():
        if n in seq_tables:
            want_seq[(s, n, r, src, None)] += c
    assert Counter(r for r in recorded if r[1] in seq_tables) == want_seq

    got, a = attributed_rows(run_dir)
    assert a.exact and not a.notes and set(a.methods["method"]) == {"recorded"}
    positional, p = attributed_rows(without_sources(run_dir, tmp_path / "nulled"))
    exact = {(o, t) for o, t, m in p.methods.iter_rows() if m != "ids-proportional"}
    assert exact and {k: v for k, v in got.items() if (k[1], k[2]) in exact} == {
        k: v for k, v in positional.items() if (k[1], k[2]) in exact}
    assert (sharding, sequence_tables) != ("row", 2) or len(exact) < len(p.methods)  # apportioned before
