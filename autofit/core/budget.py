"""Parse memory budgets such as ``8GB``, ``8G`` or ``7.5GiB`` into bytes, and format bytes back.

Units: ``KB``, ``MB``, ``GB``, ``TB`` are powers of 1000 and ``KiB``, ``MiB``, ``GiB``, ``TiB`` powers of
1024 (IEC 80000-13); a bare ``K``, ``M``, ``G`` or ``T`` is the decimal unit (``8G`` is ``8GB``,
8×10⁹ bytes, as with ``8GB``), in any case. A ``b`` is always bytes, never bits (``8gb`` is ``8GB``).
"""

from __future__ import annotations

import math
import re

from autofit.core.errors import BudgetError

# Decimal units are powers of 1000, binary units powers of 1024 (IEC 80000-13).
_UNIT_BYTES = {
    "b": 1,
    "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,  # shorthand: the decimal unit, as 8G = 8GB
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_BUDGET_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]+)\s*$")
ACCEPTED_FORMS = ("a positive number with a unit: B, KB, MB, GB, TB (powers of 1000; K, M, G, T alone are the same: "
                  "8G = 8GB) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 8GB, 8G, 7.5GiB, 512MiB")


def parse_budget(text: str | int) -> int:
    """Return the budget in bytes.

    >>> parse_budget("8GB"), parse_budget("8G"), parse_budget("512MiB")
    (8000000000, 8000000000, 536870912)

    Raises BudgetError for a bare number, zero, a negative value or an unknown unit.
    An ``int`` is taken as bytes already (the Python API's convenience).
    """
    if isinstance(text, bool):
        raise BudgetError(f"invalid budget {text!r}: expected {ACCEPTED_FORMS}")
    if isinstance(text, int):
        if text <= 0:
            raise BudgetError(f"invalid budget {text!r}: must be positive; expected {ACCEPTED_FORMS}")
        return text
    match = _BUDGET_RE.match(str(text))
    if not match or match.group(2).lower() not in _UNIT_BYTES:
        raise BudgetError(f"invalid budget {text!r}: expected {ACCEPTED_FORMS}")
    value = float(match.group(1)) * _UNIT_BYTES[match.group(2).lower()]
    if not math.isfinite(value) or int(value) <= 0:
        raise BudgetError(f"invalid budget {text!r}: must be positive and finite; expected {ACCEPTED_FORMS}")
    return int(value)


def format_bytes(n_bytes: float) -> str:
    """Bytes as the largest fitting binary unit, e.g. ``1.50 GiB``."""
    n = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            break
        n /= 1024
    return f"{n:.0f} B" if unit == "B" else f"{n:.2f} {unit}"


def format_budget(budget_bytes: int) -> str:
    """A budget in both unit systems, e.g. ``8.00 GB (7.45 GiB)`` or ``4.19 MB (4.00 MiB)``."""
    for decimal, binary, unit in ((10**9, 2**30, "G"), (10**6, 2**20, "M"), (10**3, 2**10, "K")):
        if budget_bytes >= decimal:
            return f"{budget_bytes / decimal:.2f} {unit}B ({budget_bytes / binary:.2f} {unit}iB)"
    return f"{budget_bytes} B"
