"""The timeline on traces of known timing: waiting is the time before the last rank entered,
communication the union of a rank's comm intervals within its step, stragglers the rank that ends
last and the one the others waited for, and clocks of several hosts aligned by their anchors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from analyses import timeline
from analyses.clocks import clock_offsets
from analyses.context import open_context
from tracekit.manifest import Manifest
from tests.test_traffic import MS, bsp_run, comm, make_run

WORK = np.array([[3, 5, 2, 4], [4, 1, 6, 4], [2, 2, 2, 7]]) * MS
TAILS = [0, 300_000, 100_000]


def expected_bsp(work: np.ndarray, tails: list[int], transfer: int = MS) -> tuple[dict, dict]:
    """(rank, step) -> (step, comm, wait) ns, and step -> (last, spread, margin, blocking, blocked) ns,
    by walking the bulk-synchronous schedule bsp_run writes."""
    ranks, steps = work.shape
    start = [0] * ranks
    per_rank, per_step = {}, {}
    for t in range(steps):
        entry = [start[p] + int(work[p, t]) for p in range(ranks)]
        leave = max(entry) + transfer
        ends = [leave + tails[p] for p in range(ranks)]
        for p in range(ranks):
            per_rank[(p, t)] = (ends[p] - start[p], leave - entry[p], max(entry) - entry[p])
        order = sorted(range(ranks), key=lambda p: -ends[p])
        blocking = max(range(ranks), key=lambda p: entry[p])
        per_step[t] = (order[0], ends[order[0]] - min(ends), ends[order[0]] - ends[order[1]], blocking,
                       sum(max(entry) - e for e in entry))
        start = ends
    return per_rank, per_step


def test_waiting_is_the_time_before_the_last_rank_entered(tmp_path: Path) -> None:
    with open_context(bsp_run(tmp_path / "run", WORK, tails_ns=TAILS)) as ctx:
        result = timeline.compute(ctx)
    per_rank, per_step = expected_bsp(WORK, TAILS)
    frame = result.tables["timeline"]
    got = {(r, t): (round(s * 1e9), round(c * 1e9), round(w * 1e9))
           for r, t, s, c, w in frame.select("rank", "step", "step_s", "comm_s", "wait_s").rows()}
    assert got == per_rank
    assert ((frame["compute_s"] - (frame["step_s"] - frame["comm_s"])).abs() < 1e-12).all()
    stragglers = {t: (last, round(spread * 1e9), round(margin * 1e9), blocking, round(blocked * 1e9))
                  for t, last, spread, margin, blocking, blocked in result.tables["stragglers"].rows()}
    assert stragglers == per_step
    summary = result.summary["stragglers"]
    assert summary["last"] == {"1": 3}  # steps 1..3 (step 0 is warm-up); rank 1 has the longest tail
    assert summary["blocking"] == {"0": 1, "1": 1, "2": 1}  # the last to enter at steps 1, 2, 3
    assert [per_step[t][3] for t in (1, 2, 3)] == [0, 1, 2]
    assert result.summary["per_rank"]["2"]["wait_s"] == pytest.approx(
        np.mean([per_rank[(2, t)][2] for t in (1, 2, 3)]) / 1e9)


def test_communication_is_the_union_of_intervals_within_the_step(tmp_path: Path) -> None:
    comms = {
        0: [comm(0, "all_reduce", bytes_out=4, t0=3 * MS, t1=5 * MS, is_async=True),
            comm(0, "all_to_all_single", splits_out=[4, 4], splits_in=[4, 4], t0=4 * MS, t1=7 * MS),
            comm(0, "send", splits_out=[0, 4], splits_in=[0, 0], t0=8 * MS, t1=9 * MS),
            comm(0, "isend", splits_out=[0, 4], splits_in=[0, 0], t0=int(8.5 * MS), t1=-1),  # completion unknown
            comm(0, "barrier", t0=int(9.5 * MS), t1=12 * MS)],  # crosses into step 1
        1: [comm(0, "all_reduce", bytes_out=4, t0=2 * MS, t1=8 * MS, is_async=True),
            comm(0, "all_to_all_single", splits_out=[4, 4], splits_in=[4, 4], t0=6 * MS, t1=7 * MS),
            comm(0, "recv", splits_out=[0, 0], splits_in=[4, 0], t0=8 * MS, t1=9 * MS),
            comm(1, "barrier", t0=11 * MS, t1=12 * MS)],
    }
    steps = {r: [(0, 10 * MS), (10 * MS, 20 * MS)] for r in (0, 1)}
    with open_context(make_run(tmp_path / "run", comms=comms, steps=steps)) as ctx:
        result = timeline.compute(ctx)
    got = {(r, t): (round(c * 1e9), round(w * 1e9))
           for r, t, c, w in result.tables["timeline"].select("rank", "step", "comm_s", "wait_s").rows()}
    assert got == {(0, 0): (int(5.5 * MS), int(3.5 * MS)),  # [3,7] + [8,9] + [9.5,10]; a2a 6-4, barrier 11-9.5
                   (0, 1): (2 * MS, 0),  # the barrier's [10, 12]; its wait went to the step it started in
                   (1, 0): (7 * MS, 0),  # [2,8] + [8,9]; the async all-reduce waits for nobody
                   (1, 1): (1 * MS, 0)}
    assert result.summary["unmatched_collective_calls"] == 0


@pytest.mark.parametrize("overlapping", [False, True])
def test_an_island_of_communication_counts_in_every_step_it_overlaps(tmp_path: Path, overlapping: bool) -> None:
    calls = [comm(0, "all_reduce", bytes_out=4, t0=8 * MS, t1=12 * MS),  # across steps 0 and 1
             comm(1, "all_reduce", bytes_out=4, t0=21 * MS, t1=23 * MS),  # between steps
             comm(1, "all_reduce", bytes_out=4, t0=24 * MS, t1=26 * MS)]  # from between steps into step 2
    windows = [(0, 10 * MS), (5 * MS if overlapping else 10 * MS, 20 * MS), (25 * MS, 30 * MS)]
    with open_context(make_run(tmp_path / "run", comms={0: calls, 1: calls}, steps={0: windows, 1: windows})) as ctx:
        result = timeline.compute(ctx)
    got = {(r, t): round(c * 1e9) for r, t, c in result.tables["timeline"].select("rank", "step", "comm_s").rows()}
    step1 = 4 * MS if overlapping else 2 * MS  # [8, 12] within [5, 20], else within [10, 20]
    assert got == {(r, t): c for r in (0, 1) for t, c in enumerate((2 * MS, step1, 1 * MS))}


def test_clocks_of_several_hosts_are_aligned_by_their_anchors(tmp_path: Path) -> None:
    shift = 5_000_000_000  # rank 1's monotonic clock reads 5 s ahead of rank 0's
    anchors = {0: (100, 10**18), 1: (100 + shift, 10**18)}
    with open_context(bsp_run(tmp_path / "aligned", WORK[:2], tails_ns=TAILS[:2],
                              shifts_ns=[0, shift], hosts=("a", "b"), anchors=anchors)) as ctx:
        aligned = timeline.compute(ctx)
    with open_context(bsp_run(tmp_path / "unaligned", WORK[:2], tails_ns=TAILS[:2],
                              shifts_ns=[0, shift], hosts=("a",), anchors=anchors)) as ctx:
        unaligned = timeline.compute(ctx)
    with open_context(bsp_run(tmp_path / "reference", WORK[:2], tails_ns=TAILS[:2])) as ctx:
        reference = timeline.compute(ctx)
    columns = ["rank", "step", "step_s", "comm_s", "wait_s"]
    assert aligned.summary["clock"].startswith("several hosts: aligned")
    assert aligned.tables["timeline"].select(columns).equals(reference.tables["timeline"].select(columns))
    assert aligned.tables["stragglers"].equals(reference.tables["stragglers"])
    assert not unaligned.tables["timeline"].select(columns).equals(reference.tables["timeline"].select(columns))


def test_a_run_without_steps_gets_no_timeline(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run", comms={0: [comm(0, "all_reduce", bytes_out=4, t0=0, t1=MS)]})
    with open_context(run) as ctx:
        result = timeline.compute(ctx)
    assert result.tables == {} and "no steps table" in result.notes[0]


def test_offsets_are_zero_on_one_host() -> None:
    manifest = Manifest(hosts=["h"], clock_anchors={"0": {"monotonic_ns": 1, "wall_ns": 50},
                                                    "1": {"monotonic_ns": 9, "wall_ns": 51}})
    assert clock_offsets(manifest)[0] == {0: 0, 1: 0}
    manifest = manifest.updated(hosts=["h", "g"])
    assert clock_offsets(manifest)[0] == {0: 7, 1: 0}


def test_one_rank_has_a_timeline_and_no_stragglers(tmp_path: Path, capsys) -> None:
    """A world-1 run (as the GPU check records one) is analysed and printed: there is no rank to be
    last or to wait for, and the console says so rather than failing on the missing spread."""
    from tracekit.app.console_analysis import RENDERERS

    with open_context(bsp_run(tmp_path / "run", WORK[:1], tails_ns=[0])) as ctx:
        result = timeline.compute(ctx)
    assert result.summary["ranks"] == 1 and result.summary["stragglers"]["mean_end_spread_s"] is None
    RENDERERS["timeline"](result.summary)
    assert "no step ended on more than one rank" in capsys.readouterr().out
