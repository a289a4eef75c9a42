"""The scenes-64 evaluation: sample every prompt of `eval_prompts64`, judge each image with `detect64` and
`check64`, and score each count, size, colour and shape word's map against the objects matched to it (generated
images) and against exact masks (dataset images denoised one step).

Maps use the plain aggregation (every cross-attention layer and step, `token_maps`); its threshold is chosen on
images of other seeds (the selection split), by shape-word IoU, as scenes-32's evaluation chooses its baselines'.
Each word kind is also scored at a threshold of its own, chosen on the same selection images by that kind's IoU:
colour words' maps peak harder than shape words' and the shape words' threshold cuts them inside their objects.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch

from crossattn.capture import AttentionStore
from crossattn.overlay import to_uint8

from ..pipeline import default_guidance
from .detect64 import detect
from .map_scoring import Batch, best_threshold
from .maps64 import collect64, dataset_batch64, empty_pairs64, map_scores64, word_entries
from .paired import judged
from .prompts import and_order, background_grain
from .prompts64 import TASKS64, EvalPrompt64, check64, eval_prompts64, prompt_following64


def judge64(p: EvalPrompt64, image) -> dict:
    """One image of prompt `p` judged: {"task", "prompt", "held_out", "ok", "grain", "matched", "centers"};
    `matched` holds each group's found detections, in the caption's object order once flattened; `centers` each
    group's first found centre (None if none), as scenes-32's `and_order` reads them."""
    found = detect(image)
    ok, matched = check64(p, found, image.shape[0])
    return {"task": p.task, "prompt": p.prompt, "held_out": p.held_out, "ok": ok,
            "grain": background_grain(image, found), "matched": matched,
            "centers": [group[0].center if group else None for group in matched]}


def object_masks(p: EvalPrompt64, matched: list[list]) -> list:
    """Each of the prompt's objects' masks in caption order (None where its group was found short of it)."""
    masks = []
    for group, found in zip(p.description.groups, matched):
        masks += [d.mask for d in found] + [None] * (group.count - len(found))
    return masks


@torch.no_grad()
def sample_and_judge(pipe, prompts: list[EvalPrompt64], seeds: int, base_seed: int, steps: int, guidance: float,
                     prompts_per_batch: int = 8, record_maps: bool = True) -> tuple[list[dict], dict[str, list]]:
    """Sample every prompt `seeds` times (chunk k of `prompts_per_batch` prompts from generator seed
    `base_seed + first prompt's index`), judge every image, and read each chunk's recorded attention into its words'
    plain maps with their matched masks. Returns (per-image records, `collect64`'s pairs: empty when not
    `record_maps`)."""
    records, pairs = [], empty_pairs64()
    for start in range(0, len(prompts), prompts_per_batch):
        chunk = prompts[start:start + prompts_per_batch]
        store = AttentionStore.for_pipeline(pipe) if record_maps else None  # cross-attention: the plain maps
        with store.attach(pipe.unet) if record_maps else nullcontext():
            images = pipe([p.prompt for p in chunk], num_images_per_prompt=seeds, num_inference_steps=steps,
                          guidance_scale=guidance, generator=torch.Generator().manual_seed(base_seed + start),
                          output_type="np", show_progress=False).images
        entries = []
        for i, image in enumerate(to_uint8(images)):
            p = chunk[i // seeds]
            record = judge64(p, image)
            records.append({**record, "sample": i % seeds, "image": image})
            if record_maps:
                entries += word_entries(i, pipe.tokenizer, p.prompt, p.description.word_objects(),
                                        object_masks(p, record["matched"]))
        if record_maps:
            # the words' maps now, and the store dropped: a chunk's store (every layer and timestep window, heads
            # apart) is far larger than its maps, and keeping every chunk's to the end held the evaluation at 12.6 GB
            size = (pipe.unet.config.sample_size, pipe.unet.config.sample_size)
            for key, value in collect64([Batch(store, entries)], "ours", size).items():
                pairs[key] += value
    return records, pairs


def run_evaluation64(pipe, seeds: int = 4, steps: int = 25, guidance: float | None = None,
                     dataset_images: int = 64, dataset_timestep: int = 300, tasks: tuple[str, ...] = TASKS64) -> dict:
    """Prompt following (per task, seen and held-out prompts apart, and where "and" prompts put their first object:
    `and_order`) and map accuracy for every word kind, on generated images (seeds 0 ...; the threshold chosen on
    seeds 10,000 ...) and on `dataset_images` held-out dataset scenes denoised one step from `dataset_timestep`."""
    guidance = default_guidance(pipe) if guidance is None else guidance
    prompts = [p for p in eval_prompts64() if p.task in tasks]
    size = (pipe.unet.config.sample_size, pipe.unet.config.sample_size)
    _, select_pairs = sample_and_judge(pipe, prompts, max(1, seeds // 2), 10_000, steps, guidance)
    records, pairs = sample_and_judge(pipe, prompts, seeds, 0, steps, guidance)
    own = {key: best_threshold(value) for key, value in select_pairs.items() if key != "numerals" and value}
    threshold = own.get("shape_words", best_threshold([]))  # every kind's: the shape words' own
    dataset = [dataset_batch64(pipe, dataset_images, dataset_timestep)]
    return {"prompt_following": {**prompt_following64(records), "and_order": and_order(records),
                                 "judged": judged(records, 0)},
            "maps": map_scores64(pairs, threshold, own),
            "maps_dataset": {**map_scores64(collect64(dataset, "ours", size), threshold, own),
                             "timestep": dataset_timestep, "images": dataset_images},
            "settings": {"seeds": seeds, "selection_seeds": max(1, seeds // 2), "steps": steps, "guidance": guidance,
                         "prompts": len(prompts), "tasks": list(tasks)}}


def prompt_following64_on_fresh_seeds(pipe, seeds: int, base_seed: int, steps: int = 25,
                                      guidance: float | None = None) -> dict:
    """Prompt following alone, every task, on `seeds` images per prompt from `base_seed`: noise that the report's
    seeds (0 ...) and selection seeds (10,000 ...) never use, the same for every model, so that a difference the
    report's 8 seeds cannot tell from noise is measured again on other images. No maps."""
    guidance = default_guidance(pipe) if guidance is None else guidance
    prompts = eval_prompts64()
    records, _ = sample_and_judge(pipe, prompts, seeds, base_seed, steps, guidance, record_maps=False)
    return {"prompt_following": {**prompt_following64(records), "and_order": and_order(records),
                                 "judged": judged(records, base_seed)},
            "settings": {"seeds": seeds, "base_seed": base_seed, "steps": steps, "guidance": guidance,
                         "prompts": len(prompts), "tasks": list(TASKS64)}}
