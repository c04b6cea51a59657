"""Prediction accuracy (bench/RESULTS.md §22): every policy section `analyze` writes, predicted against measured.

    .venv/bin/python bench/prediction_accuracy.py [--workloads NAME,...] [--modes default,every1] [--repeats 2] [--steps N]
        [--out runs/prediction_accuracy] [--resume]

For each workload of WORKLOADS (chosen so that nothing is tuned to them, see there), twice: with
`tracekit record`'s default recording settings and with `--lookup-every 1`:
1. the baseline is recorded (`tracekit record`, or `tracekit cluster --record` for an emulated link)
   and analysed with analyze's defaults (`tracekit analyze RUN --no-report`);
2. each training section of its policy.json (replication, tiers, schedule, compression.dp,
   compression.mp) is written alone beside policy.json (tracekit.app.optimize._write_sections, so row
   paths hold); a section marked `recommended: false` is written with `recommended: true`, so it
   runs and the bench shows whether the decision was right; `combined` holds the sections of the
   file's `combined` prediction (else every recommended one), where there are several. Sections
   optimize would not re-run either (no hot row, one-node tiers, tier 2, no all-hot sample:
   tracekit.app.optimize._why_not) get a row saying why, and no run; `lag` is inference-only, not re-run;
3. `--repeats` rounds, each a baseline re-run then every section's re-run (their order rotated from
   round to round), all recorded with the baseline's settings, so times compare: B P1 P2 .. B P2 P3 ..
   (one baseline re-run per round for all sections: a B before every P would double the runs);
4. each re-run is measured by analyses.compare against the recorded baseline (the project's one
   warm-up rule and byte definitions), and its section's predicted figures (compare's policy rows)
   are kept, each with `kind` exact/estimated and an interval where estimated.

Per workload, mode and section the table shows predicted / measured bytes per step (a2a, remote,
sync, dp: whatever the section predicts; measured = median over the repeats) and step time, with
err = predicted / measured − 1; the measured speedup (median baseline re-run / median section
re-run) with the predicted one (policy baseline / predicted step time) and the baseline re-runs'
median [min–max]; `recommended`; and the targets: bytes within 2% (default recording) or exact
(`--lookup-every 1`), step time within 10%, no recommended section slower than every baseline
re-run. Decision: `right` (recommended and faster than every baseline re-run, or not recommended and
not faster), `no gain` (recommended, inside the baselines' spread), `slower` (recommended, slower
than every baseline re-run), `missed` (not recommended, faster than every baseline re-run).

Every row goes to OUT/results.jsonl as it is measured (`--resume` keeps those and re-runs only what is
missing or failed); the table (bench/prediction_table.py) is printed and written to OUT/table.md
for bench/RESULTS.md. A run that fails (train.py refusing a section, say) is a row with its exit code
and its error's last line. One workload takes 4-10 minutes at --repeats 2 on 2 cores (a run's fixed
cost, ~10 s of imports, rendezvous and namespaces, dominates; analyze of a cluster run ~30 s).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from analyses.compare import compare  # noqa: E402
from tracekit.app.cli import cli  # noqa: E402
from tracekit.app.cluster import Cluster, check_prerequisites  # noqa: E402
from tracekit.app.optimize import _why_not, _write_sections, record  # noqa: E402
from tracekit.policy import TRAINING, load_policy, read_policy, recommended, sections  # noqa: E402
from prediction_table import markdown_table, rich_table, summary_lines  # noqa: E402

EVAL_FRACTION = 0.02  # a short held-out pass at the end of each run: time that no step pays
BYTES_TOLERANCE = {"default": 0.02, "every1": 0.0}
STEP_TOLERANCE = 0.10
ROUND_GUESS = 5  # runs a round is counted as in the progress bar until analyze says (a baseline and 4 sections)


@dataclass(frozen=True)
class Workload:
    name: str
    args: tuple[str, ...]  # train.py's model and data options
    batch: int  # per rank
    world: int
    link: str | None  # None: loopback (torchrun --standalone); else `tracekit cluster --nodes WORLD` at LINK
    steps: int
    why: str


# Each knob's range is covered at both ends and in between, values spread across workloads rather than
# varied one at a time, and none is a layout a policy was developed on (bench/replication_kaggle.py's
# Kaggle x 0.01 at dim 16, batch 512; fae_schedule.py's 6 x 2,000 at Zipf 1.3; the DCT benches' defaults).
WORKLOADS = (
    Workload("ratings-2t", ("--tables", "2", "--rows", "6000", "--dim", "8", "--zipf", "1.0"), 500, 2, None, 90,
             "a new user's first model: two id tables (user, item) of a ratings set, pooling 1, dim 8"),
    Workload("seq-z0.6-w4", ("--tables", "8", "--sequence-tables", "4", "--pooling", "4", "--rows", "50000",
                             "--dim", "32", "--zipf", "0.6"), 256, 4, None, 60,
             "flat skew, half sequence features, 4 ranks on 2 cores (waits, not bytes)"),
    Workload("kaggle-d128-1gbit", ("--preset", "criteo-kaggle", "--scale", "0.01", "--dim", "128", "--zipf", "0.7",
                                   "--bottom-mlp", "256,128"), 256, 2, "1gbit", 60,
             "26 tables, wide rows, mild skew, over a 1gbit link: output all-to-all bytes dominate"),
    Workload("pool8-z1.4-100mbit", ("--tables", "4", "--rows", "20000", "--dim", "64", "--pooling", "8",
                                    "--zipf", "1.4", "--bottom-mlp", "128,64", "--top-mlp", "128,1"),
             1024, 2, "100mbit", 60, "few multi-hot tables, steep skew, slow link: replication's best case"),
    Workload("wide-d8-b4096", ("--tables", "12", "--rows", "100000", "--dim", "8", "--pooling", "2",
                               "--zipf", "0.8"), 4096, 2, None, 60,
             "big batch, narrow rows, default MLPs: compute-bound on loopback, DDP bytes dominate"),
    Workload("seq-z1.2-1gbit", ("--tables", "6", "--sequence-tables", "2", "--pooling", "3", "--rows", "30000",
                                "--dim", "48", "--zipf", "1.2"), 768, 2, "1gbit", 80,
             "mixed pooled and sequence tables, skewed, 1gbit"),
    Workload("w4-d128-z1.1", ("--tables", "5", "--rows", "200000", "--dim", "128", "--zipf", "1.1",
                              "--bottom-mlp", "256,128", "--top-mlp", "256,1"), 512, 4, None, 60,
             "5 tables on 4 ranks (one rank owns two), wide rows, 4 ranks on 2 cores"),
    Workload("kaggle-seq-100mbit", ("--preset", "criteo-kaggle", "--scale", "0.01", "--dim", "24",
                                    "--sequence-tables", "4", "--pooling", "2", "--bottom-mlp", "128,24",
                                    "--top-mlp", "128,1"), 512, 2, "100mbit", 60,
             "26 tables with Kaggle's own per-table skew (0.13-3.5), 4 of them sequences, 100mbit"),
)
MODES = ("default", "every1")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workloads", default=",".join(w.name for w in WORKLOADS), help="comma-separated names")
    p.add_argument("--repeats", type=int, default=2, help="rounds of baseline and section re-runs")
    p.add_argument("--steps", type=int, default=None, help="steps of every run (default: each workload's own)")
    p.add_argument("--out", type=Path, default=REPO / "runs" / "prediction_accuracy",
                   help="where the runs, results.jsonl and table.md go")
    p.add_argument("--modes", default=",".join(MODES), help="recording modes: default (lookups every 10th step), every1")
    p.add_argument("--resume", action="store_true", help="keep OUT/results.jsonl's rows; run only what is missing")
    args = p.parse_args()
    chosen = named(p, args.workloads, WORKLOADS)
    args.out.mkdir(parents=True, exist_ok=True)
    store = Store(args.out / "results.jsonl", resume=args.resume)
    header = machine()
    cluster_problem = cluster_unavailable() if any(w.link for w in chosen) else None
    err = Console(stderr=True)
    err.print(header)
    if cluster_problem:
        err.print(f"[yellow]tracekit cluster cannot run here ({cluster_problem}): "
                  "the emulated-link workloads are skipped")
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err) as bar:
        modes = [m for m in MODES if m in args.modes.split(",")]
        task = bar.add_task("", total=len(chosen) * len(modes) * (2 + args.repeats * ROUND_GUESS))
        for w in chosen:
            for mode in modes:
                if w.link and cluster_problem:
                    store.add({"kind": "skipped", "key": f"{w.name}/{mode}/skipped", "workload": w.name,
                               "mode": mode, "reason": f"tracekit cluster cannot run here: {cluster_problem}"})
                    bar.advance(task, 2 + args.repeats * ROUND_GUESS)
                    continue
                Config(w, mode, args.steps or w.steps, args.repeats, args.out / w.name / mode, store, bar, task).run()
    rows, order = store.rows(), ([w.name for w in WORKLOADS], MODES)
    Console(width=220).print(rich_table(rows, order))
    markdown = "\n".join([f"Measured {datetime.date.today()}: {header}; --repeats {args.repeats}.", "",
                          *legend(chosen, rows, args.steps), "", markdown_table(rows, order), "",
                          *summary_lines(rows)])
    (args.out / "table.md").write_text(markdown + "\n")
    print("\n".join(summary_lines(rows)))
    print(f"\nresults: {store.path}; table: {args.out / 'table.md'}")


def named(parser: argparse.ArgumentParser, names: str, workloads: tuple[Workload, ...]) -> list[Workload]:
    """The workloads `names` (comma-separated) names, in its order; else the parser's error naming
    the known ones."""
    known = {w.name: w for w in workloads}
    unknown = [n for n in names.split(",") if n not in known]
    if unknown:
        parser.error(f"unknown workload(s) {', '.join(unknown)}; the workloads are {', '.join(known)}")
    return [known[n] for n in names.split(",")]


def legend(chosen: list[Workload], rows: list[dict], steps: int | None) -> list[str]:
    """One line per workload: how it runs, its train.py options, why it is in the list, and the
    seconds its records, analyses and runs took."""
    lines = []
    for w in chosen:
        spent = sum(r.get("seconds") or 0 for r in rows if r["workload"] == w.name)
        lines.append(f"- `{w.name}`: {w.world} ranks, {w.link or 'loopback'}, batch {w.batch} per rank, "
                     f"{steps or w.steps} steps, `{' '.join(w.args)}`: {w.why} ({spent / 60:.1f} min)")
    return lines


# the machine -------------------------------------------------------------------------------------

def machine() -> str:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    return (f"{cpu}, {os.cpu_count()} cores, {platform.system()}, torch {importlib.metadata.version('torch')}, "
            "gloo on CPU")


def cluster_unavailable() -> str | None:
    """Why `tracekit cluster` cannot run here (root, iproute2, tbf), or None."""
    try:
        check_prerequisites(Cluster(2, 1, "1gbit"))
    except Exception as err:  # a ClusterError, or `ip netns add` failing outright
        return str(err).splitlines()[0]
    return None


def default_lookup_every() -> int:
    """`tracekit record`'s own default, read from its option (one place says what it is)."""
    return next(p.default for p in cli.commands["record"].params if p.name == "lookup_every")


# results.jsonl -----------------------------------------------------------------------------------

class Store:
    """OUT/results.jsonl: one JSON row per record, analysis, run, section summary or skip, appended as
    each is measured. Rows are keyed; the last row of a key wins, and a new baseline recording of a
    workload and mode drops the rows before it (their policies are gone)."""

    def __init__(self, path: Path, *, resume: bool):
        self.path = path
        self._rows: dict[str, dict] = {}
        if resume and path.is_file():
            for line in path.read_text().splitlines():
                if line.strip():
                    self._keep(json.loads(line))
        elif path.exists():
            path.unlink()

    def _keep(self, row: dict) -> None:
        if row["kind"] == "record":
            prefix = f"{row['workload']}/{row['mode']}/"
            self._rows = {k: v for k, v in self._rows.items() if not k.startswith(prefix)}
        self._rows[row["key"]] = row

    def get(self, key: str) -> dict | None:
        return self._rows.get(key)

    def add(self, row: dict) -> dict:
        self._keep(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row, default=str) + "\n")
        return row

    def rows(self) -> list[dict]:
        return list(self._rows.values())


# one workload in one recording mode -------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    label: str  # a section's label, or "combined"
    recommended: bool
    policy: Path | None  # None: not re-run (skip says why)
    skip: str | None = None
    reason: str | None = None  # analyze's, where it did not recommend the section


class Config:
    """A workload in one recording mode: its baseline, analysis, plans, re-runs and summaries."""

    def __init__(self, w: Workload, mode: str, steps: int, repeats: int, folder: Path, store: Store,
                 bar: Progress, task) -> None:
        self.w, self.mode, self.repeats, self.folder, self.store, self.bar, self.task = (
            w, mode, repeats, folder, store, bar, task)
        self.lookup_every = 1 if mode == "every1" else default_lookup_every()
        self.key = f"{w.name}/{mode}"
        self.topology = Cluster(w.world, 1, w.link) if w.link else None
        samples = math.ceil(steps * w.batch * w.world * 1.05 / (1 - EVAL_FRACTION))
        train = ["train.py", *w.args, "--batch-size", str(w.batch), "--steps", str(steps), "--samples", str(samples),
                 "--eval-fraction", str(EVAL_FRACTION), "--log-every", "1000"]
        self.command = ([sys.executable, *train] if w.link else
                        [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={w.world}",
                         *train])

    def run(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        policy_path = self.baseline()
        try:
            plans = None if policy_path is None else self.plans(policy_path)
        except Exception as err:  # tracekit.policy and optimize are being edited beside this bench
            self.store.add(self.row("plan", "plan", status="failed", error=f"{type(err).__name__}: {err}"))
            plans = None
        if plans is None:
            self.bar.advance(self.task, self.repeats * ROUND_GUESS)
            return
        runnable = [p for p in plans if p.policy is not None]
        extra = self.repeats * (1 + len(runnable) - ROUND_GUESS)
        self.bar.update(self.task, total=self.bar.tasks[self.task].total + extra)
        for r in range(1, self.repeats + 1):
            shift = (r - 1) % max(len(runnable), 1)
            for plan in [None, *runnable[shift:], *runnable[:shift]]:
                self.rerun(plan, r)
        policy = load_policy(policy_path)
        base_runs = self.runs("baseline")
        self.store.add(self.baseline_row(policy, base_runs))
        for plan in plans:
            self.store.add(summarise(self.key, self.w.name, self.mode, plan, self.runs(plan.label), base_runs,
                                     policy.get("baseline", {}).get("step_time_s")))

    # the baseline and its analysis

    def baseline(self) -> Path | None:
        """Record and analyse the baseline (unless --resume has both); policy.json, or None after a
        failure (its row says why)."""
        base, policy_path = self.folder / "base", self.folder / "base" / "policy.json"
        done = self.store.get(f"{self.key}/analyze")
        if done and done["status"] == "ok" and policy_path.is_file():
            self.bar.advance(self.task, 2)
            return policy_path
        self.bar.update(self.task, description=f"{self.key}: recording the baseline")
        t0 = time.monotonic()
        code = record(base, self.command, self.folder / "base.log", lookup_every=self.lookup_every,
                      cluster=self.topology)
        self.store.add(self.row("record", "record", exit_code=code, seconds=time.monotonic() - t0,
                                status="ok" if code == 0 else "failed",
                                error=None if code == 0 else error_line(self.folder / "base.log")))
        self.bar.advance(self.task)
        if code != 0:
            return None
        self.bar.update(self.task, description=f"{self.key}: analysing")
        t0, log = time.monotonic(), self.folder / "analyze.log"
        with open(log, "w") as out:
            code = subprocess.call([sys.executable, "-m", "tracekit", "analyze", str(base), "--no-report"],
                                   cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
        row = self.row("analyze", "analyze", exit_code=code, seconds=time.monotonic() - t0,
                       status="ok" if code == 0 and policy_path.is_file() else "failed",
                       error=None if code == 0 else error_line(log))
        if row["status"] == "ok":
            policy = load_policy(policy_path)
            row["sections"] = {label: {"recommended": recommended(body), "reason": body.get("reason"),
                                       "why": body.get("why")} for label, body in sections(policy)}
            row["combined"] = policy.get("combined")
        self.store.add(row)
        self.bar.advance(self.task)
        return policy_path if row["status"] == "ok" else None

    def plans(self, policy_path: Path) -> list[Plan]:
        """One policy file per training section (module docstring, step 2), and the combined one."""
        policy = read_policy(policy_path)
        plans = []
        for label, section in policy.sections.items():
            if label not in TRAINING:
                continue  # lag: inference only
            rec = section.recommended
            forced = section if rec else replace(section, recommended=True, reason=None)
            reason = _why_not(forced)
            if reason:
                plans.append(Plan(label, rec, None, reason, section.reason))
                continue
            source = policy if rec else replace(policy, sections={**policy.sections, label: forced})
            plans.append(Plan(label, rec, _write_sections(policy_path, source, [label]), None, section.reason))
        combined = policy.combined
        names = list(combined.sections) if combined else [p.label for p in plans if p.policy and p.recommended]
        if len(names) > 1:
            plans.append(Plan("combined", True, _write_sections(policy_path, policy, names, "combined")))
        return plans

    # re-runs

    def rerun(self, plan: Plan | None, r: int) -> None:
        label = plan.label if plan else "baseline"
        key = f"{self.key}/run/{label}/{r}"
        done = self.store.get(key)
        if done and done["status"] == "ok":
            self.bar.advance(self.task)
            return
        self.bar.update(self.task, description=f"{self.key}: {label} ({r}/{self.repeats})")
        run_dir, log = self.folder / f"{label}-{r}", self.folder / f"{label}-{r}.log"
        command = [*self.command, "--policy", str(plan.policy)] if plan else self.command
        t0 = time.monotonic()
        code = record(run_dir, command, log, lookup_every=self.lookup_every, cluster=self.topology)
        row = self.row("run", f"run/{label}/{r}", label=label, repeat=r, exit_code=code,
                       seconds=time.monotonic() - t0, policy_lines=policy_lines(log))
        if code != 0:
            row.update(status="failed", error=error_line(log))
        else:
            row.update(measure(self.folder / "base", run_dir, label))
        self.store.add(row)
        self.bar.advance(self.task)

    def runs(self, label: str) -> list[dict]:
        return [row for r in range(1, self.repeats + 1) if (row := self.store.get(f"{self.key}/run/{label}/{r}"))]

    def row(self, kind: str, suffix: str, **fields) -> dict:
        return {"kind": kind, "key": f"{self.key}/{suffix}", "workload": self.w.name, "mode": self.mode,
                "lookup_every": self.lookup_every, "world": self.w.world, "link": self.w.link or "loopback",
                **fields}

    def baseline_row(self, policy: dict, base_runs: list[dict]) -> dict:
        """The policy's `baseline` (the recorded run, as analyze saw it) against the baseline re-runs."""
        ok = [r for r in base_runs if r["status"] == "ok"]
        figures = {}
        for figure, value in (policy.get("baseline") or {}).items():
            measured = median(r["figures"].get(figure) for r in ok)
            figures[figure] = {"predicted": value, "measured": measured, "err": rel_err(value, measured)}
        times = [r["figures"]["step_time_s"] for r in ok]
        return self.row("section", "section/baseline", section="baseline", recommended=None, runs=len(ok),
                        failed=len(base_runs) - len(ok), figures=figures, step_times_s=times,
                        step_time_s=median(times))


# one run's measurement ---------------------------------------------------------------------------

def measure(base: Path, run: Path, label: str) -> dict:
    """The run's figures (analyses.compare against the recorded baseline), its section's predicted
    against measured rows, which sections the trainer applied, and compare's warnings."""
    try:
        summary = compare(base, [run]).summary
    except Exception as err:  # compare is being edited beside this bench: keep the run, say what broke
        return {"status": "unmeasured", "error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
    figures = summary["runs"][1]
    keep = ("section", "figure", "unit", "kind", "predicted", "predicted_low", "predicted_high", "measured")
    return {"status": "ok",
            "figures": {k: v for k, v in figures.items() if not isinstance(v, (dict, list))},
            "applied": figures.get("policy"),
            "rows": [{k: r.get(k) for k in keep} for r in summary["rows"] if r["section"] == label],
            "warnings": summary.get("warnings", [])}


_ERROR = re.compile(r"^(\w+(\.\w+)*(Error|Exception|Mismatch)\b|(\S+: )?error\b|Error\b)")


def error_line(log: Path) -> str:
    """The last line of `log` that names an error (torchrun's ChildFailedError aside), else its last line."""
    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.is_file() else []
    errors = [ln for ln in lines if _ERROR.match(ln) and "ChildFailedError" not in ln]
    return (errors or lines or ["(no output)"])[-1][:500]


def policy_lines(log: Path) -> list[str]:
    """What the trainer said of the policy (`policy FILE: applying ...`, `policy: skipped ...`)."""
    if not log.is_file():
        return []
    lines = (ln.strip() for ln in log.read_text(errors="replace").splitlines())
    return [ln for ln in lines if ln.startswith(("policy:", "policy "))][:8]


# a section's summary -----------------------------------------------------------------------------

def summarise(key: str, workload: str, mode: str, plan: Plan, runs: list[dict], base_runs: list[dict],
              base_predicted_s: float | None) -> dict:
    """Predicted against the median measured figure over the repeats, the speedup against the baseline
    re-runs, and the targets (module docstring)."""
    row = {"kind": "section", "key": f"{key}/section/{plan.label}", "workload": workload, "mode": mode,
           "section": plan.label, "recommended": plan.recommended, "skip": plan.skip, "reason": plan.reason}
    if plan.policy is None:
        return row
    ok = [r for r in runs if r["status"] == "ok"]
    failed = [r for r in runs if r["status"] != "ok"]
    row.update(runs=len(ok), failed=len(failed), error=failed[-1].get("error") if failed else None,
               trainer_skipped=sorted({s for r in ok for s in ((r.get("applied") or {}).get("skipped") or {})}))
    figures: dict[str, dict] = {}
    for r in ok:
        for f in r["rows"]:
            figures.setdefault(f["figure"], {**f, "values": []})["values"].append(f["measured"])
    for f in figures.values():
        f["measured"] = median(f.pop("values"))
        f["err"] = rel_err(f["predicted"], f["measured"])
        low, high = f.get("predicted_low"), f.get("predicted_high")
        f["in_interval"] = None if low is None or f["measured"] is None else low <= f["measured"] <= high
    row["figures"] = figures
    times = [r["figures"]["step_time_s"] for r in ok if r["figures"].get("step_time_s") is not None]
    base = [r["figures"]["step_time_s"] for r in base_runs if r["status"] == "ok"]
    step = statistics.median(times) if times else None
    predicted_s = (figures.get("step_time_s") or {}).get("predicted")
    row.update(step_times_s=times, step_time_s=step, baseline_times_s=base,
               speedup=statistics.median(base) / step if step and base else None,
               predicted_speedup=base_predicted_s / predicted_s if base_predicted_s and predicted_s else None)
    row["verdict"] = None if step is None or not base else (
        "slower" if step > max(base) else "faster" if step < min(base) else "within spread")
    row["checks"] = checks(row, mode)
    row["decision"] = decision(plan.recommended, row["verdict"])
    return row


def checks(row: dict, mode: str) -> dict:
    """bytes: every byte figure within the mode's tolerance; time: step time within 10%; no_harm: a
    recommended section not slower than every baseline re-run. None where there is nothing to check."""
    byte_errs = [f["err"] for name, f in row["figures"].items()
                 if name.endswith("bytes_per_step") and f["predicted"] is not None and f["measured"] is not None]
    tolerance = BYTES_TOLERANCE[mode]
    step_err = (row["figures"].get("step_time_s") or {}).get("err")
    return {"bytes": None if not byte_errs else all(e is not None and abs(e) <= tolerance + 1e-9 for e in byte_errs),
            "time": None if step_err is None else abs(step_err) <= STEP_TOLERANCE,
            "no_harm": None if row["verdict"] is None or not row["recommended"] else row["verdict"] != "slower"}


def decision(rec: bool, verdict: str | None) -> str | None:
    if verdict is None:
        return None
    if rec:
        return {"faster": "right", "within spread": "no gain", "slower": "slower"}[verdict]
    return "missed" if verdict == "faster" else "right"


def median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def rel_err(predicted: float | None, measured: float | None) -> float | None:
    """predicted / measured − 1 (0 where both are 0; None where only the measurement is 0)."""
    if predicted is None or measured is None:
        return None
    if measured == 0:
        return 0.0 if predicted == 0 else None
    return predicted / measured - 1


if __name__ == "__main__":
    main()
