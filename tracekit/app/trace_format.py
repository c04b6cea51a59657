"""The trace-format page of the docs (docs/trace-format.md), rendered from tracekit/schema.py.

`tracekit.schema` defines the trace tables once, as Arrow schemas. This module reads them, the
comments written beside their columns and above them, and the docstrings of the schema's constants,
and renders one Markdown page; the prose around them lives here. The page is never edited by hand:
tests/test_docs.py checks that docs/trace-format.md equals `markdown()`.

    python -m tracekit.app.trace_format            # print the page
    python -m tracekit.app.trace_format --write    # rewrite docs/trace-format.md
"""

from __future__ import annotations

import argparse
import ast
import inspect
import io
import sys
import tokenize
from pathlib import Path

import pyarrow as pa

from tracekit import run_dir, schema
from tracekit.files import write_text

PAGE = Path(__file__).resolve().parents[2] / "docs" / "trace-format.md"
COMMAND = "python -m tracekit.app.trace_format --write"

INTRO = """\
A recorded run is a directory of Parquet part files, one folder per trace table, plus a manifest.
This page lists every trace table and column as `tracekit/schema.py` defines them, the one place
that spells them: the collectors write them through `tracekit.store`, the readers
(`tracekit.run`, `tracekit sql`, every analysis) read them through `tracekit.run`. What
`tracekit record` puts in them is described in [recording.md](recording.md); the analysis tables
that `tracekit analyze` adds under `analysis/` are in [analysis.md](analysis.md)."""

LAYOUT_PROSE = """\
Each rank writes its own files (hive partitioning by rank), so a reader globbing
`<table>/**/*.parquet` with hive partitioning on (`pl.scan_parquet(..., hive_partitioning=True)`,
DuckDB's `read_parquet(..., hive_partitioning=true)`) sees every rank with `rank` as a column, and
ranks never share a file. A part file is written under a hidden temporary name and renamed when
complete: a reader never sees half a file, and a crash loses at most the rows not yet flushed
(`tracekit record --flush-interval`, 1 s by default). `ranks/rank=R.json` is what each rank reports
when it exits (its steps, tables and rows written); `record` merges them into the manifest."""

READING_PROSE = """\
Read a run with `tracekit.run.open_run`, as `tracekit sql` and every analysis do: it checks each
part file's version first, gives `count` as int64 (so no sum overflows) and fills the columns a run
recorded before them lacks:

```python
from tracekit.run import open_run

run = open_run("runs/base")        # run.manifest, run.tables()
run.scan("comms")                  # a Polars LazyFrame over every rank's parts, `rank` a column
run.relation("steps")              # the same as a DuckDB relation
```"""

TIMES_PROSE = """\
Times (`*_ns`) are `time.monotonic_ns()` on the rank that wrote them. The manifest's
`clock_anchors` hold, per rank, one monotonic and one wall-clock reading taken together, so ranks
on one host align exactly and hosts align to their anchors. `step` is the optimizer step the row
belongs to, counted from 0 on each rank (or `tracekit.step()` where a loop has no optimizer)."""

TABLE_PROSE: dict[str, tuple[str, str]] = {
    "accesses": (
        "(step, phase, table, row) on a rank",
        "Every embedding lookup, counted: `count` is the exact number of times `row` (a global row of "
        "the logical table `table_name`) was looked up in that step on that rank. Written every step.",
    ),
    "lookups": (
        "lookup, on sampled steps",
        "The raw lookups of every `tracekit record --lookup-every N`th step (10 by default; 0: never), "
        "written where the lookup runs: in the reference trainer, at the table's owner after the input dist, "
        "so `sample` is a position in the batch the owner received. Where the program declared it with "
        "`tracekit.sources` (the reference trainer does), `src` is the rank the lookup's item (a bag, a row "
        "of a 2-D input, an id of a 1-D input) came from and `src_sample` the item's index among the items "
        "that rank sent (null for a 1-D input's ids, whose sample is not in the call); both are null where "
        "nothing was declared or a call's items did not number the declared counts, and analyze then finds "
        "the rank each bag came from in `comms` ([analysis.md](analysis.md#where-a-lookup-comes-from)).",
    ),
    "comms": (
        "`torch.distributed` call on a rank",
        "Every collective and point-to-point call, DDP's gradient buckets included (collectors/comm.py). "
        "`bytes_out` and `bytes_in` are the sizes of the call's send and receive buffers. `splits_out[j]` is "
        "the bytes of this rank's data the op delivers to group rank j, `splits_in[i]` the bytes of rank i's "
        "data this rank's result is made of, so what i sends j is what j receives from i: the op's logical "
        "exchange, not what its algorithm puts on the wire (empty for `all_reduce` and `barrier`). Two ranks, "
        "rank 0 sending 3 rows of 8 bytes to itself and 1 to rank 1 and receiving 2 from rank 1: `splits_out` "
        "[24, 8], `splits_in` [24, 16]. `t_end_ns` is -1 where the completion was never seen (gloo's "
        "`isend`/`irecv`). `tag` is the innermost `tracekit.label` around the call, else `ddp_bucket_<i>` "
        "for DDP's buckets, else the calling function's qualified name (`_sum_allreduce_hook`).",
    ),
    "steps": (
        "optimizer step on a rank",
        "A step runs from the end of the previous one to the optimizer step that ends it (or "
        "`tracekit.step()`). `loss` is the last one-element tensor a `backward()` started from during the "
        "step (null where none); `samples` is the rank's samples where the program names them "
        "(`tracekit.step`, `tracekit.step_schedule`, a TorchRec batch), else 0 (unknown).",
    ),
    "grads": (
        "optimized parameter, every `--grad-every` steps",
        "Statistics of each optimized parameter's gradient (`name` as in `named_parameters()`, e.g. "
        "`top.0.weight`), every `tracekit record --grad-every N`th step (100 by default; 0: never). A "
        "threshold stays in force, stale, until a sampled step at least the grads collector's refresh period "
        "later recomputes it (collectors/grads.py): DCT's L, without error feedback.",
    ),
    "dct_replay": (
        "(parameter, keep ratio, refresh period) on every step",
        "Written only by `tracekit record --dct-replay` (environment `TRACEKIT_DCT_REPLAY=1`), which costs "
        "the reference trainer's step about 15%; `analyze` derives `compression.dp` from it where it exists, "
        "from `grads` otherwise.",
    ),
    "gpu": (
        "NVML sample, where a rank uses a GPU",
        "Sampled every `tracekit record --gpu-interval` seconds (0.1 by default) from a thread of each rank "
        "that uses a GPU; absent where NVML is not available (the manifest's `gpu` says why).",
    ),
}
"""Per trace table: what one row is, and what the schema's comments leave out."""

SHARED_NOTES: dict[str, str] = {
    "step": "the step, from 0 on each rank",
    "table_name": "the logical table ([recording.md](recording.md#which-modules-are-one-table))",
    "row": "global row in the table",
}
"""Notes on the columns several tables share, wherever they appear."""

COLUMN_NOTES: dict[str, dict[str, str]] = {
    "accesses": {"count": "lookups of `row` in the step, exact (int64 when read)"},
    "comms": {
        "seq": "the call's order on the rank, from 0",
        "op": "the `torch.distributed` function, e.g. `all_to_all_single`",
        "group": "the process group's name",
        "group_size": "ranks in the group",
        "dtype": "the tensors' dtype, e.g. `torch.float32` (empty for `barrier`)",
        "bytes_out": "size of the send buffer",
        "bytes_in": "size of the receive buffer",
        "t_start_ns": "the call",
        "tag": "a `tracekit.label`, `ddp_bucket_<i>` or the caller's qualified name",
        "async": "called with `async_op=True`",
        "t_wait_ns": "an async call: when the rank first waited on its Work (`Work.wait()`, e.g. a TorchRec "
                     "awaitable's wait); null for a synchronous call and a Work waited elsewhere (DDP's buckets)",
    },
    "steps": {"t_start_ns": "the end of the previous step", "t_end_ns": "the end of the step",
              "samples": "the rank's samples, 0 where unknown", "loss": "the loss `backward()` ran from"},
    "grads": {"name": "the parameter, e.g. `top.0.weight`", "numel": "entries", "l2": "L2 norm of g",
              "absmax": "max |g|"},
    "dct_replay": {
        "name": "the parameter",
        "numel": "entries of the parameter",
        "replayed": "entries replayed: `numel`, or a fixed random subset",
        "keep_ratio": "the keep ratio X: " + ", ".join(f"{r:.1%}" for r in schema.KEEP_RATIOS.values()),
        "refresh_every": "the refresh period R, in steps",
        "position": "the order the rank's own gradient was taken in (-1: the all-reduced one)",
        "sent": "entries the trainer's hook would send",
        "sent_first_half": "of them, in the first half of the replayed entries",
        "refreshed": "the threshold was recomputed at this step",
    },
    "gpu": {"t_ns": "when the sample began", "device": "the GPU's NVML index (nvidia-smi's numbering)",
            "util_gpu": "% of NVML's last sample period in which a kernel ran",
            "util_mem": "% of that period in which device memory was read or written",
            "mem_used": "bytes of device memory in use, by every process", "power_mw": "board power draw",
            "sm_clock_mhz": "SM clock", "pcie_tx": "PCIe sent, over a 20 ms window", "pcie_rx": "PCIe received"},
}
"""Per trace table, notes on columns beside their schema comment (checked against the schema)."""


def markdown() -> str:
    """The trace-format page: every table of `tracekit.schema.TABLES` with its columns, types and notes."""
    _check_notes()
    source = _Source(inspect.getsource(schema))
    names = {id(value): name for name, value in vars(schema).items() if isinstance(value, pa.Schema)}
    lines = _preamble(source)
    for table, table_schema in schema.TABLES.items():
        lines += ["", *_table_section(table, table_schema, source, names[id(table_schema)])]
    return "\n".join(lines) + "\n"


def _check_notes() -> None:
    """ValueError where the prose here and tracekit/schema.py disagree on which tables and columns exist."""
    missing = [table for table in schema.TABLES if table not in TABLE_PROSE]
    if missing:
        raise ValueError(f"tracekit/app/trace_format.py has no TABLE_PROSE for {', '.join(missing)}: add one, then "
                         f"run `{COMMAND}`")
    stale = [f"{table}.{column}" for table, notes in COLUMN_NOTES.items() for column in notes
             if table not in schema.TABLES or column not in schema.TABLES[table].names]
    stale += [column for column in SHARED_NOTES if not any(column in t.names for t in schema.TABLES.values())]
    if stale:
        raise ValueError(f"tracekit/app/trace_format.py's COLUMN_NOTES name columns tracekit/schema.py does not have: "
                         f"{', '.join(stale)}")


def _preamble(source: _Source) -> list[str]:
    """The page down to its list of tables: the run directory, part files, reading, times and phase."""
    def entry(path: str, what: str) -> str:
        return f"  {path:<40} {what.replace('`', '')}"

    return [
        "# Trace format",
        "",
        f"<!-- Generated by `{COMMAND}` from tracekit/schema.py: edit those, not this page. -->",
        "",
        INTRO,
        "",
        f"Schema version **{schema.SCHEMA_VERSION}**: {source.docstrings['SCHEMA_VERSION']}",
        "",
        "## The run directory",
        "",
        "```",
        "runs/<name>/",
        entry(run_dir.MANIFEST, "run metadata, written at start and finalised at exit"),
        *[entry(f"{table}/rank=R/part-NNNNN.parquet", f"one row per {TABLE_PROSE[table][0]}")
          for table in schema.TABLES],
        entry("ranks/rank=R.json", "each rank's report at exit, merged into the manifest"),
        entry("analysis/", "written by tracekit analyze (and calibrate, planner, simulate)"),
        entry("policy.json, policy/*.parquet", "the policy file tracekit analyze derives"),
        entry(run_dir.REPORT, "tracekit report"),
        "```",
        "",
        LAYOUT_PROSE,
        "",
        f"The manifest's `status` is one of {_code_list(schema.STATUSES)}.",
        "",
        "## Part files",
        "",
        "Every part file is zstd-compressed Parquet with two keys in its key-value metadata:",
        "",
        f"- `{schema.VERSION_KEY.decode()}`: {source.docstrings['VERSION_KEY']}",
        f"- `{schema.TABLE_KEY.decode()}`: {source.docstrings['TABLE_KEY']}",
        "",
        "Readers accept any minor version of a major they know and refuse an unknown major version with a "
        "message naming both. Add columns freely; never change a column's meaning.",
        "",
        READING_PROSE,
        "",
        TIMES_PROSE,
        "",
        f"Phase: {_code_list(schema.PHASED)} carry `phase`, `train` or `eval`, decided where the lookup or "
        "call happens (see [recording.md](recording.md#training-and-evaluation)); every figure tracekit derives "
        "is from training rows unless it says otherwise.",
        "",
        "## Tables",
        "",
        "| table | one row per |",
        "|---|---|",
        *[f"| [{table}](#{table}) | {TABLE_PROSE[table][0]} |" for table in schema.TABLES],
    ]


def _table_section(table: str, table_schema: pa.Schema, source: _Source, name: str) -> list[str]:
    """One table's heading, prose and column list; `name` is its schema's name in tracekit/schema.py."""
    lines = [f"### {table}", "", TABLE_PROSE[table][1], ""]
    if name in source.comments_above:
        lines += [source.comments_above[name], ""]
    lines += ["| column | type | what |", "|---|---|---|"]
    comments = source.column_comments(name)
    notes = SHARED_NOTES | COLUMN_NOTES.get(table, {}) | _derived_notes(table)
    for field in table_schema:
        kind = f"`{_type(field.type)}`" + (", nullable" if field.nullable else "")
        what = "; ".join(text for text in (comments.get(field.name), notes.get(field.name)) if text)
        lines.append(f"| `{field.name}` | {kind} | {_cell(what)} |")
    return lines


def _derived_notes(table: str) -> dict[str, str]:
    """Notes for the columns a schema builds from a constant (grads' quantiles and keep ratios)."""
    if table != "grads":
        return {}
    notes = {column: f"the {q:g} quantile of |g|" for column, q in schema.GRAD_QUANTILES.items()}
    for suffix, ratio in schema.KEEP_RATIOS.items():
        notes[f"count_above_keep_{suffix}"] = f"elements of |g| above `thr_keep_{suffix}` (keep ratio {ratio:.1%})"
        notes[f"thr_keep_{suffix}"] = (f"DCT-DP's hard threshold for keep ratio {ratio:.1%}: the {1 - ratio:g} "
                                       "quantile of |g| at its last refresh")
    return notes


def _type(t: pa.DataType) -> str:
    if pa.types.is_dictionary(t):
        return f"{_type(t.value_type)} (dictionary-encoded)"
    if pa.types.is_list(t):
        return f"list<{_type(t.value_type)}>"
    if pa.types.is_floating(t):
        return f"float{t.bit_width}"
    return str(t)


def _code_list(items) -> str:
    quoted = [f"`{item}`" for item in items]
    return ", ".join(quoted[:-1]) + f" and {quoted[-1]}" if len(quoted) > 1 else quoted[0]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


class _Source:
    """What tracekit/schema.py says beside its code: attribute docstrings, comments above an assignment,
    and the comment at the end of each column's line."""

    def __init__(self, text: str) -> None:
        tree = ast.parse(text)
        trailing: dict[int, str] = {}
        full_line: dict[int, str] = {}
        for token in tokenize.generate_tokens(io.StringIO(text).readline):
            if token.type == tokenize.COMMENT:
                line, column = token.start
                comment = token.string.lstrip("#").strip()
                (full_line if not token.line[:column].strip() else trailing)[line] = comment
        self.docstrings: dict[str, str] = {}
        self.comments_above: dict[str, str] = {}
        self._assigns: dict[str, ast.Assign] = {}
        body = tree.body
        for node, after in zip(body, [*body[1:], None]):
            if not isinstance(node, ast.Assign) or not isinstance(node.targets[0], ast.Name):
                continue
            name = node.targets[0].id
            self._assigns[name] = node
            if isinstance(after, ast.Expr) and isinstance(getattr(after.value, "value", None), str):
                self.docstrings[name] = " ".join(after.value.value.split())
            block, line = [], node.lineno - 1
            while line in full_line:
                block.insert(0, full_line[line])
                line -= 1
            if block:
                self.comments_above[name] = " ".join(block)
        self._trailing = trailing

    def column_comments(self, name: str) -> dict[str, str]:
        """{column: the comment ending its line} for the schema assigned to `name`, following the
        module's shared fields (`_STEP`, `_PHASE`, ...) to where they are defined."""
        notes: dict[str, str] = {}
        for node in ast.walk(self._assigns[name].value):
            if isinstance(node, ast.Name) and node.id in self._assigns and node.id != name:
                notes |= self._call_comments(self._assigns[node.id].value)
        return notes | self._call_comments(self._assigns[name].value)

    def _call_comments(self, tree: ast.AST) -> dict[str, str]:
        notes = {}
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str) and node.end_lineno in self._trailing):
                notes[node.args[0].value] = self._trailing[node.end_lineno]
        return notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tracekit.app.trace_format", description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"Write {PAGE.relative_to(PAGE.parents[1])} instead of "
                                                             "printing the page.")
    args = parser.parse_args(argv)
    page = markdown()
    if args.write:
        write_text(PAGE, page)
        print(f"wrote {PAGE}", file=sys.stderr)
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
