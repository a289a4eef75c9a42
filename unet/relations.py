"""What the position words mean in an image: the one rule the scene generators draw by and the evaluation judges by.

A relation ("left of", "above") holds by GenEval's rule (`relative_position`); each position word puts an object on
one side of an axis (`WORD_SIDES`); and "and" in reading order puts the first-named object first as read
(`first_as_read`). scenes-64's generator draws its relations so that the evaluation's judge accepts them, so both
read them from here.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Box(Protocol):
    """An object's box, as a detection (`eval.detect.Detection`) or a generator's drawing gives it."""
    center: tuple[float, float]  # (x, y) pixels
    size: tuple[float, float]  # (width, height) pixels

# which side of the second object each relation puts the first one on: (axis of Box.center, sign)
RELATION_SIDES = {"left of": (0, -1), "right of": (0, 1), "above": (1, -1), "below": (1, 1)}
# the single-object captions' absolute positions: (axis, side) of the object against the image centre
POSITION_SIDES = {"on the left": (0, -1), "on the right": (0, 1), "on the top": (1, -1), "on the bottom": (1, 1)}
WORD_SIDES = {**RELATION_SIDES, **POSITION_SIDES}  # every position word: (axis, side)


def relative_position(a: Box, b: Box, threshold: float = 0.1) -> set[str]:
    """GenEval's rule: where `a` lies relative to `b`. The centre offset, less `threshold` times the
    summed box sizes on each axis, must remain; then the direction of the offset decides."""
    offset = np.subtract(a.center, b.center, dtype=np.float64)
    dims = np.add(a.size, b.size, dtype=np.float64)
    revised = np.maximum(np.abs(offset) - threshold * dims, 0) * np.sign(offset)
    if np.all(np.abs(revised) < 1e-3):
        return set()
    dx, dy = revised / np.linalg.norm(offset)
    relations = set()
    if dx < -0.5:
        relations.add("left of")
    if dx > 0.5:
        relations.add("right of")
    if dy < -0.5:
        relations.add("above")
    if dy > 0.5:
        relations.add("below")
    return relations


def first_as_read(first: tuple[float, float], second: tuple[float, float]) -> bool:
    """Whether the object centred at `first` (x, y) comes before `second` as read: left of it, or above it when
    they are further apart vertically than horizontally."""
    dx, dy = second[0] - first[0], second[1] - first[1]
    return dx > 0 if abs(dx) > abs(dy) else dy > 0
