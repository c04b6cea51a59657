"""No id lost at any step size: the piece cutter over random call layouts, counts carried between
flushes, steps of 0.1x, 1x and 3x a flush (a table looked up twice a step among them) recorded
exactly through a real RunWriter, a drain made to fail counted as lost, and a large-batch command
line (26 Kaggle tables at batch 50,000, a step larger than a flush) under `tracekit record`."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import torch
from torch import nn

from collectors import counting, embedding, host_staging, staging, steps
from collectors.counting import PHASES, Kept, Table, carried, count_rows
from collectors.steps import StepClock
from tracekit.store import RunWriter

REPO = Path(__file__).resolve().parents[1]


def rows_of(counted: counting.Counted) -> list[tuple]:
    names = np.repeat([t.name for t, _ in counted.groups], counted.sizes)
    phases = np.repeat([p for _, p in counted.groups], counted.sizes)
    return list(zip(names.tolist(), phases.tolist(), counted.step.tolist(), counted.row.tolist(),
                    counted.count.tolist()))


def random_kept(rng: np.random.Generator, tables: list[Table]) -> Kept:
    """Calls of random steps (in order or not, repeated), tables, phases and sizes (0 included)."""
    n = int(rng.integers(1, 60))
    step = np.sort(rng.integers(0, 8, n)) if rng.random() < 0.5 else rng.integers(0, 8, n)
    table = rng.integers(0, len(tables), n)
    size = rng.integers(0, 40, n) * (rng.random(n) < 0.9)
    ids = np.concatenate([rng.integers(0, tables[t].num_rows, s) for t, s in zip(table, size)]).astype(np.int64)
    return Kept(ids, step.astype(np.int64), table.astype(np.int64), rng.integers(0, 2, n).astype(np.int64),
                size.astype(np.int64))


TABLES = [Table("a", 30, None, 0, 0), Table("b", 50, 3, 100, 1), Table("c", 7, None, 0, 2)]


@pytest.mark.parametrize("seed", range(300))
def test_pieces_cut_at_call_boundaries_never_split_a_count_and_stay_near_their_size(seed):
    rng = np.random.default_rng(seed)
    kept = random_kept(rng, TABLES)
    budget = int(rng.integers(1, 120))
    pieces = list(kept.pieces(budget))
    # every call in exactly one piece, with its own ids
    calls = Counter(zip(kept.step.tolist(), kept.table.tolist(), kept.phase.tolist(),
                        (tuple(c) for c in np.split(kept.ids, np.cumsum(kept.size)[:-1]))))
    got = Counter(call for p in pieces for call in zip(p.step.tolist(), p.table.tolist(), p.phase.tolist(),
                                                       (tuple(c) for c in np.split(p.ids, np.cumsum(p.size)[:-1]))))
    assert got == calls
    # a (step, table, phase) in one piece only
    owner: dict[tuple, int] = {}
    for i, p in enumerate(pieces):
        for key in set(zip(p.step.tolist(), p.table.tolist(), p.phase.tolist())):
            assert owner.setdefault(key, i) == i, key
    # a piece over the budget only by the group that opened past it
    group_ids = Counter()
    for s, t, ph, n in zip(kept.step, kept.table, kept.phase, kept.size):
        group_ids[(s, t, ph)] += int(n)
    largest = max(group_ids.values())
    assert all(int(p.size.sum()) < budget + largest or len(p.size) == 1 for p in pieces)
    # counted apart, the pieces are the one count of the whole
    together = sorted(r for p in pieces for r in rows_of(count_rows(p, TABLES)))
    assert together == sorted(rows_of(count_rows(kept, TABLES)))
    assert len({r[:4] for r in together}) == len(together)


@pytest.mark.parametrize("seed", range(100))
def test_count_rows_equals_a_plain_count_of_the_ids_whether_its_cells_are_sorted_row_by_row_or_not(seed):
    """count_rows sorts each (step, table, phase) cell on a row of its own where the cells are even
    (`counting._sorted_by_cell`), and all keys in one sort where they are not: both are a plain count."""
    rng = np.random.default_rng(5000 + seed)
    kept = random_kept(rng, TABLES)
    if seed % 2:  # even cells: every call the same size
        kept.size[:] = int(rng.integers(1, 30))
        kept.ids = np.concatenate([rng.integers(0, TABLES[t].num_rows, int(s)) for t, s in zip(kept.table, kept.size)])
    expected = Counter()
    for (step, table, ph), ids in zip(zip(kept.step, kept.table, kept.phase),
                                      np.split(kept.ids, np.cumsum(kept.size)[:-1])):
        t = TABLES[table]
        expected.update((t.name, PHASES[ph], int(step), int(i) + t.first_row) for i in ids if i != t.padding_idx)
    rows = rows_of(count_rows(kept, TABLES))
    assert Counter({r[:4]: r[4] for r in rows}) == expected and len(rows) == len(expected)
    for name, phase in {r[:2] for r in rows}:  # within a (table, phase): (step, row) increasing
        cells = [r[2:4] for r in rows if r[:2] == (name, phase)]
        assert cells == sorted(cells)


@pytest.mark.parametrize("seed", range(50))
def test_counts_carried_to_the_next_flush_add_up_with_the_rest_of_their_step(seed):
    rng = np.random.default_rng(1000 + seed)
    first, second = random_kept(rng, TABLES), random_kept(rng, TABLES)
    again = count_rows(Kept.joined([second, carried(count_rows(first, TABLES))]), TABLES)
    assert sorted(rows_of(again)) == sorted(rows_of(count_rows(Kept.joined([first, second]), TABLES)))
    carry = carried(count_rows(first, TABLES))
    assert carry.lookups == sum(r[4] for r in rows_of(count_rows(first, TABLES)))
    before, later = first.split_at(4)
    assert (before.step < 4).all() and (later.step >= 4).all() and before.lookups + later.lookups == first.lookups


class TwoLookups(nn.Module):
    """Two tables, `a` looked up twice a step (two features of one table), `b` once."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.EmbeddingBag(5000, 2, mode="sum"), nn.EmbeddingBag(300, 2, mode="sum", padding_idx=0)


def fed_and_recorded(tmp_path: Path, step_ids: int, flush_rows: int, flush_inside: bool) -> tuple[Counter, Counter, RunWriter]:
    """Train 4 steps of TwoLookups with `step_ids` ids a step through a writer of `flush_rows`, flushing
    between the lookups of each step where `flush_inside`; the fed and recorded (step, table, row)
    counts, and the closed writer."""
    writer = RunWriter(tmp_path, rank=0, flush_rows=flush_rows, flush_interval_s=60)
    clock = StepClock()
    handles = [steps.install(writer, clock), embedding.install(writer, clock, lookup_every=0)]
    model, g, fed = TwoLookups(), torch.Generator().manual_seed(step_ids), Counter()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        for step in range(4):
            optimizer.zero_grad()
            loss = 0
            for name, table, n in (("a", model.a, step_ids * 2 // 5), ("b", model.b, step_ids // 5),
                                   ("a", model.a, step_ids - step_ids * 3 // 5)):
                ids = torch.randint(0, table.num_embeddings, (n,), generator=g)
                fed.update((step, name, int(r)) for r in ids if not (name == "b" and r == 0))
                loss = loss + table(ids, torch.arange(0, n, 4)).sum()
                if flush_inside:
                    writer.flush()
            loss.backward()
            optimizer.step()
    finally:
        for handle in reversed(handles):
            handle.uninstall()
        writer.close()
    recorded, keys = Counter(), Counter()
    for part in tmp_path.glob("accesses/rank=0/*.parquet"):
        t = pq.read_table(part).to_pydict()
        for s, name, row, count, phase in zip(t["step"], t["table_name"], t["row"], t["count"], t["phase"]):
            recorded[(s, name, row)] += count
            keys[(s, name, row, phase)] += 1
    assert max(keys.values()) == 1, "a (step, table, row) written in two rows"
    return fed, recorded, writer


@pytest.mark.parametrize("times", [0.1, 1, 3])
@pytest.mark.parametrize("flush_inside", [False, True])
def test_steps_of_a_tenth_one_and_three_flushes_are_recorded_exactly(tmp_path, times, flush_inside):
    flush_rows = 2000
    fed, recorded, writer = fed_and_recorded(tmp_path, int(times * flush_rows), flush_rows, flush_inside)
    assert recorded == fed and writer.errors == 0 and not writer.dropped and writer.lost_lookups == 0


@pytest.mark.parametrize("times", [0.1, 1, 3])
@pytest.mark.parametrize("flush_inside", [False, True])
def test_steps_copied_out_mid_step_into_small_reused_chunks_are_recorded_exactly(tmp_path, monkeypatch, times,
                                                                                flush_inside):
    """With a spill every 500 ids and chunks of 1,500: calls spilled mid-step, steps spread over several
    chunks, calls larger than a chunk, and chunks handed back and refilled."""
    monkeypatch.setattr(host_staging, "SPILL_IDS", 500)
    monkeypatch.setattr(host_staging, "CHUNK_IDS", 1500)
    flush_rows = 2000
    fed, recorded, writer = fed_and_recorded(tmp_path, int(times * flush_rows), flush_rows, flush_inside)
    assert recorded == fed and writer.errors == 0 and not writer.dropped and writer.lost_lookups == 0


def test_host_staging_hands_back_its_chunks_and_keeps_every_id_in_order(monkeypatch):
    """50 steps of 3 calls through chunks of 1,000 ids, taken every 5 steps: the ids come back as kept,
    call by call, and the training side fills at most three chunks, reused."""
    monkeypatch.setattr(host_staging, "CHUNK_IDS", 1000)
    staging, g = host_staging.HostStaging(lambda table, rows: pytest.fail(f"lost {rows} {table}")), np.random.default_rng(0)
    fed, got, chunks = [], [], set()
    for step in range(50):
        for table in range(3):
            ids = torch.from_numpy(g.integers(0, 100, int(g.integers(1, 200))))
            fed.append((step, table, ids.tolist()))
            staging.keep(step, table, "train", ids, ids.numel(), None, copy=False)
        staging.spill()
        chunks.add(id(staging._chunk))
        if step % 5 == 4:
            kept, _ = staging.take(False, step + 1, None)
            ends = np.cumsum(kept.size)
            got += [(int(s), int(t), kept.ids[e - n:e].tolist()) for s, t, n, e in zip(kept.step, kept.table, kept.size, ends)]
    assert got == fed
    assert len(chunks) <= 3


def test_a_step_end_copy_that_fails_counts_its_ids_as_lost(monkeypatch):
    lost = Counter()
    staging = host_staging.HostStaging(lambda table, rows: lost.update({table: rows}))
    for table, n in ((0, 7), (1, 5)):
        staging.keep(0, table, "train", torch.arange(n), n, None, copy=False)

    def failing_cat(*args, **kwargs):
        raise RuntimeError("no room")

    monkeypatch.setattr(host_staging.torch, "cat", failing_cat)
    with pytest.raises(RuntimeError, match="no room"):
        staging.spill()
    assert lost == {"accesses": 12} and not staging.spilled


def test_a_drain_made_to_fail_counts_its_rows_as_lost(tmp_path, monkeypatch):
    calls = Counter()
    count = staging.count_rows

    def failing_second(kept, tables):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected")
        return count(kept, tables)

    monkeypatch.setattr(staging, "count_rows", failing_second)
    monkeypatch.setattr(staging, "PIECE_IDS", 500)  # several pieces a drain: the failure is mid-drain
    fed, recorded, writer = fed_and_recorded(tmp_path, 3000, 2000, flush_inside=True)
    lost = sum(fed.values()) - sum(recorded.values())
    assert writer.errors == 1 and lost > 0
    assert writer.lost_lookups == lost and writer.dropped["accesses"] == lost  # ids never counted: one row each at most
    assert "injected" in writer.first_error


def test_the_issue_command_at_a_step_larger_than_a_flush_records_every_id(tmp_path):
    """26 Kaggle tables at batch 50,000: 1.3M ids a step against a 1M-row flush, 3 steps."""
    run = tmp_path / "big"
    r = subprocess.run([sys.executable, "-m", "tracekit", "record", "-o", str(run), "--", sys.executable, "train.py",
                        "--preset", "criteo-kaggle", "--scale", "0.01", "--batch-size", "50000", "--steps", "3",
                        "--samples", "300000", "--eval-fraction", "0", "--dim", "16", "--bottom-mlp", "32,16",
                        "--top-mlp", "32,1"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["writer_errors"] == 0
    assert manifest["lost_rows"] == {} and manifest["lost_lookups"] == 0
    counted = sum(pc.sum(pq.read_table(p, columns=["count"])["count"]).as_py() for p in run.glob("accesses/rank=0/*"))
    assert counted == 3 * 26 * 50_000
    assert r.stderr.strip().splitlines()[-1] == "  the trace is whole: no row lost"
