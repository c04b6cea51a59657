"""The verdict a user reads first: one row per training section of a run's policy, the recommended
combination first, each with its decision in a few words, its step time predicted and, where a run
applied it, measured (each with its speedup over the measured baseline), its embedding and dense bytes,
and its model-quality change. `optimize` and `compare` end with it in the console; the report opens with it.

    rows = verdict(policy, summary)   # policy.json as a dict; analyses.compare's summary, or None
    best = next(r for r in rows if r.best)   # the measured fastest, where runs measured any
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from tracekit.figures import A2A_BYTES, ALLREDUCE_BYTES, AUC_CHANGE, DP_BYTES, LOGLOSS_CHANGE, STEP_TIME
from tracekit.policy import TRAINING, recommended, section_part
from tracekit.units import format_bytes

BRIEF = 100  # characters of a decision's reason shown in the table


@dataclass
class Row:
    label: str  # a section, or "combined: a + b"
    recommended: bool
    why: str  # the decision in a few words
    predicted_s: float | None
    interval_s: tuple[float, float] | None
    measured_s: float | None
    baseline_s: float | None  # the measured baseline step the speedups are over
    embedding_bytes: float | None  # a step's all-to-all bytes, measured where a run applied it, else predicted
    dense_bytes: float | None  # a step's dense gradients' all-reduce bytes (DCT-DP's compressed), likewise
    auc_change: float | None  # eval AUC, measured where a run applied it, else predicted
    logloss_change: float | None  # eval log loss, relative
    quality_measured: bool = False
    best: bool = False  # the fastest measured row, and faster than the baseline

    @property
    def predicted_speedup(self) -> float | None:
        return _ratio(self.baseline_s, self.predicted_s)

    @property
    def speedup_range(self) -> tuple[float, float] | None:
        if self.interval_s is None or self.baseline_s is None or min(self.interval_s) <= 0:
            return None
        return self.baseline_s / self.interval_s[1], self.baseline_s / self.interval_s[0]

    @property
    def measured_speedup(self) -> float | None:
        return _ratio(self.baseline_s, self.measured_s)

    def to_json(self) -> dict:
        out = asdict(self)
        out.update(predicted_speedup=self.predicted_speedup, speedup_range=self.speedup_range,
                   measured_speedup=self.measured_speedup)
        return out


COLUMNS = ("section", "recommended", "predicted step", "speedup", "measured step", "speedup",
           "embedding bytes", "dense bytes", "AUC, log loss", "why")
"""The verdict table's columns, as `cells` fills them (the console and the report show the same strings)."""
TERMINAL_COLUMNS = ("section", "rec.", "predicted step", "×", "measured", "×", "embedding", "dense", "AUC, log loss")
"""The same but `why`, named to fit a terminal (the console prints each row's why below the table)."""


def cells(row: dict, compact: bool = False) -> list[str]:
    """A row (`Row.to_json()`) as the table's strings, steps in ms: the best marked, a quality change
    predicted rather than measured marked "pred."; `compact` (a terminal's width): no speedup interval."""
    def ms(value: float | None) -> str:
        return "–" if value is None else f"{value * 1e3:.3g} ms"

    def times(value: float | None) -> str:
        return "–" if value is None else f"{value:.2f}×"

    predicted, span = ms(row["predicted_s"]), row["interval_s"]
    if span:
        predicted = f"{predicted[:-3]} [{span[0] * 1e3:.3g}–{span[1] * 1e3:.3g}] ms"
    speedup, span = times(row["predicted_speedup"]), row["speedup_range"]
    if span and not compact:
        speedup += f" [{span[0]:.2f}–{span[1]:.2f}]"
    quality = ", ".join(part for part in (
        None if row["auc_change"] is None else f"{row['auc_change']:+.4f}",
        None if row["logloss_change"] is None else f"{row['logloss_change']:+.2%}") if part) or "–"
    if quality != "–" and not row["quality_measured"]:
        quality += " (pred.)"
    return [row["label"] + (" ★" if row["best"] else ""), "yes" if row["recommended"] else "no", predicted, speedup,
            "not run" if row["measured_s"] is None else ms(row["measured_s"]), times(row["measured_speedup"]),
            "–" if row["embedding_bytes"] is None else format_bytes(row["embedding_bytes"]),
            "–" if row["dense_bytes"] is None else format_bytes(row["dense_bytes"]), quality, row["why"]]


def verdict(policy: dict | None, summary: dict | None = None) -> list[Row]:
    """The verdict's rows (module docstring) from policy.json and, where runs were compared, compare's summary."""
    if not policy:
        return []
    runs = {r["run"]: r for r in (summary or {}).get("runs", [])}
    base = (summary or {}).get("base")
    measured_base = (runs.get(base) or {}).get(STEP_TIME) if base else None
    base_metrics = (runs.get(base) or {}).get("metrics") or {}
    recorded = policy.get("baseline") or {}
    baseline_s = measured_base or recorded.get(STEP_TIME)
    applied = _applied(summary)
    rows = []
    combined = policy.get("combined")
    if combined:
        rows.append(_row(f"combined: {' + '.join(combined['sections'])}", combined, True, "the recommended sections "
                         "together", baseline_s, recorded, applied.get("combined"), runs, base_metrics))
    for label in TRAINING:
        body = section_part(policy, label)
        if body is None:
            continue
        chosen = recommended(body)
        why = "predicted faster, within the budgets" if chosen else _brief(body.get("reason") or body.get("why") or "")
        rows.append(_row(label, body, chosen, why, baseline_s, recorded, applied.get(label), runs, base_metrics))
    faster = [r for r in rows if r.measured_s is not None and baseline_s and r.measured_s < baseline_s]
    if faster:
        min(faster, key=lambda r: r.measured_s).best = True
    return rows


def _row(label: str, body: dict, chosen: bool, why: str, baseline_s: float | None, recorded: dict,
         run: dict | None, runs: dict[str, dict], base_metrics: dict) -> Row:
    predicted = body.get("predicted") or {}
    interval = (body.get("intervals") or {}).get(STEP_TIME)
    figures = (run or {}).get("figures", {})
    measured_run = runs.get((run or {}).get("run")) or {}
    auc, loss = figures.get(AUC_CHANGE), figures.get(LOGLOSS_CHANGE)
    if auc is None and loss is None and measured_run:  # from the eval metrics of the run and the baseline
        auc, loss = _metric_changes(measured_run.get("metrics") or {}, base_metrics)
    quality_measured = auc is not None or loss is not None
    if not quality_measured:
        auc, loss = predicted.get(AUC_CHANGE), predicted.get(LOGLOSS_CHANGE)
    return Row(label, chosen, why, predicted.get(STEP_TIME), tuple(interval) if interval else None,
               measured_run.get(STEP_TIME), baseline_s,
               measured_run.get(A2A_BYTES, predicted.get(A2A_BYTES, recorded.get(A2A_BYTES))),
               measured_run.get(DP_BYTES, predicted.get(DP_BYTES, recorded.get(ALLREDUCE_BYTES))), auc, loss,
               quality_measured)


def _applied(summary: dict | None) -> dict[str, dict]:
    """Per section label (or "combined"), the run that applied it alone and its measured figures, from
    compare's rows: {"run": path, "figures": {figure: measured}}."""
    out: dict[str, dict] = {}
    for r in (summary or {}).get("rows", []):
        if r["section"] == "baseline":
            continue
        entry = out.setdefault(r["section"], {"run": r["run"], "figures": {}})
        if entry["run"] == r["run"] and r.get("measured") is not None:
            entry["figures"][r["figure"]] = r["measured"]
    return out


def _metric_changes(metrics: dict, base: dict) -> tuple[float | None, float | None]:
    """(eval AUC change, eval log loss's relative change) of a run's metrics against the baseline's."""
    auc = loss = None
    if metrics.get("eval_auc") is not None and base.get("eval_auc") is not None:
        auc = metrics["eval_auc"] - base["eval_auc"]
    if metrics.get("eval_logloss") is not None and base.get("eval_logloss"):
        loss = metrics["eval_logloss"] / base["eval_logloss"] - 1
    return auc, loss


def _brief(reason: str) -> str:
    """A decision's reason in a few words: its first clause, at most BRIEF characters."""
    text = reason.removeprefix("not recommended: ").strip()
    for stop in ("; ", " (", ": "):
        cut = text.find(stop, 12)
        if cut > 0:
            text = text[:cut]
    return text if len(text) <= BRIEF else text[:BRIEF - 1].rstrip() + "…"


def _ratio(a: Any, b: Any) -> float | None:
    return a / b if a and b else None
