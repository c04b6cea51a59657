"""The policy file (DESIGN.md §5): `policy.json` and the row lists beside it, read, validated and
written in one place. `analyses` write policies and the trainer applies them; both use this module
and neither imports the other.

    policy = new_policy(source_run="runs/base", model={"tables": [...], "world_size": 2})
    policy["replication"] = {...}
    write_policy("runs/base/policy.json", policy, rows={"hot_rows": frame})   # policy/hot_rows.parquet
    policy = load_policy("runs/base/policy.json")                              # validated
    check_model(policy, tables=[{"name": "t0", "num_rows": 100000, "dim": 32}], world_size=2)  # policy_model.py

Every section is optional. Each present holds what the trainer applies (`keep_ratio`, `rows`...) and,
as analyze writes it, a `predicted` object of numbers, a one-line `why`, `recommended` (true or false)
with a one-line `reason` where it is false, and `intervals` ({figure: [low, high]}) for the figures of
`predicted` that are estimates (a figure without one is exact). A hand-written file needs only what
the trainer applies: `predicted`, `why` and `recommended` (true where absent) are optional in a
section, and so are `schema` and `model` (without a model the trainer checks the rows it is given
against its own tables, and nothing else). The optional top-level `combined` holds the
prediction for the recommended training sections applied together: {"sections": [labels],
"predicted", "intervals", "why"}. Byte figures are per training step, summed over all ranks'
`bytes_out`. Row lists are Parquet files whose paths are relative to the JSON file. A file that
breaks any rule is refused with a PolicyError naming the file, the field and what was expected.

    for label, body in sections(policy):   # ("compression.dp", {...}), ...
        recommended(body)                  # what the trainer and `optimize` apply
"""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, ClassVar

import pyarrow.parquet as pq

from tracekit import figures
from tracekit.errors import TracekitError
from tracekit.files import read_json, replacing, write_text
from tracekit.run_dir import POLICY_ROWS

SCHEMA = "tracekit.policy/1"
SECTIONS = ("replication", "tiers", "schedule", "compression", "lag")
LABELS = ("replication", "tiers", "schedule", "compression.dp", "compression.mp", "lag")
"""Every section by its label, compression's parts apart (what `combined.sections` and the trainer name)."""
INFERENCE_ONLY = ("lag",)
"""The sections an `--inference` run applies; a training run applies the others (TRAINING)."""
TRAINING = tuple(label for label in LABELS if label not in INFERENCE_ONLY)
ROW_FIELDS = {"replication": ("rows",), "tiers": ("rows",), "schedule": ("hot_rows",)}
"""Fields of a section that name a Parquet row list, relative to the JSON file."""
REPLICATION_SYNCS = ("sparse_allreduce", "dense_allreduce")


class PolicyError(TracekitError):
    """Raised when a policy file is malformed; names the file and the field."""


def section_part(policy: dict, name: str) -> dict | None:
    """policy[name], or policy["compression"]["dp"] for "compression.dp"; None where absent."""
    section, _, part = name.partition(".")
    body = policy.get(section)
    return body.get(part) if part and isinstance(body, dict) else body


def sections(policy: dict) -> list[tuple[str, dict]]:
    """(label, body) of each section present, in LABELS order, compression's dp and mp apart."""
    return [(label, body) for label in LABELS if (body := section_part(policy, label)) is not None]


def recommended(body: dict) -> bool:
    """Whether a section is recommended: its `recommended`, true where absent (hand-written files)."""
    return body.get("recommended", True)


MIN_HOT_SAMPLES = 0.01
"""An FAE schedule with fewer all-hot samples than this skips no step: it is replication by count."""


@dataclass(frozen=True)
class Prediction:
    """What a section (or the combination) is predicted to do: `figures` (tracekit.figures names ->
    numbers), the [low, high] of those that are estimates (a figure without one is exact), and why."""

    figures: dict[str, Any]
    why: str
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)

    @classmethod
    def from_json(cls, body: dict) -> Prediction:
        return cls(dict(body.get("predicted") or {}), body.get("why") or "",
                   {figure: (low, high) for figure, (low, high) in body.get("intervals", {}).items()})

    def to_json(self) -> dict:
        """The prediction's fields; none of them for a hand-written section that has none."""
        out: dict[str, Any] = {}
        if self.figures or self.why:
            out = {"predicted": dict(self.figures), "why": self.why}
        if self.intervals:
            out["intervals"] = {figure: list(pair) for figure, pair in self.intervals.items()}
        return out


@dataclass(frozen=True, kw_only=True)
class Section:
    """One section of policy.json: what it sets (the fields of each kind below), its prediction,
    and analyze's decision (`recommended`, with a one-line `reason` where it is not). `extra` keeps
    the fields this version does not name, so a file reads and writes back as it was."""

    label: ClassVar[str]
    prediction: Prediction
    recommended: bool = True
    reason: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, body: dict) -> Section:
        own = {f.name for f in fields(cls) if f.init} - {"prediction", "recommended", "reason", "extra"}
        common = {"predicted", "why", "intervals", "recommended", "reason"}
        return cls(prediction=Prediction.from_json(body), recommended=body.get("recommended", True),
                   reason=body.get("reason"), extra={k: v for k, v in body.items() if k not in own | common},
                   **{k: body[k] for k in own if k in body})

    def to_json(self) -> dict:
        own = {f.name: getattr(self, f.name) for f in fields(self)
               if f.name not in ("prediction", "recommended", "reason", "extra")}
        decision = {"recommended": self.recommended} | ({} if self.reason is None else {"reason": self.reason})
        return {**{k: v for k, v in own.items() if v is not None}, **self.extra, **self.prediction.to_json(), **decision}


@dataclass(frozen=True, kw_only=True)
class Replicating(Section):
    """A section that keeps rows on every rank: the replica memory per rank it was sized for."""

    budget_bytes_per_rank: int | None = None


@dataclass(frozen=True, kw_only=True)
class Replication(Replicating):
    """SCARS / HugeCTR: the rows of `rows` (table_name, row) replicated on every rank, their
    gradients summed by `sync` (REPLICATION_SYNCS)."""

    label: ClassVar[str] = "replication"
    rows: str
    sync: str = "sparse_allreduce"
    kind: str | None = None


@dataclass(frozen=True, kw_only=True)
class Tiers(Replicating):
    """FlexShard: tier 1 on every rank, tier 2 once per node, tier 3 sharded (`rows`: table_name, row, tier)."""

    label: ClassVar[str] = "tiers"
    rows: str
    topology: dict[str, int] = field(default_factory=lambda: {"nodes": 1})  # nodes, ranks_per_node
    tier1_sync: str = "sparse_allreduce"
    tier2_sync: str = "sparse_allreduce"  # among the node copies (tracekit/dlrm/node_tier.py)


@dataclass(frozen=True, kw_only=True)
class Schedule(Replicating):
    """FAE: samples whose rows are all in `hot_rows` batched apart (hot steps skip the exchange);
    the hot rows are replicated, their gradients summed by `sync`."""

    label: ClassVar[str] = "schedule"
    hot_rows: str
    hot_sample_fraction: float = 0.0
    kind: str = "fae"
    sync: str = "sparse_allreduce"


@dataclass(frozen=True, kw_only=True)
class DctDp(Section):
    """DCT's data-parallel half: DDP's gradient buckets hard-thresholded to `keep_ratio`."""

    label: ClassVar[str] = "compression.dp"
    keep_ratio: float
    refresh_every: int | None = None
    error_feedback: bool | None = None


@dataclass(frozen=True, kw_only=True)
class DctMp(Section):
    """DCT's model-parallel half: each embedding output row's largest `keep_ratio` of values sent."""

    label: ClassVar[str] = "compression.mp"
    keep_ratio: float


@dataclass(frozen=True, kw_only=True)
class Lag(Section):
    """BLS: a rank may run at most `bound` steps ahead of the slowest (inference runs)."""

    label: ClassVar[str] = "lag"
    bound: int


KINDS: dict[str, type[Section]] = {kind.label: kind for kind in (Replication, Tiers, Schedule, DctDp, DctMp, Lag)}
"""Each section's type, by its label (LABELS)."""


@dataclass(frozen=True)
class Combined:
    """The recommended training sections applied together, and their prediction."""

    sections: tuple[str, ...]
    prediction: Prediction

    @classmethod
    def from_json(cls, body: dict) -> Combined:
        return cls(tuple(body["sections"]), Prediction.from_json(body))

    def to_json(self) -> dict:
        return {"sections": list(self.sections), **self.prediction.to_json()}


@dataclass(frozen=True)
class Policy:
    """policy.json as types: the model it was derived for, the baseline's figures, each section
    present by its label, and the combination. `Policy.from_json(load_policy(path))` reads a file;
    `to_json()` gives back what `write_policy` writes."""

    source_run: str
    model: dict | None  # None: a hand-written file that names no model
    baseline: dict[str, float] = field(default_factory=dict)
    sections: dict[str, Section] = field(default_factory=dict)
    combined: Combined | None = None
    created_at: str | None = field(default_factory=lambda: _now())

    @classmethod
    def from_json(cls, policy: dict) -> Policy:
        return cls(policy.get("source_run", ""), policy.get("model"), dict(policy.get("baseline", {})),
                   {label: KINDS[label].from_json(body) for label, body in sections(policy)},
                   Combined.from_json(policy["combined"]) if "combined" in policy else None, policy.get("created_at"))

    def to_json(self) -> dict:
        out = {"schema": SCHEMA, "source_run": self.source_run, "created_at": self.created_at or _now(),
               **({} if self.model is None else {"model": self.model}), "baseline": self.baseline}
        for label in LABELS:
            if label in self.sections:
                section, _, part = label.partition(".")
                body = self.sections[label].to_json()
                if part:
                    out.setdefault(section, {})[part] = body
                else:
                    out[section] = body
        if self.combined is not None:
            out["combined"] = self.combined.to_json()
        return out


def read_policy(path: str | os.PathLike) -> Policy:
    """The validated policy at `path`, typed (load_policy gives the JSON object itself)."""
    return Policy.from_json(load_policy(path))


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def nothing_to_apply(section: Section) -> str | None:
    """Why applying `section` would change nothing; None where it would (analyze then decides on its
    gain, optimize re-runs it)."""
    predicted = section.prediction.figures
    if isinstance(section, Replication) and not predicted.get(figures.HOT_ROWS):
        return "no row is worth replicating at this budget"
    if isinstance(section, Schedule) and (not predicted.get(figures.HOT_ROWS)
                                          or section.hot_sample_fraction < MIN_HOT_SAMPLES):
        return (f"{section.hot_sample_fraction:.2%} of samples hold only hot rows (under "
                f"{MIN_HOT_SAMPLES:.0%}: the schedule would be the replication section)")
    if isinstance(section, Tiers) and not predicted.get("tier1_rows") and not predicted.get("tier2_rows"):
        return "no row in tier 1 or 2"
    return None


def new_policy(*, source_run: str, model: dict, baseline: dict | None = None) -> dict:
    """An empty policy for `model` ({"tables": [{"name", "num_rows", "dim"}...], "world_size"})."""
    return {"schema": SCHEMA, "source_run": source_run,
            "created_at": _now(),
            "model": model, "baseline": baseline or {}}


def write_policy(path: str | os.PathLike, policy: Policy | dict, rows: dict[str, Any] | None = None) -> Path:
    """Validate `policy` (a Policy, or the JSON object of a hand-written file) and write it to `path`
    atomically, with each of `rows` (name -> a Polars DataFrame or Arrow table) as
    `policy/<name>.parquet` beside it. Sections refer to a row list as "policy/<name>.parquet"."""
    path = Path(path)
    if isinstance(policy, Policy):
        policy = policy.to_json()
    path.parent.mkdir(parents=True, exist_ok=True)
    for name, frame in (rows or {}).items():
        table = frame.to_arrow() if hasattr(frame, "to_arrow") else frame
        with replacing(row_list(path, name)) as tmp:
            pq.write_table(table, tmp, compression="zstd")
    validate(policy, path)
    return write_text(path, json.dumps(policy, indent=2, sort_keys=False) + "\n")


def load_policy(path: str | os.PathLike) -> dict:
    """The validated policy at `path`; PolicyError naming the file and field if it is malformed."""
    path = Path(path)
    if not path.is_file():
        raise PolicyError(f"{path}: no such policy file (written by `tracekit analyze RUN` as RUN/policy.json)")
    policy = read_json(path, PolicyError)
    validate(policy, path)
    return policy


def row_path(policy_path: str | os.PathLike, relative: str) -> Path:
    """Where a section's row list lives: `relative` to the policy file's folder."""
    return Path(policy_path).parent / relative


def row_list(policy_path: str | os.PathLike, name: str) -> Path:
    """Where `write_policy` writes the row list `name`: policy/<name>.parquet beside the policy file."""
    return row_path(policy_path, f"{POLICY_ROWS}/{name}.parquet")


def validate(policy: Any, path: str | os.PathLike) -> None:
    """Raise PolicyError unless `policy` follows the schema (and its row lists exist beside `path`)."""
    def fail(field: str, expected: str) -> None:
        raise PolicyError(f"{path}: {field}: expected {expected}")

    if not isinstance(policy, dict):
        fail("the top level", "a JSON object")
    if policy.get("schema", SCHEMA) != SCHEMA:
        fail("schema", f'"{SCHEMA}" (or no schema field), got {policy.get("schema")!r}')
    if "model" in policy:
        _check_model_field(policy["model"], fail)
    unknown = set(policy) - {"schema", "source_run", "created_at", "model", "baseline", "combined", *SECTIONS}
    if unknown:
        fail(", ".join(sorted(unknown)), f"no such field; the sections are {', '.join(SECTIONS)} (and combined)")
    if not isinstance(policy.get("baseline", {}), dict) or not _numbers(policy.get("baseline", {})):
        fail("baseline", "an object of numbers")
    for name in SECTIONS:
        if name not in policy:
            continue
        section = policy[name]
        parts = section.items() if name == "compression" and isinstance(section, dict) else [(None, section)]
        for sub, body in parts:
            where = name if sub is None else f"{name}.{sub}"
            if name == "compression" and sub not in ("dp", "mp"):
                fail(where, "compression holds only dp and mp")
            if not isinstance(body, dict):
                fail(where, "an object")
            if "predicted" in body or "why" in body or "intervals" in body:  # analyze's; a hand-written section may omit them
                _check_prediction(body, where, fail)
            if not isinstance(body.get("recommended", True), bool):
                fail(f"{where}.recommended", f"true or false, got {body['recommended']!r}")
            reason = body.get("reason")
            if not recommended(body) and not (isinstance(reason, str) and reason.strip() and "\n" not in reason):
                fail(f"{where}.reason", "a one-line reason why the section is not recommended")
        for key in ROW_FIELDS.get(name, ()):
            relative = section.get(key)
            if not isinstance(relative, str) or Path(relative).is_absolute():
                fail(f"{name}.{key}", "a Parquet path relative to the policy file")
            if not row_path(path, relative).is_file():
                fail(f"{name}.{key}", f"an existing file; {row_path(path, relative)} is missing")
    if "replication" in policy:
        if policy["replication"].get("sync") not in REPLICATION_SYNCS:
            fail("replication.sync", f"one of {', '.join(REPLICATION_SYNCS)}")
    if "lag" in policy and not (isinstance(policy["lag"].get("bound"), int) and policy["lag"]["bound"] >= 0):
        fail("lag.bound", "a non-negative integer")
    for sub, key in (("dp", "keep_ratio"), ("mp", "keep_ratio")):
        body = policy.get("compression", {}).get(sub)
        if body is not None and not (isinstance(body.get(key), (int, float)) and 0 < body[key] <= 1):
            fail(f"compression.{sub}.{key}", "a number in (0, 1]")
    if "combined" in policy:
        combined = policy["combined"]
        if not isinstance(combined, dict):
            fail("combined", "an object")
        labels = combined.get("sections")
        if not (isinstance(labels, list) and labels and all(label in TRAINING for label in labels)
                and len(set(labels)) == len(labels)):
            fail("combined.sections", f"a list of distinct training sections ({', '.join(TRAINING)}), got {labels!r}")
        _check_prediction(combined, "combined", fail)


def _check_model_field(model: Any, fail: Callable[[str, str], None]) -> None:
    """`model`: {"tables": [{"name", "num_rows", "dim"}...], "world_size"}."""
    if not isinstance(model, dict) or not isinstance(model.get("tables"), list) or not model["tables"]:
        fail("model.tables", "a non-empty list of tables")
    for i, table in enumerate(model["tables"]):
        if not isinstance(table, dict) or not isinstance(table.get("name"), str):
            fail(f"model.tables[{i}].name", "a string")
        for key in ("num_rows", "dim"):
            if not _positive_int(table.get(key)):
                fail(f"model.tables[{i}].{key}", f"a positive integer, got {table.get(key)!r}")
    if not _positive_int(model.get("world_size")):
        fail("model.world_size", f"a positive integer, got {model.get('world_size')!r}")


def _check_prediction(body: dict, where: str, fail: Callable[[str, str], None]) -> None:
    """`predicted` (numbers), `why` (one line) and `intervals` ({figure of predicted: [low, high]})."""
    if not isinstance(body.get("predicted"), dict) or not _numbers(body["predicted"]):
        fail(f"{where}.predicted", "an object of numbers")
    if not isinstance(body.get("why"), str) or not body["why"]:
        fail(f"{where}.why", "a one-line explanation")
    intervals = body.get("intervals", {})
    if not isinstance(intervals, dict):
        fail(f"{where}.intervals", "an object of figure: [low, high]")
    for figure, pair in intervals.items():
        if figure not in body["predicted"]:
            fail(f"{where}.intervals.{figure}",
                 f"a figure of {where}.predicted ({', '.join(body['predicted']) or 'none'})")
        if not (isinstance(pair, list) and len(pair) == 2 and all(_number(x) for x in pair)):
            fail(f"{where}.intervals.{figure}", f"[low, high], two numbers, got {pair!r}")
        if pair[0] > pair[1]:
            fail(f"{where}.intervals.{figure}", f"low <= high, got [{pair[0]}, {pair[1]}]")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _numbers(obj: dict) -> bool:
    """Whether every value is a number or null, or an object/list of such (nested figures)."""
    def ok(v: Any) -> bool:
        if isinstance(v, dict):
            return all(ok(x) for x in v.values())
        if isinstance(v, list):
            return all(ok(x) for x in v)
        return v is None or _number(v)
    return ok(obj)
