"""The evaluation: sample the prompts, judge each image (`prompts.py`) and score each word's map
(`map_scoring.py`), on generated and on dataset images, into one report.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from crossattn.maps import refined_store
from crossattn.metrics import THRESHOLDS
from crossattn.overlay import to_uint8
from crossattn.text import prompt_words

from ..pipeline import default_guidance
from ..relations import WORD_SIDES
from .detect import detect
from .layout import key_separation, layout_response
from .map_scoring import (
    BASELINES,
    READOUTS,
    THRESHOLD_RULE,
    Batch,
    best_threshold,
    choose_readouts,
    choose_selection,
    collect,
    dataset_batch,
    map_scores,
    one_pass,
    self_attention_entropy,
)
from .paired import judged
from .prompts import (
    OPPOSITE_RELATIONS,
    PAIRED_AXES,
    TASKS,
    EvalPrompt,
    and_order,
    background_grain,
    check,
    eval_prompts,
    paired_relation_response,
    parse_prompt,
    prompt_following,
    relation_response,
    word_objects,
)

DATASET_TIMESTEPS = (100, 200, 300, 500)  # the dataset read-out's sweep: which noise level reads best


def generate_batches(pipe, prompts: list[EvalPrompt], seeds: int, base_seed: int, steps: int, guidance: float,
                     prompts_per_batch: int = 8, progress=None):
    """Sample every prompt `seeds` times; returns per-image records and the recorded batches."""
    records, batches = [], []
    for start in range(0, len(prompts), prompts_per_batch):
        chunk = prompts[start:start + prompts_per_batch]
        store = refined_store(pipe)  # cross-attention, and self-attention heads averaged for the refined maps
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
            records.append({"task": p.task, "prompt": p.prompt, "sample": i % seeds, "ok": ok, "image": image,
                            "relation": p.relation,
                            "centers": [None if m is None else m.center for m in matched],
                            "grain": background_grain(image, found), "batch": len(batches), "index": i})
            words = prompt_words(pipe.tokenizer, p.prompt)
            for w_index, obj in word_objects(p.prompt).items():
                if matched[obj] is not None:
                    entries.append((i, words[w_index].text, words[w_index].tokens, matched[obj].mask))
        batches.append(Batch(store, entries))
        if progress:
            progress.update(len(chunk))
    return records, batches


def prompt_following_on_fresh_seeds(pipe, seeds: int, base_seed: int, steps: int = 25, guidance: float | None = None,
                                    tasks: tuple[str, ...] = TASKS, progress: bool = True) -> dict:
    """Prompt following alone, on `seeds` images per prompt of `tasks` from `base_seed`: noise the report's own
    seeds (0 ...) and selection seeds (10,000 ...) never use, the same for every model. A difference between two
    models that the report's 8 seeds cannot tell from noise is measured here on as many seeds as it needs.
    Returns the scores and, per task, how many images were right of how many."""
    guidance = default_guidance(pipe) if guidance is None else guidance
    from tqdm.auto import tqdm
    prompts = [p for p in eval_prompts() if p.task in tasks]
    bar = tqdm(total=len(prompts), desc="sampling", disable=not progress)
    records, _ = generate_batches(pipe, prompts, seeds, base_seed, steps, guidance, progress=bar)
    bar.close()
    result = {task: value for task, value in prompt_following(records).items() if task in tasks}
    if {"two_object", "color_attr"} & set(tasks):
        result["and_order"] = and_order(records)
    result["right_of"] = {task: [sum(r["ok"] for r in records if r["task"] == task),
                                 sum(r["task"] == task for r in records)] for task in tasks}
    result["judged"] = judged(records, base_seed)  # for a paired comparison with another model (paired.py)
    result["settings"] = {"seeds": seeds, "base_seed": base_seed, "steps": steps, "guidance": guidance,
                          "tasks": list(tasks), "prompts": len(prompts)}
    return result


@torch.no_grad()
def relation_word_similarity(pipe) -> dict[str, float]:
    """Cosine similarity of the text encoder's hidden states for the opposite relation words of
    "a circle left of a square" / "... right of ..." (and above / below), at the relation word's first token.
    Near 1 the U-Net receives the same vector for both words, so no image-side change can make it follow them."""
    result = {}
    for first, second in OPPOSITE_RELATIONS.values():
        key = f"{first.split()[0]}/{second.split()[0]}"  # "left/right", "above/below"
        ids = pipe.tokenizer([f"a circle {first} a square", f"a circle {second} a square"], padding="max_length",
                             max_length=pipe.tokenizer.model_max_length, truncation=True,
                             return_tensors="pt").input_ids.to(pipe.device)
        differ = (ids[0] != ids[1]).nonzero()
        if not len(differ):  # a tokenizer that cannot tell them apart: identical inputs
            result[key] = 1.0
            continue
        hidden = pipe.text_encoder(ids).last_hidden_state[:, int(differ[0])]  # (2, D) at the first token they differ
        result[key] = float(torch.cosine_similarity(hidden[0], hidden[1], dim=0))
    return result


def paired_prompts(axis: str) -> list[EvalPrompt]:
    """The prompts of one paired axis (`PAIRED_AXES`) under its first word."""
    first, _, kind = PAIRED_AXES[axis]
    if kind == "shapes":
        return [p for p in eval_prompts() if p.relation == first]
    coloured = [p.objects for p in eval_prompts() if p.task == "color_attr"]  # held-out colour pairs
    if kind == "colours":
        return [parse_prompt(f"a {c1} {s1} {first} a {c2} {s2}") for (c1, s1), (c2, s2) in coloured]
    return [parse_prompt(f"a {c} {s} {first}") for c, s in dict.fromkeys(obj[0] for obj in coloured)]


@torch.no_grad()
def paired_relations(pipe, seeds: int = 8, steps: int = 25, guidance: float | None = None,
                     base_seed: int = 20_000) -> dict:
    """Does the position word move the objects, all else held fixed? For every axis of `PAIRED_AXES`, each prompt
    with the axis's first word ("left of", "on the top") is sampled beside its opposite ("right of", "on the
    bottom") from the same noise (`paired_relation_response`), on seeds of their own so the main evaluation's
    images stay as they were."""
    guidance = default_guidance(pipe) if guidance is None else guidance
    result = {}
    for axis, (first, second, kind) in PAIRED_AXES.items():
        index = WORD_SIDES[first][0]
        prompts = paired_prompts(axis)
        opposite = [parse_prompt(p.prompt.replace(f" {first}", f" {second}")) for p in prompts]
        images = [to_uint8(pipe([p.prompt for p in chunk], num_images_per_prompt=seeds, num_inference_steps=steps,
                                guidance_scale=guidance, generator=torch.Generator().manual_seed(base_seed),
                                output_type="np", show_progress=False).images)
                  for chunk in (prompts, opposite)]  # same count, same generator: image i has the same noise
        pairs = []
        for i, (a, b) in enumerate(zip(*images)):
            offsets = []
            for prompt, image in ((prompts[i // seeds], a), (opposite[i // seeds], b)):
                _, matched = check(prompt, detect(image))
                if None in matched:
                    offsets.append(None)
                elif kind == "one object":  # against the image's centre
                    offsets.append(matched[0].center[index] - (image.shape[1 - index] - 1) / 2)
                else:
                    offsets.append(matched[0].center[index] - matched[1].center[index])
            pairs.append((*offsets, float(np.abs(a.astype(np.float64) - b).mean())))
        result[axis] = paired_relation_response(pairs, axis)
    return result


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
    readouts = choose_readouts(select_batches, size, selection)
    methods.update({name: (select, t) for name, (_, select, t) in readouts.items()})
    for name in BASELINES:
        methods[name] = (None, best_threshold(collect(select_batches, name, size)["shape_words"],
                                              THRESHOLD_RULE.get(name, "peak")))
    generated = map_scores(batches, size, methods)
    # one denoising step: the timestep filters do not apply; keep each method's layer, head and refinement choice
    data_methods = {name: (one_pass(name, select), t) for name, (select, t) in methods.items()}
    on_dataset = map_scores([dataset_batch(pipe, dataset_images, dataset_timestep)], size, data_methods)
    sweep = {}
    for t in sorted({*DATASET_TIMESTEPS, dataset_timestep}):  # plain and refined maps, other noise levels
        scores = on_dataset if t == dataset_timestep else map_scores(
            [dataset_batch(pipe, dataset_images, t)], size, {k: data_methods[k] for k in ("ours", "refined")})
        sweep[str(t)] = {k: {kind: {m: scores[k][kind][m] for m in ("miou", "pointing", "mass")}
                             for kind in ("shape_words", "color_words")} for k in ("ours", "refined")}
    report = {
        "prompt_following": {**prompt_following(records), "relation_response": relation_response(records),
                             "and_order": and_order(records),
                             "relation_response_paired": paired_relations(pipe, seeds, steps, guidance),
                             "relation_word_similarity": relation_word_similarity(pipe),
                             "layout_response": layout_response(pipe, steps=steps),
                             "judged": judged(records, 0)},
        "key_separation": key_separation(pipe),
        "maps": {**generated["ours"], "aggregation": selection_name},
        "readouts": {name: {**generated[name], "params": readouts[name][0]} for name in READOUTS},
        "baselines": {name: generated[name] for name in BASELINES},
        "maps_dataset": {**on_dataset["ours"], "timestep": dataset_timestep, "images": dataset_images},
        "readouts_dataset": {name: {**on_dataset[name], "params": readouts[name][0]} for name in READOUTS},
        "baselines_dataset": {name: on_dataset[name] for name in BASELINES},
        "dataset_timestep_sweep": sweep,
        "self_attention_entropy": self_attention_entropy(batches[0].store),
        "settings": {"seeds": seeds, "selection_seeds": max(1, seeds // 2), "steps": steps, "guidance": guidance,
                     "prompts": len(prompts), "quick": quick, "thresholds": list(THRESHOLDS)},
    }
    for r in records:  # the figure needs each image's own maps
        batch = batches[r["batch"]]
        r["words"] = [(w, tokens, mask) for b, w, tokens, mask in batch.entries if b == r["index"]]
    return report, records, batches, selection
