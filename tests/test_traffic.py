"""Traffic on runs of known content: bytes per op and step, the rank×rank matrix, nccl-tests
bandwidths, imbalance and the policy baseline; and on one real 2-rank recording of the trainer,
where every figure must equal the comms rows exactly.

The helpers here (`make_run`, `comm`, `bsp_run`) build runs through the real writer and are shared
with tests/test_timeline.py and tests/test_lag_compression.py."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from tests.manifests import write_manifest
from analyses import traffic
from analyses.context import open_context
from tracekit.run import open_run
from tracekit.store import RunWriter

MS = 1_000_000


def comm(step: int, op: str, *, splits_out: list[int] | None = None, splits_in: list[int] | None = None,
         bytes_out: int | None = None, bytes_in: int | None = None, group: str = "0", group_size: int = 2,
         dtype: str = "torch.float32", t0: int = 0, t1: int = 1, tag: str = "", is_async: bool = False,
         phase: str = "train") -> dict:
    """One comms row; bytes default to the sums of the splits."""
    splits_out, splits_in = splits_out or [], splits_in or []
    return {"step": step, "op": op, "group": group, "group_size": group_size, "dtype": dtype,
            "bytes_out": sum(splits_out) if bytes_out is None else bytes_out,
            "bytes_in": sum(splits_in) if bytes_in is None else bytes_in,
            "splits_out": splits_out, "splits_in": splits_in, "t_start_ns": t0, "t_end_ns": t1,
            "tag": tag, "async": is_async, "phase": phase}


def make_run(path: Path, *, comms: dict[int, list[dict]] | None = None,
             steps: dict[int, list[tuple[int, int]]] | None = None, grads: dict[int, list[dict]] | None = None,
             world_size: int | None = None, hosts: tuple[str, ...] = ("h0",),
             anchors: dict[int, tuple[int, int]] | None = None,
             tables: dict[str, dict[int, list[dict]]] | None = None) -> Path:
    """A run directory written with RunWriter: per rank its comms rows (seq in list order), step
    windows [(t_start_ns, t_end_ns)] for steps 0.., grads rows and the rows of other `tables`
    ({table: {rank: rows}}); and its manifest."""
    ranks = sorted(set(comms or {}) | set(steps or {}) | set(grads or {}))
    for rank in ranks:
        with RunWriter(path, rank=rank) as writer:
            rows = (comms or {}).get(rank, [])
            if rows:
                columns = {key: [row[key] for row in rows] for key in rows[0]}
                writer.append("comms", {**columns, "seq": list(range(len(rows)))})
            windows = (steps or {}).get(rank, [])
            if windows:
                writer.append("steps", {"step": list(range(len(windows))), "t_start_ns": [w[0] for w in windows],
                                        "t_end_ns": [w[1] for w in windows], "samples": [32] * len(windows),
                                        "loss": [None] * len(windows)})
            rows = (grads or {}).get(rank, [])
            if rows:
                writer.append("grads", {key: [row[key] for row in rows] for key in rows[0]})
            for table, by_rank in (tables or {}).items():
                rows = by_rank.get(rank, [])
                if rows:
                    writer.append(table, {key: [row[key] for row in rows] for key in rows[0]})
    anchors = anchors or {rank: (0, 0) for rank in ranks}
    write_manifest(path, {"schema_version": "1.1", "status": "completed", "ranks": ranks,
                          "world_size": world_size or len(ranks), "hosts": list(hosts),
                          "clock_anchors": {str(r): {"monotonic_ns": m, "wall_ns": w} for r, (m, w) in anchors.items()},
                          "tables": [{"name": "t0", "num_rows": 100, "dim": 8, "dtype": "float32", "kind": "pooled"}]})
    return path


def bsp_run(path: Path, work: np.ndarray, *, transfer_ns: int = MS, tails_ns: list[int] | None = None,
            shifts_ns: list[int] | None = None, **manifest) -> Path:
    """A bulk-synchronous trace: in step t rank p computes work[p][t] ns, enters one all-to-all
    (every rank leaves it `transfer_ns` after the last one entered), then works tails_ns[p] more and
    ends the step. shifts_ns[p] is added to all of rank p's times (its clock's offset)."""
    ranks, n_steps = work.shape
    tails = tails_ns or [0] * ranks
    shifts = shifts_ns or [0] * ranks
    start = np.zeros(ranks, dtype=np.int64)
    comms: dict[int, list[dict]] = {p: [] for p in range(ranks)}
    windows: dict[int, list[tuple[int, int]]] = {p: [] for p in range(ranks)}
    for t in range(n_steps):
        entry = start + work[:, t].astype(np.int64)
        leave = int(entry.max()) + transfer_ns
        for p in range(ranks):
            comms[p].append(comm(t, "all_to_all_single", splits_out=[8] * ranks, splits_in=[8] * ranks,
                                 group_size=ranks, t0=int(entry[p]) + shifts[p], t1=leave + shifts[p]))
            end = leave + tails[p]
            windows[p].append((int(start[p]) + shifts[p], end + shifts[p]))
            start[p] = end
    return make_run(path, comms=comms, steps=windows, **manifest)


def test_bytes_per_step_are_training_bytes_over_training_steps_with_eval_beside(tmp_path: Path) -> None:
    def rank_rows(splits_out: list[int], splits_in: list[int]) -> list[dict]:
        rows = []
        for t in range(3):
            rows.append(comm(t, "all_to_all_single", splits_out=splits_out, splits_in=splits_in, tag="emb"))
            rows.append(comm(t, "all_reduce", bytes_out=100, bytes_in=100, tag="ddp_bucket_0", is_async=True))
        return rows + [comm(3, "all_to_all_single", splits_out=[5, 5], splits_in=[5, 5], tag="emb", phase="eval")]

    comms = {0: rank_rows([10, 30], [10, 20]), 1: rank_rows([20, 40], [30, 40])}
    steps = {r: [(t * 10 * MS, (t + 1) * 10 * MS + r * MS) for t in range(3)] for r in (0, 1)}
    with open_context(make_run(tmp_path / "run", comms=comms, steps=steps)) as ctx:
        result = traffic.compute(ctx)
        by_op = {(op, phase): (calls, out, per_step)
                 for op, _, phase, calls, out, per_step in result.tables["traffic_by_op"].rows()}
        assert by_op[("all_to_all_single", "train")] == (6, 3 * (40 + 60), 100.0)
        assert by_op[("all_reduce", "train")] == (6, 600, 200.0)
        assert by_op[("all_to_all_single", "eval")] == (2, 20, None)  # beside, no per-step figure
        assert result.summary["train_bytes_per_step"] == 300.0 and result.summary["eval_bytes"] == 20
        assert result.summary["train_bytes_per_step_by_tag"] == {"ddp_bucket_0": 200.0, "emb": 100.0}
        by_rank_step = result.tables["traffic_by_rank_step"].filter(pl.col("op") == "all_to_all_single")
        assert by_rank_step.filter((pl.col("rank") == 1) & (pl.col("step") == 2))["bytes_out"].to_list() == [60]
        assert traffic.baseline(ctx) == {"a2a_bytes_per_step": 100.0, "allreduce_bytes_per_step": 200.0,
                                         "step_time_s": 0.011}  # every step: rank 1's 11 ms


def test_the_matrix_maps_group_ranks_to_global_ranks_and_matches_what_was_received(tmp_path: Path) -> None:
    # world of 3: an all-to-all in the default group, one in the subgroup {0, 2} (group ranks 0, 1),
    # a send 1 -> 2 with its receive, and a subgroup whose second member recorded nothing
    a2a = {0: [0, 11, 12], 1: [100, 0, 120], 2: [200, 210, 0]}
    sub = {0: [0, 7], 2: [9, 0]}
    comms = {r: [comm(0, "all_to_all_single", splits_out=a2a[r], splits_in=[a2a[q][r] for q in range(3)], group_size=3)]
             for r in range(3)}
    for r, splits in sub.items():
        comms[r].append(comm(0, "all_to_all_single", splits_out=splits, group="7", group_size=2,
                             splits_in=[sub[q][[0, 2].index(r)] for q in (0, 2)]))
    comms[1].append(comm(0, "send", splits_out=[0, 0, 55], splits_in=[0, 0, 0], group_size=3))
    comms[2].append(comm(0, "recv", splits_out=[0, 0, 0], splits_in=[0, 55, 0], group_size=3))
    comms[1].append(comm(0, "all_to_all_single", splits_out=[3, 5], splits_in=[3, 5], group="9", group_size=2))
    with open_context(make_run(tmp_path / "run", comms=comms)) as ctx:
        result = traffic.compute(ctx)
    expected: Counter = Counter()
    for r in range(3):
        for q in range(3):
            expected[(r, q)] += a2a[r][q]
    expected[(0, 2)] += 7
    expected[(2, 0)] += 9
    expected[(1, 2)] += 55
    got = {(s, d): (b, rec) for s, d, b, rec, _ in result.tables["traffic_matrix"].rows()}
    assert got == {key: (b, b) for key, b in expected.items()}
    assert any("8 bytes sent in subgroups" in note for note in result.notes), result.notes


def test_bandwidth_follows_the_nccl_tests_definitions(tmp_path: Path) -> None:
    rows = [comm(0, "all_reduce", bytes_out=1 << 20, bytes_in=1 << 20, group_size=4, t0=0, t1=MS),
            comm(0, "all_gather", bytes_out=1000, bytes_in=4000, group_size=4, t0=0, t1=2 * MS),
            comm(0, "all_to_all_single", splits_out=[2048] * 4, splits_in=[2048] * 4, group_size=4, t0=0, t1=4 * MS),
            comm(0, "broadcast", bytes_out=3000, bytes_in=3000, group_size=4, t0=0, t1=3 * MS),
            comm(0, "all_reduce", bytes_out=999, bytes_in=999, group_size=4, t0=0, t1=-1),  # completion unknown
            comm(0, "all_reduce", bytes_out=999, bytes_in=999, group_size=1, t0=0, t1=MS)]  # no network
    with open_context(make_run(tmp_path / "run", comms={0: rows}, world_size=4)) as ctx:
        table = traffic.compute(ctx).tables["bandwidth"]
    got = {op: (lo, calls, alg, bus) for op, _, lo, _, calls, _, _, alg, bus, _ in table.rows()}
    assert got == {
        "all_reduce": (1 << 20, 1, pytest.approx((1 << 20) / 1e-3), pytest.approx((1 << 20) / 1e-3 * 2 * 3 / 4)),
        "all_gather": (2048, 1, pytest.approx(4000 / 2e-3), pytest.approx(4000 / 2e-3 * 3 / 4)),
        "all_to_all_single": (8192, 1, pytest.approx(8192 / 4e-3), pytest.approx(8192 / 4e-3 * 3 / 4)),
        "broadcast": (2048, 1, pytest.approx(3000 / 3e-3), pytest.approx(3000 / 3e-3)),
    }


def test_measured_bandwidth_is_the_median_over_the_largest_calls(tmp_path: Path) -> None:
    sizes_times = [(1024, 10 * MS), (65536, MS), (65536, 2 * MS), (65536, 4 * MS)]
    rows = [comm(0, "all_to_all_single", splits_out=[s // 2] * 2, splits_in=[s // 2] * 2, t0=0, t1=t)
            for s, t in sizes_times]
    with open_context(make_run(tmp_path / "run", comms={0: rows})) as ctx:
        measured = traffic.measured_bandwidth(ctx)
    assert measured == {"all_to_all_single": pytest.approx(65536 / 2e-3 * 0.5), "all_reduce": None}


def test_measured_bandwidth_leaves_out_async_calls(tmp_path: Path) -> None:
    """DDP's bucket all-reduce is async: its issue-to-completion time includes the backward it overlaps."""
    rows = [comm(0, "all_reduce", bytes_out=65536, bytes_in=65536, t0=0, t1=50 * MS, is_async=True),
            comm(0, "all_to_all_single", splits_out=[32768] * 2, splits_in=[32768] * 2, t0=0, t1=MS)]
    with open_context(make_run(tmp_path / "run", comms={0: rows})) as ctx:
        measured = traffic.measured_bandwidth(ctx)
    assert measured == {"all_to_all_single": pytest.approx(65536 / 1e-3 * 0.5), "all_reduce": None}


def test_imbalance_is_the_busiest_rank_over_the_mean(tmp_path: Path) -> None:
    comms = {0: [comm(0, "all_to_all_single", splits_out=[100, 200], splits_in=[100, 50])],
             1: [comm(0, "all_to_all_single", splits_out=[50, 50], splits_in=[200, 50])]}
    with open_context(make_run(tmp_path / "run", comms=comms)) as ctx:
        table = traffic.compute(ctx).tables["traffic_imbalance"]
    assert table.rows() == [("all_to_all_single", 0, 300.0, 200.0, 1.5)]


def test_a_run_without_comms_says_so(tmp_path: Path) -> None:
    with open_context(make_run(tmp_path / "run", steps={0: [(0, MS)]})) as ctx:
        result = traffic.compute(ctx)
    assert result.tables == {} and "no comms table" in result.notes[0]
    with open_context(tmp_path / "run") as ctx:
        assert traffic.baseline(ctx) == {"a2a_bytes_per_step": None, "allreduce_bytes_per_step": None,
                                         "step_time_s": 0.001}


@pytest.mark.slow
def test_a_recorded_two_rank_run_is_reported_exactly(tmp_path: Path) -> None:
    from tests.recorded import REPO, TINY, record  # imports the CLI, and with it torch
    from analyses import timeline
    from analyses.policies import compression, lag
    from tracekit.policy import new_policy, validate

    code, run_dir = record(tmp_path, sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "2", str(REPO / "train.py"), *TINY, options=("--grad-every", "1"))
    assert code == 0
    run = open_run(run_dir)
    rows = run.scan("comms").filter(pl.col("phase") == "train").collect()
    steps = run.scan("steps").collect()["step"].n_unique()
    with open_context(run_dir) as ctx:
        result = traffic.compute(ctx)
        by_op = result.tables["traffic_by_op"].filter(pl.col("phase") == "train")
        assert steps == 4 and result.summary["steps"] == steps
        for op, tag, _, calls, bytes_out, per_step in by_op.rows():
            mine = rows.filter((pl.col("op") == op) & (pl.col("tag") == tag))
            assert (calls, bytes_out) == (mine.height, mine["bytes_out"].sum()) and per_step * steps == bytes_out
        assert by_op["bytes_out"].sum() == rows["bytes_out"].sum()
        sent: Counter = Counter()
        for rank, splits in rows.filter(pl.col("op") == "all_to_all_single").select("rank", "splits_out").rows():
            for dst, n in enumerate(splits):
                sent[(rank, dst)] += n
        matrix = result.tables["traffic_matrix"]
        assert {(s, d): b for s, d, b, _, _ in matrix.rows()} == sent
        assert matrix["bytes"].to_list() == matrix["bytes_received"].to_list()
        # per rank and step: lengths int32 2*32*4 + ids int64 2*32*3*8 + pooled rows fp32 2*32*8*4, forward and back
        grads = run.scan("grads").filter(pl.col("rank") == 0).group_by("step").agg(pl.col("numel").sum()).collect()
        dense_elements = grads["numel"][0]
        assert traffic.baseline(ctx)["a2a_bytes_per_step"] == 2 * (512 + 3072 + 4096 + 4096)
        # DDP buckets: fp32 gradients
        assert traffic.baseline(ctx)["allreduce_bytes_per_step"] == 2 * 4 * dense_elements
        # calls this small measure latency, and DDP's all-reduces are async: no bandwidth from them
        assert result.summary["bandwidth"] == {"all_to_all_single": None, "all_reduce": None}

        frame = timeline.compute(ctx).tables["timeline"]
        assert frame.height == 2 * steps
        assert ((frame["comm_s"] + frame["compute_s"] - frame["step_s"]).abs() < 1e-9).all()
        assert (frame["wait_s"] <= frame["comm_s"] + 1e-9).all() and (frame["comm_s"] > 0).all()
        policy = new_policy(source_run=str(run_dir), model=ctx.model.policy_model(), baseline=traffic.baseline(ctx))
        for derived in (lag.derive(ctx), compression.derive(ctx)):
            assert derived.as_json() is not None, derived.reason
            policy[derived.name] = derived.as_json()
        validate(policy, run_dir / "policy.json")
        assert policy["compression"]["dp"]["predicted"]["baseline_dp_bytes_per_step"] == 2 * 4 * dense_elements
