"""How well a map points at an object: IoU after thresholding, pointing game, mass inside the mask."""

from __future__ import annotations

import torch

THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)  # fractions of the map's own maximum


def iou(heat: torch.Tensor, mask: torch.Tensor, threshold: float) -> float:
    """IoU of {heat >= threshold * max(heat)} with the boolean `mask` (both (H, W))."""
    peak = heat.max()
    region = heat >= threshold * peak if peak > 0 else torch.ones_like(mask)
    union = (region | mask).sum().item()
    return (region & mask).sum().item() / union if union else 0.0


def pointing(heat: torch.Tensor, mask: torch.Tensor) -> float:
    """1 if the map's maximum lies inside `mask`; with ties, the share of tied maxima inside
    (so a constant map scores the mask's area fraction, as a random guess would)."""
    tied = heat >= heat.max() - 1e-12 * heat.abs().max().clamp(min=1)
    return (tied & mask).sum().item() / tied.sum().item()


def mass(heat: torch.Tensor, mask: torch.Tensor) -> float:
    """Share of the map's total inside `mask`."""
    total = heat.sum().item()
    return heat[mask].sum().item() / total if total > 0 else 0.0


def score_maps(pairs: list[tuple[torch.Tensor, torch.Tensor]], threshold: float) -> dict:
    """Mean IoU at `threshold`, pointing-game hit rate and mass over (map, mask) pairs, plus the IoU sweep."""
    if not pairs:
        return {"n": 0, "miou": None, "pointing": None, "mass": None, "sweep": {}}
    sweep = {t: sum(iou(h, m, t) for h, m in pairs) / len(pairs) for t in THRESHOLDS}
    return {
        "n": len(pairs),
        "miou": sum(iou(h, m, threshold) for h, m in pairs) / len(pairs),
        "pointing": sum(pointing(h, m) for h, m in pairs) / len(pairs),
        "mass": sum(mass(h, m) for h, m in pairs) / len(pairs),
        "sweep": {f"{t:.1f}": v for t, v in sweep.items()},
    }
