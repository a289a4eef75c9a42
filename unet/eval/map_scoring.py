"""Does each word's map point at its object? Colour and shape words' maps scored against their objects'
masks -- on generated images (masks from the detector) and on dataset images denoised one step (exact
masks) -- for our best aggregation and for baselines computed from the same recorded attention."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch
from diffusers import DDPMScheduler

from crossattn.capture import AttentionStore
from crossattn.maps import daam_heat_maps, token_maps
from crossattn.metrics import score_maps
from crossattn.text import prompt_words

from ..data import SHAPES, SceneSampler, scenes_to_tensor, to_model_range

BASELINES = ("uniform", "centre", "random_layer", "daam")
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
    if name == "ours":
        return token_maps(store, size, **(select or {}))
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


def dataset_batch(pipe, n: int, timestep: int, seed: int = 123) -> Batch:
    """Held-out dataset scenes noised to `timestep`, denoised one step with their captions; exact masks."""
    sampler = SceneSampler(seed, pipe.unet.config.sample_size, pipe.unet.config.sample_size, split="eval")
    scenes = [sampler() for _ in range(n)]
    x0 = to_model_range(scenes_to_tensor(scenes))  # (n, 3, H, W) in [-1, 1]
    sched = DDPMScheduler.from_config(pipe.scheduler.config)  # the model's own noise schedule
    t = torch.full((n,), timestep)
    noisy = sched.add_noise(x0, torch.randn(x0.shape, generator=torch.Generator().manual_seed(seed)), t)
    store = AttentionStore.for_pipeline(pipe)  # the same config as `sched`
    with torch.no_grad(), store.attach(pipe.unet):
        pipe.unet(noisy.to(pipe.device), t.to(pipe.device),
                  encoder_hidden_states=pipe.encode_prompt([s.caption for s in scenes]))
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


def choose_selection(batches: list[Batch], size) -> tuple[str, dict, float]:
    """Best 'ours' aggregation and threshold on the selection split, by shape-word (mIoU + pointing)."""
    best = None
    for name, select in candidate_selections(batches[0].store).items():
        try:
            pairs = collect(batches, "ours", size, select)["shape_words"]
        except ValueError:  # no layer/timestep matches this candidate
            continue
        threshold = best_threshold(pairs)
        s = score_maps(pairs, threshold)
        value = (s["miou"] or 0) + (s["pointing"] or 0)
        if best is None or value > best[0]:
            best = (value, name, select, threshold)
    return best[1], best[2], best[3]


def map_scores(batches, size, methods: dict[str, tuple[dict | None, float]]) -> dict:
    out = {}
    for name, (select, threshold) in methods.items():
        method = "ours" if name == "ours" else name
        pairs = collect(batches, method, size, select)
        rule = THRESHOLD_RULE.get(name, "peak")
        out[name] = {kind: score_maps(p, threshold, rule) for kind, p in pairs.items()}
        out[name]["threshold"], out[name]["threshold_rule"] = threshold, rule
    return out
