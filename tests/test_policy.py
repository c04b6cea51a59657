"""The policy file's schema (tracekit/policy.py): what `analyze` writes reads back unchanged, and
each way a file can be wrong is refused with the file and the field named."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from tracekit.errors import PolicyMismatch
from tracekit.policy import Policy, PolicyError, load_policy, new_policy, recommended, sections, write_policy
from tracekit.policy_model import check_model

MODEL = {"tables": [{"name": "t0", "num_rows": 1000, "dim": 8}, {"name": "t1", "num_rows": 500, "dim": 8}],
         "world_size": 2}


def full_policy() -> dict:
    policy = new_policy(source_run="runs/base", model=MODEL,
                        baseline={"a2a_bytes_per_step": 1000, "allreduce_bytes_per_step": 2000, "step_time_s": 0.03})
    policy["replication"] = {"kind": "hybrid", "rows": "policy/hot_rows.parquet", "budget_bytes_per_rank": 4096,
                             "sync": "sparse_allreduce", "predicted": {"a2a_bytes_per_step": 400,
                                                                       "sync_bytes_per_step": 100,
                                                                       "step_time_s": 0.02},
                             "intervals": {"a2a_bytes_per_step": [380, 430], "step_time_s": [0.018, 0.024]},
                             "why": "rows by benefit per byte"}
    policy["schedule"] = {"kind": "fae", "hot_rows": "policy/hot_rows.parquet", "hot_sample_fraction": 0.4,
                          "predicted": {"a2a_bytes_per_step": 600}, "why": "40% of samples are all hot",
                          "recommended": False, "reason": "the gain is within the model's error on this run"}
    policy["compression"] = {"dp": {"keep_ratio": 0.01, "refresh_every": 1000, "error_feedback": True,
                                    "predicted": {"dp_bytes_per_step": 10}, "why": "1% keeps the drift bounded"},
                             "mp": {"keep_ratio": 0.05, "predicted": {"a2a_bytes_per_step": 50}, "why": "DCT's 20x"}}
    policy["lag"] = {"bound": 0, "predicted": {"gain": 0.0}, "why": "balanced ranks: no lag helps"}
    policy["combined"] = {"sections": ["replication", "compression.dp", "compression.mp"],
                          "predicted": {"a2a_bytes_per_step": 40, "step_time_s": 0.021},
                          "intervals": {"step_time_s": [0.017, 0.026]}, "why": "the recommended sections together"}
    return policy


def hot_rows() -> pl.DataFrame:
    return pl.DataFrame({"table_name": ["t0", "t1"], "row": [3, 7]})


def test_a_written_policy_loads_back_unchanged(tmp_path: Path) -> None:
    policy = full_policy()
    path = write_policy(tmp_path / "policy.json", policy, rows={"hot_rows": hot_rows()})
    assert load_policy(path) == json.loads(json.dumps(policy))
    assert pl.read_parquet(tmp_path / "policy" / "hot_rows.parquet").equals(hot_rows())


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda p: p.update(schema="tracekit.policy/2"), 'schema: expected "tracekit.policy/1"'),
    (lambda p: p["model"].update(tables=[]), "model.tables: expected a non-empty list"),
    (lambda p: p["model"]["tables"][1].update(dim=0), "model.tables[1].dim: expected a positive integer"),
    (lambda p: p["model"].update(world_size="2"), "model.world_size: expected a positive integer"),
    (lambda p: p.update(caching={}), "caching: expected no such field"),
    (lambda p: p["replication"].update(sync="gossip"), "replication.sync: expected one of"),
    (lambda p: p["replication"].pop("why"), "replication.why: expected a one-line explanation"),
    (lambda p: p["replication"]["predicted"].update(step_time_s="fast"), "replication.predicted: expected an object of numbers"),
    (lambda p: p["replication"].update(rows="/abs/hot.parquet"), "replication.rows: expected a Parquet path relative"),
    (lambda p: p["schedule"].update(hot_rows="policy/missing.parquet"), "schedule.hot_rows: expected an existing file"),
    (lambda p: p["compression"]["dp"].update(keep_ratio=1.5), "compression.dp.keep_ratio: expected a number in (0, 1]"),
    (lambda p: p["compression"].update(qp={}), "compression.qp: expected compression holds only dp and mp"),
    (lambda p: p["lag"].update(bound=-1), "lag.bound: expected a non-negative integer"),
    # recommended, reason, intervals, combined
    (lambda p: p["replication"].update(recommended="yes"),
     "replication.recommended: expected true or false, got 'yes'"),
    (lambda p: p["schedule"].pop("reason"), "schedule.reason: expected a one-line reason why the section is not"),
    (lambda p: p["schedule"].update(reason=""), "schedule.reason: expected a one-line reason"),
    (lambda p: p["schedule"].update(reason="two\nlines"), "schedule.reason: expected a one-line reason"),
    (lambda p: p["compression"]["mp"].update(recommended=False), "compression.mp.reason: expected a one-line reason"),
    (lambda p: p["replication"].update(intervals=[1, 2]), "replication.intervals: expected an object of figure"),
    (lambda p: p["replication"]["intervals"].update(hot_rows=[1, 2]),
     "replication.intervals.hot_rows: expected a figure of replication.predicted (a2a_bytes_per_step, "
     "sync_bytes_per_step, step_time_s)"),
    (lambda p: p["replication"]["intervals"].update(step_time_s=[0.01]),
     "replication.intervals.step_time_s: expected [low, high], two numbers, got [0.01]"),
    (lambda p: p["replication"]["intervals"].update(step_time_s=["a", "b"]), "expected [low, high], two numbers"),
    (lambda p: p["replication"]["intervals"].update(step_time_s=[0.03, 0.02]),
     "replication.intervals.step_time_s: expected low <= high, got [0.03, 0.02]"),
    (lambda p: p["lag"].update(intervals={"gain": [0.1, 0.0]}), "lag.intervals.gain: expected low <= high"),
    (lambda p: p.update(combined=[]), "combined: expected an object"),
    (lambda p: p["combined"].update(sections=[]), "combined.sections: expected a list of distinct training sections"),
    (lambda p: p["combined"].update(sections=["replication", "lag"]),
     "combined.sections: expected a list of distinct training sections (replication, tiers, schedule, "
     "compression.dp, compression.mp), got ['replication', 'lag']"),
    (lambda p: p["combined"].update(sections=["compression"]), "combined.sections: expected a list of distinct"),
    (lambda p: p["combined"].update(sections=["replication", "replication"]), "combined.sections: expected a list"),
    (lambda p: p["combined"]["predicted"].update(step_time_s="fast"),
     "combined.predicted: expected an object of numbers"),
    (lambda p: p["combined"].pop("why"), "combined.why: expected a one-line explanation"),
    (lambda p: p["combined"]["intervals"].update(saving=[0, 1]), "combined.intervals.saving: expected a figure of"),
])
def test_a_malformed_policy_is_refused_naming_the_field(tmp_path: Path, mutate, message: str) -> None:
    path = write_policy(tmp_path / "policy.json", full_policy(), rows={"hot_rows": hot_rows()})
    policy = json.loads(path.read_text())
    mutate(policy)
    path.write_text(json.dumps(policy))
    with pytest.raises(PolicyError) as err:
        load_policy(path)
    assert str(err.value).startswith(f"{path}: ") and message in str(err.value), str(err.value)


def test_sections_are_labelled_and_recommended_unless_marked_otherwise(tmp_path: Path) -> None:
    policy = load_policy(write_policy(tmp_path / "policy.json", full_policy(), rows={"hot_rows": hot_rows()}))
    assert [(label, recommended(body)) for label, body in sections(policy)] == [
        ("replication", True), ("schedule", False), ("compression.dp", True), ("compression.mp", True), ("lag", True)]


def test_not_json_or_missing_is_refused(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="no such policy file"):
        load_policy(tmp_path / "policy.json")
    (tmp_path / "policy.json").write_text("{not json")
    with pytest.raises(PolicyError, match="policy.json: not valid JSON"):
        load_policy(tmp_path / "policy.json")


def test_a_policy_for_another_model_is_refused_with_every_difference() -> None:
    policy = full_policy()
    check_model(policy, tables=MODEL["tables"], world_size=2)
    tables = [{"name": "t0", "num_rows": 999, "dim": 8}, {"name": "t2", "num_rows": 500, "dim": 8}]
    with pytest.raises(PolicyMismatch) as err:
        check_model(policy, tables=tables, world_size=4, path="p.json")
    text = str(err.value)
    for part in ("table t1 is in the policy but not in the model", "table t2 is in the model but not in the policy",
                 "table t0: num_rows 1000 in the policy, 999 in the model", "world size 2 in the policy, 4 here"):
        assert part in text, text


def test_a_hand_written_section_needs_only_what_the_trainer_applies(tmp_path: Path) -> None:
    path = tmp_path / "policy.json"
    path.write_text(json.dumps({"compression": {"dp": {"keep_ratio": 0.001, "refresh_every": 20}}}))
    policy = Policy.from_json(load_policy(path))
    dp = policy.sections["compression.dp"]
    assert (dp.keep_ratio, dp.refresh_every, dp.recommended, dp.prediction.figures, policy.model) == (
        0.001, 20, True, {}, None)
    check_model(load_policy(path), tables=[{"name": "t0", "num_rows": 10, "dim": 4}], world_size=2)  # no model: passes
    written = policy.to_json()
    assert written["compression"] == {"dp": {"keep_ratio": 0.001, "refresh_every": 20, "recommended": True}}
    assert "model" not in written
    # what analyze adds must be whole where it is there
    path.write_text(json.dumps({"compression": {"dp": {"keep_ratio": 0.001, "predicted": {"dp_bytes_per_step": 1.0}}}}))
    with pytest.raises(PolicyError, match="compression.dp.why: expected a one-line explanation"):
        load_policy(path)
    path.write_text(json.dumps({"compression": {"dp": {"refresh_every": 20}}}))
    with pytest.raises(PolicyError, match=r"compression.dp.keep_ratio: expected a number in \(0, 1\]"):
        load_policy(path)
