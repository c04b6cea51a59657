"""Starts the collectors inside a process that `tracekit record` launched, lazily.

`arm()` (called from collectors/site/sitecustomize.py) watches for the first `import torch`.
Only then, and only in a process that trains (not the torchrun launcher), does `activate()` open
this rank's RunWriter and install the step, embedding (and its TorchRec/FBGEMM source, armed for
when those are imported), comm, grads and gpu collectors. At exit it closes the writer and leaves
`ranks/rank=R.json` for the manifest: what the rank wrote, dropped and failed, the tables it looked
up, the GPU it sampled (or why none), its backend, host and clock anchor, the policy file and
metrics it declared (collectors/declared.py), the writer thread's CPU time (`writer_cpu_s`) and
scheduling (`writer_scheduling`: its policy, and how often a watchdog lifted it), and
`report_errors` naming any part of the report that could not be written. Settings come from
TRACEKIT_* variables, read here once into `Settings`. The optional API (`tracekit.step()` and the
rest) reaches the active collectors through the functions below; before activation, and in
processes never traced, its calls do nothing.
"""

from __future__ import annotations

import atexit
import json
import numbers
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from collectors.imports import ImportWatcher
from tracekit.run_dir import RunDir

RANK_REPORT_RESERVE = 128 * 1024
"""Bytes of disk a rank holds back from its start for its report (ranks/rank=R.json, a few kB)."""


@dataclass(frozen=True)
class Settings:
    run_dir: Path
    rank: int
    lookup_every: int
    grad_every: int
    dct_replay: bool  # TRACEKIT_DCT_REPLAY, default 0: DCT-DP replayed every step (collectors/dct_replay.py)
    flush_interval_s: float
    gpu_interval_s: float
    local_rank: int  # with cuda_visible_devices, which GPU the gpu collector samples
    cuda_visible_devices: str | None
    writer_nice: int  # TRACEKIT_WRITER_NICE, default 10: the writer thread's niceness above the rank's (store.WRITER_NICE)
    writer_idle: bool  # TRACEKIT_WRITER_IDLE, default 1: the writer under SCHED_IDLE where it can be lifted back
    max_bytes: int | None  # TRACEKIT_MAX_SIZE (record --max-size) over WORLD_SIZE: this rank's share
    window: dict | None  # TRACEKIT_WINDOW (record --steps, --every): tracekit/window.py's fields; None: every step
    max_pending_ids: int | None  # TRACEKIT_MAX_PENDING_IDS: ids held for the writer before shedding; None: embedding's
    torchrec_plan: str | None  # TRACEKIT_TORCHREC_PLAN (record --plan): the plan injected into TorchRec's DMP

    @staticmethod
    def from_env(env: dict) -> "Settings":
        return Settings(run_dir=Path(env["TRACEKIT_RUN_DIR"]), rank=int(env.get("RANK", 0)),
                        lookup_every=int(env.get("TRACEKIT_LOOKUP_EVERY", 10)),
                        grad_every=int(env.get("TRACEKIT_GRAD_EVERY", 100)),
                        dct_replay=env.get("TRACEKIT_DCT_REPLAY", "0") == "1",
                        flush_interval_s=float(env.get("TRACEKIT_FLUSH_INTERVAL_S", 1.0)),
                        gpu_interval_s=float(env.get("TRACEKIT_GPU_INTERVAL_S", 0.1)),
                        local_rank=int(env.get("LOCAL_RANK", 0)), cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES"),
                        writer_nice=int(env.get("TRACEKIT_WRITER_NICE", 10)),
                        writer_idle=env.get("TRACEKIT_WRITER_IDLE", "1") != "0",
                        max_bytes=int(env["TRACEKIT_MAX_SIZE"]) // max(int(env.get("WORLD_SIZE", 1)), 1)
                        if env.get("TRACEKIT_MAX_SIZE") else None,
                        window=json.loads(env["TRACEKIT_WINDOW"]) if env.get("TRACEKIT_WINDOW") else None,
                        max_pending_ids=int(env["TRACEKIT_MAX_PENDING_IDS"]) if env.get("TRACEKIT_MAX_PENDING_IDS")
                        else None, torchrec_plan=env.get("TRACEKIT_TORCHREC_PLAN") or None)


def is_launcher(orig_argv: list[str]) -> bool:
    """torchrun (or python -m torch.distributed.run) only starts workers: nothing to trace.

    Takes sys.orig_argv: while site runs, and while -m imports the module's packages (torch, so
    activation too), sys.argv[0] is just "-m".
    """
    for i, arg in enumerate(orig_argv[1:], start=1):
        if arg == "-m":
            return orig_argv[i + 1:i + 2] in (["torch.distributed.run"], ["torch.distributed.launch"])
        if not arg.startswith("-"):  # the script
            return os.path.basename(arg) == "torchrun" or arg.endswith(os.path.join("torch", "distributed", "run.py"))
    return False


def arm() -> None:
    if is_launcher(sys.orig_argv):
        return
    if "torch" in sys.modules:
        activate(Settings.from_env(os.environ))
    elif not any(isinstance(f, ImportWatcher) and "torch" in f.pending for f in sys.meta_path):
        sys.meta_path.insert(0, ImportWatcher(("torch",), lambda name: activate(Settings.from_env(os.environ))))


_clock = None  # this process's step clock once activated: the process is traced once
_declared = None  # and what it declared for the manifest (collectors/declared.py)


def advance_step(samples: int | None, loss: float | None) -> None:
    """`tracekit.step()`: end the current step (only once the collectors are active)."""
    if _clock is not None:
        _clock.advance(samples=samples, loss=loss)


def name_step(kind: str | None, samples: int | None) -> None:
    """`tracekit.step_schedule()`: name the kind and the samples of the step now running."""
    if _clock is not None:
        if kind is not None:
            _clock.schedule = kind
        if samples is not None:
            _clock.samples = samples


def policy_applied(path: str | os.PathLike, applied=None, skipped=None) -> None:
    """`tracekit.policy_applied()`: note the policy file the process applies (and its sections)."""
    if _declared is not None:
        _declared.policy_applied(path, applied, skipped)


def add_metrics(values: dict) -> None:
    """`tracekit.metrics()`: keep the run's final figures."""
    if _declared is not None:
        _declared.add_metrics(values)


def write_rank_report(path: Path, parts: dict, failures: list[str]) -> None:
    """Write `ranks/rank=R.json` from `parts` (name -> function giving its value), atomically.

    Numpy numbers become Python numbers and other objects JSON cannot encode become their str(), so
    a user's `num_embeddings = np.int64(...)` does not cost the report. A part that still fails to
    compute or encode is left out and named, with `failures`, in the report's `report_errors`.
    """
    report, errors = {}, list(failures)
    for name, compute in parts.items():
        try:
            value = compute()
            json.dumps(value, default=_json_default)
        except Exception as err:
            errors.append(f"{name}: {type(err).__name__}: {err}")
        else:
            report[name] = value
    report["report_errors"] = errors
    from tracekit.files import write_text  # it makes the folder

    write_text(path, json.dumps(report, sort_keys=True, indent=2, default=_json_default))


def _json_default(obj: object) -> object:
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    if getattr(obj, "shape", None) == () and callable(getattr(obj, "item", None)):  # numpy bool, 0-d arrays
        return obj.item()
    return str(obj)


def activate(settings: Settings) -> None:
    """Install the collectors in this process, once."""
    from collectors import (comm, declared, embedding, gpu, grads, heartbeat, phase, steps, torchrec_plan,
                            torchrec_tables)
    from collectors.dct_replay import REFRESH_LADDER
    from tracekit.files import Reserve
    from tracekit.store import RunWriter
    from tracekit.window import Window

    if getattr(activate, "done", False):
        return
    activate.done = True
    global _clock, _declared
    writer = RunWriter(settings.run_dir, settings.rank, flush_interval_s=settings.flush_interval_s,
                       nice=settings.writer_nice, idle=settings.writer_idle, max_bytes=settings.max_bytes)
    # room for the rank's report, should the trace fill the disk
    ranks = RunDir.at(settings.run_dir).ranks
    reserve = Reserve(ranks / f".reserve-rank={settings.rank}", RANK_REPORT_RESERVE)
    ranks.mkdir(parents=True, exist_ok=True)
    reserve.hold()
    anchor = {"monotonic_ns": time.monotonic_ns(), "wall_ns": time.time_ns()}  # read together: aligns ranks' times
    clock = _clock = steps.StepClock()
    facts = _declared = declared.Declared()
    window = Window.of_settings({"window": settings.window})
    tables = embedding.install(writer, clock, lookup_every=settings.lookup_every, window=window,
                               max_pending_ids=settings.max_pending_ids or embedding.MAX_PENDING_IDS)
    sampler = gpu.install(writer, interval_s=settings.gpu_interval_s, ordinal=settings.local_rank,
                          visible_devices=settings.cuda_visible_devices)
    comms = comm.install(writer, clock, window=window)
    beat = heartbeat.Heartbeat(settings.run_dir, settings.rank, clock, comms)  # for tracekit/app/hang.py
    handles = [phase.install(), steps.install(writer, clock), tables, torchrec_tables.install(tables), comms,
               grads.install(writer, clock, grad_every=settings.grad_every,
                             refresh_ladder=REFRESH_LADDER if settings.dct_replay else ()), sampler]
    if settings.torchrec_plan:
        torchrec_plan.install(settings.torchrec_plan)

    def finish() -> None:
        failures = []
        closers = [("heartbeat", beat.stop), *((type(h).__name__, h.uninstall) for h in reversed(handles)),
                   ("writer", writer.close)]
        for name, close in closers:
            try:
                close()
            except Exception as err:
                failures.append(f"closing {name}: {type(err).__name__}: {err}")
        parts = {"rank": lambda: settings.rank, "pid": os.getpid, "host": socket.gethostname,
                 "clock_anchor": lambda: anchor, "backend": lambda: comms.backend, "steps": lambda: clock.step,
                 "written_rows": lambda: dict(writer.written), "dropped_rows": lambda: dict(writer.dropped),
                 "lost_lookups": lambda: writer.lost_lookups,
                 "errors": lambda: writer.errors, "first_error": lambda: writer.first_error,
                 "first_lost_step": lambda: writer.first_lost_step, "writer_cpu_s": lambda: writer.cpu_s,
                 "writer_scheduling": lambda: {"policy": writer.scheduling, "rescues": writer.rescues},
                 "settings": lambda: {**asdict(settings), "run_dir": str(settings.run_dir)},
                 "tables": lambda: tables.tables, "gpu": sampler.status,
                 "policy": lambda: facts.policy, "metrics": lambda: facts.metrics}
        if settings.torchrec_plan:
            parts["torchrec_plan_applied"] = lambda: torchrec_plan.applied
        reserve.release()
        try:
            write_rank_report(ranks / f"rank={settings.rank}.json", parts,
                              failures + facts.errors)
        except OSError as err:  # the disk is full even so: `record` names the rank's report as missing
            print(f"tracekit: rank {settings.rank} could not write its report ({err.strerror or err})", file=sys.stderr)

    atexit.register(finish)
