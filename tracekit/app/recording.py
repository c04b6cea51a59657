"""`tracekit record`: run a command with the collectors injected, and keep its run directory.

The command runs unchanged; `collectors/site` goes first on its PYTHONPATH, so every Python
process it starts imports our sitecustomize, which stays inert until torch is imported in a
process that trains (collectors/bootstrap.py). The manifest is written before the command starts
(`running`) and finalised when it ends (`completed`, `failed` with the exit code, or
`interrupted`), with what each rank reported, whether anything was traced at all (and if not, why),
and `finalise_errors` naming whatever part could not be written or that ranks disagreed on (the
policy file applied). Ctrl-C reaches the command directly (it shares the terminal's process group);
SIGTERM to `record` is forwarded to it.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import hashlib
import importlib.metadata
import json
import os
import platform
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import uuid
from collections import Counter
from pathlib import Path
from typing import IO, Callable

import collectors
from tracekit import __version__, manifest
from tracekit.errors import TracekitError
from tracekit.files import Reserve
from tracekit.app.background import in_background
from tracekit.app.hang import HangWatch
from tracekit.app.rank_reports import (gpu_outcome, merge_metrics, merge_policy, merge_tables, plan_applied,
                                       read_rank_report)
from tracekit.schema import SCHEMA_VERSION, STATUS_COMPLETED, STATUS_FAILED, STATUS_INTERRUPTED, STATUS_RUNNING
from tracekit.losses import lost_rows
from tracekit.manifest import Manifest, Table
from tracekit.torchrec_plan import ENV as ENV_PLAN
from tracekit.torchrec_plan import read_plan
from tracekit.window import Window
from tracekit.run_dir import RunDir

SITE_DIR = Path(collectors.__file__).resolve().parent / "site"
MANIFEST_RESERVE, MANIFEST_RESERVE_BYTES = ".reserve-manifest", 256 * 1024
TO_JSON = {"tables": lambda tables: [t.to_json() for t in tables]}
"""The parts of the manifest `finalise` computes as types, as their JSON."""
HANG_POLL_S = 1.0  # how often `record` looks at the ranks' heartbeats
"""Disk `record` holds back in the run directory for the final manifest, should the trace fill the disk."""
ENV_ALLOW = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS",
             "CUDA_VISIBLE_DEVICES", "NCCL_DEBUG", "GLOO_SOCKET_IFNAME")


class RecordError(TracekitError):
    """Raised when `record` cannot start: bad output directory or a command that does not exist."""


def default_run_dir(command: list[str], now: datetime.datetime | None = None) -> Path:
    script = next((Path(a).stem for a in command if a.endswith(".py")), Path(command[0]).name)
    return Path("runs") / f"{now or datetime.datetime.now():%Y%m%d-%H%M%S}-{script}"


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


def prepare(command: list[str], run_dir: Path, *, force: bool) -> None:
    """Check `command` can start and `run_dir` can take the run; RecordError saying why not."""
    check_command(command)
    prepare_run_dir(run_dir, force=force)


def check_command(command: list[str]) -> None:
    if not command:
        raise RecordError("no command given: tracekit record [OPTIONS] -- CMD ...")
    if shutil.which(command[0]) is not None:
        return
    path = Path(command[0])
    if path.is_file() and os.access(path, os.X_OK):  # a bare name is looked up on PATH only
        fixed = shlex.join([f"./{command[0]}", *command[1:]])
        raise RecordError(f"{command[0]} is an executable file here but not a command on PATH: "
                          f"name it by its path, e.g. tracekit record -- {fixed}")
    if path.is_file():
        raise RecordError(f"{command[0]} is a file but not an executable command: run it with its interpreter, "
                          f"e.g. tracekit record -- {_interpreter(path)} {shlex.join(command)}")
    raise RecordError(f"command not found: {command[0]}")


def command_start(args: list[str], takes_value: dict[str, bool]) -> int | None:
    """Where the traced command begins in record's `args` without a `--` (record's own options,
    `takes_value[option]` saying whether each takes a value, skipped), or None where an option
    record does not know comes first."""
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("-") or arg == "-":
            return i
        name = arg.split("=", 1)[0]
        if name in takes_value:
            i += 2 if takes_value[name] and "=" not in arg else 1
        elif takes_value.get(arg[:2]):  # -oDIR
            i += 1
        else:
            return None
    return None


def _interpreter(script: Path) -> str:
    return {".py": "python", ".sh": "bash"}.get(script.suffix, "INTERPRETER")


def record(command: list[str], run_dir: Path, *, lookup_every: int = 10, grad_every: int = 100,
           flush_interval_s: float = 1.0, gpu_interval_s: float = 0.1, dct_replay: bool = False,
           manifest_extra: dict | None = None, run: Callable[[dict[str, str]], tuple[int, bool]] | None = None,
           output: IO | None = None, hang_after: float | None = None, max_size: int | None = None,
           window: Window = Window(), plan: Path | None = None) -> int:
    """Run `command` traced into `run_dir`; returns what `record` exits with: the command's exit code,
    130 for Ctrl-C, 128 + N for a command killed by signal N, 126 for a command that cannot start.
    The defaults are `tracekit record`'s.

    `manifest_extra` adds fields to the manifest (a cluster's `topology`). `run`, where given, runs
    the command itself in the tracing environment it is passed and returns (exit code, interrupted):
    `tracekit cluster` runs it on every node. `output`: a file the command's stdout and stderr go to
    (default: this process's). While the command runs, a hang is diagnosed from the ranks' heartbeats
    (tracekit/app/hang.py; `hang_after` seconds, None: from the run's step times). `max_size`: bytes of
    Parquet the ranks write at most, each its 1/WORLD_SIZE share (the manifest's `truncated_at` then
    says where each stopped). `window`: the steps whose accesses, lookups and comms are recorded
    (tracekit/window.py). `plan`: a TorchRec plan file (tracekit/torchrec_plan.py, read and checked
    by the caller) the job's DistributedModelParallel is built with, noted in the manifest's
    `torchrec_plan` with its hash."""
    started = datetime.datetime.now(datetime.timezone.utc)
    settings = {"lookup_every": lookup_every, "grad_every": grad_every, "flush_interval_s": flush_interval_s,
                "gpu_interval_s": gpu_interval_s, "dct_replay": dct_replay, "max_size": max_size,
                "window": window.to_json(), "torchrec_plan": None if plan is None else str(plan.resolve())}
    started_manifest = Manifest.of(
        schema_version=SCHEMA_VERSION, tracekit_version=__version__, run_id=uuid.uuid4().hex,
        command=command, cwd=os.getcwd(), started_at=started.isoformat(), ended_at=None,
        status=STATUS_RUNNING, exit_code=None, hosts=[socket.gethostname()],
        devices={"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count()},
        torch_version=_version("torch"), collector_settings=settings, gpu=gpu_status(),
        environment={k: v for k, v in os.environ.items() if k in ENV_ALLOW or k.startswith("TRACEKIT_")},
        **({} if plan is None else {"torchrec_plan": {"path": str(plan.resolve()), "plan": read_plan(plan),
                                                      "sha256": hashlib.sha256(plan.read_bytes()).hexdigest()}}),
    )
    manifest.write(run_dir, started_manifest.updated(**(manifest_extra or {})))
    Reserve(run_dir / MANIFEST_RESERVE, MANIFEST_RESERVE_BYTES).hold()  # for the final manifest on a full disk
    env = {**os.environ, "TRACEKIT_RUN_DIR": str(run_dir.resolve()), "TRACEKIT_LOOKUP_EVERY": str(lookup_every),
           "TRACEKIT_GRAD_EVERY": str(grad_every), "TRACEKIT_DCT_REPLAY": "1" if dct_replay else "0",
           "TRACEKIT_FLUSH_INTERVAL_S": str(flush_interval_s), "TRACEKIT_GPU_INTERVAL_S": str(gpu_interval_s),
           "PYTHONPATH": os.pathsep.join([str(SITE_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]),
           **({"TRACEKIT_MAX_SIZE": str(max_size)} if max_size else {}),
           **({"TRACEKIT_WINDOW": json.dumps(window.to_json())} if not window.everything else {}),
           **({ENV_PLAN: str(plan.resolve())} if plan is not None else {})}
    if run is not None:
        with _watching_for_hangs(HangWatch(run_dir, hang_after, out=output)):
            code, interrupted = run(env)
        return finalise(run_dir, code, interrupted).record_exit_code
    try:
        child = subprocess.Popen(command, env=env, stdout=output, stderr=None if output is None else subprocess.STDOUT)
    except OSError as err:  # found and executable, yet the system cannot run it
        hint = (f"; a script needs a #! line, or its interpreter: tracekit record -- {_interpreter(Path(command[0]))} "
                f"{shlex.join(command)}" if err.errno == errno.ENOEXEC else "")
        reason = f"the command could not start ({err.strerror}: {command[0]}){hint}"
        return finalise(run_dir, 126, False, not_started=reason).record_exit_code
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: child.send_signal(signal.SIGTERM))
    interrupted = False
    with _watching_for_hangs(HangWatch(run_dir, hang_after, out=output)):
        while True:
            try:
                code = child.wait()
                break
            except KeyboardInterrupt:  # the child got the same Ctrl-C; wait for it to finish
                interrupted = True
    signal.signal(signal.SIGTERM, previous)
    return finalise(run_dir, code, interrupted).record_exit_code


def _watching_for_hangs(hangs: HangWatch) -> contextlib.AbstractContextManager[None]:
    """Check the ranks' heartbeats every HANG_POLL_S on a thread while the command runs, on this
    machine or on an emulated cluster's nodes."""
    def look(stop: threading.Event) -> None:
        while not stop.wait(HANG_POLL_S):
            try:
                hangs.check()
            except Exception as err:  # the diagnosis must never cost the run or its record
                print(f"tracekit: hang check failed ({type(err).__name__}: {err})", file=sys.stderr)

    return in_background(look, "tracekit-hang-watch")


def finalise(run_dir: Path, code: int, interrupted: bool, *, not_started: str | None = None) -> Manifest:
    """Mark the run ended, with its status and what every rank reported.

    The status, exit codes and end time are always written. Every other part is computed on its
    own: one that raises, a rank report that is unreadable, and a rank that wrote data but left no
    report (killed before its exit handlers ran) are named in `finalise_errors`, and the rest is
    written. `not_started` says why the command could not start, if it could not.
    """
    errors: list[str] = []
    started = _part(errors, "manifest.json", lambda: manifest.read(run_dir), to_json=Manifest.to_json)
    started = Manifest.of() if started is _FAILED else started
    status = STATUS_COMPLETED if code == 0 else STATUS_INTERRUPTED if interrupted or code in (130, -2) else STATUS_FAILED
    ended = started.updated(ended_at=datetime.datetime.now(datetime.timezone.utc).isoformat(), status=status,
                            exit_code=code,
                            record_exit_code=130 if status == STATUS_INTERRUPTED else 128 - code if code < 0 else code)

    reports: dict[int, dict] = {}
    unreadable = set()
    for path in RunDir.at(run_dir).ranks.glob("rank=*.json"):
        rank = _rank_of(path.stem)
        if rank is None:
            errors.append(f"ranks/{path.name}: not a rank report's name (rank=N.json); left out")
            continue
        try:
            reports[rank] = read_rank_report(path)
        except (OSError, ValueError) as err:
            unreadable.add(rank)
            errors.append(f"ranks/{path.name}: unreadable ({err}): rank {rank}'s steps, tables and rows are missing")
    with_data = {_rank_of(d.name) for d in run_dir.glob("*/rank=*") if d.is_dir()} - {None}
    for rank in sorted(with_data - reports.keys() - unreadable):
        errors.append(f"rank {rank} wrote trace data but no report (ranks/rank={rank}.json): it ended before its exit "
                      f"handlers ran (killed?), so its steps, tables and rows are missing")
    for rank, report in sorted(reports.items()):
        errors.extend(f"rank {rank}'s report: {e}" for e in report.get("report_errors", []))
    ranks = sorted(reports.keys() | unreadable | with_data)

    def each(key: str) -> dict:
        return {str(rank): report[key] for rank, report in sorted(reports.items()) if key in report}

    def having(*keys: str) -> list[dict]:
        return [{**report, "rank": rank} for rank, report in sorted(reports.items()) if set(keys) <= report.keys()]

    parts = {
        "ranks": lambda: ranks, "world_size": lambda: len(ranks) or None,
        "hosts": lambda: sorted({started.hosts[0], *each("host").values()}),
        "backend": lambda: next((b for b in each("backend").values() if b), None),
        "steps": lambda: each("steps"), "clock_anchors": lambda: each("clock_anchor"),
        "written_rows": lambda: dict(sum((Counter(rows) for rows in each("written_rows").values()), Counter())),
        "dropped_rows": lambda: {rank: rows for rank, rows in each("dropped_rows").items() if rows},
        "lost_rows": lambda: lost_rows(Manifest(dropped_rows=each("dropped_rows"))),
        "lost_lookups": lambda: sum(each("lost_lookups").values()),
        "truncated_at": lambda: {rank: step - 1 for rank, step in each("first_lost_step").items() if step is not None},
        "writer_first_errors": lambda: {rank: error for rank, error in each("first_error").items() if error},
        "writer_errors": lambda: sum(each("errors").values()),
        "writer_cpu_s": lambda: each("writer_cpu_s"),
        "writer_scheduling": lambda: each("writer_scheduling"),
        "tables": lambda: tuple(Table.from_json(t) for t in merge_tables(having("tables"))),
        "gpu": lambda: gpu_outcome(started.gpu, having("gpu", "written_rows"),
                                   started.collector_settings["gpu_interval_s"]),
        "policy": lambda: merge_policy(having("policy"), errors),
        "metrics": lambda: merge_metrics(having("metrics")),
        "torchrec_plan": lambda: plan_applied(started.torchrec_plan, each("torchrec_plan_applied"), errors),
    }
    finalised = {}
    for name, compute in parts.items():
        value = _part(errors, name, compute, to_json=TO_JSON.get(name, lambda value: value))
        if value is not _FAILED:
            finalised[name] = value
        elif name != "gpu":  # gpu keeps what was known at the start; the others are unknown
            finalised[name] = None
    ended = ended.updated(**finalised, traced=bool(ranks),
                          untraced_reason=None if ranks else not_started or _why_untraced(code), finalise_errors=errors)
    ranks_dir = RunDir.at(run_dir).ranks
    # what only a running rank needs, a killed rank's too: its reserve, its heartbeat, a stacks file never written
    left = [*ranks_dir.glob(".reserve-rank=*"), *ranks_dir.glob("heartbeat-rank=*.json"), *ranks_dir.glob(".heartbeat-*"),
            *(p for p in ranks_dir.glob("stacks-rank=*.txt") if p.stat().st_size == 0)]
    for held in [run_dir / MANIFEST_RESERVE, *left]:
        Reserve(held, 0).release()
    try:
        manifest.write(run_dir, ended)
    except OSError as err:  # even the reserve did not hold: say so, and keep the command's exit code
        print(f"tracekit: could not write {RunDir.at(run_dir).manifest} ({err.strerror or err}); it still says "
              f"`{STATUS_RUNNING}`", file=sys.stderr)
    return ended


_FAILED = object()


def _part(errors: list[str], name: str, compute, *, to_json=lambda value: value):
    """compute(), or _FAILED with the error appended to `errors` where it raises or gives what JSON
    cannot encode (`to_json(value)`, for a value that is not JSON itself)."""
    try:
        value = compute()
        json.dumps(to_json(value))
        return value
    except Exception as err:
        errors.append(f"{name}: {type(err).__name__}: {err}")
        return _FAILED


def _rank_of(name: str) -> int | None:
    """3 for `rank=3` (a report's stem or a partition's directory name)."""
    try:
        return int(name.removeprefix("rank="))
    except ValueError:
        return None


def _why_untraced(code: int) -> str:
    why = ("no process of the command imported torch with tracekit loaded; likely causes: the command is not "
           "Python or never imports torch; its Python ignored record's PYTHONPATH (-E, -I or -S, or a cleaned "
           "environment); tracekit is not installed in that Python (another virtualenv; it then prints "
           "`Error in sitecustomize`)")
    return why + (f"; or it ended (exit code {code}) before any process wrote anything" if code else "")


def summary(run_dir: Path, m: Manifest) -> dict:
    """What `record` says at the end: status, the command's and record's exit codes, whether anything
    was traced (and why not), ranks, steps per rank, rows written and dropped, trace size, and any
    part of the manifest that could not be written."""
    try:
        elapsed = (datetime.datetime.fromisoformat(m.ended_at)
                   - datetime.datetime.fromisoformat(m.started_at)).total_seconds()
    except (TypeError, ValueError):
        elapsed = None
    gpu = m.gpu or {}
    return {"run_dir": str(run_dir), "status": m.status, "exit_code": m.exit_code,
            "record_exit_code": m.record_exit_code,
            "elapsed_s": None if elapsed is None else round(elapsed, 3),
            "traced": m.traced, "untraced_reason": m.untraced_reason,
            "ranks": m.ranks or [], "steps": m.steps or {},
            "rows": m.written_rows or {}, "dropped_rows": m.dropped_rows or {},
            "lost_rows": lost_rows(m), "lost_lookups": m.lost_lookups or 0,
            "bytes": sum(p.stat().st_size for p in run_dir.rglob("*.parquet")),
            "gpu": gpu.get("reason") or ("sampled" if gpu.get("samples") else "unknown"),
            "writer_cpu_s": m.writer_cpu_s or {},
            "writer_scheduling": m.writer_scheduling or {},
            "truncated_at": m.truncated_at or {},
            "writer_first_errors": m.writer_first_errors or {},
            "finalise_errors": m.finalise_errors or []}


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


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
