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
from analyses.network import WIRE_EFFICIENCY, fit_calls, network, timed, warmup_steps
from tests.recorded import REPO
from tests.test_cluster import needs_cluster
from tests.test_traffic import make_run
from tracekit.units import parse_rate

ALPHA_A2A, ALPHA_AR, BETA = 300e-6, 150e-6, 1 / 50e6  # 50 MB/s


def _call(step: int, op: str, out: list[int], inn: list[int], t0: int, seconds: float) -> dict:
    return {"step": step, "op": op, "group": "0", "group_size": 2, "dtype": "float32", "bytes_out": sum(out),
            "bytes_in": sum(inn), "splits_out": out, "splits_in": inn, "t_start_ns": t0,
            "t_end_ns": t0 + int(seconds * 1e9), "tag": op, "async": False, "phase": "train"}


def built_calls(path: Path) -> Path:
    """Two ranks: lopsided all-to-alls (rank 0 sends s, rank 1 sends s/4) and ring all-reduces of
    sizes over two decades, each taking α + β·x on its faster rank; the other waits 1 ms more."""
    rows = {0: [], 1: []}
    t = 0
    for step, s in enumerate(np.geomspace(4e3, 4e5, 12).astype(int)):
        a2a = ALPHA_A2A + BETA * s  # busiest link: rank 0's remote s out (= rank 1's in)
        ar = ALPHA_AR + BETA * s  # ring at W = 2: 2(W−1)/W · S = S
        for rank in (0, 1):
            wait = 1e-3 if rank == 1 else 0.0
            out = [100, s] if rank == 0 else [s // 4, 100]
            inn = [100, s // 4] if rank == 0 else [s, 100]
            rows[rank].append(_call(step, "all_to_all_single", out, inn, t, a2a + wait))
            rows[rank].append(_call(step, "all_reduce", [s], [s], t + 10**7, ar + wait))
        t += 10**8
    return make_run(path, comms=rows)


def test_the_fit_recovers_known_latency_and_bandwidth(tmp_path: Path) -> None:
    with open_context(built_calls(tmp_path / "run")) as ctx:
        fit = fit_calls(ctx, [])
    assert fit.alpha_s["all_to_all_single"] == pytest.approx(ALPHA_A2A, rel=0.01)
    assert fit.alpha_s["all_reduce"] == pytest.approx(ALPHA_AR, rel=0.01)
    assert fit.beta_s_per_byte == pytest.approx(BETA, rel=0.01)
    assert fit.residual_s < 1e-6 and fit.calls == 24


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
