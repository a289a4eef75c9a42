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
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .capture import AttentionStore
from .text import Word

NORMALIZATIONS = ("raw", "minmax", "softmax")


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


def token_maps(store: AttentionStore, size: tuple[int, int], layers: list[str] | None = None,
               resolutions: list[int] | None = None, heads: list[int] | None = None,
               timesteps: tuple[float, float] | None = None, mode: str = "bilinear") -> torch.Tensor:
    """(B, T, H, W): each token's attention map, averaged over the chosen layers/heads/timesteps,
    upsampled to `size` = (H, W) of the image."""
    maps = []
    for name in select_layers(store, layers, resolutions):
        mean = store.mean(name, heads, timesteps)  # (B, hw, T)
        if mean is None:
            continue
        h, w = store.layer_shapes[name]
        grid = mean.transpose(1, 2).reshape(mean.shape[0], -1, h, w)  # (B, T, h, w)
        maps.append(F.interpolate(grid, size=size, mode=mode, align_corners=False).clamp(min=0))
    if not maps:
        raise ValueError(f"nothing was recorded within timesteps {timesteps}")
    return torch.stack(maps).mean(dim=0)  # (B, T, H, W)


def merge_words(tokens: torch.Tensor, words: list[Word], normalize: str = "raw") -> torch.Tensor:
    """Sum each word's token maps: (T, H, W) -> (num_words, H, W), then normalise."""
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")
    H, W = tokens.shape[-2:]
    maps = torch.stack([tokens[w.tokens].sum(dim=0) if w.tokens else tokens.new_zeros(H, W) for w in words])
    if normalize == "minmax":
        lo = maps.amin(dim=(1, 2), keepdim=True)
        hi = maps.amax(dim=(1, 2), keepdim=True)
        maps = (maps - lo) / (hi - lo).clamp(min=1e-12)
    elif normalize == "softmax":
        maps = maps / maps.sum(dim=0, keepdim=True).clamp(min=1e-12)
    return maps


def word_maps(store: AttentionStore, words: list[Word], size: tuple[int, int], index: int = 0,
              normalize: str = "raw", **select) -> torch.Tensor:
    """(num_words, H, W): the maps of prompt `index` in the batch, one per word.

    `select` takes token_maps' filters: layers, resolutions, heads, timesteps, mode.
    """
    return merge_words(token_maps(store, size, **select)[index], words, normalize)
