"""Does the model decide layout from the words? Two measurements that take seconds, for reports and the training log.

**Layout response.** Layout is decided at the first sampling steps, from (almost) pure noise, where the model's x0
prediction averaged over noise draws is its conditional mean image. For each pair of opposite position words
("left of" / "right of", "above" / "below", "on the left" / "on the right", "on the top" / "on the bottom"), the
first object's colour centroid in that mean moves by some pixels between the two words. The training data's own
conditional means (scenes drawn for the same captions) move it by about 9 px. The layout response is the model's
shift divided by the data's: 1 when the model places as the data does, 0 when the word changes nothing.

**Key separation.** A softmax over identical Keys gives identical weights, so two words whose Keys are (nearly)
parallel in a cross-attention layer cannot have different maps there, whatever the read-out. Per cross-attention
layer: the cosine between the Keys of the two different colour words of a prompt, and of the two shape words.
Also the text encoder's largest hidden activation, which a LayerNorm turns into one shared direction.
"""

from __future__ import annotations

import functools
import zlib

import numpy as np
import torch

from crossattn.text import prompt_words

from ..data import COLORS, SceneSampler, scenes_to_tensor, to_model_range
from ..pipeline import make_scheduler
from .prompts import eval_prompts

# (first word, second word, axis, prompt template): under the first word the first object sits at the smaller
# coordinate (left, top); axis 0 is x, 1 is y
POSITION_PAIRS = (
    ("left of", "right of", 0, "a {c1} {s1} {w} a {c2} {s2}"),
    ("above", "below", 1, "a {c1} {s1} {w} a {c2} {s2}"),
    ("on the left", "on the right", 0, "a {c1} {s1} {w}"),
    ("on the top", "on the bottom", 1, "a {c1} {s1} {w}"),
)
COMBOS = (("red", "circle", "blue", "square"), ("green", "triangle", "yellow", "circle"),
          ("blue", "square", "red", "triangle"))
LAYOUT_STEPS = 3  # the first sampling steps, where layout is decided


def pair_name(first: str, second: str) -> str:
    return f"{first}/{second}"


def first_object_weight(image: torch.Tensor, colours: list[str]) -> torch.Tensor:
    """(H, W) how much of the first colour each pixel of `image` (3, H, W, model range) holds: the pixel minus
    the black background, least-squares split along the prompt's colours (a mean image mixes them)."""
    basis = torch.stack([to_model_range(torch.tensor(COLORS[c]).view(3, 1, 1)).flatten() + 1 for c in colours], 1)
    pixels = (image + 1).flatten(1)  # (3, HW): 0 is background
    shares = torch.linalg.lstsq(basis, pixels).solution  # (colours, HW)
    return shares[0].clamp(min=0).view(image.shape[1:])


def centroid(weight: torch.Tensor, axis: int) -> float:
    """The weighted mean coordinate of (H, W) `weight` along `axis` (0: x, 1: y), in pixels."""
    coords = torch.arange(weight.shape[1 - axis], dtype=weight.dtype)
    profile = weight.sum(dim=0) if axis == 0 else weight.sum(dim=1)  # (W,) for x, (H,) for y
    return float((profile * coords).sum() / profile.sum().clamp(min=1e-12))


def prompt_colours(template: str, combo) -> list[str]:
    c1, _, c2, _ = combo
    return [c1, c2] if "{c2}" in template else [c1]


def layout_prompt(template: str, combo, word: str) -> str:
    c1, s1, c2, s2 = combo
    return template.format(c1=c1, s1=s1, c2=c2, s2=s2, w=word)


@functools.lru_cache(maxsize=64)
def data_mean(template: str, combo: tuple, word: str, height: int, width: int, scenes: int = 300,
              seed: int = 0) -> torch.Tensor:
    """(3, H, W) in model range: the mean of `scenes` training scenes drawn for the caption `layout_prompt(...)`,
    the data's own conditional mean image."""
    c1, s1, c2, s2 = combo
    caption = layout_prompt(template, combo, word)
    sampler = SceneSampler((seed, zlib.crc32(caption.encode())), height, width, split="all")  # a stream per caption
    if "{c2}" in template:
        drawn = [sampler.pair((c1, s1, c2, s2), word, with_colors=True) for _ in range(scenes)]
    else:
        drawn = [sampler.single(c1, s1, where=word.split()[-1]) for _ in range(scenes)]
    return to_model_range(scenes_to_tensor(drawn)).mean(dim=0)


def data_shifts(height: int, width: int, scenes: int = 300) -> dict[str, float]:
    """The data's own shift (px) of the first object's colour centroid for each position pair, averaged over
    `COMBOS`: the same centroid as the model's, in `data_mean`'s images."""
    result = {}
    for first, second, axis, template in POSITION_PAIRS:
        shifts = []
        for combo in COMBOS:
            a, b = (centroid(first_object_weight(data_mean(template, combo, w, height, width, scenes),
                                                 prompt_colours(template, combo)), axis) for w in (first, second))
            shifts.append(b - a)
        result[pair_name(first, second)] = float(np.mean(shifts))
    return result


@torch.no_grad()
def first_step_means(pipe, prompts: list[str], draws: int, seed: int,
                     steps: int = 25) -> tuple[list[int], list[torch.Tensor]]:
    """Per sampling step among the first `LAYOUT_STEPS` of a `steps`-step DDIM run (trailing spacing, from the
    model's own scheduler config, whatever sampler the pipeline has): the model's x0 prediction averaged over
    `draws` noise draws, (prompts, 3, H, W); every prompt starts from the same noise. Unguided: the conditional
    mean is the model's own. Returns those timesteps and the means."""
    scheduler = make_scheduler("ddim", pipe.scheduler.config)  # its x0 estimate; the pipeline's own stays untouched
    scheduler.set_timesteps(steps)
    size = pipe.unet.config.sample_size
    context = pipe.encode_prompt(prompts).repeat_interleave(draws, dim=0)  # (P * draws, T, D)
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn((draws, pipe.unet.config.in_channels, size, size), generator=generator)
    x = noise.repeat(len(prompts), 1, 1, 1).to(pipe.device) * scheduler.init_noise_sigma
    means = []
    for t in scheduler.timesteps[:LAYOUT_STEPS]:
        pred = pipe.unet(scheduler.scale_model_input(x, t), t, encoder_hidden_states=context)
        pred = pred.sample if hasattr(pred, "sample") else pred
        out = scheduler.step(pred, t, x)
        means.append(out.pred_original_sample.view(len(prompts), draws, *x.shape[1:]).mean(dim=1).cpu())
        x = out.prev_sample
    return [int(t) for t in scheduler.timesteps[:LAYOUT_STEPS]], means


def layout_response(pipe, draws: int = 32, seed: int = 0, steps: int = 25, data_scenes: int = 300) -> dict:
    """For every position pair: the model's shift (px) at each of the first sampling steps, the data's, and their
    ratio at the first step (`response`; 1 = places as the data does, 0 = the word changes nothing)."""
    size = pipe.unet.config.sample_size
    data = data_shifts(size, size, data_scenes)
    prompts, index = [], {}
    for first, second, _, template in POSITION_PAIRS:
        for combo in COMBOS:
            for word in (first, second):
                index[(first, combo, word)] = len(prompts)
                prompts.append(layout_prompt(template, combo, word))
    timesteps, means = first_step_means(pipe, prompts, draws, seed, steps)
    result = {"timesteps": timesteps, "draws": draws, "pairs": {}}
    for first, second, axis, template in POSITION_PAIRS:
        per_step = []
        for mean in means:
            shifts = []
            for combo in COMBOS:
                colours = prompt_colours(template, combo)
                a, b = (centroid(first_object_weight(mean[index[(first, combo, w)]], colours), axis)
                        for w in (first, second))
                shifts.append(b - a)
            per_step.append(float(np.mean(shifts)))
        name = pair_name(first, second)
        result["pairs"][name] = {"model_shift": per_step, "data_shift": data[name],
                                 "response": per_step[0] / data[name],
                                 "response_per_step": [s / data[name] for s in per_step]}
    return result


def word_pairs(tokenizer) -> tuple[list[str], dict[str, list[tuple[int, int, int, str]]]]:
    """The evaluation's two-object prompts, and per kind ("color", "shape") the pairs of different words in them:
    (prompt index, token position of the first word, of the second, "blue/red")."""
    prompts, pairs = [], {"color": [], "shape": []}
    for p in eval_prompts():
        if len(p.objects) != 2:
            continue
        prompts.append(p.prompt)
        words = p.prompt.split()
        tokens = {w.index: w.tokens[0] for w in prompt_words(tokenizer, p.prompt) if w.tokens}
        for kind, names in (("color", [c for c, _ in p.objects]), ("shape", [s for _, s in p.objects])):
            if None in names or names[0] == names[1]:
                continue
            i, j = words.index(names[0]), len(words) - 1 - words[::-1].index(names[1])
            if i in tokens and j in tokens:
                pairs[kind].append((len(prompts) - 1, tokens[i], tokens[j], "/".join(sorted(names))))
    return prompts, pairs


def separation(vectors: torch.Tensor, pairs: dict) -> dict:
    """Per kind of `word_pairs`: the mean and largest cosine between the two words' vectors in `vectors`
    (P, T, D), the number of pairs, and the mean per word pair."""
    entry = {}
    for kind, found in pairs.items():
        by_pair = {}
        for p, i, j, name in found:
            by_pair.setdefault(name, []).append(float(torch.cosine_similarity(vectors[p, i], vectors[p, j], dim=0)))
        cosines = [c for cs in by_pair.values() for c in cs]
        entry[kind] = {"mean": float(np.mean(cosines)) if cosines else None,
                       "max": float(np.max(cosines)) if cosines else None, "pairs": len(cosines),
                       "by_pair": {k: float(np.mean(v)) for k, v in sorted(by_pair.items())}}
    return entry


@torch.no_grad()
def encode_pairs(tokenizer, text_encoder) -> tuple[dict, torch.Tensor, list | None]:
    """`word_pairs`' prompts through the text encoder once: the pairs, its output (P, T, D), and its hidden states
    after each encoder layer (None for an ablation text side that has none)."""
    prompts, pairs = word_pairs(tokenizer)
    ids = tokenizer(prompts, padding="max_length", max_length=tokenizer.model_max_length, truncation=True,
                    return_tensors="pt").input_ids.to(text_encoder.device)
    try:
        out = text_encoder(ids, output_hidden_states=True)
        return pairs, out.last_hidden_state, list(out.hidden_states[1:])
    except (TypeError, AttributeError):  # an ablation text side without hidden states
        return pairs, text_encoder(ids).last_hidden_state, None


def text_separation(pairs: dict, output: torch.Tensor, hidden: list | None) -> dict:
    """How far apart the text encoder keeps different colour words, and different shape words, in its `output`
    (`separation` of its last hidden state, what every cross-attention layer projects to Keys), and its largest
    |activation| after any encoder layer, which a LayerNorm turns into one shared direction (`encode_pairs`)."""
    return {"text_output": separation(output, pairs),
            "largest_activation": None if hidden is None else float(max(h.abs().max() for h in hidden))}


@torch.no_grad()
def key_separation(pipe) -> dict:
    """Per cross-attention layer (its `attn2`): `separation` of the Keys of a prompt's two different colour words,
    and of its two different shape words, over the evaluation's two-object prompts; and `text_separation`."""
    pairs, context, hidden = encode_pairs(pipe.tokenizer, pipe.text_encoder)  # context: (P, T, D)
    layers = {name: separation(module.to_k(context), pairs)  # to_k: (P, T, heads * head_dim)
              for name, module in pipe.unet.named_modules() if name.endswith("attn2")}
    return {"layers": layers, **text_separation(pairs, context, hidden)}
