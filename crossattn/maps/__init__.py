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

Map kinds (`maps_of`, and `--maps` of the commands), one module each:
- "plain" (`plain.py`): `word_maps`, the cross-attention averaged as above;
- "refined" (`refined.py`): each layer's map propagated through the recorded self-attention;
- "daam" (`daam.py`): DAAM 0.2.0's recipe.
"""

from __future__ import annotations

import torch

from ..capture import AttentionStore
from ..text import Word
from .daam import (
    DAAM_DROP_FACTOR,
    daam_aggregate,
    daam_expand,
    daam_grid,
    daam_heat_maps,
    daam_layers,
    daam_summed_maps,
    daam_word_maps,
)
from .plain import (
    NORMALIZATIONS,
    check_index,
    check_normalize,
    check_size,
    check_words,
    merge_all,
    merge_words,
    normalize_maps,
    select_layers,
    token_maps,
    word_maps,
)
from .refined import (
    DEFAULT_REFINEMENT,
    REFINE_RENORMS,
    RENORM_NONE,
    SHARPEN_NONE,
    Refinement,
    fitted_refinement,
    propagate,
    refined_store,
    refined_token_maps,
    self_affinity,
    sharpen_affinity,
)

MAP_KINDS = ("plain", "refined", "daam")
DEFAULT_MAP_KIND = "plain"  # the kind that measures best on the shipped model (docs/guides/maps.md)


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
    check_normalize(normalize)
    size = check_size(size)
    check_index(index, store.batch_size)
    if kind == "plain":
        return word_maps(store, words, size, index, normalize, **select)
    if kind == "refined":
        return merge_all(refined_token_maps(store, size, refinement, **select), words, index, normalize)
    heat = daam_heat_maps(store, check_size(grid) if grid is not None else size)  # (B, T, gh, gw)
    check_words(words, heat.shape[1])
    per_image = [normalize_maps(daam_expand(daam_word_maps(h, words), size, absolute=True).clamp(min=0), normalize)
                 for h in (heat if index is None else heat[index:index + 1])]
    return torch.stack(per_image) if index is None else per_image[0]


__all__ = ["DAAM_DROP_FACTOR", "DEFAULT_MAP_KIND", "DEFAULT_REFINEMENT", "MAP_KINDS", "NORMALIZATIONS",
           "REFINE_RENORMS", "RENORM_NONE", "SHARPEN_NONE", "Refinement", "check_index", "check_normalize",
           "check_size", "check_words", "daam_aggregate", "daam_expand", "daam_grid", "daam_heat_maps", "daam_layers",
           "daam_summed_maps", "daam_word_maps", "fitted_refinement", "maps_of", "merge_all", "merge_words",
           "normalize_maps", "propagate", "refined_store", "refined_token_maps", "select_layers", "self_affinity",
           "sharpen_affinity", "token_maps", "word_maps"]
