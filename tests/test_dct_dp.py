"""DCT-DP as the reference trainer applies it (policy.json's compression.dp, tracekit/dlrm/compression.py),
on two real gloo ranks, all scenarios in one pair of spawned ranks:

1. Exactness: at keep_ratio 1.0 the trainer computes what it computes without the policy (per-step
   losses and dense weights equal), and a small keep ratio applied beside replication trains.
2. Error feedback: a small MLP under DDP with the hook (keep 5%, the threshold refreshed every 3
   steps, DDP's buckets rebuilt after the first), over 7 steps of SGD: on every rank the applied
   updates sum to Σ_ranks (Σ_steps local gradients − the residual still held back), and the weights
   moved by exactly −lr times that sum.
3. Bytes: every `comms` row tagged dct_dp carries the size the hook reports it encoded (count, then
   payload, per bucket and step), and at 5% the hook sends far fewer bytes than the plain all-reduce.
4. Replay: the grads collector's DCT-DP replay (collectors/dct_replay.py), installed around the
   same MLP under the hook at keep 10% refreshed every 3 steps, counts on every rank and step
   exactly the entries the hook sent: it takes each rank's own gradient, before DDP's all-reduce.
Encoding and decoding each encoding is checked in one process on the module docstring's example.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import polars as pl
import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from tests.manifests import write_manifest
from analyses.policies.dct_dp import _choose
from collectors import comm, grads
from collectors.steps import StepClock
from tests.multiprocess import run_ranks
from tests.test_trainer_equivalence import SMALL
from tracekit.dlrm import policies
from tracekit.dlrm.compression import BLOCK, LABEL, DctDp, DctDpState, _decode, _encode, dct_dp_hook, encoded_bytes
from tracekit.dlrm.config import TrainConfig
from tracekit.dlrm.data import open_dataset
from tracekit.dlrm.train import _sum_allreduce_hook, build_tables, run
from tracekit.policy import new_policy, validate, write_policy
from tracekit.run import open_run
from tracekit.store import RunWriter

W = 2
CFG = TrainConfig(batch_size=32, sharding="table", optimizer="sgd", **SMALL)
MLP_STEPS, MLP_LR = 7, 0.1
MLP_DCT = DctDp(keep_ratio=0.05, refresh_every=3, error_feedback=True)
REPLAY_DCT = DctDp(keep_ratio=0.1, refresh_every=3, error_feedback=True)  # a keep ratio of KEEP_RATIOS


def _dataset(cfg: TrainConfig):
    return open_dataset(cfg.data, tables=cfg.tables, rows=cfg.rows_for_data(), num_dense=cfg.dense, pooling=cfg.pooling,
                        samples=cfg.samples, seed=cfg.seed, zipf=cfg.zipf[0], drift=0.0, preset=None, scale=1.0)


def _write_policy(folder: Path, keep_ratio: float, *, replicate: bool = False) -> Path:
    tables = build_tables(CFG, _dataset(CFG))
    policy = new_policy(source_run="tests/test_dct_dp.py", model={
        "tables": [{"name": t.name, "num_rows": t.rows, "dim": t.dim} for t in tables], "world_size": W})
    policy["compression"] = {"dp": {"keep_ratio": keep_ratio, "refresh_every": 4, "error_feedback": True,
                                    "predicted": {}, "why": "test"}}
    rows = None
    if replicate:
        policy["replication"] = {"kind": "hybrid", "rows": "policy/hot_rows.parquet", "budget_bytes_per_rank": 0,
                                 "sync": "sparse_allreduce", "predicted": {}, "why": "test"}
        rows = {"hot_rows": pl.DataFrame({"table_name": [t.name for t in tables], "row": [0] * len(tables)})}
    return write_policy(folder / "policy.json", policy, rows=rows)


def _train(rank: int, cfg: TrainConfig, policy_path: Path | None):
    dataset = _dataset(cfg)
    policy = None if policy_path is None else policies.load(policy_path, build_tables(cfg, dataset),
                                                            world_size=W, local_world_size=W)
    result = run(cfg, dataset, rank=rank, world_size=W, device=torch.device("cpu"), policy=policy)
    return result.losses, result.weights["dense"]


def _mlp_steps(rank: int, hook, state, clock: StepClock) -> dict:
    """MLP_STEPS of SGD on a small MLP under DDP with `hook`; per parameter, the sums over steps of the
    local gradient and of the hook's result, the weights before and after, and the residual at the end."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 1))
    names = {id(p): name for name, p in model.named_parameters()}
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=True, bucket_cap_mb=0.002)  # ~500 floats a bucket
    local = {name: torch.zeros_like(p) for name, p in before.items()}
    summed = {name: torch.zeros_like(p) for name, p in before.items()}

    def recording(hook_state, bucket):
        params = bucket.parameters()
        sizes = [p.numel() for p in params]
        for p, g in zip(params, bucket.buffer().split(sizes)):
            local[names[id(p)]] += g.view_as(p)

        def keep(fut):
            out = fut.value()
            if isinstance(out, list):
                out = out[0]
            for p, r in zip(params, out.split(sizes)):
                summed[names[id(p)]] += r.view_as(p)
            return out
        return hook(hook_state, bucket).then(keep)

    ddp.register_comm_hook(state, recording)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=MLP_LR)
    data = torch.Generator().manual_seed(100 + rank)
    for _ in range(MLP_STEPS):
        x = torch.randn(64, 8, generator=data)
        y = torch.randn(64, 1, generator=data)
        nn.functional.mse_loss(ddp(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.advance()
    after = {name: p.detach().clone() for name, p in model.named_parameters()}
    residual = {}
    if isinstance(state, DctDpState):
        residual = {names[id(p)]: state.residual[id(p)].view_as(p).clone() for p in model.parameters()}
    return {"local": local, "summed": summed, "before": before, "after": after, "residual": residual}


def _ranks(rank: int, world_size: int, jobs: list[tuple[str, Path | None]], run_dir: str, replay_dir: str) -> dict:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*is deprecated", category=FutureWarning)
    out = {"train": {name: _train(rank, CFG, path) for name, path in jobs}}
    writer = RunWriter(run_dir, rank)
    clock = StepClock()
    handle = comm.install(writer, clock)
    try:
        state = DctDpState(MLP_DCT)
        out["dct"] = _mlp_steps(rank, dct_dp_hook, state, clock)
        out["log"] = state.log
        out["plain"] = _mlp_steps(rank, _sum_allreduce_hook, dist.group.WORLD, clock)
    finally:
        handle.uninstall()
        writer.close()
    writer, clock = RunWriter(replay_dir, rank), StepClock()
    handle = grads.install(writer, clock, grad_every=1, refresh_ladder=(REPLAY_DCT.refresh_every,))
    try:
        state = DctDpState(REPLAY_DCT)
        _mlp_steps(rank, dct_dp_hook, state, clock)  # the model is built after install: its parameters are watched
        out["replay_log"] = state.log
    finally:
        handle.uninstall()
        writer.close()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("dct_dp")
    jobs = [("plain", None), ("keep-1", _write_policy(tmp / "keep-1", 1.0)),
            ("keep-5%-replicated", _write_policy(tmp / "keep-5", 0.05, replicate=True))]
    results = run_ranks(W, _ranks, jobs, str(tmp / "run"), str(tmp / "replay"))
    for run in ("run", "replay"):
        write_manifest(tmp / run, {"status": "completed"})
    comms = open_run(tmp / "run").scan("comms").sort("rank", "seq").collect()
    replay = open_run(tmp / "replay").scan("dct_replay").collect()
    return [{**r, "comms": comms.filter(pl.col("rank") == rank), "replay": replay.filter(pl.col("rank") == rank)}
            for rank, r in enumerate(results)]


@pytest.mark.slow
def test_keep_ratio_one_computes_what_the_plain_run_computes(ranks: list[dict]) -> None:
    for r in ranks:
        plain_losses, plain_dense = r["train"]["plain"]
        losses, dense = r["train"]["keep-1"]
        assert losses == plain_losses
        for key, value in plain_dense.items():
            assert torch.equal(dense[key], value), key


@pytest.mark.slow
def test_a_small_keep_ratio_beside_replication_trains(ranks: list[dict]) -> None:
    plain_losses, _ = ranks[0]["train"]["plain"]
    losses, _ = ranks[0]["train"]["keep-5%-replicated"]
    assert losses == ranks[1]["train"]["keep-5%-replicated"][0], "every rank reports the same global losses"
    assert all(torch.isfinite(torch.tensor(losses))) and losses != plain_losses
    assert losses[-1] < losses[0]


@pytest.mark.slow
def test_error_feedback_applies_the_gradients_less_what_is_held_back(ranks: list[dict]) -> None:
    runs = [r["dct"] for r in ranks]
    for name in runs[0]["summed"]:
        expected = sum(run["local"][name] - run["residual"][name] for run in runs)
        for run in runs:
            torch.testing.assert_close(run["summed"][name], expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(run["after"][name], run["before"][name] - MLP_LR * run["summed"][name],
                                       rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")
    # not vacuous: something was held back, and the threshold was stale between refreshes
    assert any(run["residual"][name].abs().sum() > 0 for run in runs for name in run["residual"])
    log = ranks[0]["log"]
    assert {s.refreshed for s in log} == {True, False}
    assert len({s.bucket for s in log}) > 1, "DDP's buckets were rebuilt into several"


@pytest.mark.slow
def test_comms_carry_the_encoded_sizes(ranks: list[dict]) -> None:
    for r in ranks:
        rows = r["comms"].filter(pl.col("tag") == LABEL)
        reported = []
        for send in r["log"]:
            reported.append(("all_gather_single", 4))
            if send.encoding == "dense":
                reported.append(("all_reduce", send.bytes_out - 4))
            elif send.encoding != "none":
                reported.append(("all_gather_single", send.bytes_out - 4))
        assert list(zip(rows["op"], rows["bytes_out"])) == reported
        encodings = {s.encoding for s in r["log"]}
        assert encodings - {"dense"}, f"only dense buckets: {encodings}"


@pytest.mark.slow
def test_a_small_keep_ratio_sends_fewer_bytes(ranks: list[dict]) -> None:
    for r in ranks:
        sent = r["comms"].filter(pl.col("tag") == LABEL)["bytes_out"].sum()
        plain = r["comms"].filter(pl.col("tag") == "_sum_allreduce_hook")["bytes_out"].sum()
        assert plain == sum(s.dense_bytes for s in r["log"]) == MLP_STEPS * 833 * 4
        assert sent == sum(s.bytes_out for s in r["log"])
        assert sent < plain / 4, (sent, plain)


@pytest.mark.slow
def test_the_grads_collector_replays_exactly_what_the_hook_sends(ranks: list[dict]) -> None:
    targets = 26 + 52 + 32 + 16 + 16 + 1  # 10% of the two weights of 256 and 512 entries; the rest whole
    for r in ranks:
        hook: dict[int, int] = {}
        for send in r["replay_log"]:
            hook[send.step] = hook.get(send.step, 0) + send.kept
        rows = r["replay"].filter((pl.col("keep_ratio") == REPLAY_DCT.keep_ratio)
                                  & (pl.col("refresh_every") == REPLAY_DCT.refresh_every))
        replayed = dict(rows.group_by("step").agg(pl.col("sent").sum()).iter_rows())
        assert replayed == hook
        assert (rows["position"] >= 0).all(), "every gradient was the rank's own"
        assert max(hook.values()) > targets, "not vacuous: the stale threshold let more through"
    assert ranks[0]["replay"]["sent"].to_list() != ranks[1]["replay"]["sent"].to_list(), "each rank its own"


@pytest.mark.parametrize("encoding", ["int32", "int16", "bitmap"])
def test_each_encoding_round_trips_a_bucket_of_several_int16_blocks(encoding: str) -> None:
    n = 3 * BLOCK + 123
    gen = torch.Generator().manual_seed(0)
    sends = [torch.randperm(n, generator=gen)[:count].sort().values for count in (700, 450)]
    sends = [(kept, torch.randn(kept.numel(), generator=gen)) for kept in sends]
    m = max(kept.numel() for kept, _ in sends)
    size = encoded_bytes(encoding, n, m, 4)
    assert size == {"int32": 8 * m, "int16": 6 * m + 4 * 4, "bitmap": n // 8 + 1 + 4 * m}[encoding]
    gathered = torch.cat([_encode(encoding, kept, values, n, m, size) for kept, values in sends])
    expected = torch.zeros(n)
    for kept, values in sends:
        expected.index_add_(0, kept, values)
    assert torch.equal(_decode(encoding, gathered, [700, 450], torch.zeros(n), size), expected)


@pytest.mark.parametrize("encoding", ["int32", "int16", "bitmap"])
def test_each_encoding_round_trips(encoding: str) -> None:
    """The module docstring's example: n = 6, rank 0 sends {1: 0.5, 4: -2.0}, rank 1 {4: 1.0}."""
    n, m = 6, 2
    sends = [(torch.tensor([1, 4]), torch.tensor([0.5, -2.0])), (torch.tensor([4]), torch.tensor([1.0]))]
    size = encoded_bytes(encoding, n, m, 4)
    assert size == {"int32": 16, "int16": 12, "bitmap": 9}[encoding]
    gathered = torch.cat([_encode(encoding, kept, values, n, m, size) for kept, values in sends])
    result = _decode(encoding, gathered, [2, 1], torch.zeros(n), size)
    assert torch.equal(result, torch.tensor([0.0, 0.5, 0.0, 0.0, -1.0, 0.0]))


# compression.dp derived from the replay (analyses/policies/dct_dp.py) on runs of known content: two
# ranks, 10 steps, parameters (in the order their gradients became ready) top.w (1,000 entries),
# top.b (10: sent whole) and bot.w (1,000, replayed on a subset of 500); DDP buckets of 1,010 and
# 1,000 entries (top.w + top.b, then bot.w) in `comms`.
REPLAY_PARAMS = (("top.w", 1000, 1000, 0), ("top.b", 10, 10, 1), ("bot.w", 1000, 500, 2))


def replay_run(path: Path, sent: dict, *, bucket_bytes: tuple[int, int] = (4040, 4000)) -> Path:
    """`sent`: {(keep, refresh): {rank: {name: (sent, sent_first_half)}}}, the same every step."""
    from tests.test_traffic import MS, comm, make_run

    rows = {r: [{"step": t, "name": name, "numel": numel, "replayed": replayed, "position": position,
                 "keep_ratio": keep, "refresh_every": refresh, "sent": by_rank[r][name][0],
                 "sent_first_half": by_rank[r][name][1], "refreshed": t % refresh == 0}
                for (keep, refresh), ranks in sent.items() for by_rank in [ranks]
                for t in range(10) for name, numel, replayed, position in REPLAY_PARAMS]
            for r in (0, 1)}
    comms = {r: [comm(t, "all_reduce", bytes_out=size, bytes_in=size, tag="_sum_allreduce_hook", is_async=True)
                 for t in range(10) for size in bucket_bytes] for r in (0, 1)}
    steps = {r: [(t * 10 * MS, (t + 1) * 10 * MS) for t in range(10)] for r in (0, 1)}
    return make_run(path, comms=comms, steps=steps, tables={"dct_replay": rows})


HELD = {0: {"top.w": (2, 1), "top.b": (10, 5), "bot.w": (1, 1)},  # per rank: (sent, sent_first_half)
        1: {"top.w": (1, 0), "top.b": (10, 5), "bot.w": (3, 2)}}
DRIFTING = {r: {**counts, "top.w": (20, 10)} for r, counts in HELD.items()}
LARGER = {r: {"top.w": (15, 7), "top.b": (10, 5), "bot.w": (10, 5)} for r in (0, 1)}


def _derive_dp(run: Path) -> tuple[dict, dict]:
    from analyses.context import open_context
    from analyses.policies import compression

    with open_context(run) as ctx:
        derived = compression.derive(ctx)
    validate_policy = new_policy(source_run="run", model={"tables": [{"name": "t0", "num_rows": 100, "dim": 8}],
                                                           "world_size": 2})
    validate_policy["compression"] = derived.as_json()
    validate(validate_policy, run / "policy.json")
    return derived.as_json()["dp"], derived.evidence["dp"]


def test_the_longest_refresh_that_holds_the_drift_and_its_bytes_per_ddp_bucket(tmp_path: Path) -> None:
    from analyses.policies.dct_dp import RERUN_ALLOWANCE

    run = replay_run(tmp_path / "run", {(0.001, 20): DRIFTING, (0.001, 5): HELD, (0.01, 20): LARGER, (0.01, 5): LARGER})
    dp, evidence = _derive_dp(run)
    # keep 0.1% (the smallest ratio): targets 1 + 10 + 1 = 12 entries; refreshed every 20 steps its
    # threshold lets through (30 + 6) / 12 = 3x them, every 5 steps (12 + 6) / 12 = 1.5x
    assert (dp["keep_ratio"], dp["refresh_every"], dp["error_feedback"]) == (0.001, 5, True)
    assert evidence["drift"]["0.001/20"] == pytest.approx(3.0) and dp["predicted"]["drift"] == pytest.approx(1.5)
    # per step, per bucket, the largest rank's count (bot.w's scaled by 1000 / 500), int16 offsets + values:
    # bucket 0 max(2 + 10, 1 + 10) = 12 -> 2 * (4 + 6 * 12), bucket 1 max(2, 6) = 6 -> 2 * (4 + 6 * 6)
    assert dp["predicted"]["dp_bytes_per_step"] == 2 * (4 + 72) + 2 * (4 + 36) == 232
    assert dp["predicted"]["baseline_dp_bytes_per_step"] == 2 * (4040 + 4000)
    assert dp["predicted"]["kept_elements_per_rank"] == 18
    # the interval: one bucket per rank (max(14, 17) = 17 -> 2 * 6 * 17 + 2 * 2 * 4 = 220) to each
    # parameter padded alone (2 + 10 + 6 = 18 -> 232), widened by 2 sd of bot.w's subset (its halves
    # average 1.5 and 0.5 sent, so sd = 1000 / 500 * 1.0 = 2 entries, at 12 bytes an entry), then by
    # the allowance for a re-run's own gradients
    assert dp["intervals"]["dp_bytes_per_step"] == pytest.approx([(220 - 2 * 2 * 12) * (1 - RERUN_ALLOWANCE),
                                                                  (232 + 2 * 2 * 12) * (1 + RERUN_ALLOWANCE)])
    assert "DDP's" in evidence["buckets"] and "refreshed every 5 steps" in dp["why"]


def test_a_threshold_that_drifts_at_every_replayed_period_is_refreshed_every_step(tmp_path: Path) -> None:
    run = replay_run(tmp_path / "run", {(0.001, 20): DRIFTING, (0.001, 5): DRIFTING, (0.01, 5): LARGER})
    dp, _ = _derive_dp(run)
    assert (dp["keep_ratio"], dp["refresh_every"]) == (0.001, 1)
    # exactly the targets: bucket 0 1 + 10 = 11 entries, bucket 1 1 entry; an exact figure
    assert dp["predicted"]["dp_bytes_per_step"] == 2 * (4 + 6 * 11) + 2 * (4 + 6 * 1)
    assert "dp_bytes_per_step" not in dp.get("intervals", {}) and "every step" in dp["why"]


def test_buckets_that_do_not_match_pad_each_parameter_alone(tmp_path: Path) -> None:
    run = replay_run(tmp_path / "run", {(0.001, 5): HELD}, bucket_bytes=(3000, 5040))  # 750 + 1,260 entries
    dp, evidence = _derive_dp(run)
    # one bucket of 2,010 entries, 18 entries: 2 * 6 * 18, and the counts of the 2 calls a step
    assert dp["predicted"]["dp_bytes_per_step"] == 2 * 6 * 18 + 2 * 4 * 2
    assert "not matched" in evidence["buckets"]


def test_the_replay_takes_the_keep_ratio_the_calibration_chose_and_its_longest_held_refresh() -> None:
    pairs = pl.DataFrame({"keep_ratio": [0.001, 0.001, 0.01, 0.01, 0.1], "refresh_every": [5, 20, 5, 20, 5],
                          "drift": [1.5, 3.0, 1.2, 1.8, 1.1]})
    assert _choose(pairs)[:2] == (0.001, 5)  # the smallest keep ratio, uncalibrated
    assert _choose(pairs, 0.01)[:2] == (0.01, 20)
    assert _choose(pairs, 0.1)[:2] == (0.1, 5)
    assert _choose(pairs.with_columns(pl.lit(9.0).alias("drift")), 0.01) == (0.01, 1, None)  # none held: every step
