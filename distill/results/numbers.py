"""How the results print a column of measured figures: one precision rule for every table.

Why per column: a fixed ``.4g`` prints 381.0 as "381" next to "381.3" (mixed precision), and
prints 381.25 and 381.31 both as "381.3", so a gap the run measured vanishes. Here every value of
a column gets the same number of significant digits, trailing zeros kept: the fewest (at least
:data:`MIN_DIGITS`) at which values that differ print differently. Imports nothing heavy: the
sweep summary uses it from Hydra's callback.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

MIN_DIGITS = 4
MAX_DIGITS = 12
"""Past this a difference is float noise, not a measurement."""
MISSING = "–"


def _present(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


def digits_for(values: Iterable[object]) -> int:
    """The fewest significant digits (at least MIN_DIGITS) that keep distinct values distinct."""
    numbers = sorted({float(v) for v in values if _present(v)})
    for digits in range(MIN_DIGITS, MAX_DIGITS + 1):
        if len({_format(v, digits) for v in numbers}) == len(numbers):
            return digits
    return MAX_DIGITS


def column_format(values: Iterable[object]) -> Callable[[object], str]:
    """A formatter for the column holding ``values``: the same digits for each, a dash for none."""
    digits = digits_for(values)
    return lambda value: _format(float(value), digits) if _present(value) else MISSING


def format_column(values: list[object]) -> list[str]:
    """``values`` printed at their column's precision."""
    fmt = column_format(values)
    return [fmt(value) for value in values]


def signed_percent(fraction: float) -> str:
    """``fraction`` as a signed percentage with two decimals, more when a gap is smaller than that
    (two significant digits): a measured gap of 0.0016% does not print as +0.00%."""
    if not _present(fraction):
        return MISSING
    percent = 100 * fraction
    decimals = 2 if percent == 0 else max(2, 1 - math.floor(math.log10(abs(percent))))
    return f"{percent:+.{min(decimals, MAX_DIGITS)}f}%"


def ratio_to_one(ratio: float) -> str:
    """A ratio at the precision that tells it from 1 (1.0002x, not 1.000x)."""
    return column_format([1.0, ratio])(ratio)


def _format(value: float, digits: int) -> str:
    """``digits`` significant digits, trailing zeros kept (``#g``) but no bare trailing point."""
    if value == 0:
        return "0"
    return f"{value:#.{digits}g}".rstrip(".").replace(".e", "e")


def assisted_sentence(assisted: dict) -> str:
    """One paragraph: the teacher alone against the teacher with this student drafting (also in the model card)."""
    same = ("the same tokens as the teacher alone" if assisted["same"] == assisted["prompts"]
            else f"**different tokens on {assisted['prompts'] - assisted['same']} of {assisted['prompts']} prompts**")
    return (f"Assisted decoding (the teacher's `generate(..., assistant_model=student)`, greedy, "
            f"{assisted['prompts']} held-out prompts of {assisted['prompt_tokens']} tokens, "
            f"{assisted['new_tokens'] // max(assisted['prompts'], 1)} new tokens each, prefill included): "
            f"{assisted['alone_ms_per_token']:.2f} ms/token alone, {assisted['assisted_ms_per_token']:.2f} with "
            f"this student drafting ({assisted['speedup']:.2f}x); {assisted['accepted']} of {assisted['drafted']} "
            f"drafted tokens accepted ({assisted['acceptance']:.0%}); {same}.")
