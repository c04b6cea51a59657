"""analyses/skew.py on runs written with the store: every figure against a brute-force numpy
computation over the same accesses, the Zipf fit against the exponent the data was drawn with, and
hot-set stability against a plain Python replay of its definition."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest

from tests.manifests import write_manifest
from analyses import skew
from analyses.context import open_context
from tracekit.dlrm.presets import fit_zipf_exponent
from tracekit.store import RunWriter

# accesses: (step, rank, table, row, count, phase)
Access = tuple[int, int, str, int, int, str]


def table_entry(name: str, rows: int, *, owner: int = 0, placement: str = "sharded") -> dict:
    return {"name": name, "num_rows": rows, "dim": 8, "dtype": "float32", "kind": "pooled",
            "placement": placement, "shards": [{"rank": owner, "first_row": 0, "num_rows": rows}]}


def write_run(path: Path, accesses: list[Access], tables: list[dict], *, world: int = 2,
              samples_per_step: int | None = None, split_steps: bool = False) -> Path:
    """A run directory holding `accesses` (one append per (rank, step); with `split_steps`, each
    step's rows in two part files, as a step straddling a flush is written), a steps table when
    `samples_per_step` is given, and a manifest listing `tables`."""
    by_rank_step: dict[tuple[int, int], list[Access]] = defaultdict(list)
    for a in accesses:
        by_rank_step[(a[1], a[0])].append(a)
    writers = {r: RunWriter(path, r) for r in range(world)}
    for (rank, step), rows in sorted(by_rank_step.items()):
        halves = [rows[: len(rows) // 2], rows[len(rows) // 2:]] if split_steps else [rows]
        for half in halves:
            if half:
                writers[rank].append("accesses", {
                    "step": [a[0] for a in half], "table_name": [a[2] for a in half], "row": [a[3] for a in half],
                    "count": [a[4] for a in half], "phase": [a[5] for a in half]})
                if split_steps:
                    writers[rank].flush()
    if samples_per_step is not None:
        steps = sorted({a[0] for a in accesses if a[5] == "train"})
        for rank, w in writers.items():
            w.append("steps", {"step": steps, "t_start_ns": [s * 10 for s in steps],
                               "t_end_ns": [s * 10 + 5 for s in steps], "samples": [samples_per_step] * len(steps),
                               "loss": [None] * len(steps)})
    for w in writers.values():
        w.close()
    write_manifest(path, {"schema_version": "1.1", "status": "completed", "world_size": world,
                          "ranks": list(range(world)), "tables": tables})
    return path


def zipf_ranks(rng: np.random.Generator, rows: int, alpha: float, n: int) -> np.ndarray:
    """`n` popularity ranks (0 = most read) of a `rows`-row table, P(rank k) ~ (k + 1)^-alpha."""
    p = np.arange(1, rows + 1, dtype=np.float64) ** -alpha
    return rng.choice(rows, size=n, p=p / p.sum())


def zipf_steps(rng: np.random.Generator, rows: int, alpha: float, n: int, steps: int) -> list[np.ndarray]:
    """`steps` batches of `n` rows, Zipf over ranks, the ranks scattered over the rows once."""
    perm = rng.permutation(rows)
    return [perm[zipf_ranks(rng, rows, alpha, n)] for _ in range(steps)]


def accesses_of(draws_per_step: list[np.ndarray], table: str, rank: int, phase: str = "train",
                first_step: int = 0) -> list[Access]:
    out = []
    for s, draws in enumerate(draws_per_step):
        rows, counts = np.unique(draws, return_counts=True)
        out.extend((first_step + s, rank, table, int(r), int(c), phase) for r, c in zip(rows, counts))
    return out


def mixed_trace(rng: np.random.Generator) -> tuple[list[Access], list[dict]]:
    """Three manifest tables of different size and skew on 2 ranks (one replicated), one table the
    manifest does not list, and evaluation rows that must not count."""
    accesses: list[Access] = []
    for name, rows, alpha, rank in (("small", 40, 1.4, 0), ("mid", 3000, 0.9, 1), ("big", 50_000, 0.7, 0)):
        accesses += accesses_of(zipf_steps(rng, rows, alpha, 700, 30), name, rank)
    for rank in (0, 1):  # a replicated table: the same rows read on both ranks
        accesses += accesses_of(zipf_steps(rng, 500, 1.1, 300, 30), "repl", rank)
    accesses += accesses_of([rng.integers(0, 77, 50) for _ in range(30)], "unlisted", 1)
    accesses += accesses_of([np.full(5000, 7), np.full(5000, 9)], "mid", 1, phase="eval", first_step=30)
    tables = [table_entry("small", 40), table_entry("mid", 3000, owner=1), table_entry("big", 50_000),
              {**table_entry("repl", 500, placement="replicated"),
               "shards": [{"rank": r, "first_row": 0, "num_rows": 500} for r in (0, 1)]}]
    return accesses, tables


def brute_force(counts: np.ndarray, num_rows: int) -> dict:
    """Every skew figure straight from its definition, over a dense array of per-row counts."""
    x = np.sort(np.r_[counts, np.zeros(num_rows - len(counts), dtype=np.int64)])[::-1]
    total = x.sum()
    cum = np.cumsum(x)
    out = {"num_rows": num_rows, "rows_touched": int((x > 0).sum()), "lookups": int(total)}
    for column, p in skew.TOP_SHARES.items():
        out[column] = cum[math.ceil(p * num_rows) - 1] / total
    ascending = x[::-1].astype(np.float64)
    if num_rows <= 4000:
        out["gini"] = np.abs(ascending[:, None] - ascending[None, :]).sum() / (2 * num_rows**2 * ascending.mean())
    else:
        i = np.arange(1, num_rows + 1)
        out["gini"] = 2 * (i * ascending).sum() / (num_rows * total) - (num_rows + 1) / num_rows
    out["zipf_alpha"] = fit_zipf_exponent(counts)
    for column, percent in skew.ROWS_FOR.items():
        out[column] = int(np.argmax(100 * cum >= percent * total)) + 1
    return out


def per_row(accesses: list[Access]) -> dict[str, Counter]:
    totals: dict[str, Counter] = defaultdict(Counter)
    for step, rank, table, row, count, phase in accesses:
        if phase == "train":
            totals[table][row] += count
    return totals


def test_figures_equal_a_brute_force_computation(tmp_path: Path) -> None:
    accesses, tables = mixed_trace(np.random.default_rng(1))
    with open_context(write_run(tmp_path / "run", accesses, tables)) as ctx:
        result = skew.compute(ctx)
    got = {row["table_name"]: row for row in result.tables["skew"].iter_rows(named=True)}
    sizes = {t["name"]: t["num_rows"] for t in tables}
    totals = per_row(accesses)
    assert set(got) == set(totals) == {"small", "mid", "big", "repl", "unlisted"}
    for name, counter in totals.items():
        num_rows = sizes.get(name, max(counter) + 1)
        expected = brute_force(np.array(list(counter.values()), dtype=np.int64), num_rows)
        for column, value in expected.items():
            assert got[name][column] == pytest.approx(value, rel=1e-9, abs=1e-12), (name, column)
    assert any("unlisted: not in the manifest" in note for note in result.notes)

    coverage = result.tables["coverage"]
    for name, counter in totals.items():
        x = np.sort(np.array(list(counter.values())))[::-1]
        part = coverage.filter(table_name=name)
        k = part["rows"].to_numpy()
        assert k[0] == 1 and k[-1] == len(x) and (np.diff(k) > 0).all()
        np.testing.assert_allclose(part["share"].to_numpy(), np.cumsum(x)[k - 1] / x.sum(), rtol=1e-12)
    summary = result.summary["tables"]["mid"]
    assert summary["lookups"] == sum(totals["mid"].values())  # the eval rows are not in it


@pytest.mark.parametrize("alpha", [0.8, 1.05, 1.2])
def test_the_zipf_fit_recovers_the_exponent_of_generated_data(tmp_path: Path, alpha: float) -> None:
    rng = np.random.default_rng(int(alpha * 100))
    accesses = accesses_of(zipf_steps(rng, 2000, alpha, 50_000, 40), "z", 0)
    with open_context(write_run(tmp_path / "run", accesses, [table_entry("z", 2000)], world=1)) as ctx:
        result = skew.compute(ctx)
    assert result.tables["skew"]["zipf_alpha"][0] == pytest.approx(alpha, abs=0.05)


@pytest.mark.parametrize("a", [0.0, 0.5, 1.0, 1.0 + 1e-7, 1.3, 2.5])
@pytest.mark.parametrize("n", [10, skew._HEAD + 1, 3_000_000])
def test_the_model_mean_log_rank_matches_the_direct_sum(a: float, n: int) -> None:
    k = np.arange(1, n + 1, dtype=np.float64)
    w = k ** -a
    assert skew.model_mean_log_rank(a, n) == pytest.approx((w * np.log(k)).sum() / w.sum(), rel=1e-10)


def hot_sets_by_hand(accesses: list[Access], table: str, k: int, windows: int) -> list[float]:
    train = [a for a in accesses if a[5] == "train"]
    first = min(a[0] for a in train)
    span = max(a[0] for a in train) - first + 1
    counts: list[Counter] = [Counter() for _ in range(windows)]
    for step, rank, name, row, count, phase in train:
        if name == table:
            counts[(step - first) * windows // span][row] += count
    hot = [set(sorted(c, key=lambda r: (-c[r], r))[:k]) for c in counts]
    return [len(a & b) / len(a | b) for a, b in zip(hot, hot[1:])]


def test_hot_set_stability_follows_its_definition(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    perm = rng.permutation(1000)  # the popular rows drift: step s's ranks shift by 3 s
    draws = [perm[(zipf_ranks(rng, 1000, 1.0, 400) + 3 * s) % 1000] for s in range(25)]
    accesses = accesses_of(draws, "d", 0) + accesses_of([rng.integers(0, 20, 60) for _ in range(25)], "u", 1)
    with open_context(write_run(tmp_path / "run", accesses, [table_entry("d", 1000),
                                                             table_entry("u", 20, owner=1)])) as ctx:
        result = skew.compute(ctx)
    stability = result.tables["hot_set_stability"]
    k = dict(result.tables["skew"].select("table_name", "rows_for_80pct").iter_rows())
    for name in ("d", "u"):
        part = stability.filter(table_name=name).sort("window")
        assert part["window"].to_list() == list(range(1, skew.WINDOWS))
        assert (part["k"] == k[name]).all() and (part["sample_rate"] == 1.0).all()
        np.testing.assert_allclose(part["jaccard"].to_numpy(), hot_sets_by_hand(accesses, name, k[name], skew.WINDOWS))
    assert stability.filter(table_name="d")["jaccard"].mean() < stability.filter(table_name="u")["jaccard"].mean()


def test_the_row_sample_keeps_whole_rows_at_the_rate_it_reports(tmp_path: Path) -> None:
    rng = np.random.default_rng(4)
    accesses = accesses_of([rng.integers(0, 20_000, 3000) for _ in range(20)], "t", 0)
    run = write_run(tmp_path / "run", accesses, [table_entry("t", 20_000)], world=1, split_steps=True)
    with open_context(run) as ctx:
        sample = skew.access_sample(ctx, 5000)
        rate = sample.rates[0]
        assert 0.05 < rate < 0.15
        kept = set(sample.row.tolist())
        every = Counter((a[0], a[3]) for a in accesses for _ in range(a[4]))
        # whole rows: every access of a kept row is there, once per step, with its full count
        expected = sorted((s, r, c) for (s, r), c in every.items() if r in kept)
        assert sorted(zip(sample.step.tolist(), sample.row.tolist(), sample.count.tolist())) == expected
        touched = {a[3] for a in accesses}
        assert len(kept) / len(touched) == pytest.approx(rate, rel=0.1)


def test_a_run_without_training_accesses_says_so(tmp_path: Path) -> None:
    accesses = accesses_of([np.array([1, 2, 2])], "t", 0, phase="eval")
    with open_context(write_run(tmp_path / "run", accesses, [table_entry("t", 5)], world=1)) as ctx:
        result = skew.compute(ctx)
    assert not result.tables and "no training rows" in result.notes[0]
