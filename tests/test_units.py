"""Sizes and rates as typed on the command line (tracekit/units.py)."""

import pytest

from tracekit.units import format_bytes, parse_budget, parse_bytes, parse_rate


def test_sizes_rates_and_budgets() -> None:
    assert parse_bytes("64MiB") == 64 * 2**20 and parse_bytes("2GB") == 2_000_000_000 and parse_bytes("1e6") == 10**6
    assert parse_rate("1gbit") == 125e6 and parse_rate("100Mbit/s") == 12.5e6 and parse_rate("12.5GB/s") == 12.5e9
    assert parse_budget("5%") == (None, 0.05) and parse_budget("4096") == (4096, None)
    assert format_bytes(2.6e6) == "2.60 MB" and format_bytes(12) == "12 B"


@pytest.mark.parametrize(("parse", "text", "message"), [
    (parse_bytes, "64 apples", "expected a size such as"),
    (parse_rate, "fast", "expected a rate such as"),
    (parse_budget, "150%", "expected a percentage in (0, 100]"),
    (parse_budget, "x%", "expected a percentage such as 5%"),
    (parse_budget, "0.2", "expected a size of at least 1 byte"),
])
def test_bad_values_name_what_was_expected(parse, text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse(text)
