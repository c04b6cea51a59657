"""The optional API of traced programs: no-ops when nothing traces, a label that nests."""

from __future__ import annotations

import threading

import pytest
import torch

import tracekit
from tracekit.labels import current_label
from tracekit.shards import Shard, shard_of


def test_step_is_a_no_op_when_not_traced(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    threads = {t.name for t in threading.enumerate()}
    assert tracekit.step(samples=3, loss=0.5) is None
    assert {t.name for t in threading.enumerate()} == threads  # no writer started
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_labels_nest_and_unwind() -> None:
    assert current_label.get() is None
    with tracekit.label("emb_fwd"):
        assert current_label.get() == "emb_fwd"
        with tracekit.label("inner"):
            assert current_label.get() == "inner"
        assert current_label.get() == "emb_fwd"
    assert current_label.get() is None


def test_shard_tags_a_module_and_changes_nothing_else() -> None:
    emb = torch.nn.EmbeddingBag(10, 4)
    assert tracekit.shard(emb, table="t0", first_row=20, num_rows=30) is emb
    assert shard_of(emb) == Shard("t0", 20, 30)
    assert emb(torch.tensor([[1, 2]])).shape == (1, 4)  # untraced, the module works as before
    assert shard_of(tracekit.shard(torch.nn.Embedding(5, 2), table="t1")) == Shard("t1", 0, 5)  # a whole table


def test_shard_refuses_rows_outside_the_table_and_other_modules() -> None:
    with pytest.raises(ValueError, match=r"rows \[25, 35\) of this shard do not fit in a table of `num_rows`=30"):
        tracekit.shard(torch.nn.EmbeddingBag(10, 4), table="t0", first_row=25, num_rows=30)
    with pytest.raises(TypeError, match="takes an nn.Embedding or nn.EmbeddingBag, got Linear"):
        tracekit.shard(torch.nn.Linear(2, 2), table="t0")
