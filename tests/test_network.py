"""The one network model (analyses/network.py): the α–β fit recovers a known latency and bandwidth
from built calls and from a real run on `tracekit cluster` at a known link rate; the baseline step
time's warm-up rule and drift; the decision rule (analyses/decision.py) on a run where replication
cannot pay."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from analyses.context import Options, open_context
from analyses.network import WIRE_EFFICIENCY, _lstsq, fit_calls, network, timed, warmup_steps
from tests.recorded import REPO
from tests.test_cluster import needs_cluster
from tests.test_traffic import make_run
from tracekit.units import parse_rate

ALPHA_A2A, ALPHA_AR, BETA = 300e-6, 150e-6, 1 / 50e6  # 50 MB/s


def _call(step: int, op: str, out: list[int], inn: list[int], t0: int, seconds: float) -> dict:
    return {"step": step, "op": op, "group": "0", "group_size": 2, "dtype": "float32", "bytes_out": sum(out),
            "bytes_in": sum(inn), "splits_out": out, "splits_in": inn, "t_start_ns": t0,
            "t_end_ns": t0 + int(seconds * 1e9), "tag": op, "async": False, "phase": "train"}


def built_calls(path: Path, head_start: float = 0.0) -> Path:
    """Two ranks: lopsided all-to-alls (rank 0 sends s, rank 1 sends s/4) and ring all-reduces of
    sizes over two decades, each taking α + β·x from the last entry to the last exit. Rank 1 enters
    1 ms early and waits. With a head start, rank 0 enters early by that share of the transfer
    and its data is on the wire meanwhile: rank 1, entering last, leaves that much sooner."""
    rows = {0: [], 1: []}
    t = 0
    for step, s in enumerate(np.geomspace(4e3, 4e5, 12).astype(int)):
        a2a = ALPHA_A2A + BETA * s  # busiest link: rank 0's remote s out (= rank 1's in)
        ar = ALPHA_AR + BETA * s  # ring at W = 2: 2(W−1)/W · S = S
        for op, t0, took, out, inn in (("all_to_all_single", t, a2a, ([100, s], [s // 4, 100]), ([100, s // 4], [s, 100])),
                                       ("all_reduce", t + 10**7, ar, ([s], [s]), ([s], [s]))):
            if head_start:
                early = int(head_start * took * 1e9)
                rows[0].append(_call(step, op, out[0], inn[0], t0 - early, took + early / 1e9))
                rows[1].append(_call(step, op, out[1], inn[1], t0, took - early / 1e9))
            else:
                rows[0].append(_call(step, op, out[0], inn[0], t0, took))
                rows[1].append(_call(step, op, out[1], inn[1], t0 - 10**6, took + 1e-3))
        t += 10**8
    return make_run(path, comms=rows)


def test_the_fit_recovers_known_latency_and_bandwidth(tmp_path: Path) -> None:
    with open_context(built_calls(tmp_path / "run")) as ctx:
        fit = fit_calls(ctx, [])
    assert fit.alpha_s["all_to_all_single"] == pytest.approx(ALPHA_A2A, rel=0.01)
    assert fit.alpha_s["all_reduce"] == pytest.approx(ALPHA_AR, rel=0.01)
    assert fit.beta_s_per_byte == pytest.approx(BETA, rel=0.01)
    assert fit.residual_s < 1e-6 and fit.calls == 24


def test_an_early_ranks_head_start_on_the_wire_still_counts_as_transfer(tmp_path: Path) -> None:
    """Data from a rank that entered early is on the wire before the last rank enters: the call's
    transfer runs from the last entry to the last exit, not the least duration a rank saw."""
    with open_context(built_calls(tmp_path / "run", head_start=0.5)) as ctx:
        fit = fit_calls(ctx, [])
    assert fit.beta_s_per_byte == pytest.approx(BETA, rel=0.01)
    assert fit.alpha_s["all_to_all_single"] == pytest.approx(ALPHA_A2A, rel=0.01)


def test_an_alpha_below_zero_is_held_at_zero_and_beta_refitted() -> None:
    """Small calls faster than the link (a token bucket's burst) pull an unconstrained line below
    0 at x = 0: α is held at 0 and β is the least-squares slope through the origin."""
    x = np.array([47e3, 94e3, 1.5e6, 1.5e6])
    t = np.array([0.003, 0.015, 0.265, 0.283])
    alpha, beta = _lstsq(x, t, np.zeros(4, dtype=int), 1, None)
    assert alpha.tolist() == [0.0]
    assert beta == pytest.approx(float(x @ t / (x @ x)))


def test_a_given_link_rate_fixes_beta_and_the_alphas_are_fitted(tmp_path: Path) -> None:
    with open_context(built_calls(tmp_path / "run"), Options(inter_bw=25e6)) as ctx:
        fit = fit_calls(ctx, [])
    assert fit.beta_s_per_byte == pytest.approx(1 / 25e6)
    assert fit.source.startswith("β from")


def test_the_baseline_step_time_leaves_the_warm_up_out_and_states_the_drift() -> None:
    assert [warmup_steps(n) for n in (0, 1, 2, 8, 20, 400)] == [0, 0, 1, 2, 5, 5]
    times = np.array([1.0] * 5 + [0.010] * 50 + [0.012] * 50)  # start-up, then a slower second half
    step = timed(times)
    assert step.warmup == 5 and step.steps == 100
    assert step.median_s == pytest.approx(0.011)
    assert step.spread_s == pytest.approx(0.001)  # half the range of the windows' medians


@needs_cluster
def test_the_fit_recovers_the_link_rate_of_a_cluster_run(tmp_path: Path) -> None:
    """A real 2-node run at 50mbit: the fitted bandwidth is the link's payload rate."""
    link = "50mbit"
    trainer = ["--preset", "criteo-kaggle", "--scale", "0.001", "--dim", "32", "--bottom-mlp", "64,32",
               "--top-mlp", "64,1", "--batch-size", "512", "--samples", "100000", "--eval-fraction", "0",
               "--steps", "16", "--log-every", "1000"]
    run = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "tracekit", "cluster", "--nodes", "2", "--ranks-per-node", "1",
                        "--link", link, "--record", str(run), "--", sys.executable, "train.py", *trainer],
                       cwd=REPO, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    with open_context(run) as ctx:
        net = network(ctx)
    rate = parse_rate(link) * WIRE_EFFICIENCY
    fitted = net.fit.bandwidth
    assert fitted is not None, net.fit
    # within the fit's residual at the calls' typical size, and at most 15% off either way
    typical = 200e3
    assert abs(typical / fitted - typical / rate) <= max(3 * net.fit.residual_s, 0.15 * typical / rate), net.summary()
    assert all(a >= 0 for a in net.fit.alpha_s.values())
