"""Compression of the embedding output all-to-all (tracekit/dlrm/output_codec.py) on 2 real gloo
ranks: DCT-MP keeping every value computes exactly what the plain exchange does; bf16 and fp16
payloads train close to fp32 and send half its bytes; DCT-MP with a small K sends the bytes its
row encoding predicts, and the input dist is untouched. Every rank's all_to_all_single calls are
counted by the function that issued them (not by their labels: the comm collector records those)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.multiprocess import run_ranks
from tracekit.dlrm import policies
from tracekit.dlrm.config import TrainConfig
from tracekit.dlrm.data import open_dataset
from tracekit.dlrm.output_codec import OutputCodec
from tracekit.dlrm.tables import TableSpec
from tracekit.dlrm.train import build_tables, run
from tracekit.errors import ConfigError
from tracekit.policy import PolicyError, new_policy, write_policy

D, T, B = 16, 4, 32  # dim, tables, batch per rank
SMALL = dict(dim=D, dense=13, bottom_mlp=[16, D], top_mlp=[16, 1], steps=6, log_every=1000, lr=0.05,
             eval_fraction=0.0, samples=4096, rows=[997], tables=T, pooling=3, zipf=[1.1], batch_size=B)
ROWWISE_SEQUENCE = dict(sharding="row", sequence_tables=2, optimizer="adagrad")
RUNS = {  # name -> (config changes, DCT-MP keep ratio or None)
    "fp32": ({}, None),
    "keep-all": ({}, 1.0),  # K = D: every value, and its position, crosses
    "bf16": ({"a2a_dtype": "bf16"}, None),
    "fp16": ({"a2a_dtype": "fp16"}, None),
    "fp8": ({"a2a_dtype": "fp8"}, None),
    "keep-1": ({}, 1 / 16),  # K = 1: a uint8 position
    "keep-4-bf16": ({"a2a_dtype": "bf16"}, 0.25),  # K = 4: a 2-byte mask beats 4 uint8 positions
    "fp32-row-sequence": (ROWWISE_SEQUENCE, None),
    "keep-all-row-sequence": (ROWWISE_SEQUENCE, 1.0),
}
PLAIN, CODED = "_AllToAll", "_CodedAllToAll"


def _config(name: str) -> TrainConfig:
    return TrainConfig(**{**SMALL, **RUNS[name][0]})


def _policy(folder: Path, keep_ratio: float) -> Path:
    tables = [{"name": f"t{i}", "num_rows": SMALL["rows"][0], "dim": D} for i in range(T)]
    policy = new_policy(source_run="tests/test_dct_mp.py", model={"tables": tables, "world_size": 2})
    policy["compression"] = {"mp": {"keep_ratio": keep_ratio, "predicted": {}, "why": "test"}}
    return write_policy(folder / "policy.json", policy)


def _train(rank: int, world_size: int, cfg: TrainConfig, policy_path: Path | None):
    """Train; returns losses, weights and every all_to_all_single as (issuing function, dtype, bytes out)."""
    torch.set_num_threads(1)
    dataset = open_dataset(cfg.data, tables=cfg.tables, rows=cfg.rows_for_data(), num_dense=cfg.dense,
                           pooling=cfg.pooling, samples=cfg.samples, seed=cfg.seed, zipf=cfg.zipf[0], drift=0.0,
                           preset=None, scale=1.0)
    policy = None
    if policy_path is not None:
        policy = policies.load(policy_path, build_tables(cfg, dataset), world_size=world_size,
                               local_world_size=world_size)
    calls, original = [], dist.all_to_all_single

    def counted(output, input, output_split_sizes=None, input_split_sizes=None, **kwargs):
        calls.append((sys._getframe(1).f_code.co_qualname, input.dtype, input.numel() * input.element_size()))
        return original(output, input, output_split_sizes, input_split_sizes, **kwargs)

    dist.all_to_all_single = counted
    try:
        result = run(cfg, dataset, rank=rank, world_size=world_size, device=torch.device("cpu"), policy=policy)
    finally:
        dist.all_to_all_single = original
    return result.losses, result.weights, calls


def _train_all(rank: int, world_size: int, jobs):
    return [_train(rank, world_size, cfg, path) for cfg, path in jobs]


@pytest.fixture(scope="module")
def world2(tmp_path_factory) -> dict:
    """Every run of RUNS at world 2, in one pair of spawned gloo ranks."""
    jobs = []
    for name, (_, keep) in RUNS.items():
        path = None if keep is None else _policy(tmp_path_factory.mktemp(name), keep)
        jobs.append((_config(name), path))
    per_rank = run_ranks(2, _train_all, jobs)
    return {name: [per_rank[r][i] for r in range(2)] for i, name in enumerate(RUNS)}


def _output_bytes(ranks: list, prefix: str, direction: str) -> list[int]:
    """Bytes out of each output all-to-all call in `direction` (forward | backward), rank by rank."""
    return [n for _, _, calls in ranks for fn, _, n in calls if fn == f"{prefix}.{direction}"]


def _tables(ranks: list) -> dict[str, torch.Tensor]:
    """Every table, its shards put together from both ranks."""
    pieces: dict[str, list] = {}
    for _, weights, _ in ranks:
        for table, (start, shard) in weights["tables"].items():
            pieces.setdefault(table, []).append((start, shard))
    return {table: torch.cat([shard for _, shard in sorted(parts, key=lambda p: p[0])]) for table, parts in pieces.items()}


@pytest.mark.slow
@pytest.mark.parametrize("base, coded", [("fp32", "keep-all"), ("fp32-row-sequence", "keep-all-row-sequence")])
def test_dct_mp_keeping_every_value_changes_nothing(base: str, coded: str, world2: dict) -> None:
    plain, kept = world2[base], world2[coded]
    assert kept[0][0] == plain[0][0], "losses equal bit for bit"
    for table, weight in _tables(plain).items():
        assert torch.equal(_tables(kept)[table], weight), table
    for key, value in plain[0][1]["dense"].items():
        assert torch.equal(kept[0][1]["dense"][key], value), key
    assert _output_bytes(kept, CODED, "forward"), "the DCT-MP exchange was used"


# Rounding error per value is the format's unit roundoff (relative: bf16 2^-9, fp16 2^-12, fp8 2^-4
# of the row's largest value) on the embedding rows and their gradients. Over these 6 steps the
# logits stay near 0 (loss near log 2), so it reaches the losses damped: measured max relative loss
# difference bf16 6e-7, fp16 3e-7, fp8 1.3e-5; max table difference 1.5e-6, 2.8e-7, 1.2e-5. The
# tolerances are ~10x those; DCT-MP keeping 1 of 16 values moves the same losses by 9e-4.
CLOSE = {"bf16": dict(rtol=1e-5, tables=2e-5), "fp16": dict(rtol=5e-6, tables=5e-6),
         "fp8": dict(rtol=2e-4, tables=2e-4)}


@pytest.mark.slow
@pytest.mark.parametrize("dtype", list(CLOSE))
def test_quantized_runs_stay_close_to_fp32(dtype: str, world2: dict) -> None:
    plain, quantized = world2["fp32"], world2[dtype]
    tol = CLOSE[dtype]
    assert quantized[0][0] == quantized[1][0], "every rank reports the same global losses"
    assert quantized[0][0] != plain[0][0], "quantization must change something"
    torch.testing.assert_close(torch.tensor(quantized[0][0]), torch.tensor(plain[0][0]), rtol=tol["rtol"], atol=0.0)
    for table, weight in _tables(plain).items():
        torch.testing.assert_close(_tables(quantized)[table], weight, rtol=0.0, atol=tol["tables"],
                                   msg=lambda m: f"table {table}: {m}")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16", "fp16", "fp8", "keep-1", "keep-4-bf16", "keep-all"])
def test_output_exchange_sends_the_encoded_bytes(name: str, world2: dict) -> None:
    """Call by call, the coded exchange sends the plain one's rows at row_bytes each; per training step
    the forward sends T · global batch rows (table-wise, pooled), each rank's input dist unchanged."""
    cfg, (_, keep) = _config(name), RUNS[name]
    codec = OutputCodec(cfg.a2a_dtype, keep)
    plain, coded = world2["fp32"], world2[name]
    for direction, row_bytes in zip(("forward", "backward"), codec.row_bytes(D)):
        base = _output_bytes(plain, PLAIN, direction)
        assert len(base) == 2 * cfg.steps
        assert _output_bytes(coded, CODED, direction) == [n // (4 * D) * row_bytes for n in base], direction
        assert sum(_output_bytes(coded, CODED, direction)) == cfg.steps * T * 2 * B * row_bytes
    assert not _output_bytes(coded, PLAIN, "forward"), "no plain output all-to-all left"
    inputs = [[c for c in calls if c[0] == "ShardedEmbeddings._input_dist"] for _, _, calls in coded]
    assert inputs == [[c for c in calls if c[0] == "ShardedEmbeddings._input_dist"] for _, _, calls in plain]
    if name in ("bf16", "fp16"):
        dtype = torch.bfloat16 if name == "bf16" else torch.float16
        assert {c[1] for _, _, calls in coded for c in calls if c[0].startswith(CODED)} == {dtype}
        assert sum(_output_bytes(coded, CODED, "forward")) * 2 == sum(_output_bytes(plain, PLAIN, "forward"))


def test_row_bytes_take_the_cheapest_position_encoding() -> None:
    assert OutputCodec("bf16").row_bytes(16) == (32, 32)
    assert OutputCodec("fp8").row_bytes(64) == (68, 68)  # a byte a value and a 4-byte scale per row
    assert OutputCodec("fp32", 0.05).keep(64) == 4  # ⌈3.2⌉
    assert OutputCodec("fp32", 0.001).keep(64) == 1  # at least one value
    assert OutputCodec("fp32", 0.03).row_bytes(64) == (2 * 4 + 2, 2 * 4)  # two uint8 positions
    assert OutputCodec("fp32", 0.25).row_bytes(64) == (16 * 4 + 8, 16 * 4)  # a 64-bit mask, not 16 bytes
    assert OutputCodec("fp32", 0.01).row_bytes(300) == (3 * 4 + 3 * 2, 3 * 4)  # int16 positions past 256
    fp32 = 4 * 64 * 2  # forward + backward bytes of an fp32 row
    assert fp32 / sum(OutputCodec("fp32", 0.03).row_bytes(64)) >= 20  # DCT's MP figure, in bytes


@pytest.mark.parametrize("codec", [OutputCodec("fp32", 1 / 16), OutputCodec("bf16", 0.25), OutputCodec("fp8", 0.5),
                                   OutputCodec("fp8"), OutputCodec("fp16", 0.03)])
def test_a_row_decodes_to_its_largest_values(codec: OutputCodec) -> None:
    x = torch.randn(7, 64, generator=torch.Generator().manual_seed(0)) * torch.logspace(-6, 0, 7).view(7, 1)
    wire, sent = codec.encode_forward(x)
    assert wire.shape[1] * wire.element_size() == codec.row_bytes(64)[0]
    y, received = codec.decode_forward(wire, 64)
    k = codec.keep(64)
    largest = x.abs().topk(k, dim=1).indices
    expected = torch.zeros_like(x).scatter_(1, largest, x.gather(1, largest))
    assert ((y != 0).sum(dim=1) == k).all()
    # rounding: relative to the row's largest value (fp8 scales each row), plus fp16's subnormal spacing
    # (its values under 6e-5 lose precision: the gradient underflow TorchRec's fp16 loss scale is for)
    unit = {"fp32": 0.0, "bf16": 2**-8, "fp16": 2**-11, "fp8": 2**-3}[codec.dtype]
    floor = 2**-24 if codec.dtype == "fp16" else 0.0
    assert ((y - expected).abs() <= unit * x.abs().amax(dim=1, keepdim=True) + floor).all()
    grad = torch.randn(7, 64)
    back = codec.decode_backward(codec.encode_backward(grad, received), sent, 64)
    assert ((back != 0) == (y != 0)).all(), "the gradient returns at the kept positions only"


def test_a_bad_a2a_dtype_or_keep_ratio_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--a2a-dtype must be one of fp32, bf16, fp16, fp8, got 'int4'"):
        TrainConfig(a2a_dtype="int4")
    with pytest.raises(PolicyError, match=r"compression.mp.keep_ratio: expected a number in \(0, 1\]"):
        _policy(tmp_path, 0.0)
    tables = [TableSpec(f"t{i}", SMALL["rows"][0], D) for i in range(T)]
    applied = policies.load(_policy(tmp_path, 0.05), tables, world_size=2, local_world_size=2)
    assert applied.mp_keep_ratio == 0.05 and applied.sections == ("compression.mp",)
