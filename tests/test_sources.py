"""`tracekit.sources` (tracekit/sources.py): its checks, and the `src` / `src_sample` the embedding
collector records from it (collectors/lookups.py `lookup_sources`), through a real RunWriter."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import tracekit
from collectors import counting, embedding, lookups, steps
from collectors.steps import StepClock
from tests.manifests import write_manifest
from tracekit.run import open_run
from tracekit.sources import Sources, current_sources
from tracekit.store import RunWriter


def test_a_block_sets_its_sources_and_restores_the_outer_ones():
    assert current_sources.get() is None
    with tracekit.sources([2, 0, 3]) as outer:
        assert outer == Sources((2, 0, 3), (0, 1, 2)) and current_sources.get() is outer
        with tracekit.sources((np.int64(1),), ranks=[5]):
            assert current_sources.get() == Sources((1,), (5,))
        assert current_sources.get() is outer
    assert current_sources.get() is None


@pytest.mark.parametrize(("counts", "ranks", "error", "message"), [
    (5, None, TypeError, "`counts` must be a sequence of non-negative ints"),
    ("12", None, TypeError, "`counts` must be a sequence"),
    ([1, 2.0], None, TypeError, "`counts`[1] must be an int, got float 2.0"),
    ([True], None, TypeError, "`counts`[0] must be an int, got bool"),
    ([3, -1], None, ValueError, "`counts`[1] must be >= 0, got -1"),
    ([3, 1], [0], ValueError, "`ranks` names 1 ranks for 2 `counts`"),
    ([3, 1], [0, -2], ValueError, "`ranks`[1] must be >= 0"),
])
def test_bad_arguments_are_refused_with_what_to_give(counts, ranks, error, message):
    with pytest.raises(error, match=message.replace("[", r"\[").replace("(", r"\(")):
        tracekit.sources(counts, ranks=ranks)


def _recorded(tmp_path: Path, calls) -> list[tuple]:
    """Run `calls()` as step 0 with the collectors installed (lookups every step); the lookups as
    sorted (table_name, sample, pos, row, src, src_sample)."""
    writer, clock = RunWriter(tmp_path, rank=0), StepClock()
    handles = [steps.install(writer, clock), embedding.install(writer, clock, lookup_every=1)]
    try:
        calls()
        clock.advance()
    finally:
        for handle in reversed(handles):
            handle.uninstall()
        writer.close()
    write_manifest(tmp_path, {"status": "completed"})
    frame = open_run(tmp_path).scan("lookups").select("table_name", "sample", "pos", "row", "src", "src_sample")
    return sorted(frame.collect().rows(), key=lambda r: tuple(-1 if v is None else v for v in r))


def test_declared_calls_record_each_items_source_and_its_index_there(tmp_path):
    """Bags (an empty one included) and the rows of a 2-D input get (src, src_sample); a 1-D input's
    ids get src only; `ranks` names global ranks; padding ids write no row."""
    bags, seq = nn.EmbeddingBag(20, 2), nn.Embedding(20, 2, padding_idx=0)

    def calls():
        with tracekit.sources([2, 3], ranks=[4, 7]):  # bags 0-1 from rank 4, bags 2-4 from rank 7
            bags(torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([0, 1, 3, 3, 5]))
        with tracekit.sources([1, 0, 3]):
            seq(torch.tensor([0, 5, 6, 7]))  # ids: 1 from rank 0, 3 from rank 2
            seq(torch.tensor([[1, 2], [3, 0], [5, 5], [6, 6]]))  # rows: 1 from rank 0, 3 from rank 2

    assert _recorded(tmp_path, calls) == [
        ("EmbeddingBag_0", 0, 0, 1, 4, 0), ("EmbeddingBag_0", 1, 0, 2, 4, 1), ("EmbeddingBag_0", 1, 1, 3, 4, 1),
        ("EmbeddingBag_0", 3, 0, 4, 7, 1), ("EmbeddingBag_0", 3, 1, 5, 7, 1), ("EmbeddingBag_0", 4, 0, 6, 7, 2),
        ("Embedding_1", 0, 0, 1, 0, 0), ("Embedding_1", 0, 1, 2, 0, 0), ("Embedding_1", 1, 0, 3, 2, 0),
        ("Embedding_1", 1, 0, 5, 2, None), ("Embedding_1", 2, 0, 5, 2, 1), ("Embedding_1", 2, 0, 6, 2, None),
        ("Embedding_1", 2, 1, 5, 2, 1), ("Embedding_1", 3, 0, 6, 2, 2), ("Embedding_1", 3, 0, 7, 2, None),
        ("Embedding_1", 3, 1, 6, 2, 2)]


def test_undeclared_calls_and_counts_that_do_not_cover_the_call_record_nulls(tmp_path):
    """A call outside any block, and one whose items (5 bags, 3 ids) are not the counts' sum, get
    null sources; a declared call between them keeps its own."""
    bags, seq = nn.EmbeddingBag(20, 2), nn.Embedding(20, 2)
    ids, offsets = torch.tensor([1, 2, 3, 4, 5, 6]), torch.tensor([0, 1, 3, 3, 5])

    def calls():
        bags(ids, offsets)
        with tracekit.sources([2, 2]):  # 4 of 5 bags: not this call's items
            bags(ids, offsets)
        with tracekit.sources([1, 1]):
            bags(torch.tensor([9, 8]), torch.tensor([0, 1]))
        with tracekit.sources([4]):  # 3 ids
            seq(torch.tensor([1, 2, 3]))

    rows = _recorded(tmp_path, calls)
    assert [r for r in rows if r[3] in (8, 9)] == [("EmbeddingBag_0", 0, 0, 9, 0, 0), ("EmbeddingBag_0", 1, 0, 8, 1, 0)]
    others = [r for r in rows if r[3] not in (8, 9)]
    assert len(others) == 2 * 6 + 3 and {r[4:] for r in others} == {(None, None)}


@pytest.mark.parametrize("padding", [None, 3])
def test_sources_of_many_calls_at_once_equal_each_calls_own(padding):
    """The writer finds the sources of a table's sampled calls in one pass (`lookup_sources`): each
    lookup gets what its own call's counts give it, declared or not, padding ids left out."""
    table = counting.Table("t", 20, padding, 0)
    g = torch.Generator().manual_seed(2)
    layouts = [([0, 2, 2, 5], (1, 0, 3)), ([0, 0, 4], None), ([0, 3, 3, 6, 7], (2, 3)), ([0, 1], (0, 0)),
               ([0, 1, 4], (0, 2, 0))]
    calls = []
    for step, (offsets, counts) in enumerate(layouts):
        ids = torch.randint(0, 20, (offsets[-1] + 2,), generator=g)
        sources = None if counts is None else Sources(counts, tuple(range(10, 10 + len(counts))))
        calls.append(lookups.Call(step, "train", table, ids, torch.tensor(offsets), True, sources=sources))
    step, sample, pos, row, feature = lookups.lookup_rows(calls)
    src, src_sample = lookups.lookup_sources(calls, sample)
    expected = []
    for c in calls:
        own_sample = lookups.positions(c.ids, c.offsets)[0].tolist()
        items = c.offsets.numel()
        for s, i in zip(own_sample, c.ids.tolist()):
            if i == padding:
                continue
            if c.sources is None or sum(c.sources.counts) != items:
                expected.append((None, None))
                continue
            starts = np.cumsum(c.sources.counts) - c.sources.counts
            q = int(np.searchsorted(starts, s, side="right")) - 1
            expected.append((c.sources.ranks[q], s - int(starts[q])))
    assert list(zip(src.tolist(), src_sample.tolist())) == expected
    assert src.dtype == np.int32 and src_sample.dtype == np.int32
    assert lookups.lookup_sources([c for c in calls if c.sources is None], sample[:0]) is None
    assert sum(v is not None for v, _ in expected) > len(expected) // 2  # most calls here declare theirs
