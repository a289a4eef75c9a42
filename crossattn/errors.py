"""Bad input from the user, for every command of the project: one exception, one way to report it.

It lives here, at the bottom of the layering, because crossattn never imports unet; `unet.cli`
hands the same names on.
"""

from __future__ import annotations

import math
import sys


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit code 2."""


def shorten(text: str, limit: int = 60) -> str:
    """`text` cut to about `limit` characters, so an error naming a 98 KB prompt stays one short line."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def usage_error(e: Exception | str) -> int:
    """Report bad input as one line on stderr; exit code 2."""
    print(f"error: {shorten(' '.join(str(e).split()), 500)}", file=sys.stderr)
    return 2


def check_number(flag: str, value: float, low: float, high: float, note: str = "") -> None:
    """Raise UsageError unless `value` is a finite number from `low` to `high`: the one check every float option
    passes at the door, so that inf, nan and 1e308 never reach the work (a NaN in a report, an all-black image, a
    FloatingPointError deep in training). `note` says what a value means, e.g. " (0: off)"."""
    if not (math.isfinite(value) and low <= value <= high):
        raise UsageError(f"{flag} must be a finite number from {low:g} to {high:g}{note}, got {value}")
