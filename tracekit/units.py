"""Sizes, rates and durations as people type them (`64MiB`, `5%`, `1gbit`, `50us`) and as people
read them (`21.11 kB`, `200 Mbit/s`, `11.6 ms`, `7.4%`, `1.23×`, `1,536`).

    parse_bytes("64MiB") == 67108864          parse_rate("1gbit") == 125e6   (bytes per second)
    parse_budget("5%") == (None, 0.05)        parse_budget("1e6") == (1000000, None)
    format_bytes(21109) == "21.11 kB"         format_seconds(0.011577) == "11.6 ms"
"""

from __future__ import annotations

import math
import re

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
