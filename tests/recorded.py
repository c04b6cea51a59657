"""What the `tracekit record` tests share: the tiny trainer configuration, recording a command
through the CLI, and the accesses a run of it must show. Imports no polars or duckdb, so the GPU
tests (whose machines have neither) can use it."""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

from click.testing import CliRunner

from tracekit.app.cli import cli
from tracekit.dlrm.data import open_dataset

REPO = Path(__file__).resolve().parents[1]
TINY = ["--tables", "4", "--rows", "500", "--dim", "8", "--bottom-mlp", "16,8", "--top-mlp", "16,1",
        "--batch-size", "32", "--samples", "4096", "--pooling", "3", "--eval-fraction", "0", "--steps", "4"]


def record(tmp_path: Path, *command: str, options: tuple[str, ...] = ()) -> tuple[int, Path]:
    run_dir = tmp_path / "run"
    r = CliRunner().invoke(cli, ["record", "-o", str(run_dir), "--flush-interval", "0.2", *options, "--", *command])
    return r.exit_code, run_dir


def expected_accesses(world_size: int, steps: int, sequence_tables: int = 0) -> Counter:
    """(step, table, row) -> count, from the very samples the trainer consumes."""
    dataset = open_dataset("synthetic", tables=4, rows=500, num_dense=13, pooling=3, samples=4096, seed=0,
                           zipf=None, drift=0.0, preset=None, scale=1.0)
    counts: Counter = Counter()
    batch_global = 32 * world_size
    for step in range(steps):
        b = dataset.batch(step * batch_global, (step + 1) * batch_global)
        per_table = b.lengths.sum(dim=1).tolist()
        start = 0
        for t, n in enumerate(per_table):
            for row in b.values[start:start + n].tolist():
                counts[(step, f"t{t}", row)] += 1
            start += n
    return counts


def sample_accesses(start: int, stop: int, samples: int = 4096) -> Counter:
    """(table, row) -> count of global samples [start, stop) of the TINY dataset of `samples` samples."""
    dataset = open_dataset("synthetic", tables=4, rows=500, num_dense=13, pooling=3, samples=samples, seed=0,
                           zipf=None, drift=0.0, preset=None, scale=1.0)
    b = dataset.batch(start, stop)
    counts: Counter = Counter()
    offset = 0
    for t, n in enumerate(b.lengths.sum(dim=1).tolist()):
        counts.update((f"t{t}", row) for row in b.values[offset:offset + n].tolist())
        offset += n
    return counts


def record_script(tmp_path: Path, name: str, text: str, ranks: int = 2) -> tuple[int, Path]:
    """Write `text` as `tmp_path/name` and record it under torchrun with `ranks` gloo ranks."""
    script = tmp_path / name
    script.write_text(text)
    return record(tmp_path, sys.executable, "-m", "torch.distributed.run", "--standalone",
                  "--nproc-per-node", str(ranks), str(script))


def gloo_script(body: str, imports: str = "torch, torch.distributed as dist") -> str:
    """A script for torchrun's gloo ranks: `imports` and DistributedDataParallel, the process group
    started and `rank` set, then `body` (top-level code), then a barrier and the group's end."""
    return (f"\nimport {imports}\nfrom torch.nn.parallel import DistributedDataParallel\n"
            'dist.init_process_group("gloo")\nrank = dist.get_rank()\n'
            f"{body}dist.barrier()\ndist.destroy_process_group()\n")


def record_gloo(tmp_path: Path, name: str, body: str, imports: str = "torch, torch.distributed as dist") -> Path:
    """Record gloo_script(body, imports) as `tmp_path/name` under torchrun with 2 ranks; the run's
    directory, once the script exited 0."""
    code, run_dir = record_script(tmp_path, name, gloo_script(body, imports))
    assert code == 0
    return run_dir


def one_table_script(imports: str, steps: int, each_step: str) -> str:
    """A script training one 100-row table for `steps` steps, rows step % 100 and 7 a step, running
    `each_step` (code indented in the loop) after each optimizer step; `imports` its import lines."""
    return (f'\n{imports}\nmodel = torch.nn.EmbeddingBag(100, 4, mode="sum")\n'
            "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            f"for step in range({steps}):\n"
            "    model(torch.tensor([step % 100, 7]), torch.tensor([0])).sum().backward()\n"
            f"    opt.step()\n{each_step}")
