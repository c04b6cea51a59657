"""tracekit/manifest.py: manifest.json read into types and written back as it was, old runs included,
and a clear error naming the file for a manifest that is not one."""

from __future__ import annotations

import json

import pytest

from tracekit import manifest
from tracekit.errors import RunNotFound, TracekitError
from tracekit.manifest import Manifest, Table, TableShard

RECORDED = {
    "backend": "gloo", "clock_anchors": {"0": {"monotonic_ns": 5, "wall_ns": 7}},
    "collector_settings": {"lookup_every": 10, "grad_every": 100, "window": None},
    "command": ["torchrun", "train.py"], "cwd": "/w", "devices": {"cores": 2, "cpu": "x86_64"},
    "dropped_rows": {}, "ended_at": "2026-11-29T08:45:47+00:00", "environment": {}, "exit_code": 0,
    "finalise_errors": [], "gpu": {"devices": [], "reason": "NVML unavailable", "samples": False},
    "hosts": ["vm"], "lost_lookups": 0, "lost_rows": {}, "metrics": {"eval_auc": 0.53}, "policy": None,
    "ranks": [0, 1], "record_exit_code": 0, "run_id": "aa77", "schema_version": "1.6",
    "started_at": "2026-11-29T08:45:38+00:00", "status": "completed", "steps": {"0": 44, "1": 44},
    "tables": [
        {"dim": 64, "dtype": "float32", "kind": "pooled", "name": "C1", "num_rows": 15, "padding_idx": None,
         "placement": "sharded", "shards": [{"first_row": 0, "num_rows": 8, "rank": 0},
                                            {"first_row": 8, "num_rows": 7, "rank": 1}]},
        {"compute_kernel": "fused", "dim": 16, "dtype": "float16", "kind": "pooled", "name": "C2", "num_rows": 40,
         "padding_idx": None, "placement": "sharded", "sharding_type": "column_wise",
         "shards": [{"first_col": 0, "first_row": 0, "num_cols": 8, "num_rows": 40, "rank": 0},
                    {"first_col": 8, "first_row": 0, "num_cols": 8, "num_rows": 40, "rank": 1}]}],
    "torch_version": "2.13.0+cpu", "torchrec_plan": None, "traced": True, "tracekit_version": "0.1.0",
    "truncated_at": {}, "untraced_reason": None, "world_size": 2, "writer_cpu_s": {"0": 0.1, "1": 0.07},
    "writer_errors": 0, "writer_first_errors": {}, "writer_scheduling": {"0": {"policy": "idle"}},
    "written_rows": {"accesses": 497649, "comms": 564},
}


def test_a_recorded_manifest_reads_into_types_and_writes_back_byte_for_byte(tmp_path):
    (tmp_path / "manifest.json").write_text(json.dumps(RECORDED, sort_keys=True, indent=2) + "\n")
    before = (tmp_path / "manifest.json").read_bytes()
    m = manifest.read(tmp_path)
    assert (m.world_size, m.status, m.ranks, m.steps) == (2, "completed", [0, 1], {"0": 44, "1": 44})
    assert m.table("C1").shards == (TableShard(0, 0, 8), TableShard(1, 8, 7))
    assert m.table("C2").sharding_type == "column_wise" and m.table("C2").shards[1].first_col == 8
    manifest.write(tmp_path, m)
    assert (tmp_path / "manifest.json").read_bytes() == before


def test_an_old_manifest_reads_with_defaults_and_keeps_its_keys(tmp_path):
    old = {"schema_version": "1.0", "status": "completed", "world_size": 1, "future_field": [1, 2],
           "tables": [{"name": "t0", "num_rows": 100, "dim": 8}]}
    (tmp_path / "manifest.json").write_text(json.dumps(old))
    m = manifest.read(tmp_path)
    assert m.lost_rows is None and m.traced is None and m.hosts == [] and m.extra == {"future_field": [1, 2]}
    assert m.tables == (Table("t0", 100, 8),) and m.tables[0].row_bytes == 32
    assert set(m.to_json()) == set(old)


def test_a_table_knows_which_rank_holds_a_row():
    t = Table.from_json(RECORDED["tables"][0])
    assert [t.owner(r) for r in (0, 7, 8, 14, 15)] == [0, 0, 1, 1, None]
    assert (t.rows_on(0), t.rows_on(1), t.rows_on(2)) == (8, 7, 0)
    assert Table("x", 1, 16, dtype="float16").row_bytes == 32 and Table("x", 1, 16, dtype="odd").row_bytes == 64


@pytest.mark.parametrize("text, expected", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
    ('{"tables": [{"name": "t0", "dim": 8}]}', "a table or shard lacks a field"),
])
def test_a_bad_manifest_is_refused_naming_the_file(tmp_path, text, expected):
    (tmp_path / "manifest.json").write_text(text)
    with pytest.raises(TracekitError, match=expected) as err:
        manifest.read(tmp_path)
    assert str(tmp_path / "manifest.json") in str(err.value)


def test_a_missing_run_or_manifest_says_which(tmp_path):
    with pytest.raises(RunNotFound, match="does not exist"):
        manifest.read(tmp_path / "nope")
    with pytest.raises(RunNotFound, match="has no manifest.json"):
        manifest.read(tmp_path)


def test_a_new_manifest_writes_every_field():
    body = Manifest(status="running", world_size=2).to_json()
    assert body["status"] == "running" and body["tables"] == [] and "extra" not in body and "present" not in body


def test_a_first_manifest_writes_its_fields_and_an_update_adds_its_own(tmp_path):
    started = Manifest.of(status="running", hosts=["vm"], exit_code=None)
    assert started.to_json() == {"status": "running", "hosts": ["vm"], "exit_code": None}
    ended = started.updated(status="completed", exit_code=0, tables=None)
    assert ended.to_json() == {"status": "completed", "hosts": ["vm"], "exit_code": 0, "tables": None}
    manifest.write(tmp_path, ended)
    assert manifest.read(tmp_path) == ended and manifest.read(tmp_path).tables is None
