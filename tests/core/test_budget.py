import pytest

from autofit.core.budget import format_budget, format_bytes, parse_budget
from autofit.core.errors import BudgetError


@pytest.mark.parametrize("text, expected", [
    ("8GB", 8 * 10**9), ("8gb", 8 * 10**9), ("7.5GiB", int(7.5 * 2**30)), ("8000MB", 8 * 10**9),
    ("512MiB", 512 * 2**20), ("512 mib", 512 * 2**20), ("1TB", 10**12), ("100KiB", 102400), ("64B", 64),
    # the shorthand: a bare K, M, G, T is the decimal unit, in either case
    ("8G", 8 * 10**9), ("8g", 8 * 10**9), ("8 G", 8 * 10**9), ("1.5G", 1_500_000_000), ("512M", 512 * 10**6),
    ("512m", 512 * 10**6), ("100K", 100_000), ("100k", 100_000), ("1T", 10**12), ("1t", 10**12),
])
def test_parse_budget_units(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text", ["8", "0GB", "-1GB", "8 gigs", "GB", "", "8Gb/s", "1e999GB", "nanGB", "8Gi", "0G", "-8G", "G", "8P"])
def test_parse_budget_rejects(text):
    with pytest.raises(BudgetError) as err:
        parse_budget(text)
    message = str(err.value)
    assert "\n" not in message and "GiB" in message and "GB" in message


def test_lowercase_b_is_bytes_not_bits():
    assert parse_budget("8gb") == parse_budget("8GB") == parse_budget("8Gb") == parse_budget("8G")


def test_the_shorthand_is_decimal_and_the_error_says_so():
    assert parse_budget("8G") == parse_budget("8GB") != parse_budget("8GiB")
    with pytest.raises(BudgetError) as err:
        parse_budget("8Gi")
    assert "8G = 8GB" in str(err.value) and "powers of 1000" in str(err.value)


def test_format_budget_shows_both_units():
    assert format_budget(8 * 10**9) == "8.00 GB (7.45 GiB)"
    assert format_budget(4 * 2**20) == "4.19 MB (4.00 MiB)"
    assert format_bytes(1536 * 2**20) == "1.50 GiB"
    assert format_bytes(12) == "12 B"
