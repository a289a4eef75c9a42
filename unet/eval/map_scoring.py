"""Does each word's map point at its object? Colour and shape words' maps scored against their objects'
masks -- on generated images (masks from the detector) and on dataset images denoised one step (exact
masks) -- for our best aggregation, the read-outs beyond it (refined through self-attention, top heads)
and baselines, all computed from the same recorded attention."""

from __future__ import annotations

import dataclasses
import math
import random
from dataclasses import dataclass

import torch

from crossattn.capture import AttentionStore
from crossattn.maps import Refinement, daam_heat_maps, refined_store, refined_token_maps, token_maps
from crossattn.metrics import mass, score_maps
from crossattn.text import prompt_words

from ..attend import record_noised
from ..data import SHAPES, SceneSampler, scenes_to_tensor, to_model_range
from .detect import background_mask

BASELINES = ("uniform", "centre", "random_layer", "daam")
# Read-outs beyond the plain aggregation ("ours"), each chosen on the selection split as "ours" is.
READOUTS = ("refined", "top_heads")
REFINE_ITERATIONS = (1, 2, 4, 8)  # Dataset Diffusion: 4; iSeg: 5-10
REFINE_SHARPEN = (0.0, 0.05, 0.2)  # iSeg's epsilon range 0.002-0.2
TOP_HEAD_FRACTIONS = (0.1, 0.2, 0.25, 0.5)  # head selection keeps the top 20-25 %
THRESHOLD_RULE = {"daam": "minmax"}  # DAAM thresholds its min-max-rescaled map; every other method: the peak


def centre_prior(B: int, T: int, size: tuple[int, int]) -> torch.Tensor:
    H, W = size
    ys, xs = torch.meshgrid(torch.arange(H) + 0.5 - H / 2, torch.arange(W) + 0.5 - W / 2, indexing="ij")
    g = torch.exp(-(xs ** 2 + ys ** 2) / (2 * (0.25 * min(H, W)) ** 2))
    return g.expand(B, T, H, W)


def method_maps(name: str, store: AttentionStore, size, select: dict | None = None, seed: int = 0) -> torch.Tensor:
    layers = [n for n in store.layers if store.is_cross[n]]
    B, T = store.batch_size, store.keys(layers[0])  # images, tokens
    if name == "uniform":
        return torch.ones(B, T, *size)
    if name == "centre":
        return centre_prior(B, T, size)
    if name == "random_layer":
        return token_maps(store, size, layers=[random.Random(seed).choice(sorted(layers))])
    if name == "daam":
        # DAAM 0.2.0's recipe; in pixel space its grid is the image (`daam_grid`). `_pairs_for` sums a word's
        # tokens where DAAM averages them: the same here, since the min-max threshold, pointing and mass
        # ignore scale (and every scene word is one token).
        return daam_heat_maps(store, size)
    if name in ("ours", "top_heads"):  # top_heads: select names {layer: heads}
        return token_maps(store, size, **(select or {}))
    if name == "refined":  # select holds refinement= and token_maps' filters
        return refined_token_maps(store, size, **(select or {}))
    raise ValueError(f"unknown map method {name!r}")


def candidate_selections(store: AttentionStore) -> dict[str, dict]:
    """Aggregations to choose 'ours' from: layer groups (by resolution, by U-Net path, single layers)
    crossed with timestep ranges."""
    names = sorted(n for n in store.layers if store.is_cross[n])
    heights = sorted({store.layer_shapes[n][0] for n in names}, reverse=True)
    groups = {f"res={h}": {"resolutions": [h]} for h in heights}
    if len(heights) > 1:
        groups[f"res={'+'.join(map(str, heights[:2]))}"] = {"resolutions": heights[:2]}
    for path in ("down", "up"):
        chosen = [n for n in names if n.startswith(path)]
        if chosen:
            groups[f"{path} path"] = {"layers": chosen}
    groups.update({f"layer {n}": {"layers": [n]} for n in names})
    T = store.num_train_timesteps  # the scheduler's; ranges are fractions of it (t=0-499 etc. for 1000)
    spans = [(round(a * T), round(b * T) - 1) for a, b in ((0, 0.5), (0.5, 1), (0, 0.3), (0.3, 0.7))]
    ranges = {"t=all": None, **{f"t={lo}-{hi}": (lo, hi) for lo, hi in spans}}
    return {f"{g} {r}": {**select, "timesteps": t} for g, select in groups.items() for r, t in ranges.items()}


def candidate_refinements(store: AttentionStore, selection: dict) -> dict[str, dict]:
    """Refinements to choose 'refined' from, on top of the plain aggregation's `selection`: iterations,
    iSeg's sharpening and renormalisation, and which steps' self-attention (all, low noise, high noise)."""
    T = store.num_train_timesteps
    spans = (None, (0, round(0.3 * T) - 1), (round(0.5 * T), T - 1))
    out = {}
    for k in REFINE_ITERATIONS:
        for sharpen in REFINE_SHARPEN:
            for renorm in ("none", "iseg"):
                for span in spans:
                    refinement = Refinement(k, self_timesteps=span, sharpen=sharpen, renorm=renorm)
                    out[refinement.describe()] = {**selection, "refinement": refinement}
    return out


def head_relevance(batches: list[Batch], size, timesteps=None) -> dict[tuple[str, int], float]:
    """Each cross-attention (layer, head)'s relevance on `batches`: the mean share of its map inside the
    word's object, over colour and shape words alike."""
    store = batches[0].store
    out = {}
    for layer in sorted(n for n in store.layers if store.is_cross[n]):
        for head in range(store.heads(layer)):
            pairs = collect(batches, "top_heads", size, {"heads": {layer: [head]}, "timesteps": timesteps})
            scored = pairs["shape_words"] + pairs["color_words"]
            out[(layer, head)] = sum(mass(h, m) for h, m in scored) / max(1, len(scored))
    return out


def candidate_top_heads(relevance: dict[tuple[str, int], float], timesteps=None) -> dict[str, dict]:
    """The top `TOP_HEAD_FRACTIONS` of heads by relevance, each as token_maps' {layer: heads}."""
    ranked = sorted(relevance, key=lambda k: -relevance[k])
    out = {}
    for fraction in TOP_HEAD_FRACTIONS:
        n = max(1, round(fraction * len(ranked)))
        heads: dict[str, list[int]] = {}
        for layer, head in sorted(ranked[:n]):
            heads.setdefault(layer, []).append(head)
        out[f"top {fraction:.0%} ({n} of {len(ranked)} heads)"] = {"heads": heads, "timesteps": timesteps}
    return out


def self_attention_entropy(store: AttentionStore) -> dict[str, float]:
    """Per recorded self-attention layer: the mean entropy of its rows (heads and steps averaged) as a
    fraction of the maximum, log N. 1 = every pixel looks everywhere alike: nothing to propagate along."""
    out = {}
    for name in store.layers:
        if not store.is_cross[name]:
            rows = store.mean(name)  # (B, N, N)
            entropy = -(rows * rows.clamp(min=1e-12).log()).sum(-1).mean()
            out[name] = float(entropy / math.log(rows.shape[-1]))
    return out


def _pairs_for(maps: torch.Tensor, entries) -> dict[str, list]:
    """(map, mask) pairs split into shape and colour words. entries: (batch index, word, tokens, mask)."""
    out = {"shape_words": [], "color_words": []}
    for b, word, tokens, mask in entries:
        heat = maps[b, tokens].sum(0)
        out["shape_words" if word in SHAPES else "color_words"].append((heat, torch.as_tensor(mask)))
    return out


@dataclass
class Batch:
    store: AttentionStore
    entries: list  # (batch index, word, token positions, mask)


def dataset_scenes(pipe, n: int, seed: int = 123) -> list:
    """The evaluation's `n` held-out dataset scenes (`dataset_batch` reads these)."""
    sampler = SceneSampler(seed, pipe.unet.config.sample_size, pipe.unet.config.sample_size, split="eval")
    return [sampler() for _ in range(n)]


def record_scenes(pipe, scenes: list, timestep: int, seed: int, store: AttentionStore | None = None) -> AttentionStore:
    """Drawn scenes (anything with `.image` and `.caption`) noised to `timestep`, scene i with seed `seed + i`, and
    denoised one step with their captions: `store` after that pass (None: a new `refined_store`, cross-attention
    and the self-attention the refined maps need)."""
    x0 = to_model_range(scenes_to_tensor(scenes))  # (n, 3, H, W) in [-1, 1]
    return record_noised(pipe, x0, [s.caption for s in scenes], timestep, [seed + i for i in range(len(scenes))],
                         refined_store(pipe) if store is None else store)


def dataset_batch(pipe, n: int, timestep: int, seed: int = 123) -> Batch:
    """Held-out dataset scenes noised to `timestep`, denoised one step with their captions; exact masks.
    Scene i is noised with seed `seed + i` (`record_noised`), as `scripts/attend.py --seed` would."""
    scenes = dataset_scenes(pipe, n, seed)
    store = record_scenes(pipe, scenes, timestep, seed)
    entries = []
    for i, s in enumerate(scenes):
        words = prompt_words(pipe.tokenizer, s.caption)
        for w_index, obj in s.word_objects.items():
            entries.append((i, words[w_index].text, words[w_index].tokens, s.objects[obj].mask))
    return Batch(store, entries)


def collect(batches: list[Batch], method: str, size, select=None) -> dict[str, list]:
    pairs = {"shape_words": [], "color_words": []}
    for k, batch in enumerate(batches):
        maps = method_maps(method, batch.store, size, select, seed=k)
        for key, value in _pairs_for(maps, batch.entries).items():
            pairs[key] += value
    return pairs


def best_threshold(pairs, rule: str = "peak") -> float:
    if not pairs:
        return 0.5
    sweep = score_maps(pairs, 0.5, rule)["sweep"]
    return float(max(sweep, key=sweep.get))


def choose_best(batches: list[Batch], size, method: str, candidates: dict[str, dict]) -> tuple[str, dict, float]:
    """The candidate of `method` (name -> select) and threshold scoring best on `batches`, by shape-word
    (mIoU + pointing)."""
    best = None
    for name, select in candidates.items():
        try:
            pairs = collect(batches, method, size, select)["shape_words"]
        except ValueError:  # no layer/timestep matches this candidate
            continue
        threshold = best_threshold(pairs)
        s = score_maps(pairs, threshold)
        value = (s["miou"] or 0) + (s["pointing"] or 0)
        if best is None or value > best[0]:
            best = (value, name, select, threshold)
    if best is None:
        raise ValueError(f"no candidate of {method!r} matched the recorded attention: {list(candidates)[:5]}")
    return best[1], best[2], best[3]


def choose_selection(batches: list[Batch], size) -> tuple[str, dict, float]:
    """Best 'ours' aggregation and threshold on the selection split, by shape-word (mIoU + pointing)."""
    return choose_best(batches, size, "ours", candidate_selections(batches[0].store))


def choose_readouts(batches: list[Batch], size, selection: dict) -> dict[str, tuple[str, dict, float]]:
    """'refined' and 'top_heads', each chosen on the selection split `batches` on top of the plain
    aggregation's `selection`: name, select and threshold."""
    store = batches[0].store
    relevance = head_relevance(batches, size, selection.get("timesteps"))
    return {"refined": choose_best(batches, size, "refined", candidate_refinements(store, selection)),
            "top_heads": choose_best(batches, size, "top_heads",
                                     candidate_top_heads(relevance, selection.get("timesteps")))}


def one_pass(method: str, select: dict | None) -> dict | None:
    """`select` for a store of one forward pass (dataset images): timestep filters do not apply."""
    if select is None:
        return None
    select = {k: v for k, v in select.items() if k != "timesteps"}
    if method == "refined":
        select["refinement"] = dataclasses.replace(select["refinement"], self_timesteps=None)
    return select


def map_scores(batches, size, methods: dict[str, tuple[dict | None, float]]) -> dict:
    out = {}
    for name, (select, threshold) in methods.items():
        pairs = collect(batches, name, size, select)
        rule = THRESHOLD_RULE.get(name, "peak")
        out[name] = {kind: score_maps(p, threshold, rule) for kind, p in pairs.items()}
        out[name]["threshold"], out[name]["threshold_rule"] = threshold, rule
    return out


def attention_on_objects(maps: torch.Tensor, detections: list, margin: int = 1) -> torch.Tensor:
    """Each word's mean map value on each detected object's pixels and on the background (every pixel farther
    than `margin` from an object, as `background_grain` counts it): (words, objects + 1), the background last.
    `maps` is (words, H, W) at the image's size; on raw maps a value is the share of a pixel's attention."""
    shape = tuple(maps.shape[-2:])
    regions = [d.mask for d in detections] + [background_mask(shape, detections, margin)]
    columns = []
    for region in regions:
        region = torch.as_tensor(region, dtype=torch.bool)  # (H, W)
        columns.append(maps[:, region].mean(dim=1) if region.any() else torch.full(maps.shape[:1], float("nan")))
    return torch.stack(columns, dim=1)  # (words, regions)
