"""The rank-side cost calibration (tracekit/dlrm/calibrate.py) on this machine, real torch, no mocks:
`tracekit calibrate` on a recorded run writes RUN/analysis/calibration.json in the documented shape
with finite, non-negative coefficients, and the fit recovers an exact law. How well the fitted model
predicts a timed point off its grid is a wall-clock figure: bench/calibration_holdout.py's."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner
import torch

from tests.manifests import read_manifest, write_manifest
from tests.recorded import REPO, TINY, record
from tracekit.app.calibration import read_inputs
from tracekit.app.cli import cli
from tracekit.dlrm.timing import fit_nonnegative
from tracekit.policy import REPLICATION_SYNCS
from tracekit.schema import CALIBRATION_PATH, CALIBRATION_SCHEMA

COEFFICIENTS = {  # section -> the coefficients its linear model has (seconds)
    "dct_dp": ("c_bucket_s", "c_elem_s", "c_refresh_elem_s", "residual_s", "refresh_residual_s"),
    "dct_mp": ("c0_s", "c_value_s", "c_kept_s", "residual_s"),
    "schedule": ("c_sample_s", "setup_s_per_sample"),
}
REPLICATION = ("c0_s", "c_ids_s", "c_hot_s", "c_rows_s", "residual_s")


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A tiny recorded run of the reference trainer (one process: its manifest, steps and accesses)."""
    code, run_dir = record(tmp_path_factory.mktemp("calibrate"), sys.executable, str(REPO / "train.py"), *TINY)
    assert code == 0
    return run_dir


@pytest.fixture(scope="module")
def calibrated(run: Path) -> tuple[str, dict]:
    r = CliRunner().invoke(cli, ["calibrate", str(run), "--json", "--repeats", "9"])
    assert r.exit_code == 0, r.output
    return r.output, json.loads((run / CALIBRATION_PATH).read_text())


def test_calibrate_prints_the_json_it_writes_into_the_run(run: Path, calibrated: tuple[str, dict]) -> None:
    printed, written = calibrated
    assert json.loads(printed) == written, printed
    assert written["schema"] == CALIBRATION_SCHEMA
    assert not list((run / "analysis").glob(".*.tmp"))  # written under a temporary name, then renamed
    inputs = written["inputs"]
    assert inputs["world_size"] == 1 and inputs["batch_per_rank"] == 32 and inputs["id_source"] == "accesses"
    assert [t["name"] for t in inputs["tables"]] == ["t0", "t1", "t2", "t3"]
    # TINY: 3 ids per bag (pooling 3), one bag per table per sample: the run's accesses say so exactly
    assert [t["ids_per_sample"] for t in inputs["tables"]] == [3.0] * 4, inputs
    assert set(written["machine"]) >= {"cpu", "cores", "torch", "threads", "host", "clock"}
    assert written["seconds"] > 0


def test_every_coefficient_is_finite_and_non_negative(calibrated: tuple[str, dict]) -> None:
    _, c = calibrated
    assert set(c["replication"]) == set(REPLICATION_SYNCS)
    figures = {f"replication.{sync}.{k}": c["replication"][sync][k] for sync in REPLICATION_SYNCS for k in REPLICATION}
    figures |= {f"collective_call_s.{op}": s for op, s in c["collective_call_s"].items()}
    figures |= {f"{section}.{k}": c[section][k] for section, keys in COEFFICIENTS.items() for k in keys}
    assert set(c["collective_call_s"]) == {"all_reduce", "all_to_all_single", "all_gather_single"}
    bad = {name: v for name, v in figures.items() if not (isinstance(v, float) and math.isfinite(v) and v >= 0)}
    assert not bad, bad
    # every model carries the points it was fitted on
    assert len(c["replication"]["sparse_allreduce"]["points"]) == len(c["replication"]["dense_allreduce"]["points"]) == 9
    assert c["replication"]["sparse_allreduce"]["collectives"] == {"all_gather_single": 1, "all_to_all_single": 1,
                                                                   "all_reduce": 1}
    assert {p["numel"] for p in c["dct_dp"]["points"]} and {p["keep_ratio"] for p in c["dct_mp"]["points"]} == set(
        c["dct_mp"]["keep_ratios"])


def test_the_nonnegative_fit_recovers_an_exact_linear_law() -> None:
    x = np.array([[1.0, n, h] for n in (100, 200, 400) for h in (10, 50, 90)])
    y = x @ np.array([3e-4, 2e-8, 5e-7])
    c, residual = fit_nonnegative(x, y)
    assert c == pytest.approx([3e-4, 2e-8, 5e-7], rel=1e-6) and residual < 1e-12
    c, _ = fit_nonnegative(x, x @ np.array([3e-4, -2e-8, 5e-7]))  # a negative law: clipped at 0
    assert min(c) >= 0 and c[1] == 0


def test_calibrate_prints_a_table_and_refuses_what_is_not_a_run(run: Path, tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["calibrate", str(run), "--repeats", "3"])
    assert r.exit_code == 0, r.output
    for line in ("replication: extra per step", "sparse_allreduce", "dense_allreduce", "collective call",
                 "DCT-DP hook", "DCT-MP codec", "FAE schedule", f"wrote {run / CALIBRATION_PATH}"):
        assert line in r.output, line
    r = CliRunner().invoke(cli, ["calibrate", str(tmp_path / "nothing")])
    assert r.exit_code == 2 and "does not exist" in r.output, r.output


@pytest.mark.slow
def test_analyze_calibrates_first_only_on_the_host_that_recorded_the_run(run: Path, tmp_path: Path) -> None:
    fresh = tmp_path / "fresh"
    shutil.copytree(run, fresh, ignore=shutil.ignore_patterns("analysis"))
    r = CliRunner().invoke(cli, ["analyze", str(fresh), "--no-report", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads((fresh / CALIBRATION_PATH).read_text())["schema"] == CALIBRATION_SCHEMA
    # it ran beside the analysis, and the time model of that same analysis waited for it and read it
    assert json.loads(r.output)["network"]["rank_work"] == "calibrated", r.output

    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(run, elsewhere, ignore=shutil.ignore_patterns("analysis"))
    write_manifest(elsewhere, {**read_manifest(elsewhere), "hosts": ["another-host"]})
    r = CliRunner().invoke(cli, ["analyze", str(elsewhere), "--no-report", "--json"])
    assert r.exit_code == 0, r.output
    assert not (elsewhere / CALIBRATION_PATH).exists()
    assert any("did not record this run" in note for note in json.loads(r.output)["notes"]), r.output

    skipped = tmp_path / "skipped"
    shutil.copytree(run, skipped, ignore=shutil.ignore_patterns("analysis"))
    r = CliRunner().invoke(cli, ["analyze", str(skipped), "--no-report", "--no-calibrate", "--json"])
    assert r.exit_code == 0, r.output
    assert not (skipped / CALIBRATION_PATH).exists()


def test_the_rows_counts_analyze_keeps_give_the_inputs_the_accesses_give(run: Path, tmp_path: Path) -> None:
    """analyze hands the calibration its kept per-row totals (analyses.row_totals) so that it does not
    read the accesses a second time: the ids it draws follow the same counts."""
    from analyses.context import open_context
    from analyses.row_totals import kept_file

    copy = tmp_path / "run"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("analysis"))
    with open_context(copy) as ctx:
        totals = kept_file(ctx)
    assert totals is not None and totals.is_file()
    read, kept = read_inputs(copy), read_inputs(copy, totals)
    assert kept.id_source == read.id_source == "accesses"
    assert kept.ids_per_sample == read.ids_per_sample
    assert all(torch.equal(a, b) for a, b in zip(read.weights, kept.weights))
