"""Choosing words to control: token positions of named words, and WORD=FACTOR items."""

from __future__ import annotations

import math

from ..text import Word
from .reweight import check_factor


def word_positions(words: list[Word], names: list[str], what: str) -> dict[str, list[int]]:
    """Token positions of each named word (every occurrence); ValueError naming unknown words."""
    texts = [w.text for w in words]
    unknown = [n for n in names if n not in texts]
    if unknown:
        raise ValueError(f"{what}: {unknown} not in the prompt; its words are {texts}")
    return {n: [t for w in words if w.text == n for t in w.tokens] for n in names}


def parse_weights(items: list[str]) -> dict[str, float]:
    """'red=2' items -> {'red': 2.0}; ValueError naming an item that is not WORD=NUMBER within +-MAX_FACTOR, or a
    word given twice with different factors (the same factor twice is one item)."""
    weights = {}
    for item in items:
        word, sep, value = item.partition("=")
        try:
            factor = float(value)
        except ValueError:
            factor = None
        if not sep or not word or factor is None or not math.isfinite(factor):
            raise ValueError(f"--reweight {item!r}: expected WORD=NUMBER with a finite number, e.g. red=2")
        check_factor(f"--reweight {item!r}", factor)
        if weights.get(word, factor) != factor:
            raise ValueError(f"--reweight gives {word!r} two factors ({weights[word]:g} and {factor:g}): give it once")
        weights[word] = factor
    return weights
