"""Bad input from the user, for every command of the project: one exception, one way to report it.

It lives here, at the bottom of the layering, because crossattn never imports unet; `unet.cli`
hands the same names on.
"""

from __future__ import annotations

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
