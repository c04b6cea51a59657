"""The replay (analyses/replay/): built graphs whose times are known by hand (gloo's order of an
exchange entered apart, max-min sharing of a link, an async call waited for), and on `tracekit cluster`
a recorded baseline that replays to its measured step times, and whose replay with the output
all-to-all's bytes halved predicts a run where the trainer halves them (`--a2a-dtype bf16`)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from analyses.context import open_context
from analyses.replay import graph, simulation
from analyses.replay.change import Added, Change, compose
from analyses.replay.graph import Call, Step
from analyses.replay.links import Links
from analyses.replay.prediction import replay
from analyses.replay.simulation import run_steps
from tests.recorded import REPO
from tests.test_cluster import needs_cluster

MB = 1e6
TWO_NODES = Links((0, 1), inter=MB, intra=np.inf, alpha={})


def exchange(out0: float, out1: float, entries=(0.0, 0.0), is_async: bool = False, collective: str | None = None) -> Call:
    """An all-to-all of two ranks: rank 0 sends out0 bytes to rank 1, rank 1 out1 to rank 0."""
    return Call("all_to_all_single", "t", collective, (0, 1), np.array([[0.0, out0], [out1, 0.0]]), is_async, 0.0,
                max(entries), tuple(entries))


def one_step(programs: dict, calls: dict, start=None) -> Step:
    return Step(0, start or {0: 0.0, 1: 0.0}, programs, calls, 0.0)


def test_ranks_entering_together_send_both_ways_at_once() -> None:
    step = one_step({r: [("call", 0)] for r in (0, 1)}, {0: exchange(MB, MB)})
    assert run_steps([step], TWO_NODES)[0] == pytest.approx(1.0)


def test_the_later_ranks_data_crosses_first_and_the_earlier_ones_after_it() -> None:
    # rank 0 computes 0.5 s, rank 1 enters at once: rank 0's 1 MB crosses 0.5 -> 1.5 (rank 1 leaves then),
    # rank 1's notice follows it, so rank 1's 1 MB crosses 1.5 -> 2.5 (rank 0 leaves then)
    step = one_step({0: [("compute", 0.5), ("call", 0), ("end", 0)], 1: [("call", 0), ("end", 0)]},
                    {0: exchange(MB, MB)})
    ends = simulation._Simulation(TWO_NODES, step.calls).run(step.programs, step.start)
    assert ends[0] == [pytest.approx(2.5)] and ends[1] == [pytest.approx(1.5)]


def test_flows_sharing_a_link_share_it_fairly() -> None:
    # two calls move at once from node 0 to node 1: 1 MB each at half the link, then alone
    calls = {0: exchange(MB, 0.0, is_async=True), 1: exchange(2 * MB, 0.0)}
    programs = {r: [("issue", 0), ("call", 1), ("wait", None)] for r in (0, 1)}
    assert run_steps([one_step(programs, calls)], TWO_NODES)[0] == pytest.approx(3.0)
    # ... while a flow the other way takes the other direction of the link, at its full rate
    calls = {0: exchange(0.0, MB, is_async=True), 1: exchange(2 * MB, 0.0)}
    assert run_steps([one_step(programs, calls)], TWO_NODES)[0] == pytest.approx(2.0)


def test_an_async_call_runs_beside_compute_until_its_wait() -> None:
    calls = {0: exchange(MB, MB, is_async=True)}
    hidden = {r: [("issue", 0), ("compute", 1.5), ("wait", None)] for r in (0, 1)}
    exposed = {r: [("issue", 0), ("compute", 0.25), ("wait", None)] for r in (0, 1)}
    assert run_steps([one_step(hidden, calls)], TWO_NODES)[0] == pytest.approx(1.5)
    assert run_steps([one_step(exposed, calls)], TWO_NODES)[0] == pytest.approx(1.0)


def test_an_async_call_the_rank_waits_on_itself_holds_it_there_not_at_the_wait_point() -> None:
    """A TorchRec awaitable: issued, waited on (`comms.t_wait_ns`) before the rest of the forward."""
    calls = {0: exchange(MB, MB, is_async=True)}
    awaited = {r: [("issue", 0), ("compute", 0.25), ("waitfor", 0), ("compute", 1.0), ("wait", None)] for r in (0, 1)}
    assert run_steps([one_step(awaited, calls)], TWO_NODES)[0] == pytest.approx(2.0)  # 1 s transfer, then 1 s


def test_a_recorded_rank_becomes_its_program() -> None:
    """`comms` rows as `_program` reads them, (entry, completion, call, async, wait), in ns: a synchronous
    call, an async call waited on where it was recorded, and one left to the backward's wait point."""
    ms = 1_000_000
    events = [(2 * ms, 5 * ms, 0, False, None), (6 * ms, 9 * ms, 1, True, 7 * ms), (8 * ms, 12 * ms, 2, True, None)]
    program = graph._program(events, 0, 20 * ms, 10 * ms)
    assert program == [("compute", 0.002), ("call", 0), ("compute", 0.001), ("issue", 1), ("compute", 0.001),
                       ("waitfor", 1), ("compute", 0.0), ("issue", 2), ("compute", 0.001), ("wait", None),
                       ("compute", 0.008)]


def test_alpha_and_a_change_of_bytes_and_added_calls() -> None:
    links = Links((0, 1), inter=MB, intra=np.inf, alpha={"all_to_all_single": 0.01, "all_reduce": 0.02})
    programs = {r: [("call", 0), ("compute", 0.1), ("wait", None), ("compute", 0.1)] for r in (0, 1)}
    step = one_step(programs, {0: exchange(MB, MB, collective="output_fwd")})
    assert run_steps([step], links)[0] == pytest.approx(1.21)
    halved = Change(scale={"output_fwd": 0.5})
    assert run_steps([step], links, halved)[0] == pytest.approx(0.71)
    # a ring all-reduce of 1 MB a rank added after the wait: 2(W-1)/W · S = 1 MB each way, plus its α
    synced = Change(added=(Added("all_reduce", MB),), work_s=0.05)
    assert run_steps([step], links, synced)[0] == pytest.approx(1.21 + 1.02 + 0.05)
    assert run_steps([step], links, Change(skip=1.0))[0] == pytest.approx(0.2)


def test_links_without_a_rate_cost_only_alpha() -> None:
    links = Links((0, 0), inter=np.inf, intra=np.inf, alpha={"all_to_all_single": 0.001})
    step = one_step({r: [("call", 0), ("compute", 0.1)] for r in (0, 1)}, {0: exchange(MB, MB), 1: exchange(MB, 0)})
    step.programs = {r: [("call", 0), ("call", 1), ("compute", 0.1)] for r in (0, 1)}
    assert run_steps([step], links)[0] == pytest.approx(0.102)


def test_a_token_bucket_sends_its_burst_at_line_rate_then_the_rate() -> None:
    # 1 MB one way on a 1 MB/s link whose bucket holds 0.25 MB: 0.25 MB at once, the rest at the rate
    links = Links((0, 1), inter=MB, intra=np.inf, alpha={}, burst=0.25 * MB)
    step = one_step({r: [("call", 0)] for r in (0, 1)}, {0: exchange(MB, 0.0)})
    assert run_steps([step], links)[0] == pytest.approx(0.75, rel=0.02)


def test_on_one_host_a_recorded_call_takes_the_time_it_took() -> None:
    links = Links((0, 0), inter=np.inf, intra=np.inf, alpha={"all_to_all_single": 0.002}, per_call=True)
    recorded = replace(exchange(MB, MB), time_s=0.030)
    programs = {r: [("call", 0), ("compute", 0.01)] for r in (0, 1)}
    assert run_steps([one_step(programs, {0: recorded})], links)[0] == pytest.approx(0.040)
    # its bytes halved change nothing there; an added call costs its op's α
    step = one_step(programs, {0: replace(recorded, collective="output_fwd")})
    assert run_steps([step], links, Change(scale={"output_fwd": 0.5}))[0] == pytest.approx(0.040)
    added = Change(added=(Added("all_to_all_single", MB),))
    assert run_steps([step], links, added)[0] == pytest.approx(0.042)


def test_changes_compose() -> None:
    a = Change(scale={"output_fwd": 0.5}, skip=0.2, added=(Added("all_reduce", 10.0),), work_s=0.01)
    b = Change(scale={"output_fwd": 0.5, "output_bwd": 0.1}, work_s=0.02, dense=0.01)
    both = compose([a, b])
    assert both.scale == {"output_fwd": 0.25, "output_bwd": 0.1}
    assert (both.skip, len(both.added), both.work_s, both.dense) == (0.2, 1, pytest.approx(0.03), 0.01)


def test_steps_run_one_after_another() -> None:
    # rank 1 leaves each exchange 1 s before rank 0 (it entered late) and starts the next step early:
    # it waits there, and each step after the first lasts the same on both ranks
    programs = {0: [("compute", 0.5), ("call", 0)], 1: [("call", 0)]}
    steps = [Step(i, {0: 0.0, 1: 0.0}, programs, {0: exchange(MB, MB)}, 0.0) for i in range(3)]
    times = run_steps(steps, TWO_NODES)
    assert times[0] == pytest.approx(2.5)
    assert times[1] == pytest.approx(times[2])


# on an emulated cluster ------------------------------------------------------------------------------

TRAIN = ["--tables", "4", "--rows", "20000", "--dim", "32", "--pooling", "4", "--zipf", "1.2", "--batch-size", "512",
         "--steps", "40", "--bottom-mlp", "64,32", "--top-mlp", "64,1"]


def _cluster_run(run: Path, *extra: str) -> Path:
    r = subprocess.run([sys.executable, "-m", "tracekit", "cluster", "--nodes", "2", "--link", "100mbit",
                        "--record", str(run), "--", sys.executable, "train.py", *TRAIN, *extra],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return run


@needs_cluster
def test_a_cluster_baseline_replays_to_its_steps_and_predicts_halved_bytes(tmp_path: Path) -> None:
    base = _cluster_run(tmp_path / "base")
    with open_context(base) as ctx:
        rp = replay(ctx)
        check = rp.check()
        assert rp.fit.calls >= 20 and rp.fit.residual_s < 0.05 * rp.measured_median_s
        # within 3% in most runs alone, -9.2% once under the full suite: the steps can alternate between two modes
        # (a token bucket's first-in first-out queue, which the replay does not model: RESULTS §36)
        assert check["p50"]["error"] == pytest.approx(0, abs=0.15)
        assert check["p90"]["error"] == pytest.approx(0, abs=0.25)  # a FIFO link queue is not modelled (RESULTS §36)
        halved = rp.predict(Change(scale={"output_fwd": 0.5, "output_bwd": 0.5}))
    bf16 = _cluster_run(tmp_path / "bf16", "--a2a-dtype", "bf16")
    with open_context(bf16) as ctx:
        other = replay(ctx)
    # what the two runs share: the changed run's median over the baseline's, against the predicted ratio's interval
    # (the baseline's drift is in it) widened by the changed run's own drift, so a box busier for one run than the
    # other does not fail it, and halved bytes priced wrong (no gain, or the whole step halved) still do
    base_s = rp.measured_median_s
    ratio = other.measured_median_s / base_s
    low, high = halved.low_s / base_s - other.spread_s / base_s, halved.high_s / base_s + other.spread_s / base_s
    assert low <= ratio <= high, (halved, ratio, other.spread_s)
    assert halved.ratio < 0.9  # the bytes halved cost time here: the test can fail
