"""Text-to-image sampling: a diffusers `DiffusionPipeline` around our U-Net and a CLIP text encoder.

The denoising loop is plain code: encode the prompt (and the empty prompt for classifier-free
guidance), then for each scheduler timestep predict the noise and step.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from diffusers import DDIMScheduler, DDPMScheduler, DiffusionPipeline, DPMSolverMultistepScheduler
from diffusers.utils import BaseOutput
from PIL import Image

SCHEDULERS = {"ddim": DDIMScheduler, "dpm": DPMSolverMultistepScheduler, "ddpm": DDPMScheduler}
PRETRAINED = Path(__file__).parent / "pretrained" / "scenes-32"


def make_scheduler(name: str, config) -> object:
    """A sampling scheduler by name ('ddim', 'dpm' for DPM-Solver++, 'ddpm') from a scheduler config."""
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {sorted(SCHEDULERS)}")
    extra = {"algorithm_type": "dpmsolver++"} if name == "dpm" else {}
    if name == "ddim":
        # inherited from DDPM's config these would skip the final clean step; trailing spacing
        # reaches t=T at few steps.
        extra = {"set_alpha_to_one": True, "timestep_spacing": "trailing"}
    return SCHEDULERS[name].from_config(config, **extra)


class PipelineOutput(BaseOutput):
    images: list | np.ndarray | torch.Tensor


class ScenePipeline(DiffusionPipeline):
    """unet (ours or diffusers' UNet2DConditionModel), text_encoder (CLIPTextModel), tokenizer
    (CLIPTokenizer), scheduler (any diffusers scheduler)."""

    def __init__(self, unet, text_encoder, tokenizer, scheduler):
        super().__init__()
        self.register_modules(unet=unet, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler)

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str]) -> torch.Tensor:
        """(B, T, D) hidden states of the text encoder, padded to the tokenizer's maximum length."""
        ids = self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids.to(self.device)
        return self.text_encoder(ids).last_hidden_state

    @torch.no_grad()
    def __call__(self, prompt: str | list[str], height: int | None = None, width: int | None = None,
                 num_inference_steps: int = 25, guidance_scale: float = 4.0,
                 generator: torch.Generator | None = None, num_images_per_prompt: int = 1,
                 output_type: str = "pil", attention_store=None, show_progress: bool = True) -> PipelineOutput:
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not prompts or any(not isinstance(p, str) for p in prompts):
            raise ValueError("prompt must be a string or a non-empty list of strings")
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        if num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt must be >= 1, got {num_images_per_prompt}")
        if output_type not in ("pil", "np", "pt"):
            raise ValueError(f"output_type must be 'pil', 'np' or 'pt', got {output_type!r}")
        size = self.unet.config.sample_size
        height, width = height or size, width or size
        prompts = [p for p in prompts for _ in range(num_images_per_prompt)]
        B = len(prompts)
        guided = guidance_scale > 1.0

        context = self.encode_prompt(prompts)  # (B, T, D)
        if guided:
            context = torch.cat([self.encode_prompt([""] * B), context])  # (2B, T, D): [uncond, cond]

        channels = self.unet.config.in_channels
        x = torch.randn((B, channels, height, width), generator=generator, dtype=context.dtype,
                        device="cpu" if generator is None else generator.device).to(self.device)
        self.scheduler.set_timesteps(num_inference_steps, device=self.device)
        x = x * self.scheduler.init_noise_sigma
        for t in self.progress_bar(self.scheduler.timesteps) if show_progress else self.scheduler.timesteps:
            model_in = torch.cat([x, x]) if guided else x
            model_in = self.scheduler.scale_model_input(model_in, t)
            pred = self.unet(model_in, t, encoder_hidden_states=context)  # noise or v, as the scheduler says
            pred = pred.sample if hasattr(pred, "sample") else pred
            if guided:
                pred_uncond, pred_cond = pred.chunk(2)
                pred = pred_uncond + guidance_scale * (pred_cond - pred_uncond)
            x = self.scheduler.step(pred, t, x, generator=generator).prev_sample

        images = (x / 2 + 0.5).clamp(0, 1)  # (B, C, H, W) in [0, 1]
        if output_type == "pt":
            return PipelineOutput(images=images)
        array = images.permute(0, 2, 3, 1).float().cpu().numpy()
        if output_type == "np":
            return PipelineOutput(images=array)
        return PipelineOutput(images=[Image.fromarray((a * 255).round().astype(np.uint8)) for a in array])
