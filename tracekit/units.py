"""Sizes, rates and durations as people type them (`64MiB`, `5%`, `1gbit`, `50us`) and as people
read them (`21.11 kB`, `200 Mbit/s`, `11.6 ms`, `7.4%`, `1.23×`, `1,536`): every number the console
and the report print is formatted here. A figure's unit comes from its name (`UNITS`, the one place
that decides it, for the console and the report alike).

    parse_bytes("64MiB") == 67108864          parse_rate("1gbit") == 125e6   (bytes per second)
    parse_budget("5%") == (None, 0.05)        parse_budget("1e6") == (1000000, None)
    format_bytes(21109) == "21.11 kB"         format_seconds(0.011577) == "11.6 ms"
    show("a2a_bytes_per_step", 21109.0) == "21.11 kB"     show("step_time_s", 0.011577) == "11.6 ms"
    show("saving", 0.0738) == "7.4%"                      show("speedup", 1.234) == "1.23×"
    show("lookups", 1536.0) == "1,536"                    show("zipf_alpha", 1.0234) == "1.02"
    show("step_time_s", 0.011577, ms=True) == "11.6 ms"  (the console's fixed milliseconds)
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

_BYTES = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "kib": 1024, "m": 1e6, "mb": 1e6, "mib": 1024**2,
          "g": 1e9, "gb": 1e9, "gib": 1024**3, "t": 1e12, "tb": 1e12, "tib": 1024**4}
_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_NUMBER = r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*"


def parse_bytes(text: str) -> int:
    """A byte count: a number with an optional unit (B, kB, MB, GB, KiB, MiB, GiB, ...)."""
    match = re.fullmatch(_NUMBER + r"([a-z]*)\s*", text.strip().lower())
    if not match or match.group(2) not in _BYTES:
        raise ValueError(f"expected a size such as 67108864, 64MiB or 2GB, got {text!r}")
    return int(float(match.group(1)) * _BYTES[match.group(2)])


def parse_budget(text: str) -> tuple[int | None, float | None]:
    """(bytes, None) for a size, (None, fraction) for a percentage such as `5%`."""
    text = text.strip()
    if text.endswith("%"):
        try:
            fraction = float(text[:-1]) / 100
        except ValueError:
            raise ValueError(f"expected a percentage such as 5%, got {text!r}") from None
        if not 0 < fraction <= 1:
            raise ValueError(f"expected a percentage in (0, 100], got {text!r}")
        return None, fraction
    size = parse_bytes(text)
    if size < 1:
        raise ValueError(f"expected a size of at least 1 byte, got {text!r} (a share of the embedding bytes "
                         f"is written as a percentage, e.g. 20%)")
    return size, None


def parse_rate(text: str) -> float:
    """Bytes per second from `1gbit`, `100Mbit`, `12.5GB/s`, `1e9` (bytes/s)."""
    lowered = text.strip().lower().removesuffix("/s").removesuffix("ps")
    match = re.fullmatch(_NUMBER + r"([a-z]*)\s*", lowered)
    if match and match.group(2) in _BITS:
        return float(match.group(1)) * _BITS[match.group(2)] / 8
    if match and match.group(2) in _BYTES:
        return float(match.group(1)) * _BYTES[match.group(2)]
    raise ValueError(f"expected a rate such as 1gbit, 100Mbit or 12.5GB/s, got {text!r}")


def format_bytes(n: float) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def parse_duration(text: str) -> float:
    """Seconds from `50us`, `0.5ms`, `2s`, `0` (a bare number is seconds)."""
    match = re.fullmatch(_NUMBER + r"(us|µs|ms|s|)\s*", text.strip().lower())
    if not match:
        raise ValueError(f"expected a duration such as 50us, 0.5ms or 0, got {text!r}")
    return float(match.group(1)) * {"us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "": 1.0}[match.group(2)]


def format_rate(bytes_per_s: float) -> str:
    """`200 Mbit/s` from bytes per second."""
    bits = bytes_per_s * 8
    for unit, size in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bits >= size:
            return f"{bits / size:,.4g} {unit}"
    return f"{bits:,.0f} bit/s"


def significant(value: float, digits: int = 3) -> str:
    """`value` rounded to `digits` significant digits, in plain notation with thousands separators."""
    if value == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(value))))
    return f"{value:,.{decimals}f}"


def format_seconds(value: float) -> str:
    """`11.6 ms`, `1.23 s`, `25.0 µs`: 3 significant digits in the largest unit under the value."""
    for unit, size in (("s", 1.0), ("ms", 1e-3)):
        if abs(value) >= size:
            return f"{significant(value / size)} {unit}"
    return "0 s" if value == 0 else f"{significant(value / 1e-6)} µs"


def format_percent(fraction: float) -> str:
    return f"{fraction:.1%}"


def format_times(ratio: float) -> str:
    return f"{ratio:,.2f}×"


def format_count(value: float) -> str:
    return f"{value:,.0f}"


def format_ms(seconds: float, decimals: int = 1, *, separators: bool = True) -> str:
    """`1,234.56 ms`: seconds in milliseconds with `decimals` decimals (`separators` False: no thousands commas)."""
    return f"{seconds * 1e3:{',' if separators else ''}.{decimals}f} ms"


def format_us(seconds: float, decimals: int = 1) -> str:
    """`12.5 µs`: seconds in microseconds, thousands separated."""
    return f"{seconds * 1e6:,.{decimals}f} µs"


def format_ns(seconds: float) -> str:
    """`3.2 ns`: seconds in nanoseconds, one decimal, thousands separated."""
    return f"{seconds * 1e9:,.1f} ns"


def format_duration(seconds: float) -> str:
    """A rough duration for a person: "5 s", "40 s", "3 min"."""
    if seconds < 10:
        return f"{max(1, round(seconds))} s"
    if seconds < 90:
        return f"{round(seconds / 5) * 5} s"
    return f"{round(seconds / 60)} min"


def format_decimal(value: float, decimals: int = 4, *, sign: bool = False) -> str:
    """`0.7812`, or `+0.0012` with `sign`: a fixed number of decimals (AUC, log loss, their changes)."""
    return f"{value:{'+' if sign else ''}.{decimals}f}"


def format_relative(fraction: float) -> str:
    """`+1.25%`: a relative change, signed, two decimals."""
    return f"{fraction:+.2%}"


def format_general(value: float, digits: int = 4) -> str:
    """`1,234`, `0.0123`, `1.235e+07`: `digits` significant digits, thousands separated."""
    return f"{value:,.{digits}g}"


def format_cell(value: Any) -> str:
    """A table cell of any type: a float with 4 significant digits, an int with thousands separators,
    None empty, anything else as str."""
    if isinstance(value, float):
        return format_general(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return "" if value is None else str(value)


def number(value: float) -> str:
    """A figure without a unit: an integer as a count, anything else with 3 significant digits."""
    return format_count(value) if float(value).is_integer() else significant(value)


UNITS: tuple[tuple[str, Callable[[float], str]], ...] = (
    (r"rel_change$", format_relative),
    (r"_change$", lambda v: format_decimal(v, sign=True)),
    (r"bytes_per_s$|_bw$", format_rate),
    (r"bytes", format_bytes),
    (r"fraction|share|coverage|saving|gain|(keep|miss)_ratio", format_percent),
    (r"ratio|speedup", format_times),
    (r"samples_per_s$|rows|count|lookups|steps|elements|every|bound", format_count),
    (r"_s$", format_seconds),
)
"""(pattern, formatter): the first pattern found in a name (its last dotted part) picks the unit."""


def show(name: str, value: Any, *, ms: bool = False) -> str:
    """`value` of the figure or column `name` in the unit its name says; text as it is, `–` for none.
    `ms`: a time in milliseconds with one decimal (`11.6 ms`, as `tracekit analyze` prints its
    policies' figures) rather than 3 significant digits in the largest unit under it (the report's)."""
    if value is None or isinstance(value, float) and not math.isfinite(value):
        return "–"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    key = name.rsplit(".", 1)[-1]
    for pattern, formatter in UNITS:
        if re.search(pattern, key):
            return format_ms(value, separators=False) if ms and formatter is format_seconds else formatter(value)
    return number(value)


PREDICTION_UNITS: dict[str, Callable[[float], str]] = {
    "bytes": format_bytes, "s": lambda v: format_ms(v, 2), "fraction": format_percent,
    "auc": lambda v: format_decimal(v, sign=True), "relative": format_relative}
"""How `tracekit compare` prints a figure of a predicted-against-measured row by the row's `unit`
(analyses.prediction_check)."""


def format_diff(row: dict, missing: str) -> str:
    """Measured against predicted of a predicted-against-measured row: a share's in points, an AUC
    change's as a difference, others in %; `missing` where the row has none."""
    diff = row["diff_pct"] if row["unit"] not in ("auc", "relative", "fraction") else row["diff"]
    if diff is None:
        return missing
    if row["unit"] == "auc":
        return format_decimal(diff, sign=True)
    if row["unit"] == "relative":
        return f"{diff * 100:+.2f} pts"
    if row["unit"] == "fraction":
        return f"{diff * 100:+.1f} pts"
    return f"{diff:+.1%}"
