"""From recorded attention to one map per prompt word.

A cross-attention layer's softmax gives, for every pixel (query), weights over the prompt's tokens
(keys). Column `t` of that matrix, reshaped to the layer's (h, w), is token t's map. We average it
over the chosen heads, timestep windows and layers, upsample to the image, and sum the tokens of
each whitespace word.

Normalisations (`normalize=`):
- "raw": the share of each pixel's attention that went to the word, in [0, 1] (comparable across
  words, layers and prompts);
- "minmax": each map rescaled to [0, 1] on its own (good for looking, not for comparing);
- "softmax": at each pixel the words' shares renormalised to sum to 1 over the prompt's words,
  i.e. the softmax restricted to word tokens (start, end and padding tokens removed).

`daam_heat_maps` and friends reproduce DAAM 0.2.0's recipe instead (per-head bicubic upsampling,
clamp and mean; a word is the mean of its tokens), for comparing ours with it.

Map kinds (`maps_of`, and `--maps` of the commands):
- "plain": `word_maps`, the cross-attention averaged as above;
- "refined": each layer's cross-attention map propagated through the self-attention the store recorded
  (pixels that attend to each other belong to one object), `a <- A_self^k a`, as Dataset Diffusion
  ((A_self)^4 a) and iSeg (iterated, entropy-reduced) do; `refined_token_maps`;
- "daam": DAAM 0.2.0's recipe.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .capture import AttentionStore
from .text import Word

NORMALIZATIONS = ("raw", "minmax", "softmax")
MAP_KINDS = ("plain", "refined", "daam")
DEFAULT_MAP_KIND = "plain"  # the kind that measures best on the shipped model (README, "Maps that point")


def select_layers(store: AttentionStore, layers: list[str] | None = None, resolutions: list[int] | None = None,
                  cross: bool = True) -> list[str]:
    """Names of recorded layers, filtered by name and/or by feature-map height (e.g. [16, 8])."""
    names = [n for n in store.layers if store.is_cross[n] == cross]
    if layers is not None:
        unknown = [n for n in layers if n not in names]
        if unknown:
            raise ValueError(f"no recorded layer named {unknown}; recorded: {names}")
        names = [n for n in names if n in layers]
    if resolutions is not None:
        names = [n for n in names if store.layer_shapes[n][0] in resolutions]
    if not names:
        raise ValueError(f"no recorded {'cross' if cross else 'self'}-attention layer matches "
                         f"layers={layers} resolutions={resolutions}; recorded: "
                         f"{[(n, store.layer_shapes[n]) for n in store.layers]}")
    return names


def check_size(size) -> tuple[int, int]:
    """`size` as (H, W) of positive ints, or ValueError naming it."""
    if (not isinstance(size, (tuple, list, torch.Size)) or len(size) != 2
            or not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v > 0 for v in size)):
        raise ValueError(f"size must be (H, W), two positive integers, got {size!r}")
    return int(size[0]), int(size[1])


def _check_heads(heads, layers: list[str]) -> dict[str, list[int] | None]:
    """Per layer, the heads to average (None: all). `heads`: None, one list for every layer, or
    {layer: list} (top-heads selection: layers not named are left out)."""
    if heads is None:
        return dict.fromkeys(layers)
    chosen = heads if isinstance(heads, dict) else dict.fromkeys(layers, heads)
    for name, hs in chosen.items():
        if hs is not None and len(hs) == 0:
            where = f" for layer {name}" if isinstance(heads, dict) else ""
            raise ValueError(f"heads must name at least one head{where}, got [] (None: all heads)")
    kept = {n: chosen[n] for n in layers if n in chosen}
    if not kept:
        raise ValueError(f"heads names no layer among the chosen ones: {sorted(chosen)} vs {layers}")
    return kept


def token_maps(store: AttentionStore, size: tuple[int, int], layers: list[str] | None = None,
               resolutions: list[int] | None = None, heads: list[int] | dict[str, list[int]] | None = None,
               timesteps: tuple[float, float] | None = None, mode: str = "bilinear", propagate=None) -> torch.Tensor:
    """(B, T, H, W): each token's attention map, averaged over the chosen layers/heads/timesteps,
    upsampled to `size` = (H, W) of the image. `heads`: one list for every layer, or {layer: heads}.
    `propagate` (optional): applied to each layer's (B, T, h, w) maps before upsampling (refined maps)."""
    size = check_size(size)
    maps = []
    for name, layer_heads in _check_heads(heads, select_layers(store, layers, resolutions)).items():
        mean = store.mean(name, layer_heads, timesteps)  # (B, hw, T)
        if mean is None:
            continue
        h, w = store.layer_shapes[name]
        grid = mean.transpose(1, 2).reshape(mean.shape[0], -1, h, w)  # (B, T, h, w)
        if propagate is not None:
            grid = propagate(grid)
        maps.append(F.interpolate(grid, size=size, mode=mode, align_corners=False).clamp(min=0))
    if not maps:
        raise ValueError(f"nothing was recorded within timesteps {timesteps}")
    return torch.stack(maps).mean(dim=0)  # (B, T, H, W)


def check_words(words: list[Word], keys: int) -> None:
    """ValueError unless `words` is non-empty and every token index lies in 0 .. keys - 1 (a negative one
    would silently read from the end)."""
    if not words:
        raise ValueError("words is empty: give the prompt's words (crossattn.text.prompt_words)")
    for w in words:
        bad = [t for t in w.tokens if not 0 <= t < keys]
        if bad:
            raise ValueError(f"words: {w.text!r} has token index {bad} outside 0..{keys - 1} (the layer's {keys} keys)")


def normalize_maps(maps: torch.Tensor, normalize: str = "raw") -> torch.Tensor:
    """(num_words, H, W) maps normalised as `normalize` says (module docstring)."""
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    if normalize == "minmax":
        lo = maps.amin(dim=(1, 2), keepdim=True)
        hi = maps.amax(dim=(1, 2), keepdim=True)
        maps = (maps - lo) / (hi - lo).clamp(min=1e-12)
    elif normalize == "softmax":
        maps = maps / maps.sum(dim=0, keepdim=True).clamp(min=1e-12)
    return maps


def merge_words(tokens: torch.Tensor, words: list[Word], normalize: str = "raw") -> torch.Tensor:
    """Sum each word's token maps: (T, H, W) -> (num_words, H, W), then normalise."""
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    check_words(words, tokens.shape[0])
    H, W = tokens.shape[-2:]
    maps = torch.stack([tokens[w.tokens].sum(dim=0) if w.tokens else tokens.new_zeros(H, W) for w in words])
    return normalize_maps(maps, normalize)


def _check_index(index: int | None, batch: int) -> None:
    if index is not None and batch and not (isinstance(index, int) and 0 <= index < batch):  # 0: nothing recorded
        raise ValueError(f"index must be an image of the batch, 0..{batch - 1} (or None for all), got {index!r}")


def word_maps(store: AttentionStore, words: list[Word], size: tuple[int, int], index: int | None = 0,
              normalize: str = "raw", **select) -> torch.Tensor:
    """(num_words, H, W): the maps of prompt `index` in the batch, one per word; `index=None`: every
    image's, (B, num_words, H, W).

    `select` takes token_maps' filters: layers, resolutions, heads, timesteps, mode.
    """
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    _check_index(index, store.batch_size)
    tokens = token_maps(store, size, **select)  # (B, T, H, W)
    return _merge_all(tokens, words, index, normalize)


def _merge_all(tokens: torch.Tensor, words: list[Word], index: int | None, normalize: str) -> torch.Tensor:
    if index is not None:
        return merge_words(tokens[index], words, normalize)
    return torch.stack([merge_words(t, words, normalize) for t in tokens])


# --- refined maps: cross-attention propagated through the recorded self-attention
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
# model (2026-12-01; README, "Maps that point"). Reading only the low-noise steps' self-attention also bounds
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


def maps_of(kind: str, store: AttentionStore, words: list[Word], size: tuple[int, int], index: int | None = 0,
            normalize: str = "raw", refinement: Refinement = DEFAULT_REFINEMENT,
            grid: tuple[int, int] | None = None, **select) -> torch.Tensor:
    """One entry point for every map kind (`MAP_KINDS`): (num_words, H, W) of image `index`, or
    (B, num_words, H, W) for `index=None`.

    plain: `word_maps`; refined: the same through `refinement`; daam: DAAM 0.2.0's word heat maps
    (on `grid`, default the image size: see `daam_grid`), bicubic to `size` without min-max, then
    `normalize`. `select` (layers, resolutions, heads, timesteps) applies to plain and refined.
    """
    if kind not in MAP_KINDS:
        raise ValueError(f"kind must be one of {MAP_KINDS}, got {kind!r}")
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    size = check_size(size)
    _check_index(index, store.batch_size)
    if kind == "plain":
        return word_maps(store, words, size, index, normalize, **select)
    if kind == "refined":
        return _merge_all(refined_token_maps(store, size, refinement, **select), words, index, normalize)
    heat = daam_heat_maps(store, check_size(grid) if grid is not None else size)  # (B, T, gh, gw)
    check_words(words, heat.shape[1])
    per_image = [normalize_maps(daam_expand(daam_word_maps(h, words), size, absolute=True).clamp(min=0), normalize)
                 for h in (heat if index is None else heat[index:index + 1])]
    return torch.stack(per_image) if index is None else per_image[0]


# --- DAAM 0.2.0's recipe (Tang et al., ACL 2023; castorini/daam), reproduced from our store
DAAM_DROP_FACTOR = 8  # DAAM skips maps whose side is 1/8 of its grid (SD's 8x8 at 512 px)


def daam_grid(pipe, height: int | None = None, width: int | None = None) -> tuple[int, int]:
    """The (h, w) grid DAAM upsamples every map to, for an image of `height` x `width` from `pipe`.

    DAAM fixes it from the model, not the image: `latent_hw = 4096 if unet.sample_size *
    vae_scale_factor in (512, 1024) else 9216`, i.e. 64x64 for SD 1.x, SD 2 base and SDXL (whose
    latents are 128x128: DAAM's maps are half their size) and 96x96 for SD 2's 768-px model. DAAM
    only handles square images; for others we scale that grid by the image's aspect, as the latents
    are. A pixel-space model (ours: no VAE) has no latent grid, so the grid is the image.
    """
    size = pipe.unet.config.sample_size
    vae = getattr(pipe, "vae", None)
    if vae is None:
        return (height or size, width or size)
    scale = pipe.vae_scale_factor
    side = 64 if size * scale in (512, 1024) else 96
    height, width = height or size * scale, width or size * scale
    return round(height / scale * side / size), round(width / scale * side / size)


def daam_layers(store: AttentionStore) -> list[str]:
    """DAAM's layers: the cross-attention of every transformer block in the up path, then the down path
    (recording order within each); never the middle block."""
    cross = [n for n in store.layers if store.is_cross[n]]
    return [n for path in ("up", "down") for n in cross if n.split(".")[0].startswith(path)]


def daam_summed_maps(store: AttentionStore) -> list[torch.Tensor]:
    """DAAM's raw maps: for each (layer, head) of `daam_layers`, in DAAM's order (layer-major), the
    softmax weights summed over all recorded steps, (B, T, h, w); the prompt half under guidance,
    as DAAM keeps."""
    out = []
    for name in daam_layers(store):
        h, w = store.layer_shapes[name]
        passes = store.passes(name)
        for head in range(store.heads(name)):
            summed = store.mean(name, heads=[head]) * passes  # (B, hw, T): this head summed over steps
            out.append(summed.transpose(1, 2).reshape(summed.shape[0], -1, h, w))  # (B, T, h, w)
    return out


def daam_aggregate(summed: list[torch.Tensor], grid: tuple[int, int], tokens: int | None = None,
                   normalize: bool = False) -> torch.Tensor:
    """(B, T, gh, gw) from per-(layer, head) summed maps (B, T, h, w), as DAAM 0.2.0's
    `compute_global_heat_map`: each map upsampled bicubically to `grid` (see `daam_grid`) and
    clamped at 0, then the plain mean over all maps. A map whose `factor = int(sqrt(gh * gw //
    (h * w)))` is 8 is skipped, as in DAAM's hook. `tokens`: the prompt's token count; rows are
    then cut to [start, tokens..., first end] (DAAM's `tokens + 2`), and `normalize=True` divides
    every row by the sum of the prompt-token rows + 1e-6, as DAAM's does.
    """
    total, count = None, 0
    for maps in summed:
        h, w = maps.shape[-2:]
        if int(math.sqrt(grid[0] * grid[1] // (h * w))) == DAAM_DROP_FACTOR:
            continue
        maps = F.interpolate(maps.float(), size=grid, mode="bicubic", align_corners=False).clamp(min=0)
        total = maps if total is None else total + maps
        count += 1
    if total is None:
        raise ValueError(f"no map for DAAM: none recorded in the up or down path with factor != 8 on a {grid} "
                         f"grid (map sizes given: {sorted({tuple(m.shape[-2:]) for m in summed})})")
    maps = total / count  # (B, T, gh, gw)
    if tokens is not None:
        maps = maps[:, :tokens + 2]  # start, the prompt's tokens, the first end token
    if normalize:
        if tokens is None:
            raise ValueError("normalize=True needs tokens= (the prompt's token count), as DAAM's does")
        maps = maps / (maps[:, 1:-1].sum(dim=1, keepdim=True) + 1e-6)
    return maps


def daam_heat_maps(store: AttentionStore, grid: tuple[int, int], tokens: int | None = None,
                   normalize: bool = False) -> torch.Tensor:
    """(B, T, gh, gw): DAAM 0.2.0's global heat map of every recorded image, one row per token
    (`daam_aggregate` of `daam_summed_maps`)."""
    return daam_aggregate(daam_summed_maps(store), grid, tokens, normalize)


def daam_word_maps(heat: torch.Tensor, words: list[Word], merge_repeats: bool = True) -> torch.Tensor:
    """(num_words, gh, gw) from one image's DAAM heat map `heat` (T, gh, gw): each word's map is the
    mean of its token rows. DAAM finds a word by its text, so a repeated word ("a" in "a red circle
    left of a blue square") gets the mean over all its occurrences; `merge_repeats=False` keeps each
    occurrence apart."""
    maps = []
    for word in words:
        same = [w for w in words if w.text.lower() == word.text.lower()] if merge_repeats else [word]
        rows = [t for w in same for t in w.tokens]
        if not rows:
            raise ValueError(f"word {word.text!r} has no tokens (cut off by the tokenizer's length)")
        maps.append(heat[rows].mean(dim=0))
    return torch.stack(maps)


def daam_expand(maps: torch.Tensor, size: tuple[int, int], absolute: bool = False) -> torch.Tensor:
    """DAAM's `WordHeatMap.expand_as`: (..., gh, gw) maps upsampled bicubically to `size` = (H, W) and,
    unless `absolute`, each rescaled by (x - min) / (max - min + 1e-8); DAAM's segmentation is then
    `> threshold`. (DAAM passes PIL's (W, H) as the size, which transposes non-square images; we do not.)"""
    lead = maps.shape[:-2]
    flat = maps.reshape(-1, 1, *maps.shape[-2:]).float()
    flat = F.interpolate(flat, size=size, mode="bicubic", align_corners=False)
    if not absolute:
        lo = flat.amin(dim=(2, 3), keepdim=True)
        hi = flat.amax(dim=(2, 3), keepdim=True)
        flat = (flat - lo) / (hi - lo + 1e-8)
    return flat.reshape(*lead, *size)
