"""Prompt-to-prompt (Hertz et al. 2022): record a source run, then replay its attention while an edited
prompt is sampled from the same noise.

- `Record` keeps the source run's attention per (layer, timestep) and its latents in a `Recording`.
- `Edit` replays it: word swap (same number of words: the new word takes the old word's maps) or
  refinement (words only added: kept words take the source's maps, new words keep their own) for the
  first `cross_replace_steps` of the run; self-attention of small layers (<= 16x16) for the first
  `self_replace_steps`.
- `LocalBlend` keeps the source's latent where neither prompt's edited words attend.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..capture import layer_hw
from .align import Alignment
from .base import Recipe, check_share

SELF_REPLACE_MAX_QUERIES = 16 * 16  # prompt-to-prompt replays self-attention only in layers this small


class Recording:
    """A source run's attention (prompt half) per (layer, timestep) and its latent after each step."""

    def __init__(self):
        self.weights: dict[tuple[str, float], torch.Tensor] = {}  # (B, heads, N, T), detached
        self.latents: dict[float, torch.Tensor] = {}  # (B, C, H, W) after the step at that timestep

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.weights.values(), *self.latents.values()])


class Record(Recipe):
    """Record the run into `recording`: attention of cross- and small self-attention layers, latents."""

    def __init__(self, recording: Recording):
        self.recording = recording

    def weights(self, ctl, name, cross, progress, own, new):
        if not ctl.hiding and (cross or own.shape[2] <= SELF_REPLACE_MAX_QUERIES):
            self.recording.weights[ctl.key(name)] = own.detach().clone()
        return new

    def after_step(self, ctl, pipe, t, x):
        self.recording.latents[round(float(t), 3)] = x.detach().clone()
        return x


@dataclass
class Edit(Recipe):
    """Replay `recording` (of the source prompt, same seed, steps and scheduler) for the edited prompt."""
    recording: Recording
    alignment: Alignment
    cross_replace_steps: float = 0.8  # share of the run whose cross-attention is replayed
    self_replace_steps: float = 0.4  # share of the run whose self-attention (small layers) is replayed
    local_blend: bool = False  # keep the source's latent outside the edited words' attention
    blend_tokens: tuple[list[int], list[int]] | None = None  # (source, edited) positions; None: the changed words
    blend_threshold: float = 0.3  # of each map's maximum, after a 3x3 max-pool (prompt-to-prompt's values)

    def __post_init__(self):
        if not self.recording.weights:
            raise ValueError("recording: the Recording is empty; record the source first (Controller(record=True) "
                             "attached during a run of the source prompt), then pass its .recording")
        check_share("cross_replace_steps", self.cross_replace_steps)
        check_share("self_replace_steps", self.self_replace_steps)
        if self.local_blend and self.blend_tokens is None:
            self.blend_tokens = (self.alignment.source_tokens, self.alignment.target_tokens)
        if self.local_blend and not self.blend_tokens[1]:
            raise ValueError("local blend needs edited words: the edited prompt changes no word")

    def weights(self, ctl, name, cross, progress, own, new):
        if progress >= (self.cross_replace_steps if cross else self.self_replace_steps):
            return new
        if not cross and own.shape[2] > SELF_REPLACE_MAX_QUERIES:
            return new
        key = ctl.key(name)
        source = self.recording.weights.get(key)
        if source is None:
            raise RuntimeError(f"the recording has no attention for layer {key[0]} at timestep {key[1]}: record the "
                               "source with the same steps, scheduler and image size")
        if source.shape[0] != own.shape[0]:
            raise RuntimeError(f"the recording holds {source.shape[0]} images, this run {own.shape[0]}")
        source = source.to(own.dtype)
        if not cross:
            return source
        a = self.alignment
        mapped = torch.einsum("bhnt,tu->bhnu", source, a.matrix.to(own))  # (B, heads, N, T) in edited tokens
        return mapped * a.taken.to(own) + own * (1 - a.taken.to(own))


class LocalBlend(Recipe):
    """Prompt-to-prompt's local blend for `edit`: x = source + mask * (x - source) after each step, the
    mask from both prompts' edited words' maps so far (max-pooled 3x3, upsampled, each over its maximum,
    > threshold), at the largest cross-attention maps (prompt-to-prompt: its 16x16 ones)."""

    def __init__(self, edit: Edit):
        self.edit = edit
        self.start()

    def start(self) -> None:
        self.sums: list[torch.Tensor | None] = [None, None]  # source, edited: (B, h, w) summed maps
        self.side: int | None = None

    def weights(self, ctl, name, cross, progress, own, new):
        if cross and not ctl.hiding:
            self.add(ctl, 1, name, own)
        return new

    def add(self, ctl, which: int, layer_name: str, weights: torch.Tensor) -> None:
        """Add the blend words' map (heads averaged) of one layer at the blend resolution to the sums."""
        h, w = layer_hw(weights.shape[2], ctl._image_hw)
        cross_layers = set(ctl.cross_layers())
        if self.side is None:
            self.side = max(layer_hw(s.shape[2], ctl._image_hw)[0]
                            for (n, _), s in self.edit.recording.weights.items() if n in cross_layers)
        if h != self.side:
            return
        tokens = self.edit.blend_tokens[which]
        maps = weights.detach()[..., tokens].sum(-1).mean(1).reshape(-1, h, w).float()  # (B, h, w)
        self.sums[which] = maps if self.sums[which] is None else self.sums[which] + maps

    def after_step(self, ctl, pipe, t, x):
        key = round(float(t), 3)
        cross_layers = set(ctl.cross_layers())
        for (layer, step), weights in self.edit.recording.weights.items():
            if step == key and layer in cross_layers:
                self.add(ctl, 0, layer, weights)
        if self.sums[0] is None or self.sums[1] is None:
            return x
        if key not in self.edit.recording.latents:
            raise RuntimeError(f"the recording has no latent at timestep {key}: local blend needs a source run "
                               "recorded through ScenePipeline(controller=...) with the same steps and scheduler")
        source = self.edit.recording.latents[key].to(x)
        mask = torch.zeros_like(x[:, :1])  # (B, 1, H, W)
        for maps in self.sums:
            m = F.max_pool2d(maps[:, None], 3, stride=1, padding=1)
            m = F.interpolate(m, size=x.shape[-2:])
            m = m / m.amax(dim=(2, 3), keepdim=True).clamp(min=1e-12)
            mask = torch.maximum(mask, (m > self.edit.blend_threshold).to(x))
        return source + mask * (x - source)
