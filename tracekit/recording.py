"""`tracekit record`: run a command with the collectors injected, and keep its run directory.

The command runs unchanged; `collectors/site` goes first on its PYTHONPATH, so every Python
process it starts imports our sitecustomize, which stays inert until torch is imported in a
process that trains (collectors/bootstrap.py). The manifest is written before the command starts
(`running`) and finalised when it ends (`completed`, `failed` with the exit code, or
`interrupted`), with what each rank reported. Ctrl-C reaches the command directly (it shares the
terminal's process group); SIGTERM to `record` is forwarded to it.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import uuid
from collections import Counter
from pathlib import Path

import collectors
from tracekit import __version__
from tracekit.errors import TracekitError
from tracekit.schema import SCHEMA_VERSION, STATUS_COMPLETED, STATUS_FAILED, STATUS_INTERRUPTED, STATUS_RUNNING
from tracekit.store import read_manifest, write_manifest

SITE_DIR = Path(collectors.__file__).resolve().parent / "site"
ENV_ALLOW = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
             "CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "GLOO_SOCKET_IFNAME")


class RecordError(TracekitError):
    """Raised when `record` cannot start: bad output directory or a command that does not exist."""


def default_run_dir(command: list[str], now: datetime.datetime) -> Path:
    script = next((Path(a).stem for a in command if a.endswith(".py")), Path(command[0]).name)
    return Path("runs") / f"{now:%Y%m%d-%H%M%S}-{script}"


def prepare_run_dir(run_dir: Path, *, force: bool) -> None:
    if run_dir.exists() and not run_dir.is_dir():
        raise RecordError(f"-o {run_dir}: exists and is not a directory")
    if run_dir.exists() and any(run_dir.iterdir()):
        if not force:
            raise RecordError(f"-o {run_dir}: directory is not empty (use --force to replace it)")
        shutil.rmtree(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / ".write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as err:
        raise RecordError(f"-o {run_dir}: cannot write there ({err.strerror})") from None


def check_command(command: list[str]) -> None:
    if not command:
        raise RecordError("no command given: tracekit record [OPTIONS] -- CMD ...")
    if shutil.which(command[0]) is None:
        raise RecordError(f"command not found: {command[0]}")


def record(command: list[str], run_dir: Path, *, lookup_every: int, grad_every: int, flush_interval_s: float,
           gpu_interval_s: float) -> int:
    """Run `command` traced into `run_dir`; returns its exit code (130 for Ctrl-C)."""
    started = datetime.datetime.now(datetime.timezone.utc)
    settings = {"lookup_every": lookup_every, "grad_every": grad_every, "flush_interval_s": flush_interval_s,
                "gpu_interval_s": gpu_interval_s}
    manifest = {
        "schema_version": SCHEMA_VERSION, "tracekit_version": __version__, "run_id": uuid.uuid4().hex,
        "command": command, "cwd": os.getcwd(), "started_at": started.isoformat(), "ended_at": None,
        "status": STATUS_RUNNING, "exit_code": None, "hosts": [socket.gethostname()],
        "devices": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        "torch_version": _version("torch"), "collector_settings": settings, "gpu": gpu_status(),
        "environment": {k: v for k, v in os.environ.items() if k in ENV_ALLOW or k.startswith("TRACEKIT_")},
    }
    write_manifest(run_dir, manifest)
    env = {**os.environ, "TRACEKIT_RUN_DIR": str(run_dir.resolve()), "TRACEKIT_LOOKUP_EVERY": str(lookup_every),
           "TRACEKIT_GRAD_EVERY": str(grad_every),
           "TRACEKIT_FLUSH_INTERVAL_S": str(flush_interval_s), "TRACEKIT_GPU_INTERVAL_S": str(gpu_interval_s),
           "PYTHONPATH": os.pathsep.join([str(SITE_DIR), *filter(None, [os.environ.get("PYTHONPATH")])])}
    child = subprocess.Popen(command, env=env)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signal.SIGTERM))
    interrupted = False
    while True:
        try:
            code = child.wait()
            break
        except KeyboardInterrupt:  # the child got the same Ctrl-C; wait for it to finish
            interrupted = True
    signal.signal(signal.SIGTERM, previous)
    finalise(run_dir, code, interrupted)
    return 130 if interrupted and code != 0 else (128 - code if code < 0 else code)


def finalise(run_dir: Path, code: int, interrupted: bool) -> dict:
    """Mark the run ended, with its status and what every rank reported."""
    manifest = read_manifest(run_dir)
    ranks = [read_rank_report(p) for p in sorted((run_dir / "ranks").glob("rank=*.json"))]
    status = STATUS_COMPLETED if code == 0 else STATUS_INTERRUPTED if interrupted or code in (130, -2) else STATUS_FAILED
    manifest.update(
        ended_at=datetime.datetime.now(datetime.timezone.utc).isoformat(), status=status, exit_code=code,
        ranks=[r["rank"] for r in ranks], world_size=len(ranks) or None,
        hosts=sorted({manifest["hosts"][0], *(r["host"] for r in ranks)}),
        backend=next((r["backend"] for r in ranks if r["backend"]), None),
        steps={str(r["rank"]): r["steps"] for r in ranks},
        clock_anchors={str(r["rank"]): r["clock_anchor"] for r in ranks},
        written_rows=dict(sum((Counter(r["written_rows"]) for r in ranks), Counter())),
        dropped_rows={str(r["rank"]): r["dropped_rows"] for r in ranks if r["dropped_rows"]},
        writer_errors=sum(r["errors"] for r in ranks), tables=merge_tables(ranks),
        gpu=gpu_outcome(manifest["gpu"], ranks, manifest["collector_settings"]["gpu_interval_s"]),
    )
    write_manifest(run_dir, manifest)
    return manifest


def summary(run_dir: Path, manifest: dict) -> dict:
    """What `record` says at the end: status, ranks, steps, rows written and dropped, trace size."""
    started = datetime.datetime.fromisoformat(manifest["started_at"])
    ended = datetime.datetime.fromisoformat(manifest["ended_at"])
    return {"run_dir": str(run_dir), "status": manifest["status"], "exit_code": manifest["exit_code"],
            "elapsed_s": round((ended - started).total_seconds(), 3), "ranks": manifest["ranks"],
            "steps": manifest["steps"], "rows": manifest["written_rows"], "dropped_rows": manifest["dropped_rows"],
            "bytes": sum(p.stat().st_size for p in run_dir.rglob("*.parquet")),
            "gpu": manifest["gpu"]["reason"] or "sampled"}


def read_rank_report(path: Path) -> dict:
    return json.loads(path.read_text())


def merge_tables(ranks: list[dict]) -> list[dict]:
    """The manifest's `tables`: one entry per logical table, from what each rank's embedding collector
    saw, with `shards` saying which rank holds which rows (a replicated table lists every copy)."""
    seen: dict[str, list[dict]] = {}
    for report in ranks:
        for entry in report["tables"]:
            seen.setdefault(entry["table"], []).append({**entry, "rank": report["rank"]})
    tables = []
    for name, entries in sorted(seen.items()):
        entries.sort(key=lambda e: (e["first_row"], e["rank"]))
        first = entries[0]
        tables.append({"name": name, "num_rows": max(e["table_rows"] for e in entries), "dim": first["dim"],
                       "dtype": first["dtype"], "kind": first["kind"], "padding_idx": first["padding_idx"],
                       "shards": [{k: e[k] for k in ("rank", "first_row", "num_rows")} for e in entries]})
    return tables


def gpu_status() -> dict:
    """Whether NVML sees a GPU here; where it does not, why there will be no `gpu` samples.
    `gpu_outcome` completes it from what the ranks sampled."""
    from collectors import gpu

    nvml, reason = gpu.open_nvml()
    if nvml is None:
        return {"devices": [], "samples": False, "reason": reason}
    try:
        names = gpu.device_names(nvml)
    except nvml.NVMLError as err:
        return {"devices": [], "samples": False, "reason": f"NVML unavailable: {err}"}
    finally:
        nvml.nvmlShutdown()
    return {"devices": names, "samples": False, "reason": "no traced process used a GPU" if names else gpu.NO_GPU}


def gpu_outcome(gpu: dict, ranks: list[dict], interval_s: float) -> dict:
    """The manifest's `gpu` once the ranks have reported: the NVML index of the GPU each rank sampled
    (`sampled_devices`), or why none was sampled."""
    sampled = {str(r["rank"]): r["gpu"]["device"] for r in ranks if r["written_rows"].get("gpu")}
    if sampled:
        return {**gpu, "samples": True, "interval_s": interval_s, "sampled_devices": sampled, "reason": None}
    why = [f"rank {r['rank']}: {r['gpu']['reason']}" for r in ranks if r["gpu"]["reason"]]
    return {**gpu, "reason": "; ".join(why)} if gpu["devices"] and why else gpu


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
