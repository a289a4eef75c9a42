"""The training recipe: the noise schedule, where each image's t is drawn, the loss and its weight, the learning
rate. The loop that runs it is unet/train.py; the settings named here are groups of its `TrainConfig`
(unet/train_config.py): `diffusion` (`DiffusionConfig`), `optimizer` and `schedule`.

v-prediction on a schedule rescaled to zero terminal SNR (Lin et al. 2024), so t = T - 1 is pure noise and the
model can still predict x0 there, where layout and colour are decided.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from diffusers import DDPMScheduler

from crossattn.attention import CrossAttention
from crossattn.capture import layer_hw
from crossattn.text import prompt_words

from .data import COLORS

if TYPE_CHECKING:  # train_config reads this module's LR_SCHEDULES and TIMESTEP_SAMPLING
    from .train_config import DiffusionConfig, OptimizerConfig, ScheduleConfig

TIMESTEP_SAMPLING = ("uniform", "layout-share")
LR_SCHEDULES = ("constant", "cosine", "cooldown")  # see lr_at


def noise_scheduler(prediction_type: str = "v_prediction", zero_terminal_snr: bool = True) -> DDPMScheduler:
    """The training schedule; sampling schedulers are made from its config (`pipeline.make_scheduler`)."""
    return DDPMScheduler(num_train_timesteps=1000, beta_schedule="squaredcos_cap_v2", prediction_type=prediction_type,
                         rescale_betas_zero_snr=zero_terminal_snr, clip_sample=True)


def loss_weight(snr: torch.Tensor, prediction_type: str, gamma: float) -> torch.Tensor:
    """Min-SNR weights (B,). For v, min(snr + 1, gamma) / (snr + 1): 1 at zero SNR, where layout and colour are
    decided (diffusers' min(snr, gamma) / (snr + 1) would give that step no weight at all)."""
    if gamma <= 0:
        return torch.ones_like(snr)
    if prediction_type == "v_prediction":
        return (snr + 1).clamp(max=gamma) / (snr + 1)
    return snr.clamp(max=gamma) / snr


def sample_timesteps(diffusion: DiffusionConfig, batch_size: int, num_train_timesteps: int,
                     generator: torch.Generator) -> torch.Tensor:
    """The training timesteps (B,) int64 in [0, T), drawn from `generator` by `diffusion.timestep_sampling`;
    t = T - 1 is pure noise. "uniform" draws exactly what runs before this option drew, so old runs resume bit for
    bit."""
    T = num_train_timesteps
    t = torch.randint(0, T, (batch_size,), generator=generator)
    if diffusion.timestep_sampling == "layout-share":
        low = T - max(1, round(diffusion.layout_fraction * T))
        top = torch.randint(low, T, (batch_size,), generator=generator)
        t = torch.where(torch.rand(batch_size, generator=generator) < diffusion.layout_share, top, t)
    return t


def diffusion_loss(unet, scheduler: DDPMScheduler, images: torch.Tensor, context: torch.Tensor, noise: torch.Tensor,
                   t: torch.Tensor, prediction_type: str, min_snr_gamma: float) -> torch.Tensor:
    """The weighted denoising loss (a scalar) of clean `images` (B, 3, H, W) noised with `noise` to timesteps `t`
    (B,), conditioned on the text encoding `context` (B, T, D)."""
    noisy = scheduler.add_noise(images, noise, t)
    pred = unet(noisy, t, encoder_hidden_states=context).float()  # a bf16 forward's too: the loss sums in float32
    if prediction_type == "v_prediction":
        target = scheduler.get_velocity(images, noise, t)  # sqrt(a) noise - sqrt(1 - a) x0
    else:
        target = noise
    alphas = scheduler.alphas_cumprod.to(images.device)[t]
    snr = alphas / (1 - alphas)  # (B,); 0 at t = T under zero terminal SNR
    weight = loss_weight(snr, prediction_type, min_snr_gamma)
    per_image = F.mse_loss(pred, target, reduction="none").mean(dim=(1, 2, 3))
    return (weight * per_image).mean()


def lr_at(step: int, optimizer: OptimizerConfig, schedule: ScheduleConfig) -> float:
    """Linear warm-up over `optimizer.warmup` steps to `optimizer.lr`, then constant, cosine decay from lr to min_lr
    at `schedule.steps`, or a cooldown: constant, then linearly to min_lr over decay_steps from decay_start, then
    min_lr.

    A cosine schedule depends on the run's length, so extending a run with --resume restarts it high:
    that warm restart was one cause of the colour collapse in longer training
    (docs/experiments/longer-training-colour-collapse.md). A cooldown does not: it is fixed in steps, so a long
    constant run can be grown into one at any step (warmup-stable-decay, Hägele et al. 2024, arXiv 2405.18392).
    """
    lr, warmup, min_lr = optimizer.lr, optimizer.warmup, schedule.min_lr
    if step < warmup:
        return lr * (step + 1) / warmup
    if schedule.lr_schedule == "constant":
        return lr
    if schedule.lr_schedule == "cooldown":
        progress = min(1.0, max(0.0, (step - schedule.decay_start) / schedule.decay_steps))
        return lr + (min_lr - lr) * progress
    progress = min(1.0, (step - warmup) / max(1, schedule.steps - warmup))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def word_masks(scenes: list, captions: list[str], tokenizer) -> torch.Tensor:
    """(B, T, H, W) float: for each token of a caption's word that names objects of its scene (`scene.word_objects`),
    the pixels of those objects (`scene.word_mask`); zeros for every other token, and for a caption dropped to ""
    (`captions` are the ones trained on, `scenes` the ones drawn). Scenes of either world: in scenes-32 a colour or
    shape word names one object; in scenes-64 a count, size, colour or shape word names every object of its group,
    so a numeral's mask covers all of its objects."""
    T = tokenizer.model_max_length
    H, W = scenes[0].image.shape[:2]
    masks = torch.zeros(len(scenes), T, H, W)
    for b, (scene, caption) in enumerate(zip(scenes, captions)):
        if caption != scene.caption:
            continue
        for word in prompt_words(tokenizer, caption):
            if word.index in scene.word_objects:
                for position in word.tokens:
                    masks[b, position] = torch.from_numpy(scene.word_mask(word.index))
    return masks


@contextmanager
def cross_attention_weights(unet):
    """Collect the softmax weights (B, heads, N, T) of every cross-attention forward of `unet` inside the block,
    as float32 with their gradients (the explicit path runs instead of the fused kernel: the same sums)."""
    layers = [m for m in unet.modules() if isinstance(m, CrossAttention) and m.is_cross_attention]
    found: list[torch.Tensor] = []
    attached = [layer.observer for layer in layers]  # an AttentionStore's, say: it sees the weights too

    def observe(layer, weights, before):
        found.append(weights.float())  # under bf16 autocast the losses still sum in float32
        if before is not None:
            before(layer, weights)
    for layer, before in zip(layers, attached):
        layer.observer = lambda module, weights, before=before: observe(module, weights, before)
    try:
        yield found
    finally:
        for layer, before in zip(layers, attached):
            layer.observer = before


def grounding_loss(weights: list[torch.Tensor], masks: torch.Tensor) -> torch.Tensor:
    """The token loss of TokenCompose (Wang et al. 2024): for every token that names an object, (1 - the share
    of its cross-attention that falls on that object's pixels)^2, averaged over those tokens, then over layers.

    weights: each layer's (B, heads, N, T); masks: `word_masks`' (B, T, H, W). A word's attention has to land on
    its own object, so the two objects of a pair cannot both read one shape word (the commonest two-object miss
    is one shape drawn twice: docs/experiments/why-the-second-object-goes-missing.md)."""
    B, T, H, W = masks.shape
    named = masks.flatten(2).sum(-1) > 0  # (B, T): tokens with an object on the image
    per_layer = []
    for w in weights:
        a = w.mean(1)  # (B, N, T), heads averaged
        h, wd = layer_hw(a.shape[1], (H, W))
        m = F.adaptive_avg_pool2d(masks, (h, wd)).flatten(2).transpose(1, 2)  # (B, N, T): object share per query
        inside = (a * m).sum(1) / a.sum(1).clamp_min(1e-12)  # (B, T): share of each token's attention on it
        per_layer.append(((1 - inside) ** 2)[named].mean() if named.any() else a.sum() * 0)
    return torch.stack(per_layer).mean()


def same_object(masks: torch.Tensor) -> torch.Tensor:
    """(B, T, T) bool: token s names the same object as token t, from `word_masks`' (B, T, H, W). Distinct objects
    never share a visible pixel, so two tokens name one object exactly when their masks meet (a product of the
    masks, where comparing them pixel by pixel took a fifth of a second a step)."""
    flat = masks.flatten(2)  # (B, T, HW)
    return flat @ flat.transpose(1, 2) > 0


def pixel_grounding_loss(weights: list[torch.Tensor], masks: torch.Tensor) -> torch.Tensor:
    """The pixel loss of TokenCompose (Wang et al. 2024), read per object: at every pixel, the share of its
    cross-attention taken by the words that name an object (its colour and shape words together, where TokenCompose
    has one noun) is trained by binary cross-entropy toward that object's mask -- 1 on the object, 0 everywhere else,
    the other object included. The token loss (`grounding_loss`) asks where a word looks; this asks what a pixel
    reads, which is what its Values draw: a pixel of the square that reads "circle" is what draws one shape twice
    (docs/experiments/why-the-second-object-goes-missing.md).

    weights: each layer's (B, heads, N, T); masks: `word_masks`' (B, T, H, W), where the words of one object share
    its mask. Averaged over pixels, then over the named tokens, then over layers."""
    B, T, H, W = masks.shape
    named = masks.flatten(2).sum(-1) > 0  # (B, T)
    same = same_object(masks).float()  # (B, T, T)
    per_layer = []
    for w in weights:
        a = w.mean(1)  # (B, N, T), heads averaged
        h, wd = layer_hw(a.shape[1], (H, W))
        m = F.adaptive_avg_pool2d(masks, (h, wd)).flatten(2).transpose(1, 2)  # (B, N, T): object share per query
        read = (a @ same).clamp(0, 1)  # (B, N, T): each query's attention on all words of token t's object
        bce = F.binary_cross_entropy(read, m, reduction="none").mean(1)  # (B, T)
        per_layer.append(bce[named].mean() if named.any() else a.sum() * 0)
    return torch.stack(per_layer).mean()


def colour_pairs(captions: list[str], tokenizer, colour_words=tuple(COLORS)) -> torch.Tensor:
    """(P, 3) long: (caption, token of its first colour word, token of its second) for every caption that names two
    different colours of `colour_words` (the world's: scenes-32's by default) -- the pairs whose Keys
    `key_separation_loss` keeps apart (a dropped caption "" has none)."""
    found = []
    for b, caption in enumerate(captions):
        colours = [w for w in prompt_words(tokenizer, caption) if w.text in colour_words and w.tokens]
        if len(colours) == 2 and colours[0].text != colours[1].text:
            found.append((b, colours[0].tokens[0], colours[1].tokens[0]))
    return torch.tensor(found, dtype=torch.long).reshape(-1, 3)


def key_separation_loss(unet, context: torch.Tensor, pairs: torch.Tensor, margin: float) -> torch.Tensor:
    """How far two different colour words' Keys are above cosine `margin`, squared, averaged over `colour_pairs` and
    then over cross-attention layers. A softmax over equal Keys gives equal weights, so words whose Keys are alike
    cannot have different maps (the evaluation's key separation reads the same cosine on its own prompts).

    context: the text encoder's (B, T, D); the Keys are each layer's own `to_k` of it, so both the text side and
    the projections learn."""
    layers = [m for m in unet.modules() if isinstance(m, CrossAttention) and m.is_cross_attention]
    if not len(pairs):
        return context.sum() * 0
    b, i, j = pairs.to(context.device).T
    per_layer = []
    for layer in layers:
        keys = layer.to_k(context)  # (B, T, heads * head_dim)
        cosine = F.cosine_similarity(keys[b, i], keys[b, j], dim=-1)  # (P,)
        per_layer.append(F.relu(cosine - margin).pow(2).mean())
    return torch.stack(per_layer).mean()
