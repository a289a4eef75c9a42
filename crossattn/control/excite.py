"""Attend-and-Excite (Chefer et al. 2023): in the first half of the run, gradient steps on the latent
that raise the weakest subject's maximum (Gaussian-smoothed) attention, with iterative refinement at
three steps until it reaches 0.05, 0.5, 0.8 -- the paper's schedule for 50 steps, scaled to the run's
length. Needs `ScenePipeline`'s loop (it moves the latent)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..capture import layer_hw
from .base import Recipe, check_share


@dataclass
class Excite(Recipe):
    """Attend-and-Excite. Defaults are the paper's (Stable Diffusion, 50 steps), with steps as shares:
    alter the first 25 of 50 steps, refine at steps 0, 10, 20 to 0.05, 0.5, 0.8."""
    subjects: list[list[int]]  # token positions of each subject word
    text_end: int  # position of the end token: tokens 1 .. text_end-1 are the prompt's words
    max_iter_to_alter: float = 0.5
    thresholds: dict[float, float] = field(default_factory=lambda: {0.0: 0.05, 0.2: 0.5, 0.4: 0.8})
    scale_factor: float = 20.0  # step size = scale_factor * sqrt(linspace(scale_range) at the step)
    scale_range: tuple[float, float] = (1.0, 0.5)
    max_refinement_steps: int = 20
    temperature: float = 100.0  # attention * 100, softmax over the prompt's word tokens
    sigma: float = 0.5
    kernel_size: int = 3
    resolution: int | None = None  # side of the maps used (paper: 16 of a 64 latent); None: the largest
    # per altered step of the last run: the weakest subject's maximum attention per image, before and after
    log: list[dict] = field(default_factory=list, init=False, repr=False, compare=False)
    _collected: list | None = field(default=None, init=False, repr=False, compare=False)  # (layer, weights)

    def __post_init__(self):
        if not self.subjects or any(not s for s in self.subjects):
            raise ValueError("attend-and-excite needs at least one subject word with tokens")
        check_share("max_iter_to_alter", self.max_iter_to_alter)
        if any(not 1 <= t < self.text_end for s in self.subjects for t in s):
            raise ValueError(f"subject tokens {self.subjects} must lie between the start and end tokens "
                             f"(1..{self.text_end - 1})")

    def schedule(self, num_steps: int) -> tuple[int, dict[int, float], list[float]]:
        """(steps altered, {step: threshold} for iterative refinement, step size per step) for a run."""
        refine: dict[int, float] = {}
        for share, threshold in self.thresholds.items():
            step = _round_half_up(share * num_steps)
            refine[step] = max(threshold, refine.get(step, 0.0))  # at few steps two may meet: keep the higher
        sizes = torch.linspace(self.scale_range[0], self.scale_range[1], num_steps).sqrt() * self.scale_factor
        return _round_half_up(self.max_iter_to_alter * num_steps), refine, sizes.tolist()

    # --- the recipe
    def start(self) -> None:
        self.log = []

    def weights(self, ctl, name, cross, progress, own, new):
        if self._collected is not None and cross:
            self._collected.append((name, new))
        return new

    def before_step(self, ctl, pipe, t, x, context):
        guided = context.shape[0] == 2 * x.shape[0]
        timesteps = pipe.scheduler.timesteps
        step = int((timesteps == t).nonzero()[0])
        return self._excite_step(ctl, pipe, step, len(timesteps), t, x, context[x.shape[0]:] if guided else context)

    def subject_max_attention(self, ctl, pipe, t, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """(B, subjects): each subject's maximum smoothed attention for latent x (B, C, H, W) at `t`, from
        one forward pass on the prompt-conditioned `context` (B, T, D); differentiable in x."""
        self._collected, ctl.hiding = [], True
        hidden = [(m, m.observer) for m in ctl.modules]
        for m, _ in hidden:
            m.observer = None  # the maps of the gradient passes must not reach an AttentionStore
        try:
            pipe.unet(pipe.scheduler.scale_model_input(x, t), t, encoder_hidden_states=context)
            collected = self._collected
        finally:
            for m, observer in hidden:
                m.observer = observer
            self._collected, ctl.hiding = None, False
        shapes = {name: layer_hw(w.shape[2], ctl._image_hw) for name, w in collected}
        side = self.resolution or max(h for h, _ in shapes.values())
        chosen = [w for name, w in collected if shapes[name][0] == side]
        if not chosen:
            raise ValueError(f"no cross-attention maps of side {side}; the model has {sorted(set(shapes.values()))}")
        h, w = next(s for s in shapes.values() if s[0] == side)
        maps = torch.stack([c.mean(1) for c in chosen]).mean(0)  # (B, N, T): layers and heads averaged
        text = (maps[..., 1:self.text_end] * self.temperature).softmax(-1)  # (B, N, words' tokens)
        result = []
        for tokens in self.subjects:
            subject = text[..., [p - 1 for p in tokens]].sum(-1).reshape(-1, h, w)  # (B, h, w)
            result.append(gaussian_smooth(subject, self.kernel_size, self.sigma).amax(dim=(1, 2)))
        return torch.stack(result, dim=1)  # (B, subjects)

    def _excite_step(self, ctl, pipe, step: int, num_steps: int, t, x: torch.Tensor, context: torch.Tensor):
        altered, refine, sizes = self.schedule(num_steps)
        if step >= altered:
            return x
        size = sizes[step]
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            maxima = self.subject_max_attention(ctl, pipe, t, x, context)
            before = maxima.min(dim=1).values.detach()
            loss = (1 - maxima).clamp(min=0).amax(dim=1)  # (B,): the most neglected subject's shortfall
            iterations = 0
            if step in refine:
                target = 1 - refine[step]
                while iterations < self.max_refinement_steps and bool((loss > target).any()):
                    x = _descend(x, loss * (loss > target), size)
                    maxima = self.subject_max_attention(ctl, pipe, t, x, context)
                    loss = (1 - maxima).clamp(min=0).amax(dim=1)
                    iterations += 1
            if bool((loss > 0).any()):
                x = _descend(x, loss, size)
        self.log.append({"step": step, "timestep": float(t), "step_size": size, "refinements": iterations,
                         "weakest_before": before.tolist(),
                         "weakest_at_last_update": maxima.min(dim=1).values.detach().tolist()})
        return x.detach()


def _descend(x: torch.Tensor, loss: torch.Tensor, step_size: float) -> torch.Tensor:
    """One gradient step on the latent; images are independent in the U-Net, so the sum's gradient is
    each image's own."""
    grad = torch.autograd.grad(loss.sum(), [x])[0]
    return (x - step_size * grad).detach().requires_grad_(True)


def _round_half_up(x: float) -> int:
    return math.floor(x + 0.5)  # round() would send 2.5 to 2


def gaussian_smooth(maps: torch.Tensor, kernel_size: int = 3, sigma: float = 0.5) -> torch.Tensor:
    """(K, h, w) maps smoothed with Attend-and-Excite's kernel, reflect-padded to keep the size.

    The authors' kernel is exp(-((x - mean) / (2 sigma))^2), a Gaussian of standard deviation
    sigma * sqrt(2); we keep it so that sigma means what it means there.
    """
    r = torch.arange(kernel_size, dtype=maps.dtype, device=maps.device) - (kernel_size - 1) / 2
    g = torch.exp(-((r / (2 * sigma)) ** 2))
    kernel = torch.outer(g, g) / g.sum() ** 2  # (k, k), sums to 1
    pad = kernel_size // 2
    mode = "reflect" if min(maps.shape[-2:]) > pad else "replicate"
    padded = F.pad(maps[:, None], (pad, pad, pad, pad), mode=mode)  # (K, 1, h + 2p, w + 2p)
    return F.conv2d(padded, kernel[None, None])[:, 0]
