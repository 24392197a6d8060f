import pytest

from autofit.core.budget import format_budget, format_bytes, parse_budget
from autofit.core.errors import BudgetError


@pytest.mark.parametrize("text, expected", [
    ("8GB", 8 * 10**9), ("8gb", 8 * 10**9), ("7.5GiB", int(7.5 * 2**30)), ("8000MB", 8 * 10**9),
    ("512MiB", 512 * 2**20), ("512 mib", 512 * 2**20), ("1TB", 10**12), ("100KiB", 102400), ("64B", 64),
])
def test_parse_budget_units(text, expected):
    assert parse_budget(text) == expected


@pytest.mark.parametrize("text", ["8", "0GB", "-1GB", "8 gigs", "GB", "", "8Gb/s", "1e999GB", "nanGB", "8 G"])
def test_parse_budget_rejects(text):
    with pytest.raises(BudgetError) as err:
        parse_budget(text)
    message = str(err.value)
    assert "\n" not in message and "GiB" in message and "GB" in message


def test_lowercase_b_is_bytes_not_bits():
    assert parse_budget("8gb") == parse_budget("8GB")


def test_format_budget_shows_both_units():
    assert format_budget(8 * 10**9) == "8.00 GB (7.45 GiB)"
    assert format_budget(4 * 2**20) == "4.19 MB (4.00 MiB)"
    assert format_bytes(1536 * 2**20) == "1.50 GiB"
    assert format_bytes(12) == "12 B"
