"""Attaching to a model's attention layers, written once for `AttentionStore` and `Controller`.

On our `CrossAttention` layers a subclass sets a hook attribute (`observer`, `controller`); on a
diffusers `UNet2DConditionModel` it swaps the attention processors for its own wrappers. Either way
every change goes on an undo list, so `detach` (or leaving `with x.attach(model):`) restores the model
exactly, and a forward pre-hook learns, at every model call, the timestep, the image size and whether
the batch is a guided [uncond, cond] pair.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .attention import CrossAttention


def guided_batch(sample: torch.Tensor) -> bool:
    """Whether a denoiser's input batch `sample` (B, C, H, W) is classifier-free guidance's [uncond, cond].

    Every guided pipeline (ours; diffusers' SD 1.x/2.x and SDXL: `torch.cat([latents] * 2)`) feeds
    the same latents twice, so the two halves are bit-identical; without guidance each image has its
    own noise and they differ. The text side cannot tell: two prompts without guidance also differ
    half to half, and SDXL's zeroed negative prompt is just another context. Hooking the pipeline
    instead would need one hook per pipeline class and would miss direct calls of the model.
    """
    B = sample.shape[0]
    return B % 2 == 0 and torch.equal(sample[:B // 2], sample[B // 2:])


class AttentionHooks:
    """Base of everything that attaches to attention layers. A subclass says which layers it wants
    (`wants`), how it hooks one of ours (`hook`, returning the undo) and which processor wraps one of
    diffusers' (`processor`); after attaching, `_names[id(layer)]` and `_cross[id(layer)]` say what each
    hooked layer (module or processor) is."""

    def __init__(self):
        self.guided = False  # learned at every model call: True when the batch is [uncond, cond]
        self._timestep = 0.0
        self._image_hw: tuple[int, int] | None = None
        self._names: dict[int, str] = {}
        self._cross: dict[int, bool] = {}
        self._undo: list[Callable[[], object]] = []

    # --- what a subclass says
    def wants(self, cross: bool) -> bool:
        """Hook this layer? (`cross`: cross-attention, else self-attention)."""
        return cross

    def hook(self, module: CrossAttention) -> Callable[[], object]:
        """Hook one of our layers; returns what undoes it."""
        raise NotImplementedError

    def processor(self, inner, name: str, cross: bool):
        """The processor that replaces diffusers' `inner` on layer `name`."""
        raise NotImplementedError

    def check_model(self, model: torch.nn.Module) -> None:
        """Raise before anything is hooked when `model` cannot take this (e.g. one store per model)."""

    def check_attached(self, model: torch.nn.Module) -> None:
        """Raise ValueError after hooking when what was hooked does not do (the model is restored)."""
        if not self._names:
            raise ValueError(f"{type(model).__name__} has no attention layers to hook")

    # --- attaching, written once
    def attach(self, model: torch.nn.Module):
        """Hook the wanted attention layers of `model` until `detach` (or the end of `with x.attach(model):`)."""
        if self._undo:
            raise RuntimeError(f"this {type(self).__name__} is already attached; detach it first")
        if not isinstance(model, torch.nn.Module):  # a pipeline has no hooks of its own: its U-Net does
            hint = "; for a pipeline pass its U-Net, attach(pipe.unet)" if hasattr(model, "unet") else ""
            raise TypeError(f"attach takes a model (torch.nn.Module), got a {type(model).__name__}{hint}")
        self.check_model(model)
        self._undo.append(model.register_forward_pre_hook(self._before_model, with_kwargs=True).remove)
        if hasattr(model, "attn_processors") and hasattr(model, "set_attn_processor"):
            before = dict(model.attn_processors)
            processors = {}
            for key, proc in before.items():
                name = key.rsplit(".processor", 1)[0]
                cross = name.endswith("attn2")  # diffusers: attn1 self-, attn2 cross-attention
                processors[key] = self.processor(proc, name, cross) if self.wants(cross) else proc
                if self.wants(cross):
                    self._names[id(processors[key])], self._cross[id(processors[key])] = name, cross
            model.set_attn_processor(dict(processors))  # diffusers pops from the dict it gets: pass a copy
            self._undo.append(lambda: model.set_attn_processor(dict(before)))
        else:
            for name, module in model.named_modules():
                if isinstance(module, CrossAttention) and self.wants(module.is_cross_attention):
                    self._names[id(module)], self._cross[id(module)] = name, module.is_cross_attention
                    self._undo.append(self.hook(module))
        try:
            self.check_attached(model)
        except Exception:
            self.detach()
            raise
        return self

    def detach(self) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self._names.clear()
        self._cross.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.detach()

    def cross_layers(self) -> list[str]:
        """Names of the hooked cross-attention layers."""
        return [n for i, n in self._names.items() if self._cross[i]]

    def _before_model(self, module, args, kwargs):
        sample = args[0] if args else kwargs.get("sample")
        timestep = args[1] if len(args) > 1 else kwargs.get("timestep")
        if sample is None or timestep is None:
            missing = "sample" if sample is None else "timestep"
            raise ValueError(f"the U-Net was called without its {missing}: call it as unet(sample, timestep, "
                             "encoder_hidden_states=...), as diffusers does (the store files maps by timestep)")
        self._image_hw = tuple(sample.shape[-2:])
        self._timestep = float(torch.as_tensor(timestep).reshape(-1)[0])
        self.guided = guided_batch(sample)  # classifier-free guidance, seen in the input, told by no one
