"""Steer sampling with the attention maps: re-weight words, replay a source prompt's attention
(prompt-to-prompt edits), attend-and-excite.

A `Controller` holds any of three recipes and attaches like `AttentionStore`: on our
`CrossAttention` layers through their `controller` hook, on a diffusers `UNet2DConditionModel` as
`ControlProcessor`s. The attention layers hand it their softmax weights (B, heads, N, T) and what it
returns weighs the Values; the sampling loop (`ScenePipeline.__call__(controller=...)`) calls
`before_step` and `after_step` around each scheduler step.

- `Reweight` (Hertz et al. 2022, the "equalizer"): multiply chosen tokens' weights by a factor, in
  chosen layers and part of the run.
- `Edit` (prompt-to-prompt): a `Recording` of a source run (attention per layer and timestep, latents)
  is replayed while an edited prompt is sampled from the same noise. Word swap (same number of words:
  the new word takes the old word's maps) or refinement (words only added: kept words take the
  source's maps, new words keep their own) for the first `cross_replace_steps` of the run;
  self-attention of small layers (<= 16x16) for the first `self_replace_steps`; optional local blend
  (the source's latent kept where neither prompt's edited words attend).
- `Excite` (Chefer et al. 2023): in the first half of the run, gradient steps on the latent that raise
  the weakest subject's maximum (Gaussian-smoothed) attention, with iterative refinement at three steps
  until it reaches 0.05, 0.5, 0.8 -- the paper's schedule for 50 steps, scaled to the run's length.

Under classifier-free guidance only the prompt-conditioned half of the batch is changed or recorded,
as in prompt-to-prompt. "Steps" are shares of the run measured by the timestep: progress
`1 - (t + 1) / T` is 0 at pure noise, so a setting means the same at any number of steps and in any
pipeline that calls the U-Net with timesteps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .attention import CrossAttention
from .capture import CaptureProcessor, layer_hw
from .text import Word, prompt_words

SELF_REPLACE_MAX_QUERIES = 16 * 16  # prompt-to-prompt replays self-attention only in layers this small


# --- choosing words
def word_positions(words: list[Word], names: list[str], what: str) -> dict[str, list[int]]:
    """Token positions of each named word (every occurrence); ValueError naming unknown words."""
    texts = [w.text for w in words]
    unknown = [n for n in names if n not in texts]
    if unknown:
        raise ValueError(f"{what}: {unknown} not in the prompt; its words are {texts}")
    return {n: [t for w in words if w.text == n for t in w.tokens] for n in names}


def parse_weights(items: list[str]) -> dict[str, float]:
    """'red=2' items -> {'red': 2.0}; ValueError naming an item that is not WORD=finite number."""
    weights = {}
    for item in items:
        word, sep, value = item.partition("=")
        try:
            factor = float(value)
        except ValueError:
            factor = None
        if not sep or not word or factor is None or not math.isfinite(factor):
            raise ValueError(f"--reweight {item!r}: expected WORD=NUMBER with a finite number, e.g. red=2")
        weights[word] = factor
    return weights


def _check_share(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and 0.0 <= value <= 1.0):
        raise ValueError(f"{name} must be a share of the run in [0, 1], got {value!r}")


@dataclass
class Reweight:
    """Scale the attention weights of some tokens (prompt-to-prompt's equalizer), not renormalised."""
    factors: dict[int, float]  # token position -> factor
    layers: list[str] | None = None  # layer names; None: every cross-attention layer
    steps: tuple[float, float] = (0.0, 1.0)  # [start, end) shares of the run

    def __post_init__(self):
        bad = {k: v for k, v in self.factors.items() if not math.isfinite(v)}
        if bad:
            raise ValueError(f"re-weighting factors must be finite numbers, got {bad}")
        _check_share("reweight start", self.steps[0])
        _check_share("reweight end", self.steps[1])


# --- prompt-to-prompt: aligning a source and an edited prompt
@dataclass
class Alignment:
    """Where each token of the edited prompt takes its attention from in the source prompt.

    matrix (T, T): the edited token j's map is sum_i source_map_i * matrix[i, j].
    taken (T,): 1 where token j takes the source's map, 0 where it keeps its own (added words).
    """
    kind: str  # "swap" or "refine"
    matrix: torch.Tensor
    taken: torch.Tensor
    changed: list[tuple[str, str]]  # (source word, edited word); "" for an added word
    source_tokens: list[int]  # token positions of the changed words in the source
    target_tokens: list[int]  # ... and in the edited prompt


def align_prompts(tokenizer, source: str, target: str) -> Alignment:
    """Align the edited prompt `target` with `source`, as prompt-to-prompt does.

    Same number of words: a word swap (differing words exchange maps; a word of k tokens spreads the
    old word's map over them). More words: a refinement, which needs every source word kept in order
    (words only added). Anything else raises ValueError naming the words that do not align.
    """
    T = tokenizer.model_max_length
    src, tgt = prompt_words(tokenizer, source), prompt_words(tokenizer, target)
    for prompt, words in ((source, src), (target, tgt)):
        if not words or any(not w.tokens for w in words):
            raise ValueError(f"cannot align {prompt!r}: it is empty or longer than the tokenizer's {T} tokens")
    matrix, taken = torch.zeros(T, T), torch.ones(T)
    matrix[0, 0] = 1.0  # start token
    changed, source_tokens, target_tokens = [], [], []

    def pair(a: Word, b: Word) -> None:
        if len(a.tokens) == len(b.tokens):
            matrix[a.tokens, b.tokens] = 1.0  # token k of the old word -> token k of the new one
        else:
            for j in b.tokens:
                matrix[a.tokens, j] = 1.0 / len(b.tokens)

    if len(src) == len(tgt):
        kind = "swap"
        for a, b in zip(src, tgt):
            pair(a, b)
            if a.text != b.text:
                changed.append((a.text, b.text))
                source_tokens += a.tokens
                target_tokens += b.tokens
    else:
        kind = "refine"
        k = 0
        for b in tgt:
            if k < len(src) and src[k].text == b.text:
                pair(src[k], b)
                k += 1
            else:
                taken[b.tokens] = 0.0  # an added word keeps its own attention
                changed.append(("", b.text))
                target_tokens += b.tokens
        if k < len(src):
            missing = [w.text for w in src if w.text not in [b.text for b in tgt]]
            raise ValueError(f"cannot align the edit {target!r} with {source!r}: a swap keeps the number of words "
                             "and a refinement only adds words, but " +
                             (f"{missing} are missing" if missing else "the source's words are out of order"))
    # end token and padding follow the last word in both prompts
    last_src, last_tgt = src[-1].tokens[-1], tgt[-1].tokens[-1]
    for j in range(last_tgt + 1, T):
        matrix[min(T - 1, j - last_tgt + last_src), j] = 1.0
    return Alignment(kind, matrix, taken, changed, source_tokens, target_tokens)


class Recording:
    """A source run's attention (prompt half) per (layer, timestep) and its latent after each step."""

    def __init__(self):
        self.weights: dict[tuple[str, float], torch.Tensor] = {}  # (B, heads, N, T), detached
        self.latents: dict[float, torch.Tensor] = {}  # (B, C, H, W) after the step at that timestep

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in [*self.weights.values(), *self.latents.values()])


@dataclass
class Edit:
    """Replay `recording` (of the source prompt, same seed, steps and scheduler) for the edited prompt."""
    recording: Recording
    alignment: Alignment
    cross_replace_steps: float = 0.8  # share of the run whose cross-attention is replayed
    self_replace_steps: float = 0.4  # share of the run whose self-attention (small layers) is replayed
    local_blend: bool = False  # keep the source's latent outside the edited words' attention
    blend_tokens: tuple[list[int], list[int]] | None = None  # (source, edited) positions; None: the changed words
    blend_threshold: float = 0.3  # of each map's maximum, after a 3x3 max-pool (prompt-to-prompt's values)

    def __post_init__(self):
        _check_share("cross_replace_steps", self.cross_replace_steps)
        _check_share("self_replace_steps", self.self_replace_steps)
        if self.local_blend and self.blend_tokens is None:
            self.blend_tokens = (self.alignment.source_tokens, self.alignment.target_tokens)
        if self.local_blend and not self.blend_tokens[1]:
            raise ValueError("local blend needs edited words: the edited prompt changes no word")


@dataclass
class Excite:
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

    def __post_init__(self):
        if not self.subjects or any(not s for s in self.subjects):
            raise ValueError("attend-and-excite needs at least one subject word with tokens")
        _check_share("max_iter_to_alter", self.max_iter_to_alter)
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


class ControlProcessor:
    """Wraps a diffusers attention processor so that the controller sees and may change the weights.

    It swaps the module's `get_attention_scores` for the call; processors that compute the softmax
    explicitly call it (diffusers' `AttnProcessor`, our `CaptureProcessor`, which then records the
    changed weights). The fused default (`AttnProcessor2_0`) is replaced by `AttnProcessor`.
    """

    def __init__(self, controller: Controller, inner):
        from diffusers.models.attention_processor import AttnProcessor
        self.controller = controller
        self.inner = inner if isinstance(inner, CaptureProcessor) else AttnProcessor()
        self.plain = AttnProcessor()  # used while the controller hides attention from the store

    def __call__(self, attn, *args, **kwargs):
        original = attn.get_attention_scores

        def scores(query, key, attention_mask=None):
            weights = original(query, key, attention_mask)  # (B * heads, N, T), batch-major
            B = weights.shape[0] // attn.heads
            return self.controller(self, weights.view(B, attn.heads, *weights.shape[1:])).reshape(weights.shape)

        attn.get_attention_scores = scores
        try:
            return (self.plain if self.controller.hiding else self.inner)(attn, *args, **kwargs)
        finally:
            del attn.get_attention_scores  # the class's method again


class Controller:
    """Steers a model's attention (and, in `ScenePipeline`, the latent) with any of the recipes.

    `Controller(record=True)` records a run for a later `Edit`. With no recipe, it changes nothing
    (weights pass through untouched; outputs equal a run without it up to the fused kernel's rounding).
    After a run with `Excite`, `excite_log` holds, per altered step, the weakest subject's maximum
    attention per image before and after the latent moved.
    """

    def __init__(self, reweight: Reweight | None = None, edit: Edit | None = None, excite: Excite | None = None,
                 record: bool = False, num_train_timesteps: int = 1000):
        self.reweight, self.edit, self.excite = reweight, edit, excite
        self.recording = Recording() if record else None
        self.num_train_timesteps = num_train_timesteps
        self.guided = False  # learned at every model call, as AttentionStore does: [uncond, cond] halves
        self.hiding = False  # True during attend-and-excite's own forward passes
        self.excite_log: list[dict] = []
        self._names: dict[int, str] = {}
        self._cross: dict[int, bool] = {}
        self._modules: list[CrossAttention] = []
        self._timestep = 0.0
        self._image_hw: tuple[int, int] | None = None
        self._collected: list[tuple[str, torch.Tensor]] | None = None  # excite pass: (layer, weights)
        self._blend_sums: list[torch.Tensor | None] = [None, None]  # source, edited: (B, h, w) summed maps
        self._blend_side: int | None = None
        self._undo: list = []

    # --- attaching
    def attach(self, model: torch.nn.Module) -> Controller:
        """Hook every cross-attention layer of `model` (and self-attention to record or replay it).

        On a diffusers UNet attach an `AttentionStore` first: its processors are then wrapped, and it
        records the weights the controller let through (attached after, it would replace them)."""
        if self._undo:
            raise RuntimeError("this Controller is already attached; detach it first")
        # a recording and its replay must take the same (explicit) path in every layer to match exactly
        with_self = self.edit is not None or self.recording is not None
        self._undo.append(model.register_forward_pre_hook(self._before_model, with_kwargs=True).remove)
        if hasattr(model, "attn_processors") and hasattr(model, "set_attn_processor"):
            before = dict(model.attn_processors)
            processors = {}
            for key, proc in before.items():
                cross = key.rsplit(".processor", 1)[0].endswith("attn2")
                if cross or with_self:
                    processors[key] = ControlProcessor(self, proc)
                    self._names[id(processors[key])] = key.rsplit(".processor", 1)[0]
                    self._cross[id(processors[key])] = cross
                else:
                    processors[key] = proc
            model.set_attn_processor(dict(processors))  # diffusers pops from the dict it gets: pass a copy
            self._undo.append(lambda: model.set_attn_processor(dict(before)))
        else:
            for name, module in model.named_modules():
                if isinstance(module, CrossAttention) and (module.is_cross_attention or with_self):
                    self._names[id(module)], self._cross[id(module)] = name, module.is_cross_attention
                    self._modules.append(module)
                    module.controller = self
                    self._undo.append(lambda m=module: setattr(m, "controller", None))
        cross_layers = [n for i, n in self._names.items() if self._cross[i]]
        unknown = [n for n in (self.reweight.layers or []) if n not in cross_layers] if self.reweight else []
        if not cross_layers or unknown:
            self.detach()
            raise ValueError(f"{type(model).__name__}: " + (f"no cross-attention layer named {unknown}; its layers "
                                                            f"are {cross_layers}" if unknown else
                                                            "has no cross-attention layers to steer"))
        return self

    def detach(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self._names.clear()
        self._cross.clear()
        self._modules.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()

    def _before_model(self, module, args, kwargs):
        sample = args[0] if args else kwargs["sample"]
        timestep = args[1] if len(args) > 1 else kwargs["timestep"]
        self._image_hw = tuple(sample.shape[-2:])
        self._timestep = float(torch.as_tensor(timestep).reshape(-1)[0])
        B = sample.shape[0]  # guided pipelines feed the same latents twice (see AttentionStore._before_model)
        self.guided = B % 2 == 0 and torch.equal(sample[:B // 2], sample[B // 2:])

    def progress(self, timestep: float) -> float:
        """Share of the run done at `timestep`: 0 at t = T - 1 (pure noise), near 1 at t = 0."""
        return min(1.0, max(0.0, 1.0 - (timestep + 1) / self.num_train_timesteps))

    # --- the attention hook
    def __call__(self, module, weights: torch.Tensor) -> torch.Tensor:
        """Weights (B, heads, N, T) of one forward pass of layer `module` -> the weights to use."""
        name, cross = self._names[id(module)], self._cross[id(module)]
        key, progress = (name, round(self._timestep, 3)), self.progress(self._timestep)
        half = weights.shape[0] // 2 if self.guided and not self.hiding else 0
        own = weights[half:]  # (B, heads, N, T): the prompt-conditioned images
        new = own
        if self.recording is not None and not self.hiding and (cross or own.shape[2] <= SELF_REPLACE_MAX_QUERIES):
            self.recording.weights[key] = own.detach().clone()
        if self.edit is not None:
            new = self._replay(key, cross, progress, own)
            if cross and self.edit.local_blend and not self.hiding:
                self._add_blend(1, name, own)
        if cross and self.reweight is not None and self.reweight.steps[0] <= progress < self.reweight.steps[1] \
                and (self.reweight.layers is None or name in self.reweight.layers):
            equalizer = own.new_ones(own.shape[-1])
            for position, factor in self.reweight.factors.items():
                equalizer[position] = factor
            new = new * equalizer  # (B, heads, N, T) * (T,)
        if self._collected is not None and cross:
            self._collected.append((name, new))
        if new is own:
            return weights
        return torch.cat([weights[:half], new]) if half else new

    def _replay(self, key, cross: bool, progress: float, own: torch.Tensor) -> torch.Tensor:
        edit = self.edit
        if progress >= (edit.cross_replace_steps if cross else edit.self_replace_steps):
            return own
        if not cross and own.shape[2] > SELF_REPLACE_MAX_QUERIES:
            return own
        source = edit.recording.weights.get(key)
        if source is None:
            raise RuntimeError(f"the recording has no attention for layer {key[0]} at timestep {key[1]}: record the "
                               "source with the same steps, scheduler and image size")
        if source.shape[0] != own.shape[0]:
            raise RuntimeError(f"the recording holds {source.shape[0]} images, this run {own.shape[0]}")
        source = source.to(own.dtype)
        if not cross:
            return source
        a = edit.alignment
        mapped = torch.einsum("bhnt,tu->bhnu", source, a.matrix.to(own))  # (B, heads, N, T) in edited tokens
        return mapped * a.taken.to(own) + own * (1 - a.taken.to(own))

    # --- local blend
    def _add_blend(self, which: int, layer_name: str, weights: torch.Tensor) -> None:
        """Add the blend words' map (heads averaged) of one layer at the blend resolution to the sums."""
        h, w = layer_hw(weights.shape[2], self._image_hw)
        if self._blend_side is None:  # prompt-to-prompt blends with its 16x16 maps: here the largest ones
            self._blend_side = max(layer_hw(s.shape[2], self._image_hw)[0]
                                   for (n, _), s in self.edit.recording.weights.items() if n in self._cross_names())
        if h != self._blend_side:
            return
        tokens = self.edit.blend_tokens[which]
        maps = weights.detach()[..., tokens].sum(-1).mean(1).reshape(-1, h, w).float()  # (B, h, w)
        sums = self._blend_sums
        sums[which] = maps if sums[which] is None else sums[which] + maps

    def _cross_names(self) -> set[str]:
        return {n for i, n in self._names.items() if self._cross[i]}

    def _blend(self, t: float, x: torch.Tensor) -> torch.Tensor:
        """Prompt-to-prompt's local blend: x = source + mask * (x - source), the mask from both prompts'
        edited words' maps so far (max-pooled 3x3, upsampled, each over its maximum, > threshold)."""
        key = round(t, 3)
        for (layer, step), weights in self.edit.recording.weights.items():
            if step == key and layer in self._cross_names():
                self._add_blend(0, layer, weights)
        if self._blend_sums[0] is None or self._blend_sums[1] is None:
            return x
        if key not in self.edit.recording.latents:
            raise RuntimeError(f"the recording has no latent at timestep {key}: local blend needs a source run "
                               "recorded through ScenePipeline(controller=...) with the same steps and scheduler")
        source = self.edit.recording.latents[key].to(x)
        mask = torch.zeros_like(x[:, :1])  # (B, 1, H, W)
        for maps in self._blend_sums:
            m = F.max_pool2d(maps[:, None], 3, stride=1, padding=1)
            m = F.interpolate(m, size=x.shape[-2:])
            m = m / m.amax(dim=(2, 3), keepdim=True).clamp(min=1e-12)
            mask = torch.maximum(mask, (m > self.edit.blend_threshold).to(x))
        return source + mask * (x - source)

    # --- the sampling loop's hooks (ScenePipeline)
    def before_step(self, pipe, t, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Called with the latent (B, C, H, W) before the model sees it; returns the latent to use."""
        guided = context.shape[0] == 2 * x.shape[0]
        timesteps = pipe.scheduler.timesteps
        if float(t) == float(timesteps[0]):  # a new run
            self.excite_log, self._blend_sums = [], [None, None]
        if self.excite is None:
            return x
        step = int((timesteps == t).nonzero()[0])
        return self._excite_step(pipe, step, len(timesteps), t, x, context[x.shape[0]:] if guided else context)

    def after_step(self, pipe, t, x: torch.Tensor) -> torch.Tensor:
        """Called with the latent after the scheduler step at timestep `t`; returns the latent to keep."""
        if self.recording is not None:
            self.recording.latents[round(float(t), 3)] = x.detach().clone()
        if self.edit is not None and self.edit.local_blend:
            x = self._blend(float(t), x)
        return x

    # --- attend-and-excite
    def subject_max_attention(self, pipe, t, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """(B, subjects): each subject's maximum smoothed attention for latent x (B, C, H, W) at `t`, from
        one forward pass on the prompt-conditioned `context` (B, T, D); differentiable in x."""
        e = self.excite
        self._collected, self.hiding = [], True
        hidden = [(m, m.observer) for m in self._modules]
        for m, _ in hidden:
            m.observer = None  # the maps of the gradient passes must not reach an AttentionStore
        try:
            pipe.unet(pipe.scheduler.scale_model_input(x, t), t, encoder_hidden_states=context)
            collected = self._collected
        finally:
            for m, observer in hidden:
                m.observer = observer
            self._collected, self.hiding = None, False
        shapes = {name: layer_hw(w.shape[2], self._image_hw) for name, w in collected}
        side = e.resolution or max(h for h, _ in shapes.values())
        chosen = [w for name, w in collected if shapes[name][0] == side]
        if not chosen:
            raise ValueError(f"no cross-attention maps of side {side}; the model has {sorted(set(shapes.values()))}")
        h, w = next(s for s in shapes.values() if s[0] == side)
        maps = torch.stack([c.mean(1) for c in chosen]).mean(0)  # (B, N, T): layers and heads averaged
        text = (maps[..., 1:e.text_end] * e.temperature).softmax(-1)  # (B, N, words' tokens)
        result = []
        for tokens in e.subjects:
            subject = text[..., [p - 1 for p in tokens]].sum(-1).reshape(-1, h, w)  # (B, h, w)
            result.append(gaussian_smooth(subject, e.kernel_size, e.sigma).amax(dim=(1, 2)))
        return torch.stack(result, dim=1)  # (B, subjects)

    def _excite_step(self, pipe, step: int, num_steps: int, t, x: torch.Tensor, context: torch.Tensor):
        altered, refine, sizes = self.excite.schedule(num_steps)
        if step >= altered:
            return x
        size = sizes[step]
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            maxima = self.subject_max_attention(pipe, t, x, context)
            before = maxima.min(dim=1).values.detach()
            loss = (1 - maxima).clamp(min=0).amax(dim=1)  # (B,): the most neglected subject's shortfall
            iterations = 0
            if step in refine:
                target = 1 - refine[step]
                while iterations < self.excite.max_refinement_steps and bool((loss > target).any()):
                    x = self._descend(x, loss * (loss > target), size)
                    maxima = self.subject_max_attention(pipe, t, x, context)
                    loss = (1 - maxima).clamp(min=0).amax(dim=1)
                    iterations += 1
            if bool((loss > 0).any()):
                x = self._descend(x, loss, size)
        self.excite_log.append({"step": step, "timestep": float(t), "step_size": size, "refinements": iterations,
                                "weakest_before": before.tolist(),
                                "weakest_at_last_update": maxima.min(dim=1).values.detach().tolist()})
        return x.detach()

    @staticmethod
    def _descend(x: torch.Tensor, loss: torch.Tensor, step_size: float) -> torch.Tensor:
        """One gradient step on the latent; images are independent in the U-Net, so the sum's gradient is
        each image's own."""
        grad = torch.autograd.grad(loss.sum(), [x])[0]
        return (x - step_size * grad).detach().requires_grad_(True)
