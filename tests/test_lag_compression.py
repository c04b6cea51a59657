"""The BLS lag bound and DCT compression policies on runs of known content: the lag recurrence
against a discrete-event simulation, the bound chosen on balanced and jittered traces, and the
compression bytes against their formulas; every section passes the core's validator."""

from __future__ import annotations

import heapq
import json
from pathlib import Path

import numpy as np
import pytest

from analyses import quality
from analyses.context import open_context
from analyses.network import warmup_steps
from analyses.policies import compression, lag
from analyses.timeline import compute as timeline
from tests.test_traffic import MS, bsp_run, comm, make_run
from tracekit.policy import new_policy, validate

DIM = 16  # the tables of compression_run: its 2,048-byte output splits are 32 fp32 rows each


def simulate(c: np.ndarray, x: np.ndarray, bound: int | None) -> float:
    """Makespan by discrete events, two workers a rank: its exchange thread starts exchange t (taking
    x) the moment exchange t-1 is done and every rank has finished step t-1-bound; its main thread
    computes step t (taking c) the moment it has finished t-1 and exchange t is done. The clock
    jumps from one completion to the next."""
    ranks, steps = c.shape
    exchanged, computed = [0] * ranks, [0] * ranks  # how many each rank completed
    busy: set[tuple[str, int]] = set()
    events: list[tuple[float, str, int]] = []
    now = 0.0
    while True:
        for p in range(ranks):
            t = exchanged[p]
            if ("x", p) not in busy and t < steps and (bound is None or min(computed) >= t - bound):
                busy.add(("x", p))
                heapq.heappush(events, (now + x[p, t], "x", p))
            t = computed[p]
            if ("c", p) not in busy and t < exchanged[p]:
                busy.add(("c", p))
                heapq.heappush(events, (now + c[p, t], "c", p))
        if not events:
            return now
        now, kind, p = heapq.heappop(events)
        busy.discard((kind, p))
        if kind == "x":
            exchanged[p] += 1
        else:
            computed[p] += 1


def spare_cores(run_dir: Path, cores: int) -> Path:
    """The run as recorded on a host of `cores` cores (lag.overlaps reads them from the manifest)."""
    manifest = json.loads((run_dir / "manifest.json").read_text())
    manifest["devices"] = {"cpu": "x86_64", "cores": cores}
    (run_dir / "manifest.json").write_text(json.dumps(manifest))
    return run_dir


def test_the_lag_recurrence_equals_a_discrete_event_simulation() -> None:
    rng = np.random.default_rng(7)
    for ranks, steps in ((2, 10), (3, 12), (5, 7)):
        c = rng.exponential(1.0, size=(ranks, steps)) + 0.1
        x = rng.uniform(0.0, 0.5, size=(ranks, steps))
        none = np.zeros_like(c)
        for bound in (0, 1, 2, 4, None):
            assert lag.replay(c, bound, x) == pytest.approx(simulate(c, x, bound), rel=1e-12), (ranks, steps, bound)
            assert lag.replay(c, bound, 0.3) == pytest.approx(simulate(c, np.full_like(c, 0.3), bound), rel=1e-12)
            # one core a rank: the exchange is work in series with the compute
            assert lag.replay(c, bound, x, overlap=False) == pytest.approx(simulate(c + x, none, bound), rel=1e-12)
    c = rng.exponential(1.0, size=(3, 9))
    assert lag.replay(c, 0) == pytest.approx(c.max(axis=0).sum())  # bulk-synchronous
    assert lag.replay(c, None) == pytest.approx(c.sum(axis=1).max())  # every rank alone
    assert lag.replay(c, 0, 0.2) == pytest.approx((c.max(axis=0) + 0.2).sum())  # the exchange in series
    # unbounded, a rank's exchanges run ahead of its compute: its own total less what they overlap
    alone = lag.replay(c, None, 0.2)
    assert max(c.sum(axis=1).max(), 9 * 0.2) < alone < c.sum(axis=1).max() + 9 * 0.2


def test_the_exchange_is_apart_from_the_compute(tmp_path: Path) -> None:
    # compute work[p][t], then an all-to-all whose transfer takes 2 ms after the last rank entered
    work = np.array([[3, 4, 9, 4, 3], [4, 3, 3, 4, 9]]) * MS
    with open_context(bsp_run(tmp_path / "run", work, transfer_ns=2 * MS)) as ctx:
        frame = timeline(ctx).tables["timeline"]
    c, x, ranks, steps = lag.work_matrix(frame)
    assert ranks == [0, 1] and steps == [1, 2, 3, 4]  # step 0 is warm-up
    np.testing.assert_allclose(c, work[:, 1:] / 1e9, atol=1e-12)
    np.testing.assert_allclose(x, 2e-3, atol=1e-12)
    # bound 0 replays the recorded run; a cheaper exchange (1 ms) and a bound hide the stragglers
    assert lag.replay(c, 0, x) == pytest.approx(sum(np.max(work[:, 1:], axis=0) + 2 * MS) / 1e9)
    assert lag.replay(c, 0, 1e-3) == pytest.approx((5 + 10 + 5 + 10) * MS / 1e9)
    # bound 1: rank 1's rows of its last step arrive at 15 ms, 1 ms after rank 0 finished step 1
    assert lag.replay(c, 1, 1e-3) == pytest.approx((15 + 9) * MS / 1e9)
    assert lag.replay(c, None, 1e-3) == pytest.approx((1 + 20) * MS / 1e9)  # rank 0 alone: one exchange, then compute
    assert lag.replay(c, 1, 1e-3, overlap=False) == pytest.approx(25 * MS / 1e9)  # rank 1 starts its last step at 15 ms
    assert lag.replay(c, None, 1e-3, overlap=False) == pytest.approx((20 + 4) * MS / 1e9)  # rank 0's own total


def policy_with(section: dict, name: str) -> dict:
    model = {"tables": [{"name": "t0", "num_rows": 100, "dim": 8}], "world_size": 2}
    policy = new_policy(source_run="run", model=model)
    policy[name] = section
    return policy


def test_a_balanced_run_keeps_the_synchronous_bound_and_says_so(tmp_path: Path) -> None:
    per_step = np.array([3, 5, 2, 4, 6, 3, 2, 5]) * MS
    with open_context(bsp_run(tmp_path / "run", np.stack([per_step, per_step]), transfer_ns=0)) as ctx:
        derived = lag.derive(ctx)
    assert derived.as_json()["bound"] == 0
    assert abs(derived.as_json()["predicted"]["gain"]) < 1e-12
    assert derived.as_json()["why"].startswith("balanced run")
    assert derived.tables["lag_makespan"]["gain"].abs().max() < 1e-12
    validate(policy_with(derived.as_json(), "lag"), tmp_path / "policy.json")


def test_a_balanced_run_with_an_exchange_gains_only_its_overlap(tmp_path: Path) -> None:
    # the exchange (1 ms) of the next step runs during this step's compute: bound 1 gets all of it
    per_step = np.array([3, 5, 2, 4, 6, 3, 2, 5]) * MS
    run_dir = bsp_run(tmp_path / "run", np.stack([per_step, per_step]))
    with open_context(run_dir) as ctx:
        one_core = lag.derive(ctx)  # 2 ranks, 1 core: nothing to overlap
    assert one_core.as_json()["bound"] == 0 and not one_core.evidence["exchange_overlaps_compute"]
    with open_context(spare_cores(run_dir, 4)) as ctx:
        derived = lag.derive(ctx)
    assert derived.evidence["exchange_overlaps_compute"]
    c = per_step[warmup_steps(8):] / 1e9  # the first steps are warm-up (analyses.network)
    overlapped = 1e-3 + c.sum()  # the first exchange, then compute back to back
    assert derived.as_json()["bound"] == 1
    assert derived.as_json()["predicted"]["makespan_s"] == pytest.approx(overlapped)
    assert derived.tables["lag_makespan"]["makespan_s"].to_list()[1:] == pytest.approx([overlapped] * 9)
    assert derived.as_json()["why"].startswith("balanced run") and "hides no straggler" in derived.as_json()["why"]


def test_per_rank_jitter_gets_a_bound_and_its_replayed_gain(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    work = (2 * MS + rng.exponential(3 * MS, size=(2, 30))).astype(np.int64)
    with open_context(spare_cores(bsp_run(tmp_path / "run", work), 4)) as ctx:
        derived = lag.derive(ctx)
    skip = warmup_steps(30)  # compute, and the all-to-all's transfer; the first steps are warm-up
    c, x = work[:, skip:] / 1e9, MS / 1e9
    table = derived.tables["lag_makespan"]
    assert table["bound"].to_list() == [*range(9), None]
    assert table["makespan_s"].to_list() == pytest.approx([lag.replay(c, b, x) for b in [*range(9), None]])
    assert derived.evidence["exchange_per_step_s"] == pytest.approx(x)
    bound = derived.as_json()["bound"]
    best = table["makespan_s"].min()
    assert bound >= 1 and lag.replay(c, bound, x) <= best * 1.01 < lag.replay(c, bound - 1, x)
    assert derived.as_json()["predicted"]["gain"] == pytest.approx(1 - lag.replay(c, bound, x) / lag.replay(c, 0, x))
    assert derived.as_json()["predicted"]["gain"] > 0.05
    assert derived.as_json()["predicted"]["step_time_s"] == pytest.approx(lag.replay(c, bound, x) / (30 - skip))
    validate(policy_with(derived.as_json(), "lag"), tmp_path / "policy.json")


def test_one_rank_gets_a_reason_not_a_bound(tmp_path: Path) -> None:
    with open_context(bsp_run(tmp_path / "run", np.array([[1, 2, 3]]) * MS)) as ctx:
        derived = lag.derive(ctx)
    assert derived.section is None and "at least 2 ranks" in derived.reason


def grad_row(step: int, name: str, numel: int, counts: tuple[int, int, int]) -> dict:
    return {"step": step, "name": name, "numel": numel, "l2": 1.0, "absmax": 1.0, "q50": 0.1, "q90": 0.5,
            "q99": 0.8, "q999": 0.9, "count_above_keep_0_1pct": counts[0], "count_above_keep_1pct": counts[1],
            "count_above_keep_10pct": counts[2], "thr_keep_0_1pct": 0.9, "thr_keep_1pct": 0.8, "thr_keep_10pct": 0.5}


# counts above the stale thresholds (0.1%, 1%, 10%) at sampled steps 0, 10, 20
COUNTS = {"a": (1000, [(1, 10, 100), (6, 12, 150), (3, 8, 90)]),
          "b": (200, [(1, 2, 20), (0, 3, 10), (2, 1, 30)])}


def compression_run(path: Path, *, with_grads: bool = True) -> Path:
    grads = [grad_row(10 * i, name, numel, counts[i]) for name, (numel, counts) in COUNTS.items() for i in range(3)]
    comms = {r: [c for t in range(3) for c in (
        comm(t, "all_to_all_single", splits_out=[1536, 1536], splits_in=[1536, 1536], dtype="torch.int64"),
        comm(t, "all_to_all_single", splits_out=[2048, 2048], splits_in=[2048, 2048], tag="output_fwd"),
        comm(t, "all_reduce", bytes_out=4800, bytes_in=4800, tag="_sum_allreduce_hook", is_async=True),
        comm(t, "all_to_all_single", splits_out=[2048, 2048], splits_in=[2048, 2048], tag="output_bwd"),
        comm(t, "all_reduce", bytes_out=16, bytes_in=16, tag="_log_progress", dtype="torch.float64"))]
        for r in (0, 1)}
    steps = {r: [(t * 10 * MS, (t + 1) * 10 * MS) for t in range(3)] for r in (0, 1)}
    run = make_run(path, comms=comms, steps=steps, grads={0: grads, 1: grads} if with_grads else None)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["tables"] = [{"name": "t0", "num_rows": 100, "dim": DIM, "dtype": "float32", "kind": "pooled",
                           "shards": [{"rank": 0, "first_row": 0, "num_rows": 100}]}]
    (run / "manifest.json").write_text(json.dumps(manifest))
    return run


def test_compression_bytes_follow_their_formulas(tmp_path: Path) -> None:
    with open_context(compression_run(tmp_path / "run")) as ctx:
        derived = compression.derive(ctx)
    dp, mp = derived.as_json()["dp"], derived.as_json()["mp"]
    # no replay: the smallest keep ratio, refreshed every step, sends the targets ⌈0.001 · 1000⌉ + ⌈0.001 · 200⌉
    assert dp["keep_ratio"] == 0.001 and dp["refresh_every"] == 1 and dp["error_feedback"] is True
    kept = 1 + 1
    assert dp["predicted"]["kept_elements_per_rank"] == kept
    # N = 1,200 entries in one bucket: int32 indices (8 bytes an entry) tie int16 offsets (6, and one block
    # count), beat a bitmap (150 + 4K) and dense (4N); plus each rank's count, per rank
    dp_bytes = 2 * (8 * kept + 4)
    assert dp["predicted"]["dp_bytes_per_step"] == dp_bytes
    assert "dp_bytes_per_step" not in dp.get("intervals", {})  # no parameter sent whole: exact
    assert dp["predicted"]["baseline_dp_bytes_per_step"] == 2 * 4800  # the hook's all-reduce, not the log's
    assert dp["predicted"]["ratio"] == pytest.approx(dp_bytes / 9600)
    assert dp["predicted"]["dp_wire_bytes_per_step"] == 1 * dp_bytes
    assert dp["predicted"]["baseline_dp_wire_bytes_per_step"] == 2 * 1 / 2 * 9600
    per_param = {name: (ratio, d01, d1) for name, ratio, d01, d1 in
                 derived.tables["dct_dp"].select("name", "keep_ratio", "drift_0_1pct", "drift_1pct").rows()}
    assert per_param == {"a": (0.01, 6.0, 1.2), "b": (0.001, 2.0, 1.5)}
    measured = 2 * (4096 + 4096)
    assert mp["keep_ratio"] == 0.05
    assert mp["predicted"]["baseline_output_a2a_bytes_per_step"] == measured
    # 128 rows of D = 16 each way a step; K = ⌈0.05·16⌉ = 1: forward 4 + 1 (uint8 position), backward 4
    compressed = 128 * (4 + 1) + 128 * 4
    assert mp["predicted"]["output_a2a_bytes_per_step"] == pytest.approx(compressed)
    assert mp["predicted"]["a2a_bytes_per_step"] == pytest.approx(2 * 3072 + compressed)
    assert mp["predicted"]["ratio"] == pytest.approx(compressed / measured)
    assert derived.evidence["mp"]["quantized_alternatives_bytes_per_step"] == {
        "bf16": measured / 2, "fp16": measured / 2, "fp8": 256 * (16 + 4)}
    assert set(derived.tables["dct_mp"]["tag"]) == {"output_fwd", "output_bwd"}
    validate(policy_with(derived.as_json(), "compression"), tmp_path / "policy.json")


def test_compression_dp_takes_the_most_compressive_keep_ratio_its_calibration_keeps_in_budget(tmp_path: Path) -> None:
    """Calibrated at keep 0.1% (over the AUC budget at one seed) and 1% (within at both), the section
    is written at 1%, refreshed every step, sending 1% of `a`'s 1,000 and `b`'s 200 entries."""
    run = compression_run(tmp_path / "run")
    base = {"eval_auc": 0.75, "eval_logloss": 0.5}

    def point(keep: float, *aucs: float) -> dict:
        seeds = [quality.seed_of(i, f"runs/q{i}", {"eval_auc": 0.75 + auc, "eval_logloss": 0.5}, base)
                 for i, auc in enumerate(aucs)]
        return quality.point_of("compression.dp", keep, 30, seeds)

    quality.write(run, [point(0.001, -0.001, -0.004), point(0.01, -0.0005, -0.001)])
    with open_context(run) as ctx:
        dp = compression.derive(ctx).as_json()["dp"]
    assert (dp["keep_ratio"], dp["refresh_every"]) == (0.01, 1)
    assert dp["predicted"]["kept_elements_per_rank"] == 10 + 2
    assert dp["predicted"]["eval_auc_change"] == pytest.approx(-0.00075)
    assert "the most compressive measured within an eval AUC loss of at most 0.002" in dp["why"]


def test_the_codec_work_is_the_calibrated_exchange_of_the_values_a_rank_sends_each_way(tmp_path: Path) -> None:
    """calibrate._dct_mp times one exchange of n rows forward and backward; the run's output bytes hold
    both directions, so a rank encodes half of them each way: 64 rows of D = 16 here (bench/RESULTS.md
    §32: counting both directions doubled the work and predicted DCT-MP's step 25-35% slow)."""
    run = compression_run(tmp_path / "run")
    model = {"c0_s": 0.001, "c_value_s": 1e-6, "c_kept_s": 1e-5, "residual_s": 0.0}
    (run / "analysis").mkdir(exist_ok=True)
    (run / "analysis" / "calibration.json").write_text(json.dumps({"machine": {"cores": 2}, "dct_mp": model}))
    with open_context(run) as ctx:
        mp = compression.derive(ctx).as_json()["mp"]
    values = 64 * 16  # a rank's forward all-to-all, as its backward
    assert mp["predicted"]["rank_work_s"] == pytest.approx(0.001 + 1e-6 * values + 1e-5 * values * 0.05)


def test_without_grads_only_mp_is_derived_and_dp_says_why(tmp_path: Path) -> None:
    with open_context(compression_run(tmp_path / "run", with_grads=False)) as ctx:
        derived = compression.derive(ctx)
    assert set(derived.as_json()) == {"mp"} and "no grads table" in derived.evidence["not_derived"]["dp"]
    with open_context(make_run(tmp_path / "bare", steps={0: [(0, MS)], 1: [(0, MS)]})) as ctx:
        bare = compression.derive(ctx)
    assert bare.as_json() is None and "compression.dp: no grads table" in bare.reason
    assert "compression.mp: no training comms" in bare.reason
