"""Which policy sections `analyze` recommends, and what they predict together (DESIGN.md §5).

A section is recommended only when its predicted gain exceeds the model's error on this run: the
upper end of its step-time interval (`intervals.step_time_s`, the prediction ± analyses.network's
error) lies below the measured baseline step time (analyses.network's rule). A section without an
interval takes ± (the fit's residual + the baseline's drift). Otherwise it is written with
`recommended: false` and the reason, and neither `optimize` nor the trainer applies it. Also not
recommended: a section that changes nothing (no hot row), one without a measured step time, tiers
on nodes of one rank (replication by another name), and a lossy section (analyses.quality.LOSSY)
whose model-quality cost is not measured or is beyond the quality budget: it must harm neither speed
nor the model.

The trainer unions the rows of replication, tiers and schedule when they are applied together,
so at most one of them is recommended: the one of least predicted step time. `combined` is the
prediction for every recommended training section applied together: bytes from the exchange
section and the compression parts; step time the replay of their changes composed where the run
replays (analyses/replay/), else the baseline plus their changes, its error the root of the sum of
their squared errors. The changes add, except where two sections save the same time:
compression.mp shrinks the output all-to-all that an exchange section (replication, tiers,
schedule) has already shrunk, so its change counts in proportion to the all-to-all bytes the
exchange section leaves (on pool8-z1.4-100mbit the plain sum predicted 0 ms against a measured
35.8 ms, bench/RESULTS.md §30).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Callable

from analyses.network import Network
from analyses.quality import LOSSY, Budget
from tracekit.figures import A2A_BYTES, DP_BYTES, STEP_TIME, SYNC_BYTES
from tracekit.policy import TRAINING, Combined, Policy, Prediction, Section, Tiers, nothing_to_apply

EXCHANGE = ("replication", "tiers", "schedule")


def decide(policy: Policy, net: Network, budget: Budget = Budget(), together: Callable | None = None) -> Policy:
    """`policy` with `recommended` (and the `reason` where false) set on every section, and its
    `combined` prediction where more than one training section is recommended: `together(labels)`, the
    replay of their changes composed (analyses.replay.prediction.together), where it gives one."""
    base = net.step.median_s
    decided: dict[str, Section] = {}
    for label, section in policy.sections.items():
        reason = (nothing_to_apply(section) or _replication_by_another_name(section) or no_gain(label, section, base, net)
                  or (budget.exceeded_by(section.prediction.figures, section.prediction.intervals)
                      if label in LOSSY else None))
        decided[label] = replace(section, recommended=reason is None, reason=reason)
    chosen = [label for label in EXCHANGE if label in decided and decided[label].recommended]
    if len(chosen) > 1:
        best = min(chosen, key=lambda label: decided[label].prediction.figures[STEP_TIME])
        for label in chosen:
            if label != best:
                decided[label] = replace(decided[label], recommended=False, reason=(
                    f"{best} predicts a faster step ({_ms(decided[best])} against {_ms(decided[label])}); "
                    "the trainer would apply the union of their rows"))
    chosen = {label: decided[label] for label in TRAINING if label in decided and decided[label].recommended}
    both = combined(policy.baseline, chosen, base, net, together) if len(chosen) > 1 and base is not None else None
    return replace(policy, sections=decided, combined=both)


def _replication_by_another_name(section: Section) -> str | None:
    """Tiers on nodes of one rank: a copy per node is a replica on every rank, so the section is
    replication with its sync split in two, and replication's section decides (measured on a 2x1
    cluster: tiers recommended at 1.87x, replication 1.97x)."""
    if isinstance(section, Tiers) and int(section.topology.get("nodes", 1)) > 1 \
            and int(section.topology.get("ranks_per_node", 1)) == 1:
        return "one rank per node: tier 2 is a replica on every rank, which the replication section is"
    return None


def no_gain(label: str, section: Section, base: float | None, net: Network) -> str | None:
    predicted = section.prediction.figures
    step = predicted.get(STEP_TIME)
    if label == "lag" and base is not None and predicted.get("gain") is not None:
        step = base * (1 - predicted["gain"])  # the lag model's gain over its own replay of the bound-0 steps
    if base is None or step is None:
        return "no measured step time to compare with: the gain is unknown"
    low, high = interval(section.prediction, net, step)
    if high < base:
        return None
    return (f"predicted step {step * 1e3:.2f} ms against the measured {base * 1e3:.2f} ms: a gain of "
            f"{(base - step) * 1e3:+.2f} ms, within the model's error (±{(high - step) * 1e3:.2f} ms: "
            "its interval: the replayed steps' spread and the baseline's drift)")


def interval(prediction: Prediction, net: Network, step: float | None = None) -> tuple[float, float]:
    step = float(prediction.figures[STEP_TIME] if step is None else step)
    given = prediction.intervals.get(STEP_TIME)
    if given:
        return float(given[0]), float(given[1])
    error = net.fit.residual_s + net.step.spread_s
    return step - error, step + error


def combined(baseline: dict, sections: dict[str, Section], base: float, net: Network,
             together: Callable | None = None) -> Combined:
    """The prediction for `sections` applied together (module docstring)."""
    exchange = next((section.prediction.figures for label, section in sections.items() if label in EXCHANGE), None)
    left = _a2a_left(baseline, exchange)
    replayed = together(list(sections)) if together is not None else None
    if replayed is not None:
        step, span = replayed.step_s, (max(replayed.low_s, 0.0), replayed.high_s)
    else:
        change, variance = 0.0, 0.0
        for label, section in sections.items():
            low, high = interval(section.prediction, net)
            weight = left if label == "compression.mp" else 1.0
            change += weight * (float(section.prediction.figures[STEP_TIME]) - base)
            variance += (weight * (high - low) / 2) ** 2
        step = max(base + change, 0.0)
        span = (max(step - math.sqrt(variance), 0.0), step + math.sqrt(variance))
    predicted = {STEP_TIME: step}
    a2a = (exchange or {}).get(A2A_BYTES, baseline.get(A2A_BYTES))
    mp = sections.get("compression.mp")
    if a2a is not None:
        if mp is not None and baseline.get(A2A_BYTES):
            a2a *= mp.prediction.figures[A2A_BYTES] / baseline[A2A_BYTES]
        predicted[A2A_BYTES] = float(a2a)
    if exchange is not None:
        predicted[SYNC_BYTES] = float(exchange.get(SYNC_BYTES, 0.0))
    if "compression.dp" in sections:
        predicted[DP_BYTES] = float(sections["compression.dp"].prediction.figures[DP_BYTES])
    labels = list(sections)
    how = ("the recorded steps replayed with their changes together" if replayed is not None else
           f"the baseline's {base * 1e3:.2f} ms plus each section's predicted change"
           + (f", compression.mp's at the {left:.0%} of all-to-all bytes the exchange section leaves"
              if mp is not None and exchange is not None else ""))
    why = (f"{', '.join(labels)} together: {how}, bytes from the exchange section"
           + (" scaled by compression.mp's ratio" if mp is not None else ""))
    return Combined(tuple(labels), Prediction(predicted, why, {STEP_TIME: span}))


def _a2a_left(baseline: dict, exchange: dict | None) -> float:
    """The share of the baseline's all-to-all bytes an exchange section's prediction leaves (1: none)."""
    if exchange is None or not baseline.get(A2A_BYTES) or exchange.get(A2A_BYTES) is None:
        return 1.0
    return min(max(float(exchange[A2A_BYTES]) / float(baseline[A2A_BYTES]), 0.0), 1.0)


def _ms(section: Section) -> str:
    return f"{section.prediction.figures[STEP_TIME] * 1e3:.2f} ms"
