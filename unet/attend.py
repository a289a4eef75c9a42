"""The attention maps of an image you already have: take it as the model sees it, noise it to a timestep,
run the denoiser once with a store attached.

`record_noised` is the one noise-and-record step: `scripts/attend.py` runs it on a file, the evaluation
(`unet/eval/map_scoring.py: dataset_batch`) on dataset scenes, so both read the same maps from the same
image, timestep and seed.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import torch
from diffusers import DDPMScheduler
from PIL import Image, UnidentifiedImageError

from crossattn.errors import UsageError, shorten

from .data import to_model_range
from .pipeline import ScenePipeline, default_size

# Chosen by measurement (docs/model-card.md, the dataset read-out against the timestep): the shipped model's plain
# maps of dataset scenes at t = 100, 200, 300, 500 (outputs/examples/eval/report.json, "dataset_timestep_sweep").
# t = 100 points best (shape words: mIoU 0.209, pointing 0.728, against 0.209 / 0.662 at t = 300; colour words
# 0.150 / 0.595 against 0.160 / 0.503); the field's one-pass recipes (iSeg, DiffSegmenter) also read at t = 100.
ATTEND_TIMESTEP = 100


def read_image(path) -> tuple[Image.Image, list[str]]:
    """The file at `path` decoded whole as an RGB image, and notes on what was done to it.

    Grayscale and palette images are converted to RGB, 16-bit and float ones by their value range (PIL's own
    conversion would clip them to black and white); an alpha channel is composited on black (the scenes'
    background). Anything that is not a complete, readable image of a sane size raises UsageError.
    """
    notes = []
    try:
        with warnings.catch_warnings():
            # a header declaring more pixels than PIL decodes safely: refused before it is decoded
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(path)
        with image:
            image.load()  # decodes everything: a truncated file fails here, not later
            mode = image.mode
            if mode.startswith("I") or mode == "F":
                return high_depth_to_rgb(image), [f"{mode} image converted to 8-bit RGB by its value range"]
            if image.has_transparency_data:  # not `"A" in getbands()`: LAB's A is a colour axis, not alpha
                rgba = image.convert("RGBA")
                image = Image.alpha_composite(Image.new("RGBA", rgba.size, (0, 0, 0, 255)), rgba).convert("RGB")
                notes.append(f"{mode} image: alpha composited on black")
            elif mode != "RGB":
                image = image.convert("RGB")
                notes.append(f"{mode} image converted to RGB")
            else:
                image = image.copy()
            return image, notes
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        declared = re.search(r"\((\d+) pixels\)", str(e))
        count = f"{int(declared[1]):,}" if declared else "too many"
        raise UsageError(f"image {shorten(str(path))} declares {count} pixels, more than the "
                         f"{Image.MAX_IMAGE_PIXELS:,} PIL decodes safely: not an image this model can use") from e
    except FileNotFoundError as e:
        raise UsageError(f"image {shorten(str(path))} does not exist") from e
    except IsADirectoryError as e:
        raise UsageError(f"image {shorten(str(path))} is a folder, not an image file") from e
    except UnidentifiedImageError as e:
        raise UsageError(f"{shorten(str(path))} is not an image file PIL can read (PNG, JPEG, ...)") from e
    except (OSError, SyntaxError, ValueError) as e:  # truncated or corrupt data, unreadable file
        raise UsageError(f"image {shorten(str(path))} could not be read whole: {shorten(str(e), 120)}") from e


def high_depth_to_rgb(image: Image.Image) -> Image.Image:
    """A 16-bit ("I;16", "I") or float ("F") grayscale image as 8-bit RGB: 16-bit values scaled from 0..65535,
    float ones from 0..1 when they fit (the usual range of a float image: from 0..255 it would be all black),
    others from 0..255 when they fit, else from their own minimum..maximum. UsageError for inf or NaN pixels."""
    values = np.asarray(image, dtype=np.float64)
    if not np.isfinite(values).all():
        raise UsageError(f"{image.mode} image has {int((~np.isfinite(values)).sum())} pixels that are inf or NaN; "
                         "give finite values (0..1 or 0..255)")
    if image.mode.startswith("I;16") or (image.mode == "I" and values.max(initial=0) > 255):
        top, low = 65535.0, 0.0
    elif image.mode == "F" and values.min(initial=0) >= 0 and values.max(initial=0) <= 1:
        top, low = 1.0, 0.0
    elif values.min(initial=0) >= 0 and values.max(initial=0) <= 255:
        top, low = 255.0, 0.0
    else:
        low, top = float(values.min()), float(values.max())
    gray = np.round((values - low) / max(top - low, 1e-12) * 255).clip(0, 255).astype(np.uint8)
    return Image.fromarray(np.repeat(gray[..., None], 3, axis=2), "RGB")


def fit_image(image: Image.Image, size: tuple[int, int]) -> tuple[np.ndarray, list[str]]:
    """`image` as (H, W, 3) uint8 at `size` = (H, W), resized (bicubic) only if it is another size."""
    if (image.height, image.width) == tuple(size):
        return np.asarray(image, dtype=np.uint8).copy(), []
    note = f"resized from {image.width}x{image.height} to the model's {size[1]}x{size[0]}"
    resized = image.resize((size[1], size[0]), Image.Resampling.BICUBIC)
    return np.asarray(resized, dtype=np.uint8).copy(), [note]


def model_size(pipe) -> tuple[int, int]:
    """The (H, W) in pixels the model sees an image at: its own default size."""
    side = default_size(pipe)
    return side, side


def image_latents(pipe, images: np.ndarray) -> torch.Tensor:
    """(B, H, W, 3) uint8 -> what the denoiser works on, (B, C, h, w): our pixels in [-1, 1], or for a
    Stable Diffusion folder the VAE's latents (the posterior mean times the VAE's scaling factor)."""
    x = to_model_range(torch.from_numpy(np.ascontiguousarray(images)).permute(0, 3, 1, 2))  # (B, 3, H, W)
    if isinstance(pipe, ScenePipeline):
        return x.to(pipe.device)
    vae = pipe.vae
    with torch.no_grad():
        latents = vae.encode(x.to(vae.device, vae.dtype)).latent_dist.mean
    return latents * vae.config.scaling_factor


def prompt_context(pipe, prompts: list[str]) -> torch.Tensor:
    """(B, T, D): the text encoder's hidden states for `prompts`, as the pipeline feeds its U-Net."""
    if isinstance(pipe, ScenePipeline):
        return pipe.encode_prompt(prompts)
    with torch.no_grad():
        return pipe.encode_prompt(prompts, pipe.device, 1, False)[0]


def check_attend_model(pipe) -> None:
    """attend runs the U-Net once by itself; SDXL's U-Net also needs pooled text and size conditioning."""
    if getattr(pipe, "tokenizer_2", None) is not None:
        raise UsageError(f"{type(pipe).__name__} is not supported by attend (its U-Net needs SDXL's pooled text "
                         "and size conditioning); use our model or a Stable Diffusion 1.x/2.x folder")


def check_timestep(pipe, timestep: int, flag: str = "--timestep") -> None:
    top = pipe.scheduler.config.num_train_timesteps - 1
    if not 0 <= timestep <= top:
        raise UsageError(f"{flag} must be a training timestep from 0 to {top}, got {timestep}")


@torch.no_grad()
def record_noised(pipe, x0: torch.Tensor, prompts: list[str], timestep: int, seeds: list[int], store):
    """Noise each clean `x0` (B, C, h, w) to `timestep` with its own seed's noise (the model's own DDPM
    schedule), run the denoiser once on the batch with `store` attached, and return the store.

    Image i's noise depends only on seeds[i], so an image gives the same maps alone or in a batch."""
    if len(seeds) != x0.shape[0] or len(prompts) != x0.shape[0]:
        raise ValueError(f"need one prompt and one seed per image: {x0.shape[0]} images, {len(prompts)} prompts, "
                         f"{len(seeds)} seeds")
    noise = torch.cat([torch.randn((1, *x0.shape[1:]), generator=torch.Generator().manual_seed(s)) for s in seeds])
    schedule = DDPMScheduler.from_config(pipe.scheduler.config)  # how the model was trained to see noise
    t = torch.full((x0.shape[0],), int(timestep))
    noisy = schedule.add_noise(x0.cpu().float(), noise, t)  # (B, C, h, w)
    dtype = next(pipe.unet.parameters()).dtype
    with store.attach(pipe.unet):
        pipe.unet(noisy.to(pipe.device, dtype), t.to(pipe.device), encoder_hidden_states=prompt_context(pipe, prompts))
    return store
