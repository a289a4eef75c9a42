"""Refined maps: each layer's cross-attention map propagated through the recorded self-attention.

Pixels that attend to each other belong to one object, so `a <- A_self^k a` fills an object and drops
the background, as Dataset Diffusion ((A_self)^4 a) and iSeg (iterated, entropy-reduced) do.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..capture import AttentionStore
from .plain import token_maps

SHARPEN_NONE, RENORM_NONE = 0.0, "none"
REFINE_RENORMS = ("none", "iseg")


@dataclass(frozen=True)
class Refinement:
    """How `refined_token_maps` propagates. iterations: k in a <- A^k a (0: the plain maps);
    self_resolution: the self-attention's feature-map height (None: the highest recorded);
    self_timesteps: which windows' self-attention to average (None: all recorded);
    sharpen: iSeg's entropy reduction epsilon (0: A as recorded); renorm: "iseg" rescales each map
    to (a - min) / sum after every iteration (then values are no longer shares of attention)."""
    iterations: int = 1
    self_resolution: int | None = None
    self_timesteps: tuple[float, float] | None = None
    sharpen: float = SHARPEN_NONE
    renorm: str = RENORM_NONE

    def __post_init__(self):
        if not (isinstance(self.iterations, int) and self.iterations >= 0):
            raise ValueError(f"iterations must be an integer >= 0, got {self.iterations!r}")
        if not (self.sharpen >= 0 and math.isfinite(self.sharpen)):
            raise ValueError(f"sharpen must be a finite number >= 0, got {self.sharpen!r}")
        if self.renorm not in REFINE_RENORMS:
            raise ValueError(f"renorm must be one of {REFINE_RENORMS}, got {self.renorm!r}")

    def describe(self) -> str:
        parts = [f"k={self.iterations}"]
        if self.self_timesteps is not None:
            parts.append(f"self t={self.self_timesteps[0]:g}-{self.self_timesteps[1]:g}")
        if self.sharpen:
            parts.append(f"sharpen={self.sharpen:g}")
        if self.renorm != RENORM_NONE:
            parts.append(f"renorm={self.renorm}")
        return " ".join(parts)


# What `--maps refined` uses: the refinement the full evaluation chose on its selection split for the shipped
# model (2026-12-01; docs/model-card.md, "Map accuracy"). Reading only the low-noise steps' self-attention also bounds
# the store: 3 of 10 timestep windows.
DEFAULT_REFINEMENT = Refinement(iterations=4, self_timesteps=(0, 299), renorm="iseg")


def fitted_refinement(refinement: Refinement, timesteps) -> Refinement:
    """`refinement` for a run whose denoiser sees `timesteps`: when none falls within its self_timesteps
    (a one-pass read-out at t = 500, a 3-step run), the self-attention of every step it has instead."""
    span = refinement.self_timesteps
    if span is None or any(span[0] <= float(t) <= span[1] for t in timesteps):
        return refinement
    return dataclasses.replace(refinement, self_timesteps=None)


def self_affinity(store: AttentionStore, resolution: int | None = None,
                  timesteps: tuple[float, float] | None = None) -> tuple[torch.Tensor, tuple[int, int]]:
    """(B, N, N) row-stochastic affinity: the recorded self-attention of every self-attention layer of
    feature-map height `resolution` (None: the highest recorded), heads and steps averaged, and its (h, w).
    Row i is where pixel i looks."""
    names = [n for n in store.layers if not store.is_cross[n]]
    if not names:
        raise ValueError("no self-attention was recorded: refined maps need a store from "
                         "refined_store(...) or AttentionStore(self_attention=True)")
    heights = sorted({store.layer_shapes[n][0] for n in names})
    resolution = heights[-1] if resolution is None else resolution
    chosen = [n for n in names if store.layer_shapes[n][0] == resolution]
    if not chosen:
        raise ValueError(f"no self-attention recorded at resolution {resolution}; recorded: {heights}")
    means = [m for m in (store.mean(n, timesteps=timesteps) for n in chosen) if m is not None]
    if not means:
        raise ValueError(f"no self-attention recorded within timesteps {timesteps}")
    return torch.stack(means).mean(dim=0), store.layer_shapes[chosen[0]]  # (B, N, N)


def sharpen_affinity(affinity: torch.Tensor, epsilon: float) -> torch.Tensor:
    """iSeg's entropy reduction of a (B, N, N) affinity: columns scaled to a maximum of 1,
    T <- clamp(T + eps * log10(e * T), 0, 1) (small weights pushed down, large ones up), rows renormalised."""
    if epsilon == 0:
        return affinity
    t = affinity / affinity.amax(dim=1, keepdim=True).clamp(min=1e-12)  # each key's column max is 1
    t = (t + epsilon * torch.log10(math.e * t.clamp(min=1e-12))).clamp(0, 1)
    return t / t.sum(dim=-1, keepdim=True).clamp(min=1e-12)


def propagate(maps: torch.Tensor, affinity: torch.Tensor, affinity_hw: tuple[int, int], iterations: int,
              renorm: str = RENORM_NONE) -> torch.Tensor:
    """(B, T, h, w) maps -> the same shape, `iterations` times a <- A a at the affinity's resolution
    (resampled there and back when the layer's differs: area down, bilinear up). 0 iterations: unchanged."""
    if iterations == 0:
        return maps
    B, T, h, w = maps.shape
    hs, ws = affinity_hw
    a = maps if (h, w) == (hs, ws) else F.interpolate(maps, size=(hs, ws), mode="area" if h >= hs else "bilinear",
                                                      align_corners=None if h >= hs else False)
    a = a.reshape(B, T, hs * ws).transpose(1, 2)  # (B, N, T)
    for _ in range(iterations):
        a = affinity @ a  # pixel i takes the mean of the maps where it looks
        if renorm == "iseg":
            a = a - a.amin(dim=1, keepdim=True)
            a = a / a.sum(dim=1, keepdim=True).clamp(min=1e-12)
    a = a.transpose(1, 2).reshape(B, T, hs, ws)
    return a if (h, w) == (hs, ws) else F.interpolate(a, size=(h, w), mode="bilinear", align_corners=False)


def refined_token_maps(store: AttentionStore, size: tuple[int, int], refinement: Refinement = DEFAULT_REFINEMENT,
                       **select) -> torch.Tensor:
    """(B, T, H, W): `token_maps` with each layer's map first propagated through the recorded self-attention
    (`refinement`); `select` takes token_maps' filters. Zero iterations give exactly `token_maps`."""
    if refinement.iterations == 0:
        return token_maps(store, size, **select)
    affinity, hw = self_affinity(store, refinement.self_resolution, refinement.self_timesteps)
    if hw[0] * hw[1] < 2:  # one pixel attends only to itself: propagation has nothing to spread, iSeg's renorm -> 0
        raise ValueError(f"refined maps need self-attention over at least 2 pixels; this image's is {hw[0]}x{hw[1]} "
                         "(too small an image for the model's self-attention level): use plain maps or a larger image")
    affinity = sharpen_affinity(affinity, refinement.sharpen)
    return token_maps(store, size, propagate=lambda m: propagate(m, affinity, hw, refinement.iterations,
                                                                 refinement.renorm), **select)


def refined_store(pipe=None, refinement: Refinement | None = None, **kwargs) -> AttentionStore:
    """A store that records what refined maps need and no more: every cross-attention, and self-attention
    with heads averaged, only at `refinement.self_resolution` and within `refinement.self_timesteps`
    (`refinement=None`: at every resolution and step, for choosing among refinements)."""
    resolution = None if refinement is None else refinement.self_resolution
    kwargs.update(self_attention=True, self_heads="mean", self_resolutions=None if resolution is None else [resolution],
                  self_timesteps=None if refinement is None else refinement.self_timesteps)
    return AttentionStore.for_pipeline(pipe, **kwargs) if pipe is not None else AttentionStore(**kwargs)
