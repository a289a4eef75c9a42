"""Re-weighting (Hertz et al. 2022, prompt-to-prompt's "equalizer"): multiply chosen tokens' weights by
a factor, in chosen layers and part of the run."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import Recipe, check_share


@dataclass
class Reweight(Recipe):
    """Scale the attention weights of some tokens (prompt-to-prompt's equalizer), not renormalised."""
    factors: dict[int, float]  # token position -> factor
    layers: list[str] | None = None  # layer names; None: every cross-attention layer
    steps: tuple[float, float] = (0.0, 1.0)  # [start, end) shares of the run

    def __post_init__(self):
        bad = {k: v for k, v in self.factors.items() if not math.isfinite(v)}
        if bad:
            raise ValueError(f"re-weighting factors must be finite numbers, got {bad}")
        check_share("reweight start", self.steps[0])
        check_share("reweight end", self.steps[1])

    def weights(self, ctl, name, cross, progress, own, new):
        if not cross or not self.steps[0] <= progress < self.steps[1] or \
                (self.layers is not None and name not in self.layers):
            return new
        equalizer = own.new_ones(own.shape[-1])
        for position, factor in self.factors.items():
            equalizer[position] = factor
        return new * equalizer  # (B, heads, N, T) * (T,)
