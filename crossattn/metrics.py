"""How well a map points at an object: IoU after thresholding, pointing game, mass inside the mask."""

from __future__ import annotations

import torch

# Fractions of the map's own maximum (or range). Down to 0.02: maps trained to stay on their object (a grounding
# loss) score best at the lowest thresholds, and a sweep that stopped at 0.1 understated them.
THRESHOLDS = (0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
# "peak": heat >= threshold * max(heat) (ours); "minmax": DAAM's rule, the map rescaled by
# (x - min) / (max - min + 1e-8) (its `expand_as`), then > threshold.
THRESHOLD_RULES = ("peak", "minmax")


def region(heat: torch.Tensor, threshold: float, rule: str = "peak") -> torch.Tensor:
    """The boolean (H, W) region a map `heat` marks at `threshold` under `rule` (see THRESHOLD_RULES)."""
    if rule == "peak":
        peak = heat.max()
        return heat >= threshold * peak if peak > 0 else torch.ones_like(heat, dtype=torch.bool)
    if rule == "minmax":
        lo, hi = heat.min(), heat.max()
        return (heat - lo) / (hi - lo + 1e-8) > threshold
    raise ValueError(f"threshold rule must be one of {THRESHOLD_RULES}, got {rule!r}")


def iou(heat: torch.Tensor, mask: torch.Tensor, threshold: float, rule: str = "peak") -> float:
    """IoU of the map's region at `threshold` (see `region`) with the boolean `mask` (both (H, W))."""
    marked = region(heat, threshold, rule)
    union = (marked | mask).sum().item()
    return (marked & mask).sum().item() / union if union else 0.0


def pointing(heat: torch.Tensor, mask: torch.Tensor) -> float:
    """1 if the map's maximum lies inside `mask`; with ties, the share of tied maxima inside
    (so a constant map scores the mask's area fraction, as a random guess would)."""
    tied = heat >= heat.max() - 1e-12 * heat.abs().max().clamp(min=1)
    return (tied & mask).sum().item() / tied.sum().item()


def coverage(heat: torch.Tensor, mask: torch.Tensor, threshold: float, rule: str = "peak") -> tuple[float, float]:
    """(recall, precision) of the map's region at `threshold`: the share of `mask` it marks, and the share of it
    inside `mask`. They tell why an IoU is low: a region cut too small (a peaked map) or spilt over the mask."""
    marked = region(heat, threshold, rule)
    hit = (marked & mask).sum().item()
    return hit / max(mask.sum().item(), 1), hit / max(marked.sum().item(), 1)


def mass(heat: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of the map's total inside `mask`."""
    total = heat.sum().item()
    return heat[mask].sum().item() / total if total > 0 else 0.0


def score_maps(pairs: list[tuple[torch.Tensor, torch.Tensor]], threshold: float, rule: str = "peak") -> dict:
    """Mean IoU, recall and precision at `threshold` (under threshold `rule`, see `coverage`), pointing-game hit
    rate and mass over (map, mask) pairs, plus the IoU sweep."""
    if not pairs:
        return {"n": 0, "miou": None, "recall": None, "precision": None, "pointing": None, "mass": None, "sweep": {}}
    sweep = {t: sum(iou(h, m, t, rule) for h, m in pairs) / len(pairs) for t in THRESHOLDS}
    recall, precision = (sum(c) / len(pairs) for c in zip(*(coverage(h, m, threshold, rule) for h, m in pairs)))
    return {
        "n": len(pairs),
        "miou": sum(iou(h, m, threshold, rule) for h, m in pairs) / len(pairs),
        "recall": recall,
        "precision": precision,
        "pointing": sum(pointing(h, m) for h, m in pairs) / len(pairs),
        "mass": sum(mass(h, m) for h, m in pairs) / len(pairs),
        "sweep": {f"{t:g}": v for t, v in sweep.items()},
    }
