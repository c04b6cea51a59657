"""A recorded run repeated in time: what a long run of the same job records, for analysis at scale
(bench/RESULTS.md §27) without recording for hours.

Copy k of SRC (k = 0, 1, ...) has its steps shifted by k · S (S the run's steps), its times by
k · T (T the run's span, first step start to last step end) and its comms' seq by k · Q (Q one
more than the largest seq); every other column is SRC's, so shares, traffic per step and replays
per step are SRC's, and any step-windowed figure of the tiled run equals SRC's on the same steps.
Part files are rewritten with the recorder's metadata (tracekit.parts.write_part); the manifest's
step counts and written rows are scaled to match.

    .venv/bin/python bench/tile_run.py runs/kaggle /tmp/tracekit-tiled --accesses 100M
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tracekit.parts import PARQUET_OPTIONS, write_part  # noqa: E402
from tracekit.run_dir import MANIFEST  # noqa: E402

TIME_COLUMNS = ("t_start_ns", "t_end_ns", "t_ns")


def span(src: Path) -> tuple[int, int, int]:
    """S (steps), T (ns from the first step's start to the last one's end, plus one step's mean gap)
    and Q (comms seq) of SRC."""
    steps = pq.read_table(src / "steps").select(["step", "t_start_ns", "t_end_ns"])
    n_steps = int(pc.max(steps["step"]).as_py()) + 1
    t0, t1 = pc.min(steps["t_start_ns"]).as_py(), pc.max(steps["t_end_ns"]).as_py()
    seq = pq.read_table(src / "comms", columns=["seq"])["seq"] if (src / "comms").is_dir() else None
    return n_steps, t1 - t0 + (t1 - t0) // n_steps, 0 if seq is None else int(pc.max(seq).as_py()) + 1


def shifted(table: pa.Table, k: int, n_steps: int, dt: int, dseq: int) -> pa.Table:
    for name, by in (("step", k * n_steps), ("seq", k * dseq), *((c, k * dt) for c in TIME_COLUMNS)):
        i = table.schema.get_field_index(name)
        if i >= 0 and by:
            table = table.set_column(i, table.schema.field(i), pc.add(table[name], pa.scalar(by, table[name].type)))
    return table


def tile(src: Path, dst: Path, copies: int, grow: bool = False) -> None:
    """DST: `copies` copies of SRC one after the other; `grow`: DST already holds some and gets the
    copies after them in new part files (a recording that went on), the old parts left untouched."""
    n_steps, dt, dseq = span(src)
    had = json.loads((dst / MANIFEST).read_text())["tiled"]["copies"] if grow else 0
    if not grow:
        shutil.rmtree(dst, ignore_errors=True)
        dst.mkdir(parents=True)
    for folder in sorted(p for p in src.iterdir() if p.is_dir() and p.name not in ("analysis", "policy", "ranks")):
        for rank_dir in sorted(folder.glob("rank=*")):
            out = dst / folder.name / rank_dir.name
            n = len(list(out.glob("*.parquet"))) if grow else 0
            parts = [pq.read_table(part) for part in sorted(rank_dir.glob("*.parquet"))]
            for k in range(had, copies):  # in step order, as the recorder writes them
                for table in parts:
                    write_part(shifted(table, k, n_steps, dt, dseq), out, n, **PARQUET_OPTIONS.get(folder.name, {}))
                    n += 1
    if not grow:
        shutil.copytree(src / "ranks", dst / "ranks")
    manifest = json.loads((src / MANIFEST).read_text())
    manifest["steps"] = {r: s * copies for r, s in (manifest.get("steps") or {}).items()}
    manifest["written_rows"] = {t: n * copies for t, n in (manifest.get("written_rows") or {}).items()}
    manifest["tiled"] = {"source": str(src), "copies": copies, "steps_per_copy": n_steps}
    (dst / MANIFEST).write_text(json.dumps(manifest, indent=1))


def copies_for(src: Path, size: str) -> int:
    """Copies of SRC that hold at least `size` accesses rows ("100M", "1B", "2500000")."""
    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in (src / "accesses").rglob("*.parquet"))
    wanted = int(float(size.upper().replace("M", "e6").replace("B", "e9")))
    return -(-wanted // rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    p.add_argument("--accesses", default="100M", help="accesses rows wanted (at least): sets the copies")
    args = p.parse_args()
    copies = copies_for(args.src, args.accesses)
    tile(args.src, args.dst, copies)
    rows = json.loads((args.dst / MANIFEST).read_text())["written_rows"]["accesses"]
    print(f"{args.dst}: {copies} copies of {args.src}, {rows:,} accesses rows in all")


if __name__ == "__main__":
    main()
