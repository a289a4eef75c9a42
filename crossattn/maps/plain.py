"""Plain word maps: the cross-attention softmax averaged over heads, timestep windows and layers.

A cross-attention layer's softmax gives, for every pixel (query), weights over the prompt's tokens
(keys). Column `t` of that matrix, reshaped to the layer's (h, w), is token t's map. We average it
over the chosen heads, timestep windows and layers, upsample to the image, and sum the tokens of
each whitespace word.
"""

from __future__ import annotations

import numbers

import torch
import torch.nn.functional as F

from ..capture import AttentionStore
from ..text import Word

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


def check_word_list(words: list[Word]) -> None:
    """ValueError unless `words` is a non-empty list of `Word`s (text alone does not say which tokens to read)."""
    if not words:
        raise ValueError("words is empty: give the prompt's words (crossattn.text.prompt_words)")
    wrong = next((w for w in words if not isinstance(w, Word)), None)
    if wrong is not None:
        raise ValueError(f"words must be Word objects with their token positions, from crossattn.text."
                         f"prompt_words(tokenizer, prompt); got a {type(wrong).__name__} ({wrong!r:.40})")


def check_words(words: list[Word], keys: int) -> None:
    """ValueError unless `words` is non-empty and every token index lies in 0 .. keys - 1 (a negative one
    would silently read from the end)."""
    check_word_list(words)
    for w in words:
        bad = [t for t in w.tokens if not 0 <= t < keys]
        if bad:
            raise ValueError(f"words: {w.text!r} has token index {bad} outside 0..{keys - 1} (the layer's {keys} keys)")


def check_normalize(normalize: str) -> None:
    """ValueError unless `normalize` is one of `NORMALIZATIONS` (the package docstring says what each does)."""
    if normalize not in NORMALIZATIONS:
        raise ValueError(f"normalize must be one of {NORMALIZATIONS}, got {normalize!r}")


def normalize_maps(maps: torch.Tensor, normalize: str = "raw") -> torch.Tensor:
    """(num_words, H, W) maps normalised as `normalize` says (the package docstring)."""
    check_normalize(normalize)
    if normalize == "minmax":
        lo = maps.amin(dim=(1, 2), keepdim=True)
        hi = maps.amax(dim=(1, 2), keepdim=True)
        maps = (maps - lo) / (hi - lo).clamp(min=1e-12)
    elif normalize == "softmax":
        maps = maps / maps.sum(dim=0, keepdim=True).clamp(min=1e-12)
    return maps


def merge_words(tokens: torch.Tensor, words: list[Word], normalize: str = "raw") -> torch.Tensor:
    """Sum each word's token maps: (T, H, W) -> (num_words, H, W), then normalise."""
    check_words(words, tokens.shape[0])
    H, W = tokens.shape[-2:]
    maps = torch.stack([tokens[w.tokens].sum(dim=0) if w.tokens else tokens.new_zeros(H, W) for w in words])
    return normalize_maps(maps, normalize)


def check_index(index: int | None, batch: int) -> None:
    if index is not None and batch and not (isinstance(index, int) and 0 <= index < batch):  # 0: nothing recorded
        raise ValueError(f"index must be an image of the batch, 0..{batch - 1} (or None for all), got {index!r}")


def word_maps(store: AttentionStore, words: list[Word], size: tuple[int, int], index: int | None = 0,
              normalize: str = "raw", **select) -> torch.Tensor:
    """(num_words, H, W): the maps of prompt `index` in the batch, one per word; `index=None`: every
    image's, (B, num_words, H, W).

    `select` takes token_maps' filters: layers, resolutions, heads, timesteps, mode.
    """
    check_normalize(normalize)  # at the door: before the maps are computed
    check_word_list(words)
    check_index(index, store.batch_size)
    tokens = token_maps(store, size, **select)  # (B, T, H, W)
    return merge_all(tokens, words, index, normalize)


def merge_all(tokens: torch.Tensor, words: list[Word], index: int | None, normalize: str) -> torch.Tensor:
    if index is not None:
        return merge_words(tokens[index], words, normalize)
    return torch.stack([merge_words(t, words, normalize) for t in tokens])
