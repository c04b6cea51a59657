"""How the report shows a number: the unit comes from the figure's or column's name (`UNITS`, the one
place that decides it), bytes and rates as the console prints them (tracekit.units), the rest with
at most 3 significant digits and never an exponent.

    show("a2a_bytes_per_step", 21109.0) == "21.11 kB"     show("step_time_s", 0.011577) == "11.6 ms"
    show("saving", 0.0738) == "7.4%"                      show("speedup", 1.234) == "1.23×"
    show("lookups", 1536.0) == "1,536"                    show("zipf_alpha", 1.0234) == "1.02"
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

from tracekit.units import (format_bytes, format_count, format_percent, format_rate, format_seconds, format_times,
                            significant)


def number(value: float) -> str:
    """A figure without a unit: an integer as a count, anything else with 3 significant digits."""
    return format_count(value) if float(value).is_integer() else significant(value)


UNITS: tuple[tuple[str, Callable[[float], str]], ...] = (
    (r"rel_change$", lambda v: f"{v:+.2%}"),
    (r"_change$", lambda v: f"{v:+.4f}"),
    (r"bytes_per_s$|_bw$", format_rate),
    (r"bytes", format_bytes),
    (r"fraction|share|coverage|saving|gain|(keep|miss)_ratio", format_percent),
    (r"ratio|speedup", format_times),
    (r"samples_per_s$|rows|count|lookups|steps|elements|every|bound", format_count),
    (r"_s$", format_seconds),
)
"""(pattern, formatter): the first pattern found in a name (its last dotted part) picks the unit."""


def show(name: str, value: Any) -> str:
    """`value` of the figure or column `name` as the report prints it; text as it is, `–` for none."""
    if value is None or isinstance(value, float) and not math.isfinite(value):
        return "–"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    key = name.rsplit(".", 1)[-1]
    for pattern, formatter in UNITS:
        if re.search(pattern, key):
            return formatter(value)
    return number(value)
