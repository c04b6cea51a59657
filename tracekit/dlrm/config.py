"""The trainer's configuration: one dataclass, one field per command-line option.

Every check that can fail runs in `__post_init__`, before any process group starts, so an
impossible configuration is refused with a message naming the option.
"""

from __future__ import annotations

import argparse
from dataclasses import MISSING, dataclass, field, fields

from tracekit.errors import ConfigError

SHARDINGS = ("table", "row")
OPTIMIZERS = ("sgd", "adagrad")
A2A_DTYPES = ("fp32", "bf16", "fp16", "fp8")
"""--a2a-dtype: the embedding output all-to-all's value precision (tracekit/dlrm/output_codec.py)."""
PRECISIONS = ("fp32", "bf16")
"""--precision: the dense part's compute precision (tracekit/dlrm/model.py); weights stay fp32."""


def _int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _opt(default, help: str):
    """A config field with its --help text; callables are default factories (for lists)."""
    if callable(default):
        return field(default_factory=default, metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class TrainConfig:
    # model
    tables: int = _opt(8, 'number of embedding tables (sparse features)')
    rows: list[int] | None = _opt(None, 'rows per table, one value for all (default 100000; Parquet: max id + 1)')
    dim: int = _opt(64, "embedding dimension; the bottom MLP's last width")
    dense: int = _opt(13, 'dense features')
    bottom_mlp: list[int] | None = _opt(None, 'bottom MLP widths; the last must equal --dim (default: 512,256,DIM)')
    top_mlp: list[int] = _opt(lambda: [512, 256, 1], 'top MLP widths; the last must be 1')
    pooling: int = _opt(1, 'ids per bag (synthetic data)')
    sequence_tables: int = _opt(0, 'the first N tables are sequence (unpooled) features')
    precision: str = _opt("fp32", 'compute precision of the MLPs and the interaction: fp32 | bf16 (autocast; '
                                  'fp32 weights, optimizer state, tables and loss)')
    # parallelism
    sharding: str = _opt("table", 'table-wise or row-wise model parallelism of the tables')
    a2a_dtype: str = _opt("fp32", 'precision of the embedding output all-to-all, forward and backward: fp32 | bf16 | '
                               'fp16 | fp8 (e4m3, one scale per row); TorchRec qcomms')
    # data
    data: str = _opt("synthetic", 'synthetic | criteo:PATH | parquet:PATH')
    preset: str | None = _opt(None, 'criteo-kaggle: the 26 Kaggle tables, times --scale')
    scale: float = _opt(1.0, 'multiplies the preset table sizes')
    samples: int = _opt(1 << 20, 'synthetic dataset size (train + eval)')
    zipf: list[float] | None = _opt(None, 'synthetic skew per table (one value for all); 0 = uniform')
    drift: float = _opt(0.0, 'synthetic: hot set shift over the dataset, in table lengths')
    eval_fraction: float = _opt(0.1, 'held out from the end of the dataset')
    # optimisation
    batch_size: int = _opt(512, 'samples per rank per step')
    steps: int | None = _opt(None, 'stop after this many steps (default: run --epochs)')
    epochs: int = _opt(1, 'passes over the training split (the last partial batch is kept)')
    lr: float = _opt(0.1, 'learning rate of the tables and the MLPs')
    optimizer: str = _opt("sgd", 'sgd | adagrad (row-wise for the tables)')
    seed: int = _opt(0, 'fixes the data, the initial weights and so the whole loss curve')
    # policy
    policy: str | None = _opt(None, 'apply this policy.json (written by tracekit analyze): replication, tiers, schedule')
    # inference (BLS)
    inference: bool = _opt(False, 'forward only over --steps global batches (tables read, never written): '
                                  'AUC, logloss and makespan; no training')
    lag_bound: int | None = _opt(None, 'with --inference: let a rank run up to N iterations ahead of the slowest '
                                       '(BLS; default: the policy\'s lag.bound, else synchronous collectives)')
    straggler: str | None = _opt(None, 'with --inference: PROB:DELAY_MS[:RANKS], delay an iteration by DELAY_MS '
                                       'with probability PROB on each listed rank (default: every rank)')
    # output
    eval_every: int = _opt(0, 'evaluate every N steps (0: only at the end)')
    log_every: int = _opt(50, 'progress line every N steps')
    warmup_steps: int = _opt(5, 'first steps left out of samples/s')
    json: bool = _opt(False, 'print one JSON summary line instead of the human summary')
    device: str = _opt("auto", 'auto | cpu | cuda (auto: cuda with NCCL when available, else cpu with gloo)')

    def __post_init__(self) -> None:
        positive = ("tables", "dim", "dense", "batch_size", "pooling", "epochs", "samples", "log_every")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{_flag(name)} must be positive, got {getattr(self, name)}")
        for name in ("steps",):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ConfigError(f"--{_flag(name)} must be positive, got {value}")
        if (self.lag_bound is not None or self.straggler is not None) and not self.inference:
            raise ConfigError("--lag-bound and --straggler apply to --inference runs only")
        if self.lag_bound is not None and self.lag_bound < 0:
            raise ConfigError(f"--lag-bound must be at least 0, got {self.lag_bound}")
        if self.eval_every < 0 or self.warmup_steps < 0:
            raise ConfigError("--eval-every and --warmup-steps must not be negative")
        if self.lr <= 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if not 0 <= self.eval_fraction < 1:
            raise ConfigError(f"--eval-fraction must be in [0, 1), got {self.eval_fraction}")
        if self.sharding not in SHARDINGS:
            raise ConfigError(f"--sharding must be one of {', '.join(SHARDINGS)}, got {self.sharding!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.a2a_dtype not in A2A_DTYPES:
            raise ConfigError(f"--a2a-dtype must be one of {', '.join(A2A_DTYPES)}, got {self.a2a_dtype!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.precision != "fp32" and self.inference:
            raise ConfigError(f"--precision {self.precision} applies to training; --inference runs the forward "
                              "in fp32 (drop --precision)")
        if self.bottom_mlp is None:
            self.bottom_mlp = [512, 256, self.dim]
        if not self.bottom_mlp or not self.top_mlp or min(self.bottom_mlp + self.top_mlp) <= 0:
            raise ConfigError("--bottom-mlp and --top-mlp need positive widths, e.g. 512,256,64")
        if self.bottom_mlp[-1] != self.dim:
            raise ConfigError(
                f"--bottom-mlp must end in --dim ({self.dim}) for the dot interaction, got {self.bottom_mlp[-1]}"
            )
        if self.top_mlp[-1] != 1:
            raise ConfigError(f"--top-mlp must end in 1 (the click logit), got {self.top_mlp[-1]}")
        if self.rows is not None and (not self.rows or min(self.rows) <= 0):
            raise ConfigError(f"--rows must be positive, got {self.rows}")
        if self.rows is not None and len(self.rows) not in (1, self.tables) and self.preset is None:
            raise ConfigError(f"--rows takes one value or one per table ({self.tables}), got {len(self.rows)}")
        if not 0 <= self.sequence_tables <= self.tables:
            raise ConfigError(f"--sequence-tables must be in [0, --tables], got {self.sequence_tables}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device must be auto, cpu or cuda, got {self.device!r}")

    def rows_for_data(self) -> list[int] | int | None:
        """--rows as the data layer takes it: one count, one per table, or None (Parquet: max id + 1)."""
        if self.rows is None:
            return None if self.data.startswith("parquet:") else 100_000
        return self.rows[0] if len(self.rows) == 1 else self.rows

    def check_world(self, world_size: int, num_tables: int) -> None:
        """Refuse layouts that cannot be sharded over `world_size` ranks."""
        if self.sharding == "table" and num_tables < world_size:
            raise ConfigError(
                f"table-wise sharding needs at least one table per rank: {num_tables} tables, "
                f"{world_size} ranks (use --sharding row or more --tables)"
            )


def _flag(name: str) -> str:
    return name.replace("_", "-")


def parser() -> argparse.ArgumentParser:
    """The command line of `train.py`, one option per TrainConfig field."""
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Reference DLRM trainer (hybrid data/model parallel). "
        "Run with python (1 process) or torchrun --nproc-per-node N.",
    )
    types = {
        "rows": _int_list, "bottom_mlp": _int_list, "top_mlp": _int_list, "zipf": _float_list,
        "steps": int, "preset": str, "rows": _int_list, "policy": str, "lag_bound": int, "straggler": str,
    }
    for f in fields(TrainConfig):
        default = f.default_factory() if f.default is MISSING else f.default  # as declared: bottom_mlp stays None
        if isinstance(default, bool):
            p.add_argument(f"--{_flag(f.name)}", action="store_true", help=f.metadata["help"])
            continue
        kind = types.get(f.name, type(default))
        shown = ",".join(map(str, default)) if isinstance(default, list) else default
        if default is None:
            kind = types[f.name]
        p.add_argument(f"--{_flag(f.name)}", type=kind, default=default, metavar=f.name.upper(),
                       help=f.metadata["help"] + ("" if default is None else f" (default: {shown})"))
    return p


def from_args(argv: list[str] | None = None) -> TrainConfig:
    args = parser().parse_args(argv)
    return TrainConfig(**vars(args))
