"""Evidence for what the model gets wrong, and why: colour collapse, grain, merged words, two objects, counts.

    python scripts/diagnose.py first-step --model PATH --out outputs/examples/diagnosis/NAME
    python scripts/diagnose.py grain --model PATH --out outputs/examples/diagnosis/NAME
    python scripts/diagnose.py unconditional --model PATH --out outputs/examples/diagnosis/NAME
    python scripts/diagnose.py words --model PATH --out outputs/examples/diagnosis/NAME
    python scripts/diagnose.py two-objects --model PATH --out outputs/examples/diagnosis/NAME
    python scripts/diagnose.py text-routes --model PATH --out outputs/examples/diagnosis/NAME
    python scripts/diagnose.py self-attention-wall --model PATH --out outputs/examples/diagnosis/NAME
    python scripts/diagnose.py counts --model scenes-64 --out outputs/examples/diagnosis/NAME
    python scripts/diagnose.py count-noise --model scenes-64 --out outputs/examples/diagnosis/NAME

first-step: for single-object colour prompts, samples the same seeds twice: with trailing DDIM, whose first step is
t = T (for an epsilon model at ~zero SNR, the x0 estimate there is noise amplified by 1/sqrt(alpha_bar)),
and with the first step moved to t = 0.96 T (DDIM's "leading" spacing). Reports the size of the first
x0 estimate, how much of it is clipped, colour accuracy, and which colours the detector found.
unconditional: which colours the detector finds in images sampled from the empty prompt, and the hue
of the palette's mean colour (where an undecided colour averages to).
words: where the text encoder merges two colour words of one prompt ("red" and "blue" in "a red circle left of
a blue square", and the other pairs of `WORD_PROMPTS`): their cosine after the embeddings and after each encoder
layer, the largest |activation| per token, and the cosine at the output when the largest dimensions are zeroed
before the final LayerNorm (does one massive dimension cause the merge, or the whole vector?).
two-objects: when a prompt with two objects is missed, what was drawn, and did the x0 estimate ever show both
objects right? The evaluation's two-object and colour-attribution prompts are sampled exactly as `evaluate.py
--fresh-seeds 50000` samples them (same batches, same noise: the same images), and the detector reads the
final image and the x0 estimate of every step; a second pass of the same images reads, at every step, how much
the two objects' word maps overlap (right images against misses). Unguided models only. Its default of 24 seeds
matches those fresh seeds.
text-routes: the same fresh seeds' two-object and colour-attribution prompts, sampled as trained and with the pooled
text, or the padding tokens' states, replaced by the empty prompt's (routes that carry both shapes unbound), and with
the second object's words kept from reading the first object's in the causal text encoder.
self-attention-wall: the same fresh seeds' two-object and colour-attribution images sampled again with self-attention
cut between where the two objects were drawn (every step, the first 8 of 25 only, or the rest), and with the same
walls moved elsewhere as a control, and with the objects reading each other more at the first steps: do the objects
settle their shapes by reading each other?
counts (a model of world scenes-64 only): for the evaluation's counting prompts ("three diamonds"), how many objects
of the named shape each image holds, by the count asked, on fresh seeds (16 per prompt from seed 60000 by default):
is a miss one too many, one too few, or another shape? At the model's own guidance, or at `--guidance`, guided
only at the timesteps `--guidance-min-t` to `--guidance-max-t`: does guidance where layout is decided draw the
count asked?
count-noise (a model of world scenes-64 only): does the starting noise decide the count? Each shape's four counting
prompts ("one circle" to "four circles") start from the same noise, `--seeds` noises per shape (16 by
default, from seed 70000). If the words decided the count, the misses of one noise would be as independent
as the misses of four noises; if the noise did, a noise that draws one too many for "two" would also for
"three". At the model's own guidance, or at `--guidance` within `--guidance-min-t` to `--guidance-max-t`, as
counts. Reports the misses per noise, whether a noise's misses err the same way, and how the errors (drawn
less asked) of two counts correlate over the noises; and each of them again with the noises shuffled count by count
within each shape, which gives what a noise with no say would.
grain: background grain (mean |pixel| off the objects, 0-255) and colour accuracy of the same prompts under
guidance 1 to 4, 25 or 50 steps, guidance limited to t >= 400 and rescaled guidance (`SETTINGS`): tells
guidance, step count and the model's own low-noise denoising apart.
"""

import argparse
import json
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from crossattn.control import Recipe
from crossattn.overlay import to_uint8
from crossattn.text import prompt_words
from unet.cli import (
    UsageError,
    add_model_argument,
    check_guidance,
    check_out_dir,
    interrupted,
    partial_folder,
    publish_files,
    sigterm_as_interrupt,
    usage_error,
)
from unet.data import COLORS, SHAPES
from unet.eval.detect import detect
from unet.eval.prompts import background_grain
from unet.folders import WRITE_ERRORS, hold_folder, write_failed
from unet.pipeline import default_guidance, load_pipeline, make_scheduler, model_label


def first_step_x0(pipe, prompts, seed: int, guidance: float) -> dict:
    """Mean |x0| and the clipped share of the x0 estimate, guided by `guidance`, at the first trailing step."""
    sched = pipe.scheduler
    sched.set_timesteps(25)
    t = sched.timesteps[0]
    B = len(prompts)
    config = pipe.unet.config
    x = torch.randn((B, config.in_channels, config.sample_size, config.sample_size),
                    generator=torch.Generator().manual_seed(seed))
    context = torch.cat([pipe.encode_prompt([""] * B), pipe.encode_prompt(prompts)])
    with torch.no_grad():
        pred_uncond, pred_cond = pipe.unet(torch.cat([x, x]), t, encoder_hidden_states=context).chunk(2)
    pred = pred_uncond + guidance * (pred_cond - pred_uncond)
    a = sched.alphas_cumprod[int(t)]
    if sched.config.prediction_type == "v_prediction":
        x0 = a.sqrt() * x - (1 - a).sqrt() * pred
    else:
        x0 = (x - (1 - a).sqrt() * pred) / a.sqrt()
    return {"t": int(t), "guidance": guidance, "alpha_bar": float(a), "mean_abs_x0": float(x0.abs().mean()),
            "clipped_share": float((x0.abs() > 1).float().mean())}


def colour_run(pipe, prompts, colours, seeds: int, spacing: str) -> dict:
    pipe.scheduler = make_scheduler("ddim", pipe.scheduler.config)
    if spacing == "leading":
        pipe.scheduler = type(pipe.scheduler).from_config(pipe.scheduler.config, timestep_spacing="leading")
    images = pipe(prompts, num_images_per_prompt=seeds, generator=torch.Generator().manual_seed(0),
                  output_type="np", show_progress=False).images
    detections = [detect(image) for image in images]
    found = Counter(d.color for dets in detections for d in dets)
    pipe.scheduler.set_timesteps(25)
    return {"first_timestep": int(pipe.scheduler.timesteps[0]),
            "colour_accuracy": colour_accuracy(detections, colours, seeds),
            "detected_colours": dict(found), "images": len(images)}


def colour_accuracy(detections, colours, seeds: int) -> float:
    """Share of images whose largest object has the prompt's colour (image i belongs to prompt i // seeds)."""
    return float(np.mean([bool(dets) and dets[0].color == colours[i // seeds] for i, dets in enumerate(detections)]))


def unconditional_colours(pipe, images: int) -> dict:
    """Detected colours in images sampled from the empty prompt (no guidance), and the palette's mean."""
    out = pipe([""] * images, guidance_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="np",
               show_progress=False).images
    found = Counter(d.color for image in out for d in detect(image))
    mean = np.mean(list(COLORS.values()), axis=0)
    return {"images": images, "detected_colours": dict(found),
            "palette_mean_rgb": [round(float(v), 1) for v in mean],
            "palette_mean_nearest_hue": detect(np.tile(mean.round().astype(np.uint8), (8, 8, 1)))[0].color}


# (steps, guidance scale, lowest guided timestep, guidance rescale)
SETTINGS = ((25, 4.0, 0, 0.0), (25, 1.0, 0, 0.0), (25, 1.5, 0, 0.0), (25, 2.0, 0, 0.0), (50, 4.0, 0, 0.0),
            (25, 4.0, 400, 0.0), (25, 4.0, 0, 0.7), (25, 2.0, 0, 0.7), (25, 2.0, 400, 0.7), (25, 1.5, 400, 0.0))


def grain_runs(pipe, prompts, colours, seeds: int) -> dict:
    """Grain and colour accuracy per (steps, guidance, lowest guided timestep)."""
    out = {}
    for steps, guidance, min_t, rescale in SETTINGS:
        images = pipe(prompts, num_images_per_prompt=seeds, num_inference_steps=steps, guidance_scale=guidance,
                      guidance_min_t=min_t, guidance_rescale=rescale, generator=torch.Generator().manual_seed(0),
                      output_type="np", show_progress=False).images
        found = [detect(image) for image in images]
        grain = [background_grain(image, dets) for image, dets in zip(images, found)]
        out[f"steps={steps} guidance={guidance} guided t>={min_t} rescale={rescale}"] = {
            "grain_mean": float(np.mean(grain)), "colour_accuracy": colour_accuracy(found, colours, seeds),
            "images": len(images)}
    return out


def objects_along_sampling(pipe, tasks=("two_object", "color_attr"), seeds: int = 24, base_seed: int = 50_000,
                           steps: int = 25) -> list[dict]:
    """Per image of `evaluate.py --fresh-seeds` (same prompts, batches and noise, unguided): whether it is right,
    and at each step how many of its prompt's objects the detector finds in the x0 estimate, and how many
    objects of any kind. Steps count from 1."""
    from unet.eval.evaluate import generate_batches
    from unet.eval.prompts import check, eval_prompts
    guidance = default_guidance(pipe)
    if guidance != 1.0:  # a guided batch is doubled, and its x0 is not one U-Net call's
        raise UsageError(f"two-objects reads unguided models only; this one samples with guidance {guidance}")
    estimates = []  # per U-Net call, batch after batch: (B, 3, H, W) x0 in [-1, 1]
    ddim = make_scheduler("ddim", pipe.scheduler.config)  # its x0 estimate; the pipeline's own stays untouched
    ddim.set_timesteps(steps)

    def keep_x0(module, args, kwargs, output):
        pred = output.sample if hasattr(output, "sample") else output
        estimates.append(ddim.step(pred, args[1], args[0]).pred_original_sample.clamp(-1, 1))

    prompts = {p.prompt: p for p in eval_prompts() if p.task in tasks}
    handle = pipe.unet.register_forward_hook(keep_x0, with_kwargs=True)
    try:
        batch, _ = generate_batches(pipe, list(prompts.values()), seeds, base_seed, steps, 1.0)
    finally:
        handle.remove()
    records = []
    for record in batch:
        p = prompts[record["prompt"]]
        shown, found = [], []
        for x0 in estimates[record["batch"] * steps:(record["batch"] + 1) * steps]:
            detections = detect((x0[record["index"]].permute(1, 2, 0).cpu().numpy() + 1) / 2)
            shown.append(sum(m is not None for m in check(p, detections)[1]))
            found.append(len(detections))
        drawn = sorted(f"{d.color} {d.shape}" if any(c for c, _ in p.objects) else d.shape
                       for d in detect(record["image"]))
        records.append({"task": p.task, "prompt": p.prompt, "ok": record["ok"], "objects_shown": shown,
                        "objects_found": found, "asked": sorted(f"{c} {s}" if c else s for c, s in p.objects),
                        "drawn": drawn, "image": record["image"]})
    return records


def map_overlap(read_a: torch.Tensor, read_b: torch.Tensor) -> torch.Tensor:
    """Histogram intersection of two attention maps (..., N): each normalised over its N pixels, the sum of the
    smaller share at every pixel; 1 for one map, 0 for maps on different pixels."""
    a = read_a / read_a.sum(-1, keepdim=True).clamp_min(1e-12)
    b = read_b / read_b.sum(-1, keepdim=True).clamp_min(1e-12)
    return torch.minimum(a, b).sum(-1)


@torch.no_grad()
def object_map_overlap(pipe, tasks=("two_object", "color_attr"), seeds: int = 24, base_seed: int = 50_000,
                       steps: int = 25) -> list[dict]:
    """Per image of `objects_along_sampling` (same prompts, batches and noise), at each step, how much the two
    objects' word maps overlap: the histogram intersection of the cross-attention on each object's words (colour and
    shape), averaged over heads and layers (`map_overlap`); 1 is one map, 0 maps on different pixels. A pass of its
    own: the evaluation's store takes the layers' observer, so the images are sampled again and their own right/wrong
    is returned beside the overlaps."""
    from unet.eval.prompts import check, eval_prompts, word_objects
    from unet.recipe import cross_attention_weights
    prompts = [p for p in eval_prompts() if p.task in tasks]
    overlaps = []  # per U-Net call: (B,) overlaps of the batch's images
    out = []
    for start in range(0, len(prompts), 8):  # generate_batches' chunks and generators
        chunk = prompts[start:start + 8]
        groups = torch.zeros(len(chunk) * seeds, pipe.tokenizer.model_max_length, 2)  # (B, T, 2): tokens per object
        for i, p in enumerate(chunk):
            words = prompt_words(pipe.tokenizer, p.prompt)
            for w, obj in word_objects(p.prompt).items():
                if obj < 2:
                    groups[i * seeds:(i + 1) * seeds, words[w].tokens, obj] = 1
        with cross_attention_weights(pipe.unet) as weights:
            def per_call(module, args, output, groups=groups):
                per_layer = []
                for w in weights:
                    read = w.mean(1) @ groups.to(w.device)  # (B, N, 2): each pixel's attention on each object's words
                    per_layer.append(map_overlap(read[..., 0], read[..., 1]))  # (B,)
                overlaps.append(torch.stack(per_layer).mean(0).cpu())
                weights.clear()
            handle = pipe.unet.register_forward_hook(per_call)
            try:
                images = pipe([p.prompt for p in chunk], num_images_per_prompt=seeds, num_inference_steps=steps,
                              guidance_scale=1.0, generator=torch.Generator().manual_seed(base_seed + start),
                              output_type="np", show_progress=False).images
            finally:
                handle.remove()
        calls = overlaps[-steps:]
        for i, image in enumerate(to_uint8(images)):
            p = chunk[i // seeds]
            out.append({"prompt": p.prompt, "ok": check(p, detect(image))[0],
                        "overlap": [round(c[i].item(), 4) for c in calls]})
    return out


def one_shape_twice(shapes: list[str]) -> bool:
    """Whether the shapes drawn in an image are two or more of one shape: the commonest two-object miss."""
    return len(shapes) >= 2 and len(set(shapes)) == 1


def overlap_summary(records: list[dict]) -> dict:
    """Mean map overlap of `object_map_overlap` over steps 1-5, 6-12 and 13-25 (of 25), right images against
    wrong ones, and against the wrong images that draw one shape twice, per task."""
    bands = {"steps 1-5": slice(0, 5), "steps 6-12": slice(5, 12), "steps 13-25": slice(12, None)}
    out = {}
    for task in sorted({r["task"] for r in records}):
        rows = [r for r in records if r["task"] == task]
        twice = [r for r in rows if not r["ok"] and one_shape_twice([d.split()[-1] for d in r["drawn"]])]
        out[task] = {name: {band: round(float(np.mean([np.mean(r["overlap"][cut]) for r in group])), 3)
                            for band, cut in bands.items()} | {"images": len(group)}
                     for name, group in (("right", [r for r in rows if r["ok"]]),
                                         ("wrong", [r for r in rows if not r["ok"]]),
                                         ("one shape drawn twice", twice)) if group}
    return out


def miss_kinds(records: list[dict]) -> dict:
    """Sorts the wrong images of `objects_along_sampling` by what was drawn at the end and whether the x0
    estimate ever showed both objects right, and says at which step (from 1) the right ones first showed both."""
    out = {}
    for task in sorted({r["task"] for r in records}):
        rows = [r for r in records if r["task"] == task]
        kinds = Counter()
        for r in rows:
            if r["ok"]:
                continue
            drawn_two = r["objects_found"][-1] >= 2 and r["objects_shown"][-1] < 2
            ever = "both shown right at some step" if max(r["objects_shown"]) >= 2 else "never both shown"
            kinds[f"{'two or more drawn, a shape or colour wrong' if drawn_two else 'one or none drawn'}; {ever}"] += 1
        first_both = [next(i for i, n in enumerate(r["objects_shown"], 1) if n >= 2) for r in rows
                      if r["ok"] and max(r["objects_shown"]) >= 2]
        drawn = Counter(f"asked {' + '.join(r['asked'])}, drawn {' + '.join(r['drawn']) or 'nothing'}"
                        for r in rows if not r["ok"])
        one_shape = sum(one_shape_twice([d.split()[-1] for d in r["drawn"]]) for r in rows if not r["ok"])
        out[task] = {"right": sum(r["ok"] for r in rows), "images": len(rows), "misses": dict(kinds),
                     "misses drawing two or more objects of one shape": one_shape,
                     "misses by what was drawn": dict(drawn.most_common()),
                     "final objects found in misses": dict(Counter(r["objects_found"][-1] for r in rows
                                                                   if not r["ok"])),
                     "first step showing both (from 1), right images": dict(sorted(Counter(first_both).items()))}
    return out


TEXT_ROUTES = ("as trained", "pooled text of the empty prompt", "padding of the empty prompt",
               "second object blind to the first")


def second_object_blind_mask(tokenizer, prompts: list[str], dtype=torch.float32) -> torch.Tensor:
    """(B, 1, T, T) additive attention mask for the text encoder: causal, and in a prompt that names two shapes
    the second object's words (from the "a" before its shape word to that word) may not see the first object's
    (from the prompt's first word to the first shape word). In a causal encoder the second shape word has read the
    first; this takes that away and leaves every other token as trained."""
    T = tokenizer.model_max_length
    allowed = torch.ones(T, T).tril().bool().expand(len(prompts), T, T).clone()  # (B, T, T): query row, key column
    for b, prompt in enumerate(prompts):
        words = prompt_words(tokenizer, prompt)
        shapes = [w for w in words if w.text in SHAPES]
        if len(shapes) < 2:
            continue
        first_end, second_end = shapes[0].index, shapes[1].index
        second_start = max(w.index for w in words if w.text == "a" and w.index < second_end)
        first = [t for w in words[:first_end + 1] for t in w.tokens]
        second = [t for w in words[second_start:second_end + 1] for t in w.tokens]
        allowed[b, torch.tensor(second)[:, None], torch.tensor(first)[None, :]] = False
    mask = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
    return mask[:, None]  # (B, 1, T, T), as transformers takes a prepared 4D mask


@contextmanager
def text_route_replaced(pipe, route: str):
    """Sample with one route by which the prompt reaches the U-Net replaced by the empty prompt's: the pooled text
    (the end token's state, added to the time embedding where the model has `pooled_text`) or the padding tokens
    (every state after the end token, which a causal encoder fills with a summary of the whole prompt). Both carry
    every word of the prompt to every pixel without saying which object is which. Or the second object's words
    encoded without reading the first object's (`second_object_blind_mask`): does the second shape word carry
    the first shape too?"""
    empty = pipe.encode_prompt([""])  # (1, T, D)
    if route == "pooled text of the empty prompt":
        proj = pipe.unet.pooled_text_proj
        if proj is None:
            raise UsageError("this model has no pooled text (trained without --pooled-text): nothing to replace")

        class EmptyPooled(torch.nn.Module):
            def forward(self, pooled):  # (B, D) -> (B, time_dim), the empty prompt's whatever the prompt
                return proj(empty[:, -1].expand(len(pooled), -1))
        pipe.unet.pooled_text_proj = EmptyPooled()
    elif route == "padding of the empty prompt":
        tokenizer, real = pipe.tokenizer, pipe.encode_prompt

        def encode(prompts: list[str]) -> torch.Tensor:
            context = real(prompts)  # (B, T, D)
            ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                            return_tensors="pt").input_ids
            for b in range(len(prompts)):
                end = int((ids[b] == tokenizer.eos_token_id).nonzero()[0])  # the first: padding repeats it
                context[b, end + 1:] = empty[0, end + 1:]
            return context
        pipe.encode_prompt = encode
    elif route == "second object blind to the first":
        real = pipe.encode_prompt

        def encode(prompts: list[str]) -> torch.Tensor:
            mask = second_object_blind_mask(pipe.tokenizer, prompts, pipe.text_encoder.dtype)  # (B, 1, T, T)
            return real(prompts, attention_mask=mask)  # (B, T, D)
        pipe.encode_prompt = encode
    try:
        yield pipe
    finally:
        if route == "pooled text of the empty prompt":
            pipe.unet.pooled_text_proj = proj
        pipe.__dict__.pop("encode_prompt", None)


def text_routes(pipe, seeds: int = 24, base_seed: int = 50_000) -> dict:
    """Right images of `evaluate.py --fresh-seeds` (two objects, colour attribution) with each of `TEXT_ROUTES`:
    does a route that carries both shapes unbound make one shape be drawn twice?"""
    from unet.eval.evaluate import prompt_following_on_fresh_seeds
    out = {}
    for route in TEXT_ROUTES:
        with text_route_replaced(pipe, route):
            scores = prompt_following_on_fresh_seeds(pipe, seeds, base_seed, tasks=("color_attr", "two_object"),
                                                     progress=False)
        out[route] = {task: f"{right} / {images}" for task, (right, images) in scores["right_of"].items()}
    return out


def object_regions(image: np.ndarray, grow: int = 1, found: list | None = None) -> np.ndarray:
    """(H, W) int labels of an image's two largest objects as the detector finds them (`found`, if already run on
    `image`), each grown by `grow` pixels (an object's edge in the x0 estimate wanders by a pixel or so): 1 and 2,
    0 elsewhere; all 0 with fewer than two objects. Where the grown regions meet, the larger object keeps the pixel."""
    found = detect(image) if found is None else found
    labels = np.zeros(image.shape[:2], dtype=np.int64)
    if len(found) < 2:
        return labels
    for label, d in ((2, found[1]), (1, found[0])):  # the larger object written last keeps shared pixels
        grown = torch.nn.functional.max_pool2d(torch.from_numpy(d.mask)[None, None].float(), 2 * grow + 1, 1, grow)
        labels[grown[0, 0].numpy() > 0] = label
    return labels


class SelfAttentionBetweenObjects(Recipe):
    """Self-attention weights between two regions multiplied by `factor` and each row renormalised: 0 is a wall
    (object 1's pixels no longer read object 2's, nor the reverse), above 1 the objects read each other more; the
    background and every other weight as the model computed them. `regions` is (B, H, W) labels at image size
    (`object_regions`), pooled to each layer's own grid; it acts for the share of the run [begin, end) (0 is pure
    noise; see `crossattn.control`)."""

    def __init__(self, regions: torch.Tensor, factor: float = 0.0, begin: float = 0.0, end: float = float("inf")):
        self.regions = regions  # (B, H, W): 0 background, 1 and 2 the two objects
        self.factor = factor
        self.begin, self.end = begin, end  # not `start`: Recipe.start() is the hook a new run calls

    def weights(self, ctl, name, cross, progress, own, new):
        if cross or not self.begin <= progress < self.end:
            return new
        B, heads, N, _ = new.shape  # (B, heads, N, N): image tokens read image tokens
        side = int(N ** 0.5)
        one_hot = torch.nn.functional.one_hot(self.regions, 3).permute(0, 3, 1, 2).float()  # (B, 3, H, W)
        region = torch.nn.functional.adaptive_max_pool2d(one_hot, side).flatten(2)  # (B, 3, N): token touches region
        between = (region[:, 1, :, None] * region[:, 2, None, :] + region[:, 2, :, None] * region[:, 1, None, :]) > 0
        scaled = torch.where(between[:, None], new * self.factor, new)  # (B, heads, N, N)
        return scaled / scaled.sum(dim=-1, keepdim=True).clamp_min(1e-12)


EARLY = 0.3  # share of the run: steps 1-8 of 25 trailing DDIM steps (t >= 719)
BOOST = 3.0  # the weights between the objects, times this, in the arm where they read each other more


@torch.no_grad()
def self_attention_wall(pipe, tasks=("two_object", "color_attr"), seeds: int = 24, base_seed: int = 50_000,
                        steps: int = 25) -> dict:
    """The images of `evaluate.py --fresh-seeds` (same prompts, batches and noise, unguided), then the same images
    again with a wall in every self-attention layer between the regions where the two objects were drawn the first
    time (`SelfAttentionBetweenObjects`, at every step); with the same walls moved by half the image in both
    directions (a control: a wall of that size between other pixels); walled only in the first `EARLY` of the run
    (the first 8 of 25 steps, where layout is decided) or only after it; and with the objects reading each other
    `BOOST` times more in those first steps. Do the two objects tell each other their shapes through
    self-attention? Regions come from the unwalled image, so the wall is an oracle: where the objects end up, not
    where the model would say they are while sampling."""
    from crossattn.control import Controller
    from unet.eval.prompts import check, eval_prompts
    if default_guidance(pipe) != 1.0:
        raise UsageError("self-attention-wall reads unguided models only (the wall would need the guided batch's "
                         "unconditional half too)")

    class EveryLayer(Controller):
        def wants(self, cross: bool) -> bool:
            return True

    def sample(chunk, seed, controller=None):
        return to_uint8(pipe([p.prompt for p in chunk], num_images_per_prompt=seeds, num_inference_steps=steps,
                             guidance_scale=1.0, generator=torch.Generator().manual_seed(seed), output_type="np",
                             show_progress=False, controller=controller).images)

    prompts = [p for p in eval_prompts() if p.task in tasks]
    rows = []
    for start in range(0, len(prompts), 8):  # generate_batches' chunks and generators: the same images
        chunk = prompts[start:start + 8]
        before = sample(chunk, base_seed + start)
        found_before = [detect(image) for image in before]
        regions = np.stack([object_regions(image, found=found) for image, found in zip(before, found_before)])
        regions = torch.from_numpy(regions).to(pipe.device)  # (B, H, W)
        H, W = regions.shape[1:]
        after = {}
        moved = regions.roll((H // 2, W // 2), dims=(1, 2))
        for arm, recipe in (("walled", SelfAttentionBetweenObjects(regions)),
                            ("control", SelfAttentionBetweenObjects(moved)),
                            ("walled early", SelfAttentionBetweenObjects(regions, end=EARLY)),
                            ("walled late", SelfAttentionBetweenObjects(regions, begin=EARLY)),
                            (f"read {BOOST:g}x more early", SelfAttentionBetweenObjects(regions, BOOST, end=EARLY))):
            ctl = EveryLayer.for_pipeline(pipe)
            ctl.recipes.append(recipe)
            with ctl.attach(pipe.unet):
                after[arm] = sample(chunk, base_seed + start, ctl)
        for i, image in enumerate(before):
            p = chunk[i // seeds]
            row = {"task": p.task, "prompt": p.prompt, "walled": bool(regions[i].max() > 0)}
            for arm, drawn in [("before", image)] + [(arm, images[i]) for arm, images in after.items()]:
                found = found_before[i] if arm == "before" else detect(drawn)
                row[f"ok {arm}"], row[f"drawn {arm}"] = check(p, found)[0], sorted(d.shape for d in found)
            rows.append(row)
    out = {}
    for task in tasks:
        mine = [r for r in rows if r["task"] == task]
        out[task] = {"images with two regions (walled)": sum(r["walled"] for r in mine)}
        for arm in ("before", "walled", "control", "walled early", "walled late", f"read {BOOST:g}x more early"):
            out[task][arm] = {
                "right": f"{sum(r[f'ok {arm}'] for r in mine)} / {len(mine)}",
                "misses made right": sum(r[f"ok {arm}"] and not r["ok before"] for r in mine),
                "right images made wrong": sum(r["ok before"] and not r[f"ok {arm}"] for r in mine),
                "misses drawing one shape twice": sum(not r[f"ok {arm}"] and one_shape_twice(r[f"drawn {arm}"])
                                                      for r in mine)}
    return {"summary": out, "images": rows}


WORD_PROMPTS = (("a red circle left of a blue square", "red", "blue"),
                ("a green triangle above a yellow circle", "green", "yellow"),
                ("a red square and a green triangle", "red", "green"),
                ("a blue circle below a green square", "blue", "green"))


@torch.no_grad()
def word_merging(pipe, zeroed=(0, 1, 2, 3)) -> dict:
    """Per prompt of `WORD_PROMPTS`: the two words' cosine per layer and at the output with the largest
    dimensions zeroed before the final LayerNorm; the largest |activation| of each token after the last layer."""
    encoder, result = pipe.text_encoder, {}
    for prompt, first, second in WORD_PROMPTS:
        words = prompt_words(pipe.tokenizer, prompt)
        i, j = (next(w.tokens[0] for w in words if w.text == name) for name in (first, second))
        ids = pipe.tokenizer([prompt], padding="max_length", max_length=pipe.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids.to(pipe.device)
        hidden = encoder(ids, output_hidden_states=True).hidden_states  # embeddings, then after each layer
        last = hidden[-1][0]  # (T, D) before the final LayerNorm
        largest = last.abs().max(dim=0).values.argsort(descending=True)
        at_output = {}
        for k in zeroed:
            kept = last.clone()
            kept[:, largest[:k]] = 0
            out = encoder.final_layer_norm(kept)
            at_output[f"largest {k} dims zeroed"] = float(torch.cosine_similarity(out[i], out[j], dim=0))
        result[f"{prompt}: {first}/{second}"] = {
            "cosine_per_layer": [float(torch.cosine_similarity(h[0, i], h[0, j], dim=0)) for h in hidden],
            "cosine_at_output": at_output,
            "largest_activation_per_token": {w.text + f"@{w.index}": float(last[w.tokens[0]].abs().max())
                                             for w in words if w.tokens}}
    return result


def guided_timesteps(pipe) -> list:
    """[lowest, highest] timestep the pipeline guides (None: no upper bound), as the counting diagnoses record it."""
    return [pipe.config.get("guidance_min_t", 0), pipe.config.get("guidance_max_t")]


COUNTS_BASE_SEED = 60_000  # noise the scenes-64 evaluation's seeds (0 and 10,000 on) never use


def counts_drawn(pipe, seeds: int, base_seed: int = COUNTS_BASE_SEED, guidance: float | None = None) -> dict:
    """A scenes-64 model's counting prompts, `seeds` images each, sampled at `guidance` (None: the model's own) within
    the pipeline's guided timesteps: {"drawn": {asked: {objects of that shape found: images}}, "exact": {asked: share
    drawn exactly}}. The detector is the evaluation's, so "exact" is its counting task on other seeds."""
    from unet.eval.detect64 import detect as detect64
    from unet.eval.evaluate64 import sample_and_judge
    from unet.eval.prompts64 import eval_prompts64
    prompts = [p for p in eval_prompts64() if p.task == "counting"]
    guidance = default_guidance(pipe) if guidance is None else guidance
    records, _ = sample_and_judge(pipe, prompts, seeds, base_seed, 25, guidance, record_maps=False)
    drawn = {}
    for k, record in enumerate(records):  # prompt by prompt, `seeds` images each
        group = prompts[k // seeds].description.groups[0]
        found = sum(d.shape == group.shape for d in detect64(record["image"]))
        row = drawn.setdefault(str(group.count), Counter())
        row[str(found)] += 1
    return {"seeds": seeds, "base_seed": base_seed, "guidance": guidance,
            "guided_t": guided_timesteps(pipe),
            "drawn": {n: dict(sorted(row.items())) for n, row in drawn.items()},
            "exact": {n: row[n] / sum(row.values()) for n, row in drawn.items()}}


COUNT_NOISE_BASE_SEED = 70_000  # noise that neither the evaluation nor `counts_drawn` uses


def count_noise(pipe, seeds: int, base_seed: int = COUNT_NOISE_BASE_SEED, shuffles: int = 1000,
                guidance: float | None = None) -> dict:
    """Each counting shape's prompts, one per count, sampled from one shared noise, `seeds` noises per shape, at
    `guidance` (None: the model's own) within the pipeline's guided timesteps: {"drawn": {shape: [[objects of that
    shape found, per count asked] per noise]}, "exact", "guided_t", "misses_per_noise", "same_direction" (of the
    noises with two or more misses, those whose misses are all too many or all too few) and "error_correlation"
    (Pearson's r of drawn less asked between two counts, over the noises)}. Each summary is also given for the same
    images with the noises shuffled, count by count within each shape: what it would be if a noise had no say (the
    mean of `shuffles` shuffles; for the mean correlation its 2.5 and 97.5 percentiles too)."""
    from unet.eval.detect64 import detect as detect64
    from unet.eval.prompts64 import eval_prompts64
    by_shape = {}
    for prompt in eval_prompts64():
        if prompt.task == "counting":
            group = prompt.description.groups[0]
            by_shape.setdefault(group.shape, []).append((group.count, prompt.prompt))
    counts = sorted({n for rows in by_shape.values() for n, _ in rows})
    size, channels = pipe.unet.config.sample_size, pipe.unet.config.in_channels
    guidance = default_guidance(pipe) if guidance is None else guidance
    drawn = {}
    for shape, rows in by_shape.items():
        rows.sort()
        for seed in range(seeds):
            noise = torch.randn((1, channels, size, size), generator=torch.Generator().manual_seed(base_seed + seed))
            # (counts, H, W, 3): one noise under every count
            images = pipe([text for _, text in rows], latents=noise.expand(len(rows), -1, -1, -1),
                          guidance_scale=guidance, output_type="np", show_progress=False).images
            drawn.setdefault(shape, []).append([sum(d.shape == shape for d in detect64(image))
                                                for image in to_uint8(images)])
    errors = np.array([row for rows in drawn.values() for row in rows]) - np.array(counts)  # (noises, counts)
    observed = noise_summaries(errors, counts)
    rng, shuffled = np.random.default_rng(0), []
    blocks = np.split(np.arange(len(errors)), len(drawn))  # each shape's noises
    for _ in range(shuffles):
        order = np.concatenate([rng.permuted(np.tile(block, (len(counts), 1)), axis=1) for block in blocks], axis=1)
        shuffled.append(noise_summaries(errors[order.T, np.arange(len(counts))], counts))
    means = [s["mean_error_correlation"] for s in shuffled if s["mean_error_correlation"] is not None]
    same = [s["same_direction_share"] for s in shuffled if s["same_direction_share"] is not None]
    return {"seeds": seeds, "base_seed": base_seed, "guidance": guidance, "noises": len(errors),
            "guided_t": guided_timesteps(pipe),
            "drawn": drawn,
            "exact": {str(n): float(share) for n, share in zip(counts, (errors == 0).mean(axis=0))},
            **observed,
            "shuffled": {"misses_per_noise": np.mean([s["misses_per_noise"] for s in shuffled], axis=0).tolist(),
                         "same_direction_share": float(np.mean(same)) if same else None,
                         "mean_error_correlation": float(np.mean(means)) if means else None,
                         "mean_error_correlation_95": np.percentile(means, [2.5, 97.5]).tolist() if means else None}}


def noise_summaries(errors: np.ndarray, counts: list[int]) -> dict:
    """What `count_noise` reports of `errors` (noises, counts): drawn less asked, one row per noise."""
    several = [row[row != 0] for row in errors if (row != 0).sum() >= 2]
    same = sum(bool((e > 0).all() or (e < 0).all()) for e in several)
    correlation = {}
    for i in range(len(counts)):
        for j in range(i + 1, len(counts)):
            a, b = errors[:, i], errors[:, j]
            correlation[f"{counts[i]}/{counts[j]}"] = float(np.corrcoef(a, b)[0, 1]) if a.std() and b.std() else None
    known = [r for r in correlation.values() if r is not None]
    return {"misses_per_noise": np.bincount((errors != 0).sum(axis=1), minlength=len(counts) + 1).tolist(),
            "same_direction": f"{same} of {len(several)}",
            "same_direction_share": same / len(several) if several else None, "error_correlation": correlation,
            "mean_error_correlation": float(np.mean(known)) if known else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["first-step", "grain", "unconditional", "words", "two-objects", "text-routes",
                                     "self-attention-wall", "counts", "count-noise"])
    add_model_argument(p)
    p.add_argument("--out", required=True, help="folder for <what>.json")
    p.add_argument("--overwrite", action="store_true", help="replace a <what>.json (and misses.png) already in --out")
    p.add_argument("--seeds", type=int, default=None, help="seeds per prompt (default 4; two-objects: 24, the "
                   "images of evaluate.py --fresh-seeds 50000 --seeds 24; counts and count-noise: 16)")
    p.add_argument("--guidance", type=float, default=None,
                   help="first-step: guidance of the x0 estimate; counts and count-noise: guidance of the sampling "
                   "(default: the model's own)")
    p.add_argument("--guidance-min-t", type=int, default=None,
                   help="counts and count-noise: guide only at timesteps >= this (default: the model's own)")
    p.add_argument("--guidance-max-t", type=int, default=None,
                   help="counts and count-noise: guide only at timesteps <= this (default: the model's own)")
    args = p.parse_args(argv)
    if args.seeds is None:
        args.seeds = (24 if args.what in ("two-objects", "text-routes", "self-attention-wall") else
                      16 if args.what in ("counts", "count-noise") else 4)
    with sigterm_as_interrupt():
        try:
            if args.seeds < 1:
                raise UsageError(f"--seeds must be a positive integer, got {args.seeds}")
            check_guidance(args.guidance)
            check_guidance_flags(args)
            check_out_dir(args.out)
            with hold_folder(args.out):  # one writer per folder: a second command into it is refused
                return diagnose(args)
        except UsageError as e:
            return usage_error(e)
        except WRITE_ERRORS as e:
            return write_failed(e, f"{args.what}.json into {args.out}")
        except KeyboardInterrupt as e:
            return interrupted(e, "nothing was written")


def check_guidance_flags(args) -> None:
    """UsageError for a guidance flag that the diagnosis `args.what` would ignore."""
    takes = {"--guidance": ("first-step", "counts", "count-noise"), "--guidance-min-t": ("counts", "count-noise"),
             "--guidance-max-t": ("counts", "count-noise")}
    for flag, whats in takes.items():
        if getattr(args, flag[2:].replace("-", "_")) is not None and args.what not in whats:
            named = f"{', '.join(whats[:-1])} and {whats[-1]}"
            raise UsageError(f"{flag} applies to diagnose {named}, not {args.what}; leave it out")


def guide_only_within(pipe, low: int | None, high: int | None) -> None:
    """Guide `pipe` only at timesteps in [low, high] (None keeps the pipeline's own bound), as evaluate.py's
    --guidance-max-t does; UsageError for a bound outside the scheduler's timesteps or a range with none in it."""
    last = pipe.scheduler.config.num_train_timesteps - 1
    for flag, t in (("--guidance-min-t", low), ("--guidance-max-t", high)):
        if t is not None and not 0 <= t <= last:
            raise UsageError(f"{flag} must be a timestep from 0 to {last} (the scheduler's), got {t}")
    if low is not None and high is not None and low > high:
        raise UsageError(f"--guidance-min-t {low} is above --guidance-max-t {high}: no timestep would be guided")
    for field, t in (("guidance_min_t", low), ("guidance_max_t", high)):
        if t is not None:
            pipe.register_to_config(**{field: t})


def diagnose(args) -> int:
    """Run the diagnosis `args.what` and write its JSON (and, for two-objects, misses.png) into --out whole."""
    out = Path(args.out)
    if (out / f"{args.what}.json").exists() and not args.overwrite:
        raise UsageError(f"--out {args.out} already holds {args.what}.json; pass --overwrite to replace it, or "
                         "choose another folder")
    pipe = load_pipeline(args.model)
    # the others use scenes-32's prompts and detector
    wants = "scenes-64" if args.what in ("counts", "count-noise") else "scenes-32"
    world = pipe.world or "scenes-32"  # a Stable Diffusion folder: scenes-32's prompts, as before worlds had names
    if world != wants:
        raise UsageError(f"diagnose {args.what} measures a model of world {wants}; {model_label(args.model)} is a "
                         f"model of world {world} (diagnose counts and count-noise take scenes-64 models, every "
                         "other diagnosis "
                         "scenes-32 models)")
    colours = [c for c in COLORS for _ in SHAPES]
    prompts = [f"a {c} {s}" for c in COLORS for s in SHAPES]
    result = {"model": model_label(args.model), "prediction_type": pipe.scheduler.config.prediction_type}
    grid = None
    if args.what == "first-step":
        result.update(first_step=first_step_x0(pipe, prompts, 0, default_guidance(pipe) if args.guidance is None
                                                              else args.guidance),
                      trailing=colour_run(pipe, prompts, colours, args.seeds, "trailing"),
                      leading=colour_run(pipe, prompts, colours, args.seeds, "leading"))
    elif args.what == "words":
        result["words"] = word_merging(pipe)
    elif args.what == "two-objects":
        records = objects_along_sampling(pipe, seeds=args.seeds)
        second = object_map_overlap(pipe, seeds=args.seeds)
        for r, again in zip(records, second):
            r["overlap"] = again["overlap"]
        agree = sum(r["ok"] == again["ok"] for r, again in zip(records, second))
        result["two_objects"] = {"summary": miss_kinds(records), "map_overlap": overlap_summary(records),
                                 "overlap pass agrees on right/wrong": f"{agree} of {len(records)}",
                                 "images": [{k: v for k, v in r.items() if k != "image"} for r in records]}
        misses = [np.pad(r["image"], ((2, 2), (2, 2), (0, 0)), constant_values=128) for r in records
                  if not r["ok"]][:32]  # the first misses, 8 per row, grey-framed
        if misses:
            misses += [np.full_like(misses[0], 128)] * (-len(misses) % 8)
            grid = np.concatenate([np.concatenate(misses[k:k + 8], axis=1) for k in range(0, len(misses), 8)])
    elif args.what == "text-routes":
        result["text_routes"] = text_routes(pipe, seeds=args.seeds)
    elif args.what == "self-attention-wall":
        result["self_attention_wall"] = self_attention_wall(pipe, seeds=args.seeds)
    elif args.what == "counts":
        guide_only_within(pipe, args.guidance_min_t, args.guidance_max_t)
        result["counts"] = counts_drawn(pipe, args.seeds, guidance=args.guidance)
    elif args.what == "count-noise":
        guide_only_within(pipe, args.guidance_min_t, args.guidance_max_t)
        result["count_noise"] = count_noise(pipe, args.seeds, guidance=args.guidance)
    elif args.what == "grain":
        result["grain"] = grain_runs(pipe, prompts, colours, args.seeds)
    else:
        result["unconditional"] = unconditional_colours(pipe, 12 * args.seeds)
    with partial_folder(out) as tmp:  # written whole, then moved in: never a 0-byte JSON on a full disk
        written = [tmp / f"{args.what}.json"]
        written[0].write_text(json.dumps(result, indent=1))
        if grid is not None:
            written.append(tmp / "misses.png")
            Image.fromarray(grid).resize((grid.shape[1] * 4, grid.shape[0] * 4), Image.NEAREST).save(written[1])
        publish_files(tmp, out, written)
    print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
