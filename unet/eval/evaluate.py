"""Measured truth: does the image follow the prompt, and does each word's map point at its object?

Prompt following mirrors GenEval's tasks on our world (single object, two objects, colours,
position, colour attribution); a prompt counts only if every clause holds, judged by the detector.
Map accuracy scores each colour and shape word's map against its object's mask, on generated
images (mask from the detector) and on dataset images denoised one step (exact masks), for our
best aggregation and for baselines computed from the same recorded attention.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch
from diffusers import DDPMScheduler
from scipy import ndimage

from crossattn.capture import AttentionStore
from crossattn.maps import daam_heat_maps, token_maps
from crossattn.metrics import THRESHOLDS, score_maps
from crossattn.overlay import to_uint8
from crossattn.text import prompt_words

from ..data import COLORS, HELD_OUT_PAIRS, RELATIONS, SHAPES, SceneSampler, scenes_to_tensor, to_model_range
from ..pipeline import default_guidance
from .detect import Detection, detect, relative_position

TASKS = ("single_object", "two_object", "colors", "position", "color_attr")
BASELINES = ("uniform", "centre", "random_layer", "daam")
THRESHOLD_RULE = {"daam": "minmax"}  # DAAM thresholds its min-max-rescaled map; every other method: the peak


@dataclass
class EvalPrompt:
    task: str
    prompt: str
    objects: list[tuple[str | None, str]]  # (colour or None, shape) per object, in prompt order
    relation: str | None = None


def eval_prompts() -> list[EvalPrompt]:
    """GenEval-style prompts. Pairs with colours come from the held-out combinations only."""
    prompts = [EvalPrompt("single_object", f"a {s}", [(None, s)]) for s in SHAPES]
    prompts += [EvalPrompt("colors", f"a {c} {s}", [(c, s)]) for c in COLORS for s in SHAPES]
    shape_pairs = [(a, b) for a in SHAPES for b in SHAPES if a != b]
    prompts += [EvalPrompt("two_object", f"a {a} and a {b}", [(None, a), (None, b)]) for a, b in shape_pairs]
    prompts += [EvalPrompt("position", f"a {a} {r} a {b}", [(None, a), (None, b)], r)
                for a, b in shape_pairs for r in RELATIONS]
    prompts += [EvalPrompt("color_attr", f"a {c1} {s1} and a {c2} {s2}", [(c1, s1), (c2, s2)])
                for c1, s1, c2, s2 in HELD_OUT_PAIRS if c1 != c2 and s1 != s2]
    return prompts


def word_objects(prompt: str) -> dict[int, int]:
    """Word index -> object index for colour and shape words ("a red circle and a square": 1,2 -> 0; 5 -> 1)."""
    mapping, obj = {}, 0
    for i, w in enumerate(prompt.split()):
        if w in COLORS or w in SHAPES:
            mapping[i] = obj
        if w in SHAPES:
            obj += 1
    return mapping


def check(p: EvalPrompt, detections: list[Detection]) -> tuple[bool, list[Detection | None]]:
    """Whether every clause of `p` holds, and the detection matched to each of its objects."""
    matched, used = [], set()
    for color, shape in p.objects:
        hit = next((i for i, d in enumerate(detections) if i not in used and d.shape == shape
                    and (color is None or d.color == color)), None)
        matched.append(None if hit is None else detections[hit])
        if hit is not None:
            used.add(hit)
    ok = all(m is not None for m in matched)
    if ok and p.relation is not None:
        ok = p.relation in relative_position(matched[0], matched[1])
    return ok, matched


def background_grain(image: np.ndarray, detections: list[Detection], margin: int = 1) -> float:
    """Mean |pixel| (0-255 scale, all channels) of the background: every pixel farther than `margin` from a
    detected object. The data's background is exactly 0, so anything above it is grain the model left."""
    image = np.asarray(image)
    if image.dtype != np.uint8:
        image = to_uint8(image)
    objects = np.zeros(image.shape[:2], bool)
    for d in detections:
        objects |= d.mask
    if margin:
        objects = ndimage.binary_dilation(objects, iterations=margin)  # anti-aliased edges belong to objects
    background = image[~objects].astype(np.float64)  # (pixels, 3)
    return float(background.mean()) if background.size else 0.0


# --- map methods: each returns (B, T, H, W) token maps from the same recorded attention
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


def generate_batches(pipe, prompts: list[EvalPrompt], seeds: int, base_seed: int, steps: int, guidance: float,
                     prompts_per_batch: int = 8, progress=None):
    """Sample every prompt `seeds` times; returns per-image records and the recorded batches."""
    records, batches = [], []
    for start in range(0, len(prompts), prompts_per_batch):
        chunk = prompts[start:start + prompts_per_batch]
        store = AttentionStore.for_pipeline(pipe)
        with store.attach(pipe.unet):
            images = pipe([p.prompt for p in chunk], num_images_per_prompt=seeds, num_inference_steps=steps,
                          guidance_scale=guidance, generator=torch.Generator().manual_seed(base_seed + start),
                          output_type="np", show_progress=False).images
        images = to_uint8(images)
        entries = []
        for i, image in enumerate(images):
            p = chunk[i // seeds]
            found = detect(image)
            ok, matched = check(p, found)
            records.append({"task": p.task, "prompt": p.prompt, "ok": ok, "image": image,
                            "grain": background_grain(image, found), "batch": len(batches), "index": i})
            words = prompt_words(pipe.tokenizer, p.prompt)
            for w_index, obj in word_objects(p.prompt).items():
                if matched[obj] is not None:
                    entries.append((i, words[w_index].text, words[w_index].tokens, matched[obj].mask))
        batches.append(Batch(store, entries))
        if progress:
            progress.update(len(chunk))
    return records, batches


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


def prompt_following(records) -> dict:
    result = {"n_images": {}}
    for task in TASKS:
        rows = [r for r in records if r["task"] == task]
        result[task] = sum(r["ok"] for r in rows) / len(rows) if rows else None
        result["n_images"][task] = len(rows)
    scored = [result[t] for t in TASKS if result[t] is not None]
    result["overall"] = sum(scored) / len(scored)  # GenEval: mean over tasks
    grain = [r["grain"] for r in records]
    result["background_grain"] = {"mean": float(np.mean(grain)), "p90": float(np.percentile(grain, 90)),
                                  "unit": "mean |pixel| of background pixels, 0-255"}
    return result


def map_scores(batches, size, methods: dict[str, tuple[dict | None, float]]) -> dict:
    out = {}
    for name, (select, threshold) in methods.items():
        method = "ours" if name == "ours" else name
        pairs = collect(batches, method, size, select)
        rule = THRESHOLD_RULE.get(name, "peak")
        out[name] = {kind: score_maps(p, threshold, rule) for kind, p in pairs.items()}
        out[name]["threshold"], out[name]["threshold_rule"] = threshold, rule
    return out


def run_evaluation(pipe, seeds: int = 4, steps: int = 25, guidance: float | None = None, dataset_images: int = 64,
                   dataset_timestep: int = 300, quick: bool = False, progress: bool = True):
    """Everything in the report: returns (report dict, per-image records, recorded batches, our selection)."""
    guidance = default_guidance(pipe) if guidance is None else guidance  # None: the model's own
    from tqdm.auto import tqdm
    prompts = eval_prompts()
    if quick:
        rng = random.Random(0)
        prompts = [p for task in TASKS for p in rng.sample([q for q in prompts if q.task == task],
                                                           min(3, sum(q.task == task for q in prompts)))]
    size = (pipe.unet.config.sample_size, pipe.unet.config.sample_size)
    bar = tqdm(total=2 * len(prompts), desc="sampling", disable=not progress)
    # selection split: other seeds, used only to choose our aggregation and every method's threshold
    _, select_batches = generate_batches(pipe, prompts, max(1, seeds // 2), 10_000, steps, guidance, progress=bar)
    records, batches = generate_batches(pipe, prompts, seeds, 0, steps, guidance, progress=bar)
    bar.close()
    selection_name, selection, threshold = choose_selection(select_batches, size)
    methods = {"ours": (selection, threshold)}
    for name in BASELINES:
        methods[name] = (None, best_threshold(collect(select_batches, name, size)["shape_words"],
                                              THRESHOLD_RULE.get(name, "peak")))
    generated = map_scores(batches, size, methods)
    data_batch = dataset_batch(pipe, dataset_images, dataset_timestep)
    # one denoising step: the timestep filter of 'ours' does not apply; keep its layer choice
    data_methods = dict(methods, ours=({k: v for k, v in selection.items() if k != "timesteps"}, threshold))
    on_dataset = map_scores([data_batch], size, data_methods)
    report = {
        "prompt_following": prompt_following(records),
        "maps": {**generated["ours"], "aggregation": selection_name},
        "baselines": {name: generated[name] for name in BASELINES},
        "maps_dataset": {**on_dataset["ours"], "timestep": dataset_timestep, "images": dataset_images},
        "baselines_dataset": {name: on_dataset[name] for name in BASELINES},
        "settings": {"seeds": seeds, "selection_seeds": max(1, seeds // 2), "steps": steps, "guidance": guidance,
                     "prompts": len(prompts), "quick": quick, "thresholds": list(THRESHOLDS)},
    }
    for r in records:  # the figure needs each image's own maps
        batch = batches[r["batch"]]
        r["words"] = [(w, tokens, mask) for b, w, tokens, mask in batch.entries if b == r["index"]]
    return report, records, batches, selection
