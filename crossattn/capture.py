"""Record attention weights while a model runs: `AttentionStore`.

The store attaches to every `CrossAttention` of a model (ours), or installs `CaptureProcessor`
on every attention of a diffusers `UNet2DConditionModel`. It keeps running sums keyed by layer
and timestep window -- heads kept apart -- so its memory is the same after 10 steps or 1,000.
Under classifier-free guidance the batch is `[uncond, cond]`; the store notices this by itself
(see `_before_model`) and keeps only the prompt-conditioned half. Detaching restores the model
exactly (the fused kernel runs again).
"""

from __future__ import annotations

import math

import torch

from .attention import CrossAttention
from .hooks import AttentionHooks, guided_batch  # noqa: F401 -- guided_batch: old imports


def layer_hw(num_queries: int, image_hw: tuple[int, int]) -> tuple[int, int]:
    """The (h, w) of a feature map with `num_queries` pixels inside a U-Net whose input is `image_hw`.

    Each U-Net level halves the size (rounding up), so try factors 1, 2, 4, ... until one fits.
    """
    H, W = image_hw
    for k in range(12):
        h, w = math.ceil(H / 2 ** k), math.ceil(W / 2 ** k)
        if h * w == num_queries:
            return h, w
    raise ValueError(f"cannot place {num_queries} queries on a downsampled {H}x{W} grid")


# The timesteps of diffusers' DDPM default, for a bare model with no scheduler to ask; a pipeline's store
# takes its scheduler's through `AttentionStore.for_pipeline`.
DEFAULT_TIMESTEPS = 1000


class AttentionStore(AttentionHooks):
    """Running sums of attention weights, per layer and timestep window.

    self_attention: also record self-attention (weights are (heads, N, N): large at high resolution).
    windows: the number of equal timestep windows over [0, num_train_timesteps).
    What the refined read-out needs of self-attention, and no more (`crossattn.maps.refined_store`):
    self_heads="mean" sums its heads' mean, (B, 1, N, N) instead of (B, heads, N, N);
    self_resolutions: record only self-attention layers whose feature-map height is listed;
    self_timesteps: (lo, hi), record self-attention only at timesteps lo <= t <= hi.
    After a run, `sums[(layer, window)]` is (B, heads, N, keys) and `counts[(layer, window)]` the
    number of forward passes summed in it; `layer_shapes[layer]` = (h, w) and `is_cross[layer]`.
    Read them through `mean`, `batch_size`, `heads(layer)`, `keys(layer)`, `recorded_windows()`,
    `window_range(window)` and `passes()` rather than indexing `sums`.
    """

    def __init__(self, self_attention: bool = False, windows: int = 10, num_train_timesteps: int = DEFAULT_TIMESTEPS,
                 self_heads: str = "apart", self_resolutions: list[int] | None = None,
                 self_timesteps: tuple[float, float] | None = None):
        if windows < 1:
            raise ValueError(f"windows must be >= 1, got {windows}")
        if self_heads not in ("apart", "mean"):
            raise ValueError(f"self_heads must be 'apart' or 'mean', got {self_heads!r}")
        if self_timesteps is not None and (len(self_timesteps) != 2 or self_timesteps[0] > self_timesteps[1]):
            raise ValueError(f"self_timesteps must be (lo, hi) with lo <= hi, got {self_timesteps!r}")
        super().__init__()
        self.self_attention, self.windows, self.num_train_timesteps = self_attention, windows, num_train_timesteps
        self.self_heads, self.self_resolutions, self.self_timesteps = self_heads, self_resolutions, self_timesteps
        self.sums: dict[tuple[str, int], torch.Tensor] = {}
        self.counts: dict[tuple[str, int], int] = {}
        self.layer_shapes: dict[str, tuple[int, int]] = {}
        self.is_cross: dict[str, bool] = {}

    @classmethod
    def for_pipeline(cls, pipe, **kwargs) -> AttentionStore:
        """A store whose timestep windows span `pipe`'s scheduler's training timesteps."""
        return cls(num_train_timesteps=pipe.scheduler.config.num_train_timesteps, **kwargs)

    # --- attaching (crossattn.hooks): every cross-attention, and self-attention if asked
    def wants(self, cross: bool) -> bool:
        return cross or self.self_attention

    def hook(self, module: CrossAttention):
        module.observer = self.record
        return lambda: setattr(module, "observer", None)

    def processor(self, inner, name: str, cross: bool):
        return CaptureProcessor(self, name, cross)

    def check_model(self, model: torch.nn.Module) -> None:
        # a second store would take over the first one's hooks
        if _attached_store(model) is not None:
            raise RuntimeError(f"{type(model).__name__} already has an AttentionStore attached (one store per model "
                               "at a time); detach that store first or reuse it")

    def check_attached(self, model: torch.nn.Module) -> None:
        if not self._names:
            raise ValueError(f"{type(model).__name__} has no attention layers to capture")

    def reset(self) -> None:
        """Forget everything recorded (sums, counts, layer shapes, last timestep and image size); stays attached."""
        self.sums.clear()
        self.counts.clear()
        self.layer_shapes.clear()
        self.is_cross.clear()
        self._timestep = 0
        self._image_hw = None

    # --- recording
    def _before_model(self, module, args, kwargs):
        super()._before_model(module, args, kwargs)
        if not 0 <= self._timestep <= self.num_train_timesteps:  # windows would silently clamp
            raise ValueError(f"timestep {self._timestep:g} is outside [0, {self.num_train_timesteps}]: create the "
                             "store with num_train_timesteps=<the scheduler's config.num_train_timesteps>")

    def window_of(self, timestep: float) -> int:
        return min(self.windows - 1, max(0, int(timestep * self.windows // self.num_train_timesteps)))

    def record(self, module, weights: torch.Tensor) -> None:
        """Add one forward pass's weights (B, heads, N, keys) of layer `module` to the sums."""
        name = self._names[id(module)]
        cross = getattr(module, "is_cross_attention", getattr(module, "cross", True))
        if not cross and not self._wants_self(weights.shape[2]):
            return
        if self.guided:
            weights = weights[weights.shape[0] // 2:]  # keep the prompt-conditioned half
        key = (name, self.window_of(self._timestep))
        w = weights.detach().float()
        if not cross and self.self_heads == "mean":
            w = w.mean(dim=1, keepdim=True)  # (B, 1, N, N): a 1/heads of the memory
        if key in self.sums:
            self.sums[key] += w
            self.counts[key] += 1
        else:
            self.sums[key], self.counts[key] = w.clone(), 1
            self.layer_shapes[name] = layer_hw(w.shape[2], self._image_hw)
            self.is_cross[name] = cross

    def _wants_self(self, num_queries: int) -> bool:
        """Whether a self-attention pass with `num_queries` pixels, now, is one the store keeps."""
        if self.self_timesteps is not None and not self.self_timesteps[0] <= self._timestep <= self.self_timesteps[1]:
            return False
        return self.self_resolutions is None or layer_hw(num_queries, self._image_hw)[0] in self.self_resolutions

    # --- reading
    @property
    def layers(self) -> list[str]:
        return list(self.layer_shapes)

    @property
    def batch_size(self) -> int:
        """Images recorded per forward pass (the prompt half only under guidance); 0 before any."""
        return next(iter(self.sums.values())).shape[0] if self.sums else 0

    def _first(self, layer: str) -> torch.Tensor:
        found = next((s for (name, _), s in self.sums.items() if name == layer), None)
        if found is None:
            raise ValueError(f"nothing was recorded for layer {layer!r}; recorded layers: {self.layers}")
        return found

    def heads(self, layer: str) -> int:
        """Number of attention heads of `layer`."""
        return self._first(layer).shape[1]

    def keys(self, layer: str) -> int:
        """Keys each query of `layer` weighs: the prompt's tokens (cross) or the layer's pixels (self)."""
        return self._first(layer).shape[-1]

    def recorded_windows(self, layer: str | None = None) -> list[int]:
        """The timestep windows holding records (of `layer`, or of any layer), ascending."""
        return sorted({w for (name, w) in self.sums if layer is None or name == layer})

    def window_range(self, window: int) -> tuple[float, float]:
        """The timesteps [lo, hi) that window `window` collects."""
        if not 0 <= window < self.windows:
            raise ValueError(f"window must be in 0..{self.windows - 1}, got {window}")
        size = self.num_train_timesteps / self.windows
        return window * size, (window + 1) * size

    def passes(self, layer: str | None = None) -> int:
        """Forward passes recorded (in `layer`, or summed over layers)."""
        return sum(c for (name, _), c in self.counts.items() if layer is None or name == layer)

    def window_sums(self, layer: str) -> list[tuple[int, int, torch.Tensor]]:
        """(window, passes, weights summed over those passes (B, heads, N, keys)) per window of `layer`, ascending."""
        return [(w, self.counts[(layer, w)], self.sums[(layer, w)]) for w in self.recorded_windows(layer)]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.sums.values())

    def mean(self, layer: str, heads: list[int] | None = None, timesteps: tuple[float, float] | None = None):
        """Weights of `layer` averaged over the chosen heads and the windows within `timesteps`
        (inclusive range of timestep values): (B, N, keys), or None if nothing was recorded there."""
        total, count = None, 0
        for (name, window), s in self.sums.items():
            if name != layer:
                continue
            lo, hi = self.window_range(window)
            if timesteps is not None and (hi <= timesteps[0] or lo > timesteps[1]):
                continue
            total = s.clone() if total is None else total + s
            count += self.counts[(name, window)]
        if total is None:
            return None
        total = total / count  # (B, heads, N, keys)
        if heads is not None:
            if max(heads) >= total.shape[1] or min(heads) < 0:
                raise ValueError(f"layer {layer} has {total.shape[1]} heads; got heads {heads}")
            total = total[:, heads]
        return total.mean(dim=1)  # (B, N, keys)


def _attached_store(model: torch.nn.Module):
    """The AttentionStore already feeding on `model`'s attention layers, or None."""
    for module in model.modules():
        if isinstance(module, CrossAttention) and module.observer is not None:
            return getattr(module.observer, "__self__", module.observer)
    if hasattr(model, "attn_processors"):
        return next((p.store for p in model.attn_processors.values() if isinstance(p, CaptureProcessor)), None)
    return None


class CaptureProcessor:
    """A diffusers attention processor that computes attention explicitly and feeds an AttentionStore.

    Same maths as diffusers' `AttnProcessor`, with the softmax weights handed to the store.
    """

    def __init__(self, store: AttentionStore, name: str, cross: bool):
        self.store, self.name, self.cross = store, name, cross

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, temb=None,
                 *args, **kwargs):
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        image_shape = None
        if hidden_states.dim() == 4:
            B, C, H, W = hidden_states.shape
            image_shape = (B, C, H, W)
            hidden_states = hidden_states.view(B, C, H * W).transpose(1, 2)
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        B, N = hidden_states.shape[:2]
        attention_mask = attn.prepare_attention_mask(attention_mask, context.shape[1], B)
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        if encoder_hidden_states is not None and attn.norm_cross:
            context = attn.norm_encoder_hidden_states(context)

        q = attn.head_to_batch_dim(attn.to_q(hidden_states))  # (B*heads, N, head_dim)
        k = attn.head_to_batch_dim(attn.to_k(context))  # (B*heads, T, head_dim)
        v = attn.head_to_batch_dim(attn.to_v(context))
        weights = attn.get_attention_scores(q, k, attention_mask)  # (B*heads, N, T): scaled, softmaxed
        self.store.record(self, weights.view(B, attn.heads, N, -1))
        out = attn.batch_to_head_dim(torch.bmm(weights, v))  # (B, N, heads*head_dim)
        out = attn.to_out[1](attn.to_out[0](out))
        if image_shape is not None:
            out = out.transpose(1, 2).reshape(image_shape)
        if attn.residual_connection:
            out = out + residual
        return out / attn.rescale_output_factor
