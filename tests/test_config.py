"""The trainer's configuration (tracekit/dlrm/config.py): defaults that follow other options."""

from __future__ import annotations

import pytest

from tracekit.dlrm.config import TrainConfig, from_args
from tracekit.errors import ConfigError


def test_the_default_bottom_mlp_ends_in_dim() -> None:
    assert from_args(["--dim", "16"]).bottom_mlp == [512, 256, 16]
    assert from_args([]).bottom_mlp == [512, 256, 64]
    assert TrainConfig(dim=8).bottom_mlp == [512, 256, 8]


def test_an_explicit_bottom_mlp_is_kept_and_must_end_in_dim() -> None:
    assert from_args(["--dim", "8", "--bottom-mlp", "32,8"]).bottom_mlp == [32, 8]
    with pytest.raises(ConfigError, match=r"--bottom-mlp must end in --dim \(16\) for the dot interaction, got 64"):
        from_args(["--dim", "16", "--bottom-mlp", "128,64"])
