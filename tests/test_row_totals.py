"""The per-row totals of the training accesses (analyses.row_totals): equal to a GROUP BY of the
trace, and incremental: a run that grew is read only in the parts it added, with the same totals as
a fresh pass; a part that changed, or a state file cut short, makes the pass start again."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from analyses import row_totals, skew
from analyses.analyze import analyze
from analyses.context import open_context
from tests.test_skew import accesses_of, table_entry, write_run, zipf_steps

TABLES = [table_entry("a", 500), table_entry("b", 2000, owner=1)]


def steps(first: int, count: int, seed: int) -> list:
    rng = np.random.default_rng(seed)
    out = accesses_of(zipf_steps(rng, 500, 1.0, 300, count), "a", 0, first_step=first)
    out += accesses_of(zipf_steps(rng, 2000, 1.1, 400, count), "b", 1, first_step=first)
    out += accesses_of(zipf_steps(rng, 500, 1.0, 50, 2), "a", 0, phase="eval", first_step=first)
    return out


def expected_totals(accesses) -> dict:
    """(table, row) -> (lookups, accesses rows, min rank, max rank), training rows only."""
    lookups, entries, ranks = Counter(), Counter(), {}
    for step, rank, table, row, count, phase in accesses:
        if phase == "train":
            lookups[(table, row)] += count
            entries[(table, row)] += 1
            ranks.setdefault((table, row), set()).add(rank)
    return {k: (lookups[k], entries[k], min(ranks[k]), max(ranks[k])) for k in lookups}


def totals_of(run: Path, read: list | None = None) -> dict:
    with open_context(run) as ctx:
        if read is not None:
            relation = ctx.run.relation
            ctx.run.relation = lambda table, con=None, parts=None: read.append(parts) or relation(table, con, parts)
        name = row_totals.row_totals(ctx)
        rows = ctx.sql(f'SELECT table_name, "row", lookups, accesses, min_rank, max_rank FROM {name}').fetchall()
    return {(t, r): (int(n), int(a), lo, hi) for t, r, n, a, lo, hi in rows}


def test_the_totals_are_a_group_by_of_the_training_accesses(tmp_path: Path) -> None:
    accesses = steps(0, 12, seed=1)
    run = write_run(tmp_path / "run", accesses, TABLES, split_steps=True)  # a step in two parts: summed
    assert totals_of(run) == expected_totals(accesses)


def test_a_run_that_grew_is_read_only_in_its_new_parts(tmp_path: Path) -> None:
    first, later = steps(0, 10, seed=1), steps(10, 6, seed=2)
    run = write_run(tmp_path / "run", first, TABLES, samples_per_step=300)
    analyze(run)  # keeps the totals of the parts it read
    before = set(map(str, (p.relative_to(run) for p in (run / "accesses").rglob("*.parquet"))))
    write_run(run, later, TABLES, samples_per_step=300)  # the recording went on: more parts
    added = [p for p in sorted((run / "accesses").rglob("*.parquet")) if str(p.relative_to(run)) not in before]
    assert added
    read: list = []
    assert totals_of(run, read) == expected_totals(first + later)
    assert read == [added]  # only the new parts were read
    read.clear()
    assert totals_of(run, read) == expected_totals(first + later) and read == []  # nothing new: nothing read
    with open_context(run) as ctx:  # what skew reports from them equals a fresh pass's
        grown = skew.lookup_histogram(ctx)
    (run / row_totals.STATE_DIR / "row_totals.json").unlink()
    with open_context(run) as ctx:
        assert skew.lookup_histogram(ctx).equals(grown)


@pytest.mark.parametrize("damage", ["rewritten part", "removed part", "no part list", "other steps"])
def test_a_changed_run_is_read_again_from_every_part(tmp_path: Path, damage: str) -> None:
    accesses = steps(0, 10, seed=3)
    run = write_run(tmp_path / "run", accesses, TABLES)
    totals_of(run)
    parts = sorted((run / "accesses").rglob("*.parquet"))
    state = run / row_totals.STATE_DIR
    if damage == "rewritten part":  # same parts, one of them written again with fewer rows
        victim = [a for a in accesses if a[0] != 9 or a[1] != 1]
        for part in (run / "accesses").rglob("*.parquet"):
            part.unlink()
        write_run(run, victim, TABLES)
        accesses = victim
        assert sorted((run / "accesses").rglob("*.parquet")) == parts  # the same paths, other contents
    elif damage == "removed part":
        assert [p.parent.name for p in parts] == ["rank=0", "rank=1"]
        parts[-1].unlink()
        accesses = [a for a in accesses if a[1] != 1]
        parts = parts[:-1]
    elif damage == "no part list":  # killed between the totals and their list
        (state / "row_totals.json").unlink()
    else:  # a window analysed where the totals covered every step
        (state / "row_totals.json").write_text((state / "row_totals.json").read_text().replace('"steps": ""',
                                                                                                 '"steps": "x"'))
    read: list = []
    assert totals_of(run, read) == expected_totals(accesses)
    assert read == [parts]
