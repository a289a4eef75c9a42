"""Does each word's map land on the objects it names, in the scenes-64 world? Colour, shape, size and count words
are scored against the union of their objects' masks (mIoU, pointing, mass: `crossattn.metrics.score_maps`); a
numeral's map is also scored by how it spreads over its objects: the share of its mass on all of them, and the
smallest share any one of them gets (the target: at least 0.8 on them, and at least 1/(2N) on each of N).
"""

from __future__ import annotations

import torch

from crossattn.capture import AttentionStore
from crossattn.metrics import mass, score_maps
from crossattn.text import prompt_words

from ..scenes64 import Scenes64Sampler
from ..world import WORD_KINDS, word_kind
from .map_scoring import Batch, method_maps, record_scenes

NUMERAL_MASS_TARGET = 0.8  # the share of a numeral's map that should fall on its objects


def word_entries(index: int, tokenizer, caption: str, word_objects: dict[int, tuple[int, ...]],
                 masks: list) -> list[tuple]:
    """(image index, word, token positions, its objects' masks) for every word of `caption` that names objects.
    `masks[k]` is object k's (H, W) bool mask, None where it was not found: a word with an object not found is
    left out, as its map has nothing to be scored against."""
    words = prompt_words(tokenizer, caption)
    entries = []
    for w_index, objects in sorted(word_objects.items()):
        named = [masks[k] for k in objects]
        if all(m is not None for m in named):
            entries.append((index, words[w_index].text, words[w_index].tokens, tuple(named)))
    return entries


def spread(heat: torch.Tensor, masks: list[torch.Tensor]) -> dict:
    """How a word's (H, W) map spreads over its objects' (H, W) bool masks: the share of its mass on all of them
    (`mass`), the smallest share on any one of them (`min_share`), and that smallest share times their number
    (`evenness`: 1 when every object gets an equal share of all the mass, 0 when one gets none)."""
    union = torch.stack(list(masks)).any(dim=0)
    smallest = min(mass(heat, m) for m in masks)
    return {"mass": mass(heat, union), "min_share": smallest, "evenness": smallest * len(masks),
            "objects": len(masks)}


def numeral_scores(items: list[tuple[torch.Tensor, list[torch.Tensor]]]) -> dict:
    """Means of `spread` over numerals' (map, masks) items, per count ("1".."4") and over counts of two or more
    ("several"), with the share of maps meeting the target (mass >= 0.8 and every object >= 1/(2N))."""
    rows = [spread(heat, masks) for heat, masks in items]
    groups = {str(n): [r for r in rows if r["objects"] == n] for n in sorted({r["objects"] for r in rows})}
    groups["several"] = [r for r in rows if r["objects"] >= 2]
    out = {}
    for key, chosen in groups.items():
        if not chosen:
            out[key] = {"n": 0, "mass": None, "min_share": None, "evenness": None, "meets_target": None}
            continue
        out[key] = {"n": len(chosen), **{m: sum(r[m] for r in chosen) / len(chosen)
                                         for m in ("mass", "min_share", "evenness")},
                    "meets_target": sum(r["mass"] >= NUMERAL_MASS_TARGET and r["evenness"] >= 0.5
                                        for r in chosen) / len(chosen)}
    return out


def empty_pairs64() -> dict[str, list]:
    """Every key `word_pairs64` fills, with no pairs yet."""
    return {f"{kind}_words": [] for kind in WORD_KINDS} | {"numerals": []}


def word_pairs64(maps: torch.Tensor, entries: list[tuple]) -> dict[str, list]:
    """From (B, T, H, W) token maps: (map, union of its objects' masks) pairs per word kind ("color_words",
    "shape_words", "size_words", "count_words"), and (map, masks) items of the numerals ("numerals")."""
    out = empty_pairs64()
    for b, word, tokens, masks in entries:
        heat = maps[b, tokens].sum(0)  # (H, W): a word's tokens together
        masks = [torch.as_tensor(m) for m in masks]
        out[f"{word_kind(word)}_words"].append((heat, torch.stack(masks).any(dim=0)))
        if word_kind(word) == "count":
            out["numerals"].append((heat, masks))
    return out


def collect64(batches: list[Batch], method: str, size, select: dict | None = None) -> dict[str, list]:
    """`word_pairs64` over recorded batches, each word's map made by map method `method` (`method_maps`)."""
    pairs = empty_pairs64()
    for k, batch in enumerate(batches):
        for key, value in word_pairs64(method_maps(method, batch.store, size, select, seed=k), batch.entries).items():
            pairs[key] += value
    return pairs


def map_scores64(pairs: dict[str, list], threshold: float, own: dict[str, float] | None = None) -> dict:
    """`score_maps` per word kind at `threshold`, and `numeral_scores` for the numerals. With `own` (word kind ->
    a threshold of that kind's own, chosen on other images), each kind also gets its mIoU there ("own_threshold",
    "own_miou"): one threshold for every kind cuts a peaked map's region inside its objects."""
    out = {key: score_maps(value, threshold) for key, value in pairs.items() if key != "numerals"}
    for key, t in (own or {}).items():
        out[key] |= {"own_threshold": t, "own_miou": out[key]["sweep"].get(f"{t:g}")}
    return out | {"numerals": numeral_scores(pairs["numerals"]), "threshold": threshold}


def dataset_batch64(pipe, n: int, timestep: int, seed: int = 123, split: str = "eval") -> Batch:
    """`n` scenes of the world (held-out split by default) noised to `timestep` and denoised one step with their
    captions, with their exact masks. Scene i is noised with seed `seed + i`, as `dataset_batch` does."""
    side = pipe.unet.config.sample_size
    sampler = Scenes64Sampler(seed, split, side)
    scenes = [sampler() for _ in range(n)]
    store = record_scenes(pipe, scenes, timestep, seed, AttentionStore.for_pipeline(pipe))  # plain maps: cross only
    entries = []
    for i, scene in enumerate(scenes):
        entries += word_entries(i, pipe.tokenizer, scene.caption, scene.word_objects, [o.mask for o in scene.objects])
    return Batch(store, entries)
