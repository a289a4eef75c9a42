"""Re-weighting (Hertz et al. 2022, prompt-to-prompt's "equalizer"): multiply chosen tokens' weights by
a factor, in chosen layers and part of the run."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import Recipe, check_share

# Weights are not renormalised, so a factor scales what the layer adds to the image; far beyond this the
# next norms square values past float32's range (1e30 gave an all-black image, 1e300 is not a float32 at all).
MAX_FACTOR = 1000.0


def check_factor(what: str, factor: float) -> None:
    """ValueError unless `factor` is a finite number within +-MAX_FACTOR."""
    if not (isinstance(factor, (int, float)) and math.isfinite(factor) and abs(factor) <= MAX_FACTOR):
        raise ValueError(f"{what}: a re-weighting factor must be a finite number from {-MAX_FACTOR:g} to "
                         f"{MAX_FACTOR:g}, got {factor!r}")


@dataclass
class Reweight(Recipe):
    """Scale the attention weights of some tokens (prompt-to-prompt's equalizer), not renormalised."""
    factors: dict[int, float]  # token position -> factor
    layers: list[str] | None = None  # layer names; None: every cross-attention layer
    steps: tuple[float, float] = (0.0, 1.0)  # [start, end) shares of the run

    def __post_init__(self):
        for position, factor in self.factors.items():
            if not isinstance(position, int) or position < 0:
                raise ValueError(f"factors: token positions must be integers >= 0, got {position!r}")
            check_factor(f"factors[{position}]", factor)
        check_share("reweight start", self.steps[0])
        check_share("reweight end", self.steps[1])
        if self.steps[0] > self.steps[1]:  # an empty window (start == end) is a way to switch it off
            raise ValueError(f"steps {tuple(self.steps)} is a reversed window: start must not be after end")

    def weights(self, ctl, name, cross, progress, own, new):
        if not cross or not self.steps[0] <= progress < self.steps[1] or \
                (self.layers is not None and name not in self.layers):
            return new
        beyond = [p for p in self.factors if p >= own.shape[-1]]
        if beyond:
            raise ValueError(f"factors: token positions {beyond} are beyond layer {name}'s {own.shape[-1]} keys "
                             f"(0..{own.shape[-1] - 1})")
        equalizer = own.new_ones(own.shape[-1])
        for position, factor in self.factors.items():
            equalizer[position] = factor
        return new * equalizer  # (B, heads, N, T) * (T,)
