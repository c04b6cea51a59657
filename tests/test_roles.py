"""Each recorded call's role in the embedding exchange (analyses/roles.py): from the reference
trainer's labels, from the callers' names a run recorded before the labels carries, and from the
order of a TorchRec step's all-to-alls; and a real 2-rank run analyses the same read either way."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from polars.testing import assert_frame_equal

from analyses import attribution, exchange
from analyses.context import open_context
from analyses.measure import by_op_tag, measure
from analyses.replay.graph import recorded_steps
from analyses.roles import with_roles
from tests.recorded import REPO, TINY, record
from tracekit import tags

A2A = "all_to_all_single"
TORCHREC = "KJTAllToAllTensorsAwaitable.__init__"  # a TorchRec call's tag: its caller's qualified name


def _roles(calls: list[tuple[int, str, str, str | None]]) -> list[str | None]:
    """The role with_roles gives each (step, phase, op, tag), rank 0, `seq` in list order."""
    comms = pl.DataFrame({"rank": [0] * len(calls), "step": [c[0] for c in calls], "phase": [c[1] for c in calls],
                          "seq": list(range(len(calls))), "op": [c[2] for c in calls], "tag": [c[3] for c in calls]})
    con = duckdb.connect()
    con.register("comms_rel", comms)
    return [r for _, r in con.sql(f"SELECT seq, role FROM ({with_roles('comms_rel')}) ORDER BY seq").fetchall()]


def test_roles_come_from_labels_legacy_names_or_a_torchrec_steps_order() -> None:
    labelled = [(0, "train", A2A, tags.TIER2_INPUT), (0, "train", A2A, tags.TIER2_INPUT),  # tier 2 first
                (0, "train", A2A, tags.INPUT_LENGTHS), (0, "train", A2A, tags.INPUT_IDS),
                (0, "train", A2A, tags.OUTPUT_FWD_CODED), (0, "train", A2A, tags.TIER2_OUTPUT_FWD),
                (0, "train", A2A, tags.OUTPUT_BWD_CODED), (0, "train", "all_reduce", tags.DENSE_ALLREDUCE)]
    assert _roles(labelled) == [None, None, "input_lengths", "input_ids", "output_fwd", None, "output_bwd", None]
    legacy = [(1, "train", A2A, tags.TIER2_INPUT), (1, "train", A2A, tags.LEGACY_INPUT_DIST),
              (1, "train", A2A, tags.LEGACY_INPUT_DIST), (1, "train", A2A, "_AllToAll.forward"),
              (1, "train", A2A, tags.REPLICA_SYNC), (1, "train", A2A, "_AllToAll.backward"),
              (1, "eval", A2A, tags.LEGACY_INPUT_DIST), (1, "eval", A2A, tags.LEGACY_INPUT_DIST),
              (1, "eval", A2A, "_CodedAllToAll.forward")]
    assert _roles(legacy) == [None, "input_lengths", "input_ids", "output_fwd", None, "output_bwd",
                              "input_lengths", "input_ids", "output_fwd"]
    torchrec = [(2, "train", A2A, f"{tags.TORCHREC_SPLITS}.__init__"), (2, "train", A2A, TORCHREC),
                (2, "train", A2A, TORCHREC), (2, "train", "all_reduce", None),
                (2, "train", A2A, "DefaultAll2AllSingle.__call__"), (2, "train", A2A, "All2All_Pooled_Wait.backward")]
    assert _roles(torchrec) == [None, *tags.EXCHANGE[:2], None, *tags.EXCHANGE[2:]]
    two_groups = [(3, "train", A2A, TORCHREC)] * 4 + [(3, "train", A2A, "DefaultAll2AllSingle.__call__")] * 4
    assert _roles(two_groups) == [None] * 8
    assert _roles([(4, "train", A2A, None)] * 3) == [None] * 3  # fewer than the exchange's four


LEGACY = {tags.INPUT_LENGTHS: tags.LEGACY_INPUT_DIST, tags.INPUT_IDS: tags.LEGACY_INPUT_DIST,
          **{new: old for old, new in tags.LEGACY_OUTPUT.items()}}
"""A new run's tag -> the tag the same call carried before the trainer labelled its exchange."""


def as_recorded_before(run_dir: Path, to: Path) -> Path:
    """A copy of `run_dir` whose comms carry the tags of a run recorded before the labels."""
    shutil.copytree(run_dir, to)
    for path in sorted((to / "comms").glob("*/*.parquet")):
        t = pq.read_table(path)
        old = pa.array([LEGACY.get(tag, tag) for tag in t.column("tag").to_pylist()], type=t.schema.field("tag").type)
        t = t.set_column(t.schema.get_field_index("tag"), t.schema.field("tag"), old)
        pq.write_table(t.replace_schema_metadata(pq.read_schema(path).metadata), path)
    return to


def _analysed(run_dir: Path) -> tuple[list, pl.DataFrame, list, pl.DataFrame, pl.DataFrame]:
    with open_context(run_dir) as ctx:
        sources = sorted(attribution.attributed(ctx).relation.fetchall(), key=str)
        replayed = exchange.comms_replay(ctx)
        steps = recorded_steps(ctx, [])
        roles = ctx.frame("SELECT rank, step, seq, phase, role FROM comms ORDER BY rank, step, phase, seq")
        by_tag = by_op_tag(measure(ctx, None).calls, ctx.train_steps())
    names = [(s.step, k, c.op, c.collective) for s in steps for k, c in sorted(s.calls.items())]
    return sources, replayed, names, roles, by_tag


@pytest.mark.slow
def test_a_run_recorded_before_the_labels_analyses_the_same(tmp_path: Path) -> None:
    code, run_dir = record(tmp_path, sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(REPO / "train.py"), *TINY, "--sharding", "row",
                           "--sequence-tables", "1", options=("--lookup-every", "2"))
    assert code == 0
    before = as_recorded_before(run_dir, tmp_path / "before")
    with open_context(before) as ctx:
        assert {t for (t,) in ctx.sql(f"SELECT DISTINCT tag FROM comms WHERE op = '{A2A}'").fetchall()} == \
            {tags.LEGACY_INPUT_DIST, "_AllToAll.forward", "_AllToAll.backward"}
    sources, replayed, names, roles, by_tag = _analysed(run_dir)
    sources_before, replayed_before, names_before, roles_before, by_tag_before = _analysed(before)
    assert set(roles["role"].drop_nulls()) == set(tags.EXCHANGE)
    assert_frame_equal(roles_before, roles)
    assert sources_before == sources and {row[7] for row in sources} == {0, 1}  # every lookup's src
    assert set(replayed["tag"].drop_nulls()) == set(tags.EXCHANGE)
    assert_frame_equal(replayed_before.drop("tag"), replayed.drop("tag"))
    assert names_before == names and {n[3] for n in names} >= set(tags.EXCHANGE)
    assert_frame_equal(by_tag_before, by_tag)  # compare's table by tag shows today's labels for both
    assert set(tags.EXCHANGE) <= set(by_tag["tag"])
