"""Which policy sections `analyze` recommends, and what they predict together (DESIGN.md §5).

A section is recommended only when its predicted gain exceeds the model's error on this run: the
upper end of its step-time interval (`intervals.step_time_s`, the prediction ± analyses.network's
error) lies below the measured baseline step time (analyses.network's rule). A section without an
interval takes ± (the fit's residual + the baseline's drift). Otherwise it is written with
`recommended: false` and the reason, and neither `optimize` nor the trainer applies it. Also not
recommended: a section the reference trainer cannot apply on the recorded topology (tier-2 rows
across nodes), one that changes nothing (no hot row), one without a measured step time.

The trainer unions the rows of replication, tiers and schedule when they are applied together,
so at most one of them is recommended: the one of least predicted step time. `combined` is the
prediction for every recommended training section applied together: bytes from the exchange
section and the compression parts, step time the baseline plus the sum of their changes, its
error the root of the sum of their squared errors.
"""

from __future__ import annotations

import math

from analyses.network import Network
from tracekit.figures import A2A_BYTES, DP_BYTES, STEP_TIME, SYNC_BYTES
from tracekit.policy import LABELS, TRAINING, nothing_to_apply, recommended, section_part

EXCHANGE = ("replication", "tiers", "schedule")


def decide(policy: dict, net: Network) -> None:
    """Set `recommended` (and `reason` where false) on every section of `policy`, and its
    `combined` prediction where more than one training section is recommended."""
    base = net.step.median_s
    for label in LABELS:
        body = section_part(policy, label)
        if body is None:
            continue
        reason = nothing_to_apply(label, body) or no_gain(label, body, base, net)
        body["recommended"] = reason is None
        body.pop("reason", None)
        if reason:
            body["reason"] = reason
    chosen = [label for label in EXCHANGE if _recommended(policy, label)]
    if len(chosen) > 1:
        best = min(chosen, key=lambda label: section_part(policy, label)["predicted"][STEP_TIME])
        for label in chosen:
            if label != best:
                body = section_part(policy, label)
                body["recommended"] = False
                body["reason"] = (f"{best} predicts a faster step ({_ms(section_part(policy, best))} against "
                                  f"{_ms(body)}); the trainer would apply the union of their rows")
    policy.pop("combined", None)
    together = [label for label in TRAINING if _recommended(policy, label)]
    if len(together) > 1 and base is not None:
        policy["combined"] = combined(policy, together, base, net)


def no_gain(label: str, body: dict, base: float | None, net: Network) -> str | None:
    predicted = body.get("predicted", {})
    step = predicted.get(STEP_TIME)
    if label == "lag" and base is not None and predicted.get("gain") is not None:
        step = base * (1 - predicted["gain"])  # the lag model's gain over its own replay of the bound-0 steps
    if base is None or step is None:
        return "no measured step time to compare with: the gain is unknown"
    low, high = interval(body, net, step)
    if high < base:
        return None
    return (f"predicted step {step * 1e3:.2f} ms against the measured {base * 1e3:.2f} ms: a gain of "
            f"{(base - step) * 1e3:+.2f} ms, within the model's error (±{(high - step) * 1e3:.2f} ms: "
            "the fit's residuals, the baseline's drift)")


def interval(body: dict, net: Network, step: float | None = None) -> tuple[float, float]:
    step = float(body["predicted"][STEP_TIME] if step is None else step)
    given = body.get("intervals", {}).get(STEP_TIME)
    if given:
        return float(given[0]), float(given[1])
    error = net.fit.residual_s + net.step.spread_s
    return step - error, step + error


def combined(policy: dict, labels: list[str], base: float, net: Network) -> dict:
    """The prediction for `labels` applied together (module docstring)."""
    change, variance = 0.0, 0.0
    for label in labels:
        body = section_part(policy, label)
        low, high = interval(body, net)
        change += float(body["predicted"][STEP_TIME]) - base
        variance += ((high - low) / 2) ** 2
    step = max(base + change, 0.0)
    error = math.sqrt(variance)
    predicted = {STEP_TIME: step}
    exchange = next((section_part(policy, label) for label in labels if label in EXCHANGE), None)
    baseline = policy.get("baseline", {})
    a2a = (exchange or {}).get("predicted", {}).get(A2A_BYTES, baseline.get(A2A_BYTES))
    mp = section_part(policy, "compression.mp") if "compression.mp" in labels else None
    if a2a is not None:
        if mp is not None and baseline.get(A2A_BYTES):
            a2a *= mp["predicted"][A2A_BYTES] / baseline[A2A_BYTES]
        predicted[A2A_BYTES] = float(a2a)
    if exchange is not None:
        predicted[SYNC_BYTES] = float(exchange["predicted"].get(SYNC_BYTES, 0.0))
    if "compression.dp" in labels:
        predicted[DP_BYTES] = float(section_part(policy, "compression.dp")["predicted"][DP_BYTES])
    return {"sections": labels, "predicted": predicted,
            "intervals": {STEP_TIME: [max(step - error, 0.0), step + error]},
            "why": (f"{', '.join(labels)} together: the baseline's {base * 1e3:.2f} ms plus each section's predicted "
                    "change (assumed additive), bytes from the exchange section"
                    + (" scaled by compression.mp's ratio" if mp is not None else ""))}


def _recommended(policy: dict, label: str) -> bool:
    body = section_part(policy, label)
    return body is not None and recommended(body)


def _ms(body: dict) -> str:
    return f"{body['predicted']['step_time_s'] * 1e3:.2f} ms"
