"""DAAM 0.2.0's recipe (Tang et al., ACL 2023; castorini/daam), reproduced from our store, for comparing
ours with it: per-head bicubic upsampling to a fixed grid, clamp and mean; a word is the mean of its tokens."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..capture import AttentionStore
from ..text import Word

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
