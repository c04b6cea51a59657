"""Analysis at scale: how long `skew` and `cache` (and, with --full, the whole `tracekit analyze`)
take on a synthetic run of 100M `accesses` rows, and how much memory, at 50M and 100M rows.

The run is written once into the directory given (and reused): the 26 Criteo Kaggle tables at full
size with their fitted Zipf exponents, 2 ranks, 4096 samples per rank and step, one id per sample
and table, each table on one rank (table-wise sharding, t -> rank t % 2), so the owner sees the
whole global batch of 8192 lookups per table and step. Part files carry the recorder's schema,
metadata and encodings (`tracekit.parts.write_part`), about 2M rows each, rows sorted within a
(step, table) as the recorder writes them. Its first half of steps (hard links to the same part
files) is the 50M-row run. Each measurement is a fresh subprocess; wall time is the parent's clock
around it and peak memory its `ru_maxrss` from `os.wait4` (the child's own, not the maximum over
all children that `getrusage(RUSAGE_CHILDREN)` reports).

    .venv/bin/python bench/analyze_scale.py /tmp/tracekit-scale --runs 3
    .venv/bin/python bench/analyze_scale.py /tmp/tracekit-scale --runs 3 --full
    .venv/bin/python bench/analyze_scale.py /tmp/tracekit-scale --accuracy C2,C10,C24   # sampled vs exact
    .venv/bin/python bench/analyze_scale.py /tmp/tracekit-tiled --tiled runs/kaggle --runs 3   # 10M, 100M, 1B
    .venv/bin/python bench/analyze_scale.py /tmp/tracekit-tiled --tiled runs/kaggle --sizes 100M --grow 0.1
    .venv/bin/python bench/analyze_scale.py /tmp/tracekit-tiled --tiled runs/kaggle --sizes 100M --first --runs 3

--tiled takes a real recorded run (e.g. `tracekit record -o runs/kaggle -- torchrun --standalone
--nproc-per-node 2 train.py --preset criteo-kaggle --scale 0.01 --batch-size 1024 --steps 200
--samples 100000`: accesses, lookups every 10th step, comms) and repeats it in time to each size, so
the trace holds lookups and comms in the recorder's proportions, and times the whole analysis.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from tracekit.parts import PARQUET_OPTIONS, write_part  # noqa: E402
from tracekit.schema import TABLES, file_metadata  # noqa: E402
from tracekit import manifest as run_manifest  # noqa: E402
from tracekit.manifest import Manifest  # noqa: E402

BATCH_PER_RANK = 4096
WORLD = 2
PART_ROWS = 2_000_000
SCRAMBLE = 2_654_435_761  # a prime larger than every table: row = rank * SCRAMBLE mod rows is a bijection
TABLE_NAMES = tuple(f"C{i}" for i in range(1, 27))


def zipf_rows(rng: np.random.Generator, rows: int, alpha: float, n: int) -> np.ndarray:
    """`n` rows of a table of `rows` rows, popularity rank k drawn with P(k) ~ k^-alpha (inverse of
    the continuous power law's CDF on [1, rows + 1), floored), hot rows spread over the ids."""
    u = rng.random(n)
    top = rows + 1.0
    x = top ** u if abs(alpha - 1) < 1e-9 else (1 + u * (top ** (1 - alpha) - 1)) ** (1 / (1 - alpha))
    k = np.minimum(np.floor(x).astype(np.int64), rows) - 1
    return (k * SCRAMBLE) % rows


def manifest(steps: int, rows_written: int) -> dict:
    from tracekit.dlrm.presets import CRITEO_KAGGLE_ROWS  # imports torch: only where the run is written

    tables = [{"name": name, "num_rows": rows, "dim": 64, "dtype": "float32", "kind": "pooled",
               "placement": "sharded", "shards": [{"rank": t % WORLD, "first_row": 0, "num_rows": rows}]}
              for t, (name, rows) in enumerate(zip(TABLE_NAMES, CRITEO_KAGGLE_ROWS))]
    return {"schema_version": "1.1", "run_id": "analyze-scale", "status": "completed", "world_size": WORLD,
            "ranks": list(range(WORLD)), "steps": steps, "tables": tables, "command": ["bench/analyze_scale.py"],
            "bench": {"accesses_rows": rows_written, "batch_per_rank": BATCH_PER_RANK, "seed": 0}}


class PartWriter:
    """Accesses of one rank, buffered and written as part files of about PART_ROWS rows."""

    def __init__(self, run_dir: Path, rank: int) -> None:
        self.directory = run_dir / "accesses" / f"rank={rank}"
        self.batches: list[pa.RecordBatch] = []
        self.rows = 0
        self.index = 0
        self.parts: list[tuple[Path, int]] = []  # (file, last step in it)

    def add(self, step: int, names: np.ndarray, rows: np.ndarray, counts: np.ndarray) -> None:
        n = len(rows)
        table_name = pa.DictionaryArray.from_arrays(pa.array(names, pa.int32()), pa.array(TABLE_NAMES))
        phase = pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, np.int8)), pa.array(["train"]))
        self.batches.append(pa.RecordBatch.from_arrays(
            [pa.array(np.full(n, step, np.int64)), table_name, pa.array(rows), pa.array(counts.astype(np.int32)),
             phase],
            schema=TABLES["accesses"]))
        self.rows += n
        if self.rows >= PART_ROWS:
            self.flush(step)

    def flush(self, step: int) -> None:
        if not self.batches:
            return
        data = pa.Table.from_batches(self.batches).replace_schema_metadata(file_metadata("accesses"))
        self.parts.append((write_part(data, self.directory, self.index, **PARQUET_OPTIONS["accesses"]), step))
        self.index += 1
        self.batches, self.rows = [], 0


def write_steps(run_dir: Path, steps: int) -> None:
    for rank in range(WORLD):
        step = np.arange(steps, dtype=np.int64)
        t0 = step * 50_000_000
        data = pa.table({"step": step, "t_start_ns": t0, "t_end_ns": t0 + 45_000_000,
                         "samples": np.full(steps, BATCH_PER_RANK, np.int32), "loss": pa.nulls(steps, pa.float64()),
                         "schedule": pa.nulls(steps, pa.string())},
                        schema=TABLES["steps"]).replace_schema_metadata(file_metadata("steps"))
        write_part(data, run_dir / "steps" / f"rank={rank}", 0)


def generate(run_dir: Path, target_rows: int, seed: int = 0) -> dict:
    """Write the synthetic run (about `target_rows` accesses rows) and its half; the manifest last,
    so a directory with a manifest is complete."""
    from tracekit.dlrm.presets import CRITEO_KAGGLE_ROWS, CRITEO_KAGGLE_ZIPF

    rng = np.random.default_rng(seed)
    offsets = np.cumsum((0,) + CRITEO_KAGGLE_ROWS)
    owner = np.arange(len(TABLE_NAMES)) % WORLD
    writers = [PartWriter(run_dir, rank) for rank in range(WORLD)]
    written, step = 0, 0
    while written < target_rows:
        keys = np.concatenate([offsets[t] + zipf_rows(rng, rows, alpha, WORLD * BATCH_PER_RANK)
                               for t, (rows, alpha) in enumerate(zip(CRITEO_KAGGLE_ROWS, CRITEO_KAGGLE_ZIPF))])
        unique, counts = np.unique(keys, return_counts=True)  # sorted: by table, then row
        table = np.searchsorted(offsets, unique, side="right") - 1
        for rank, writer in enumerate(writers):
            mine = owner[table] == rank
            writer.add(step, table[mine], unique[mine] - offsets[table[mine]], counts[mine])
        written += len(unique)
        step += 1
    for writer in writers:
        writer.flush(step - 1)
    write_steps(run_dir, step)
    run_manifest.write(run_dir, Manifest.from_json(manifest(step, written)))
    half = run_dir.with_name(run_dir.name + "-half")
    link_half(run_dir, half, writers, written)
    return {"rows": written, "steps": step}


def link_half(run_dir: Path, half: Path, writers: list[PartWriter], total_rows: int) -> None:
    """The run of the first parts (hard links): every part ending before the step whose cut comes
    closest to half the rows."""
    import shutil

    shutil.rmtree(half, ignore_errors=True)
    parts = [(path, last, pq.ParquetFile(path).metadata.num_rows) for w in writers for path, last in w.parts]
    cuts = sorted({last + 1 for _, last, _ in parts})
    rows_before = {cut: sum(n for _, last, n in parts if last < cut) for cut in cuts}
    steps = min(cuts, key=lambda cut: abs(rows_before[cut] - total_rows / 2))
    for path, last, _ in parts:
        if last < steps:
            target = half / path.relative_to(run_dir)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.link(path, target)
    write_steps(half, steps)
    run_manifest.write(half, Manifest.from_json(manifest(steps, rows_before[steps])))


def ensure(run_dir: Path, target_rows: int) -> None:
    path = run_dir / "manifest.json"
    half = run_dir.with_name(run_dir.name + "-half") / "manifest.json"
    if path.is_file() and half.is_file() and json.loads(path.read_text())["bench"]["accesses_rows"] >= target_rows:
        return
    import shutil

    shutil.rmtree(run_dir, ignore_errors=True)
    started = time.perf_counter()
    info = generate(run_dir, target_rows)
    print(f"wrote {info['rows']:,} accesses rows over {info['steps']} steps in {time.perf_counter() - started:.0f} s")


# ---------------------------------------------------------------------------------------------- timing

def full_analyze(run_dir: Path, incremental: bool = False) -> None:
    """`tracekit analyze` in this process, each phase (analyze's progress names) timed; prints the
    phase times, the peak RSS (MiB) reached by the end of each, and the time left that analyze
    told at each phase's start with the time that was in fact left, as JSON. `incremental`:
    reusing what an earlier analyze of the run kept (analyses.row_totals), else from nothing."""
    import resource

    from analyses.analyze import analyze
    from analyses.row_totals import STATE_DIR

    if not incremental:  # a full analysis: not the per-row totals an earlier analyze of the run kept
        shutil.rmtree(run_dir / STATE_DIR, ignore_errors=True)
    times: dict[str, float] = {}
    peaks: dict[str, float] = {}
    told: list[tuple[str, float, float]] = []  # (phase, time left told, when)
    current = ["open"]
    mark = [time.perf_counter()]

    def progress(name: str, left_s: float | None = None) -> None:
        now = time.perf_counter()
        times[current[0]] = round(times.get(current[0], 0.0) + now - mark[0], 3)
        peaks[current[0]] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
        current[0], mark[0] = name, now
        if left_s is not None:
            told.append((name, left_s, now))

    started = time.perf_counter()
    analyze(run_dir, progress=progress)
    progress("end")
    ended = time.perf_counter()
    times["total"] = round(ended - started, 3)
    left = {name: [round(said, 2), round(ended - when, 2)] for name, said, when in told}
    print(json.dumps({"times": times, "peak_rss_mib": peaks, "time_left": left}))


def child(target: str, run_dir: Path) -> None:
    """Run `target` on `run_dir` in this process and print its phase times as JSON."""
    if target in ("full", "incremental"):
        full_analyze(run_dir, incremental=target == "incremental")
        return
    from analyses import cache, skew
    from analyses.context import open_context

    times: dict[str, float] = {}
    started = time.perf_counter()
    ctx = open_context(run_dir)

    def timed(name, fn):
        t = time.perf_counter()
        out = fn()
        times[name] = round(time.perf_counter() - t, 3)
        return out

    timed("per_row_pass", lambda: skew.lookup_histogram(ctx))
    timed("sample_pass", lambda: skew.access_sample(ctx))
    results = []
    if target in ("skew", "skew+cache"):
        results.append(timed("skew", lambda: skew.compute(ctx)))
    if target in ("cache", "skew+cache"):
        results.append(timed("cache", lambda: cache.compute(ctx)))
    for result in results:
        for name, frame in result.tables.items():
            ctx.write(name, frame)
    times["total"] = round(time.perf_counter() - started, 3)
    ctx.close()
    print(json.dumps(times))


def run_child(command: list[str]) -> dict:
    """Wall time, CPU time and peak RSS (ru_maxrss from os.wait4 on exactly this child) of
    `command`, and the phase times it prints as its last JSON line."""
    with tempfile.TemporaryFile() as stderr:
        started = time.perf_counter()
        process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr)
        out = process.stdout.read().decode()
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        process.returncode = code = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        if code != 0:
            stderr.seek(0)
            raise SystemExit(f"{' '.join(command)} failed ({code}):\n{stderr.read().decode()[-3000:]}")
    last = out.strip().splitlines()[-1] if out.strip() else ""
    phases = json.loads(last) if "--child" in command else {}
    return {"wall_s": wall, "peak_rss_mib": usage.ru_maxrss / 1024, "cpu_s": usage.ru_utime + usage.ru_stime,
            "phases": phases}


def accuracy(run_dir: Path, tables: tuple[str, ...]) -> None:
    """The sampled miss-ratio curves of `tables` against an exact replay of every one of their rows."""
    import polars as pl

    from analyses import cache
    from analyses.context import open_context

    with open_context(run_dir) as ctx:
        sampled = cache.compute(ctx).tables["cache_mrc"].filter(pl.col("table_name").is_in(tables))
        started = time.perf_counter()
        exact = cache.compute(ctx, sample_rows=None, tables=tables).tables["cache_mrc"]
        rows = {t.name: t.num_rows for t in ctx.model.tables}
    print(f"exact replay of {', '.join(tables)}: {time.perf_counter() - started:.0f} s")
    error = (pl.col("miss_ratio") - pl.col("miss_ratio_exact")).abs()
    joined = sampled.join(exact, on=["table_name", "policy", "load_factor"], suffix="_exact")
    summary = joined.group_by("table_name").agg(
        pl.col("sample_rate").first(), error.mean().alias("mean_abs_error"), error.max().alias("max_abs_error"),
        pl.col("miss_ratio_exact").min().alias("exact_min"), pl.col("miss_ratio_exact").max().alias("exact_max"))
    print("| table | rows | sample rate | mean abs error | max abs error | exact miss ratios |")
    print("|---|---:|---:|---:|---:|---|")
    for row in summary.sort("table_name").iter_rows(named=True):
        print(f"| {row['table_name']} | {rows.get(row['table_name'], '?'):,} | {row['sample_rate']:.3f} | "
              f"{row['mean_abs_error']:.4f} | {row['max_abs_error']:.4f} | "
              f"{row['exact_min']:.3f}-{row['exact_max']:.3f} |")


def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    memory = next((int(ln.split()[1]) for ln in open("/proc/meminfo") if ln.startswith("MemTotal")), 0)
    return f"{cpu}, {os.cpu_count()} cores, {memory / 2**20:.0f} GiB, {platform.system()}"


def rows_of(run_dir: Path) -> int:
    return json.loads((run_dir / "manifest.json").read_text())["bench"]["accesses_rows"]


def tiled(src: Path, sizes: list[str], runs: int, out: Path) -> None:
    """The whole analysis (`full_analyze`) of SRC repeated in time (bench/tile_run.py) to each of
    `sizes` accesses rows, `runs` times each: wall time, peak RSS, time per phase (medians), and the
    slope of log time against log rows between successive sizes (1: linear)."""
    from tile_run import copies_for, tile

    print(f"machine: {machine()}; {src} repeated in time; {runs} runs per size, medians")
    print("| accesses rows | lookups rows | comms rows | copies | wall s (median) | runs | peak RSS MiB | "
          "slowest phases (median s) |")
    print("|---:|---:|---:|---:|---:|---|---:|---|")
    previous = None
    for size in sizes:
        copies = copies_for(src, size)
        run = out / f"tiled-{size}"
        manifest = run / "manifest.json"
        if not manifest.is_file() or json.loads(manifest.read_text()).get("tiled", {}).get("copies") != copies:
            tile(src, run, copies)
        written = json.loads(manifest.read_text())["written_rows"]
        got = [run_child([sys.executable, __file__, str(run), "--child", "full"]) for _ in range(runs)]
        wall = statistics.median(g["wall_s"] for g in got)
        phases = {k: statistics.median(g["phases"]["times"][k] for g in got) for k in got[0]["phases"]["times"]}
        slowest = sorted(((v, k) for k, v in phases.items() if k != "total"), reverse=True)[:4]
        told = {k: [statistics.median(g["phases"]["time_left"][k][i] for g in got) for i in (0, 1)]
                for k in ("skew", "cache", "policy: replication")}
        print(f"| {written['accesses']:,} | {written.get('lookups', 0):,} | {written.get('comms', 0):,} | {copies} | "
              f"{wall:.1f} | {', '.join(f'{w:.1f}' for w in (g['wall_s'] for g in got))} | "
              f"{max(g['peak_rss_mib'] for g in got):.0f} | {', '.join(f'{k} {v:.1f}' for v, k in slowest)} |",
              flush=True)
        print("|  | | | | time left, told against taken (medians): " + ", ".join(
            f"at {k} {said:.0f} s / {taken:.0f} s" for k, (said, taken) in told.items()) + " | | | |", flush=True)
        if previous:
            slope = np.log(wall / previous[1]) / np.log(written["accesses"] / previous[0])
            print(f"|  | | | | slope from the size before: **{slope:.2f}** | | | |", flush=True)
            print(f"|  | | | | {same_results(previous[2], run)} | | | |", flush=True)
        previous = (written["accesses"], wall, run)


def tree_rss_mib(pid: int) -> float:
    """The summed resident memory of process `pid` and its descendants, MiB (0 where it has gone)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
            with open(f"/proc/{p}/task/{p}/children") as f:
                todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue
    return total / 1024


def run_tree(command: list[str]) -> dict:
    """Wall time of `command` and the peak of its process tree's summed RSS (sampled every 50 ms)."""
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peak = 0.0
    while process.poll() is None:
        peak = max(peak, tree_rss_mib(process.pid))
        time.sleep(0.05)
    wall = time.perf_counter() - started
    if process.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({process.returncode}):\n{process.stderr.read().decode()[-3000:]}")
    return {"wall_s": wall, "peak_mib": peak}


def first(src: Path, size: str, runs: int, out: Path) -> None:
    """A user's first `tracekit analyze` of SRC tiled to `size` accesses rows: with no calibration and no kept
    totals (the calibration runs beside the analysis), against the analysis with its calibration already
    written and against the calibration alone, interleaved, `runs` times each: wall time and the peak of
    the process tree's summed RSS."""
    from tile_run import copies_for, tile

    from analyses.row_totals import STATE_DIR
    from tracekit.schema import CALIBRATION_PATH

    copies = copies_for(src, size)
    run = out / f"tiled-{size}"
    manifest = run / "manifest.json"
    if not manifest.is_file() or json.loads(manifest.read_text()).get("tiled", {}).get("copies") != copies:
        tile(src, run, copies)
    analyze = [sys.executable, "-m", "tracekit", "analyze", str(run), "--no-report", "--json"]
    calibrate = [sys.executable, "-m", "tracekit.app.calibration", "--run", str(run),
                 "--row-totals", str(run / STATE_DIR / "row_totals.parquet")]
    got: dict[str, list[dict]] = {"first analyze (calibration beside it)": [], "analyze, calibration written": [],
                                  "calibration alone": []}
    print(f"machine: {machine()}; {src} tiled to {size} ({copies} copies); {runs} interleaved runs", flush=True)
    for _ in range(runs):
        (run / CALIBRATION_PATH).unlink(missing_ok=True)
        shutil.rmtree(run / STATE_DIR, ignore_errors=True)
        got["first analyze (calibration beside it)"].append(run_tree(analyze))
        got["analyze, calibration written"].append(run_tree(analyze))
        (run / CALIBRATION_PATH).unlink()
        got["calibration alone"].append(run_tree(calibrate))
    print("| what | wall s (median) | runs (wall s) | peak tree RSS MiB (max) |")
    print("|---|---:|---|---:|")
    for name, rows in got.items():
        walls = [g["wall_s"] for g in rows]
        print(f"| {name} | {statistics.median(walls):.1f} | {', '.join(f'{w:.1f}' for w in walls)} | "
              f"{max(g['peak_mib'] for g in rows):.0f} |", flush=True)


def grown(src: Path, size: str, share: float, runs: int, out: Path) -> None:
    """Incremental analysis: SRC tiled to `size` accesses rows and analysed, then grown by `share`
    more copies (new part files, as a recording that went on writes them) and analysed again,
    reusing what the first analysis kept (`--child incremental`) against from nothing (`--child
    full`), alternating, `runs` times each; the two must write the same results."""
    from tile_run import copies_for, tile

    base = copies_for(src, size)
    run = out / f"grown-{size}"
    times: dict[str, list[float]] = {"incremental": [], "full": []}
    for _ in range(runs):
        tile(src, run, base)
        run_child([sys.executable, __file__, str(run), "--child", "full"])  # what the first analysis keeps
        tile(src, run, base + max(1, round(share * base)), grow=True)
        for mode in ("incremental", "full"):
            if mode == "full":
                keep = run.parent / f"{run.name}-incremental"
                shutil.rmtree(keep, ignore_errors=True)
                shutil.copytree(run / "analysis", keep)
            got = run_child([sys.executable, __file__, str(run), "--child", mode])
            times[mode].append(got["wall_s"])
        print(f"incremental {times['incremental'][-1]:.1f} s, full {times['full'][-1]:.1f} s; "
              f"{same_analysis(keep, run / 'analysis')}", flush=True)
    written = json.loads((run / "manifest.json").read_text())["written_rows"]["accesses"]
    print(f"grown to {written:,} accesses rows (+{share:.0%}): analyze reusing the first analysis "
          f"{statistics.median(times['incremental']):.1f} s, from nothing {statistics.median(times['full']):.1f} s "
          f"(medians of {runs})")


def same_analysis(a: Path, b: Path) -> str:
    """Whether two analyses of one run wrote equal skew and cache tables."""
    import polars as pl

    equal = all(pl.read_parquet(a / name).equals(pl.read_parquet(b / name))
                for name in ("skew.parquet", "cache_mrc.parquet"))
    return "skew and cache_mrc equal" if equal else "skew or cache_mrc DIFFER"


def same_results(a: Path, b: Path) -> str:
    """How far two tilings of one run differ where they should not: every skew figure (copies of a
    run have the same shares) and the miss-ratio curves (both steady states of one workload)."""
    import polars as pl

    skew_a, skew_b = (pl.read_parquet(r / "analysis" / "skew.parquet").sort("table_name") for r in (a, b))
    numeric = [c for c in skew_a.columns if c.startswith(("top_", "gini", "zipf"))]
    skew = max(float((skew_a[c] - skew_b[c]).abs().max()) for c in numeric)
    keys = ["table_name", "policy", "load_factor"]
    mrc = pl.read_parquet(a / "analysis" / "cache_mrc.parquet").join(
        pl.read_parquet(b / "analysis" / "cache_mrc.parquet"), on=keys, suffix="_b")
    return (f"against the size before: skew shares differ by at most {skew:.2g}, miss ratios by at most "
            f"{float((mrc['miss_ratio'] - mrc['miss_ratio_b']).abs().max()):.2g}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, help="where the synthetic run is (written there if absent)")
    p.add_argument("--rows", type=float, default=100e6, help="accesses rows of the run (default 100M)")
    p.add_argument("--runs", type=int, default=3, help="measurements of each target at each size")
    p.add_argument("--targets", default="skew,cache,skew+cache", help="comma-separated: skew, cache, skew+cache")
    p.add_argument("--full", action="store_true", help="also time `tracekit analyze RUN --json`")
    p.add_argument("--accuracy", metavar="TABLES",
                   help="instead: compare the sampled miss-ratio curves of these tables (comma-separated) "
                        "with an exact replay")
    p.add_argument("--tiled", type=Path, metavar="SRC",
                   help="instead: the whole analysis of the recorded run SRC repeated in time (bench/tile_run.py) "
                        "to --sizes accesses rows, written under RUN_DIR")
    p.add_argument("--sizes", default="10M,100M,1B", help="with --tiled: accesses rows of each size")
    p.add_argument("--grow", type=float, metavar="SHARE",
                   help="with --tiled: analyse the first size, grow it by SHARE (0.1: 10%% more steps) and "
                        "time analyze reusing the first analysis against from nothing")
    p.add_argument("--first", action="store_true",
                   help="with --tiled: a user's first analyze of the first size (its calibration included) "
                        "against the analysis and the calibration alone")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.run_dir)
        return 0
    if args.tiled and args.first:
        first(args.tiled, args.sizes.split(",")[0], args.runs, args.run_dir)
        return 0
    if args.tiled and args.grow:
        grown(args.tiled, args.sizes.split(",")[0], args.grow, args.runs, args.run_dir)
        return 0
    if args.tiled:
        tiled(args.tiled, args.sizes.split(","), args.runs, args.run_dir)
        return 0
    manifest = args.run_dir / "manifest.json"
    if "tiled" not in (json.loads(manifest.read_text()) if manifest.is_file() else {}):  # tile_run.py's: as it is
        ensure(args.run_dir, int(args.rows))
    if args.accuracy:
        accuracy(args.run_dir, tuple(args.accuracy.split(",")))
        return 0
    half = args.run_dir.with_name(args.run_dir.name + "-half")
    python = sys.executable
    targets = [t for t in args.targets.split(",") if t]
    commands = {t: lambda run, t=t: [python, __file__, str(run), "--child", t] for t in targets}
    if args.full:
        if (ROOT / "analyses" / "analyze.py").is_file():
            commands["tracekit analyze"] = lambda run: [python, "-m", "tracekit", "analyze", str(run), "--json"]
        else:
            print("analyses/analyze.py does not exist yet: --full skipped")
    print(f"machine: {machine()}; runs: {args.runs} per cell, medians")
    print("| target | accesses rows | wall s (median) | runs (wall s) | CPU s (median) | peak RSS MiB (max) | "
          "phases in the process (median s) |")
    print("|---|---:|---:|---|---:|---:|---|")
    for target, command in commands.items():
        for run in (half, args.run_dir):
            got = [run_child(command(run)) for _ in range(args.runs)]
            walls = [g["wall_s"] for g in got]
            phases = {k: statistics.median(g["phases"][k] for g in got) for k in got[0]["phases"]}
            print(f"| {target} | {rows_of(run):,} | {statistics.median(walls):.1f} | "
                  f"{', '.join(f'{w:.1f}' for w in walls)} | {statistics.median(g['cpu_s'] for g in got):.1f} | "
                  f"{max(g['peak_rss_mib'] for g in got):.0f} | "
                  f"{', '.join(f'{k} {v:.1f}' for k, v in phases.items())} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
