"""How rlmm writes a number for people (tables, console summaries): one rule, so the same value reads the
same everywhere. A leaf module: it imports nothing of rlmm."""
from __future__ import annotations

import math


def format_number(value) -> str:
    """4 significant digits: `.3e` when 0 < |v| < 1e-2 or |v| >= 1e4, else 4 decimals; near ±1 (correlations,
    ratios) enough decimals to show 3 digits of the gap to 1. An int is written whole, and None, NaN and
    ±inf as `str(value)`.

        format_number(7.6e-5) == "7.600e-05"      format_number(0.25) == "0.2500"
        format_number(0.9999598) == "0.9999598"   format_number(12) == "12"
    """
    if value is None or isinstance(value, int) or not math.isfinite(value):
        return str(value)
    if 0.99 < abs(value) < 1:
        return f"{value:.{math.ceil(-math.log10(1 - abs(value))) + 2}f}"
    return f"{value:.3e}" if value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e4) else f"{value:.4f}"
