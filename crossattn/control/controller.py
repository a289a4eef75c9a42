"""The `Controller`: attaches like `AttentionStore` (crossattn.hooks) and runs its recipes in order --
record, replay (edit), local blend, re-weight, excite -- at every attention call and around every step."""

from __future__ import annotations

import torch

from ..attention import CrossAttention
from ..capture import DEFAULT_TIMESTEPS, CaptureProcessor
from ..hooks import AttentionHooks
from .base import Recipe
from .edit import Edit, LocalBlend, Record, Recording
from .excite import Excite
from .reweight import Reweight


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


class Controller(AttentionHooks):
    """Controls a model's attention (and, in `ScenePipeline`, the latent) with any of the recipes.

    `Controller(record=True)` records a run for a later `Edit`. With no recipe, it changes nothing
    (weights pass through untouched; outputs equal a run without it up to the fused kernel's rounding).
    After a run with `Excite`, `excite_log` holds, per altered step, the weakest subject's maximum
    attention per image before and after the latent moved.
    """

    def __init__(self, reweight: Reweight | None = None, edit: Edit | None = None, excite: Excite | None = None,
                 record: bool = False, num_train_timesteps: int = DEFAULT_TIMESTEPS):
        super().__init__()
        self.reweight, self.edit, self.excite = reweight, edit, excite
        self.recording = Recording() if record else None
        self.num_train_timesteps = num_train_timesteps
        self.hiding = False  # True during attend-and-excite's own forward passes
        self.modules: list[CrossAttention] = []  # our hooked layers (excite hides their observers)
        blend = LocalBlend(edit) if edit is not None and edit.local_blend else None
        record_into = Record(self.recording) if record else None
        self.recipes: list[Recipe] = [r for r in (record_into, edit, blend, reweight, excite) if r is not None]

    @classmethod
    def for_pipeline(cls, pipe, **kwargs) -> Controller:
        """A controller whose shares of the run are measured on `pipe`'s scheduler's training timesteps."""
        return cls(num_train_timesteps=pipe.scheduler.config.num_train_timesteps, **kwargs)

    @property
    def excite_log(self) -> list[dict]:
        return self.excite.log if self.excite is not None else []

    # --- attaching (crossattn.hooks)
    def wants(self, cross: bool) -> bool:
        # a recording and its replay must take the same (explicit) path in every layer to match exactly
        return cross or self.edit is not None or self.recording is not None

    def hook(self, module: CrossAttention):
        module.controller = self
        self.modules.append(module)
        return lambda: setattr(module, "controller", None)

    def processor(self, inner, name: str, cross: bool):
        return ControlProcessor(self, inner)

    def attach(self, model: torch.nn.Module) -> Controller:
        """Hook every cross-attention layer of `model` (and self-attention to record or replay it).

        On a diffusers UNet attach an `AttentionStore` first: its processors are then wrapped, and it
        records the weights the controller let through (attached after, it would replace them)."""
        return super().attach(model)

    def check_attached(self, model: torch.nn.Module) -> None:
        cross_layers = self.cross_layers()
        unknown = [n for n in (self.reweight.layers or []) if n not in cross_layers] if self.reweight else []
        if not cross_layers or unknown:
            raise ValueError(f"{type(model).__name__}: " + (f"no cross-attention layer named {unknown}; its layers "
                                                            f"are {cross_layers}" if unknown else
                                                            "has no cross-attention layers to control"))

    def detach(self) -> None:
        super().detach()
        self.modules.clear()

    def progress(self, timestep: float) -> float:
        """Share of the run done at `timestep`: 0 at t = T - 1 (pure noise), near 1 at t = 0."""
        return min(1.0, max(0.0, 1.0 - (timestep + 1) / self.num_train_timesteps))

    def key(self, name: str) -> tuple[str, float]:
        """How a recording names layer `name` at the current timestep."""
        return name, round(self._timestep, 3)

    # --- the attention hook
    def __call__(self, module, weights: torch.Tensor) -> torch.Tensor:
        """Weights (B, heads, N, T) of one forward pass of layer `module` -> the weights to use."""
        name, cross = self._names[id(module)], self._cross[id(module)]
        progress = self.progress(self._timestep)
        half = weights.shape[0] // 2 if self.guided and not self.hiding else 0
        own = weights[half:]  # (B, heads, N, T): the prompt-conditioned images
        new = own
        for recipe in self.recipes:
            new = recipe.weights(self, name, cross, progress, own, new)
        if new is own:
            return weights
        return torch.cat([weights[:half], new]) if half else new

    # --- the sampling loop's hooks (ScenePipeline)
    def before_step(self, pipe, t, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Called with the latent (B, C, H, W) before the model sees it; returns the latent to use."""
        if float(t) == float(pipe.scheduler.timesteps[0]):  # a new run
            for recipe in self.recipes:
                recipe.start()
        for recipe in self.recipes:
            x = recipe.before_step(self, pipe, t, x, context)
        return x

    def after_step(self, pipe, t, x: torch.Tensor) -> torch.Tensor:
        """Called with the latent after the scheduler step at timestep `t`; returns the latent to keep."""
        for recipe in self.recipes:
            x = recipe.after_step(self, pipe, t, x)
        return x

    def subject_max_attention(self, pipe, t, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        """Attend-and-excite's measure (`Excite.subject_max_attention`) through this controller's hooks."""
        return self.excite.subject_max_attention(self, pipe, t, x, context)
