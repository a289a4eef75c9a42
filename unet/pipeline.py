"""Text-to-image sampling: a diffusers `DiffusionPipeline` around our U-Net and a CLIP text encoder.

The denoising loop is plain code: encode the prompt (and the empty prompt for classifier-free
guidance), then for each scheduler timestep predict the noise and step.
"""

from __future__ import annotations

import contextlib
import json
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers import DDIMScheduler, DDPMScheduler, DiffusionPipeline, DPMSolverMultistepScheduler
from diffusers.utils import BaseOutput
from PIL import Image

from crossattn.errors import UsageError, shorten  # noqa: F401 -- UsageError: old imports
from crossattn.overlay import to_uint8

from .checkpoint import check_finite
from .data import SHAPES as SHAPES_32
from .signals import raise_swallowed
from .world import PLURALS
from .world import SHAPES as SHAPES_64

SD_GUIDANCE = 7.5  # diffusers' Stable Diffusion pipelines' default scale


def default_guidance(pipe) -> float:
    """The guidance scale `pipe` should be sampled with when the user gives none: a ScenePipeline's own,
    saved in its model_index.json (docs/model-card.md); 7.5 for a Stable Diffusion folder."""
    if isinstance(pipe, ScenePipeline):
        return float(pipe.config.guidance_scale)
    return SD_GUIDANCE


def size_multiple(pipe) -> int:
    """Height and width must be multiples of this: our U-Net halves the image at every level but the
    last; a Stable Diffusion pipeline works on latents `vae_scale_factor` times smaller."""
    if not isinstance(pipe, ScenePipeline):
        return int(getattr(pipe, "vae_scale_factor", 8))
    config = pipe.unet.config
    return 2 ** (len(getattr(config, "channels", None) or config.block_out_channels) - 1)


def default_size(pipe) -> int:
    """The image side the model was made for, in pixels."""
    return pipe.unet.config.sample_size * (1 if isinstance(pipe, ScenePipeline) else size_multiple(pipe))


# torch.Generator.manual_seed and numpy's SeedSequence both take any 64-bit seed.
MAX_SEED = 2 ** 64 - 1


def check_seed(seed: int, flag: str = "--seed", top: int = MAX_SEED) -> None:
    """Raise UsageError unless 0 <= seed <= top; the message names the flag and the range."""
    if not 0 <= seed <= top:
        bits = top.bit_length()
        raise UsageError(f"{flag} must be an integer from 0 to 2**{bits} - 1, got {shorten(str(seed))}")


@dataclass
class Settings:
    """One sampling run, as the commands pass it around: `num_images` images from one seed."""
    seed: int = 0
    steps: int = 25
    guidance: float | None = None  # None: the model's own default (model_index.json)
    num_images: int = 1
    height: int | None = None
    width: int | None = None
    normalize: str = "raw"
    scheduler: str = "ddim"
    self_attention: bool = False
    truncate: bool = False
SCHEDULERS = {"ddim": DDIMScheduler, "dpm": DPMSolverMultistepScheduler, "ddpm": DDPMScheduler}
SHIPPED = Path(__file__).parent / "pretrained"  # the pipelines that ship inside the package, one folder each
PRETRAINED = SHIPPED / "scenes-32"  # the default model
TRAINED_WORDS = "trained_words.json"
# The synthetic worlds a model of this project is trained in (`TrainConfig.data.world`): scenes-32 (unet/data.py) and
# scenes-64 (unet/world.py, unet/scenes64.py). A pipeline folder's train_config.json names its world; one without a
# name in it was trained before scenes-64 existed, in scenes-32.
WORLDS = ("scenes-32", "scenes-64")
# the words that name a shape in each world's prompts, the singular and (scenes-64 counts) the plural: the subjects
# `--excite` takes by default and the word `explain` follows
SHAPE_WORDS = {"scenes-32": SHAPES_32, "scenes-64": (*SHAPES_64, *PLURALS.values())}


def shape_words(pipe) -> tuple[str, ...]:
    """The shape words of `pipe`'s world (`SHAPE_WORDS`); scenes-32's for a pipeline of no world of ours (a Stable
    Diffusion folder), as before worlds had names."""
    return SHAPE_WORDS[getattr(pipe, "world", None) or "scenes-32"]


def shipped_models() -> list[str]:
    """The names `--model` takes for the shipped pipelines: the folders in unet/pretrained/."""
    return sorted(p.name for p in SHIPPED.iterdir() if (p / "model_index.json").is_file())


def model_folder(model: str | Path | None) -> Path:
    """The folder of `--model`: None is the default model; a shipped model's name ("scenes-32") is its folder in
    unet/pretrained/; anything else is a path. A folder that exists wins over a name, so `--model scenes-32` in a
    directory holding a scenes-32 folder means that folder, as it did before names."""
    if model is None:
        return PRETRAINED
    if not Path(model).exists() and str(model) in shipped_models():
        return SHIPPED / str(model)
    return Path(model)


def missing_model(model: str | Path) -> str:
    """The one line for a `--model` that is neither a folder nor a shipped model's name."""
    return (f"model folder {model} does not exist; the shipped models are {', '.join(shipped_models())} (by name: "
            f"--model NAME), or give the path of a pipeline folder")


def model_label(model: str | Path | None) -> str:
    """What a report calls the model it measured: the folder given, or a shipped one and where it lives (the
    shipped model changes when a better one ships: with the report's date, the path says which it was)."""
    folder = model_folder(model)
    if folder.parent != SHIPPED:
        return str(model)
    return f"shipped {folder.name} ({folder.relative_to(SHIPPED.parents[1])})"


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


def check_device(device: str | None) -> None:
    """Raise UsageError unless `device` (e.g. 'cpu', 'cuda:1', 'mps') names a device this machine has."""
    if device is None:
        return
    try:
        torch.empty(1, device=torch.device(device))
    except Exception as e:  # torch raises RuntimeError, AssertionError or ValueError by backend
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UsageError(f"device {shorten(repr(device))} is not usable here ({reason}); "
                         "e.g. cpu, cuda, cuda:1, mps") from e


@contextlib.contextmanager
def progress_bars(show: bool):
    """Hide diffusers' and transformers' loading bars unless `show`; restore their setting after."""
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging
    libraries = [lib for lib in (diffusers_logging, transformers_logging) if lib.is_progress_bar_enabled()]
    for lib in libraries if not show else []:
        lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib in libraries if not show else []:
            lib.enable_progress_bar()


def _read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path} is not a readable JSON file ({what}): {type(e).__name__}: {e}") from e


def load_pipeline(model: str | Path | None = None, scheduler: str = "ddim", device: str | None = None,
                  show_progress: bool = True):
    """Our pipeline folder (default: the shipped model) or a Stable Diffusion folder, offline, safetensors only.

    Every problem with the folder or the device raises UsageError with a one-line reason.
    """
    if model is not None and not str(model).strip():
        raise UsageError("the model folder is empty (''); give a pipeline folder, or leave it out for the "
                         "shipped model")
    folder = model_folder(model)
    index = folder / "model_index.json"
    if not folder.exists():
        raise UsageError(missing_model(model))
    if not folder.is_dir():
        raise UsageError(f"model {folder} is a file, not a pipeline folder")
    if not index.is_file():
        raise UsageError(f"{folder} is not a pipeline folder: it has no model_index.json file")
    pickled = [p.name for p in folder.rglob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl")]
    if not any(folder.rglob("*.safetensors")):
        raise UsageError(f"{folder} has no .safetensors weights{f' (found {pickled})' if pickled else ''}; "
                         "only safetensors checkpoints are loaded, never pickles")
    config = _read_json(index, "the pipeline's components")
    if not isinstance(config, dict) or not isinstance(config.get("_class_name"), str):
        raise UsageError(f"{index} must be a JSON object with a \"_class_name\", got {shorten(repr(config))}")
    trained_words = None
    if (folder / TRAINED_WORDS).exists():
        trained_words = _read_json(folder / TRAINED_WORDS, "the words the model was trained on")
        if not isinstance(trained_words, list) or not all(isinstance(w, str) for w in trained_words):
            raise UsageError(f"{folder / TRAINED_WORDS} must be a JSON list of words, "
                             f"got {shorten(repr(trained_words))}")
        trained_words = set(trained_words)
    world = pipeline_world(folder) if config["_class_name"] == "ScenePipeline" else None  # Stable Diffusion: none
    check_device(device)
    try:
        with warnings.catch_warnings(), progress_bars(show_progress):
            warnings.simplefilter("ignore")
            if config["_class_name"] == "ScenePipeline":
                pipe = ScenePipeline.from_pretrained(folder, local_files_only=True, use_safetensors=True)
            else:
                pipe = DiffusionPipeline.from_pretrained(folder, local_files_only=True, use_safetensors=True,
                                                         safety_checker=None, feature_extractor=None,
                                                         requires_safety_checker=False)
        if device:
            pipe.to(device)
    except Exception as e:  # diffusers raises many types; the user needs the message, not the trace
        raise_swallowed()  # diffusers turns Ctrl-C or SIGTERM inside a weight load into "Unable to load weights"
        reason = shorten(" ".join(str(e).split()), 300)
        raise UsageError(f"could not load the model in {folder}: {type(e).__name__}: {reason}") from e
    try:
        pipe.scheduler = make_scheduler(scheduler, pipe.scheduler.config)
    except ValueError as e:
        raise UsageError(str(e)) from e
    # diffusers loads a weights file that lacks a tensor with a warning, leaving that tensor on the meta device,
    # where the first use fails deep inside
    missing = [f"{name}.{key}" for name, part in pipe.components.items() if isinstance(part, torch.nn.Module)
               for key, value in part.state_dict().items() if value.is_meta]
    if missing:
        raise UsageError(f"the model in {folder} lacks {len(missing)} weight tensor(s) "
                         f"({shorten(', '.join(missing))}): its weights are incomplete or belong to another model")
    try:  # damaged weights would sample NaN, which becomes an all-black image without a word
        check_finite({f"{name}.{key}": value for name, part in pipe.components.items()
                      if isinstance(part, torch.nn.Module) for key, value in part.state_dict().items()},
                     f"the model in {folder}")
    except ValueError as e:
        raise UsageError(str(e)) from e
    pipe.trained_words = trained_words
    pipe.world = world
    return pipe


def pipeline_world(folder: Path) -> str:
    """The world (`WORLDS`) the pipeline in `folder` was trained in, as its train_config.json names it; scenes-32 for
    a folder without one, or with a config from before worlds had names."""
    path = folder / "train_config.json"
    if not path.is_file():
        return "scenes-32"
    config = _read_json(path, "the settings the model was trained with")
    world = config.get("world", "scenes-32") if isinstance(config, dict) else None
    if world not in WORLDS:
        raise UsageError(f"{path} names the world {shorten(repr(world))}; this code knows "
                         f"{', '.join(WORLDS)}")
    return world


@dataclass
class PipelineOutput(BaseOutput):
    images: list | np.ndarray | torch.Tensor


class ScenePipeline(DiffusionPipeline):
    """unet (ours or diffusers' UNet2DConditionModel), text_encoder (CLIPTextModel), tokenizer
    (CLIPTokenizer), scheduler (any diffusers scheduler)."""

    def __init__(self, unet, text_encoder, tokenizer, scheduler, guidance_scale: float = 1.0,
                 guidance_min_t: int = 0, guidance_rescale: float = 0.0, guidance_max_t: int | None = None):
        super().__init__()
        self.register_modules(unet=unet, text_encoder=text_encoder, tokenizer=tokenizer, scheduler=scheduler)
        # How this model wants to be guided, saved with it (model_index.json). guidance_scale is the default
        # scale: 1 = no guidance, which our models trained from scratch sample best with
        # (docs/experiments/guidance.md, docs/experiments/longer-training-colour-collapse.md).
        # Guidance is applied only while guidance_min_t <= t <= guidance_max_t (None: no upper limit):
        # guiding the low-noise steps adds grain, and on our model guiding the high-noise steps, where the
        # prompt barely moves the prediction, breaks colours ("Applying guidance in a limited interval",
        # Kynkaanniemi et al. 2024). guidance_rescale: pull the guided prediction's std back toward the
        # conditional one's, which keeps colours from saturating at zero terminal SNR (Lin et al. 2024, 3.4).
        # A folder saved before guidance_max_t existed loads with None, i.e. as it was sampled then.
        self.register_to_config(guidance_scale=guidance_scale, guidance_min_t=guidance_min_t,
                                guidance_rescale=guidance_rescale, guidance_max_t=guidance_max_t)

    @torch.no_grad()
    def encode_prompt(self, prompts: list[str], attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """(B, T, D) hidden states of the text encoder, padded to the tokenizer's maximum length. `attention_mask`:
        a prepared (B, 1, T, T) additive mask for the encoder's self-attention (None: the causal mask it trained
        with), for diagnostics that keep some words from reading others."""
        ids = self.tokenizer(prompts, padding="max_length", max_length=self.tokenizer.model_max_length,
                             truncation=True, return_tensors="pt").input_ids.to(self.device)
        if attention_mask is None:  # ablation text sides (unet/research/text_variants.py) take the ids alone
            return self.text_encoder(ids).last_hidden_state
        mask = attention_mask.to(self.device, self.text_encoder.dtype)  # (B, 1, T, T), added to the scores
        return self.text_encoder(ids, attention_mask=mask).last_hidden_state

    def check_inputs(self, prompt, num_inference_steps: int, num_images_per_prompt: int, output_type: str) -> list[str]:
        """The prompts as a list; ValueError naming the first bad argument (as diffusers' `check_inputs`)."""
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        if not prompts or any(not isinstance(p, str) for p in prompts):
            raise ValueError("prompt must be a string or a non-empty list of strings")
        if num_inference_steps < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        if num_images_per_prompt < 1:
            raise ValueError(f"num_images_per_prompt must be >= 1, got {num_images_per_prompt}")
        if output_type not in ("pil", "np", "pt"):
            raise ValueError(f"output_type must be 'pil', 'np' or 'pt', got {output_type!r}")
        return prompts

    @torch.no_grad()
    def __call__(self, prompt: str | list[str], height: int | None = None, width: int | None = None,
                 num_inference_steps: int = 25, guidance_scale: float | None = None,
                 generator: torch.Generator | None = None, num_images_per_prompt: int = 1,
                 output_type: str = "pil", show_progress: bool = True,
                 controller=None, guidance_min_t: int | None = None,
                 guidance_rescale: float | None = None, guidance_max_t: int | None = None,
                 latents: torch.Tensor | None = None) -> PipelineOutput:
        """Sample images of `prompt`.

        Args:
            prompt: one prompt, or a list of prompts (one batch).
            height, width: image size in pixels (default: the U-Net's `sample_size`).
            num_inference_steps: denoising steps; the scheduler spaces them over its training timesteps.
            guidance_scale: classifier-free guidance; <= 1 turns it off (default: the pipeline's config).
            generator: the torch generator of the initial noise and of any stochastic scheduler step; the same
                seed, prompt and device give the same images.
            num_images_per_prompt: images per prompt.
            output_type: "pil" (PIL images), "np" ((B, H, W, 3) floats in [0, 1]) or "pt" ((B, 3, H, W) tensor).
            show_progress: a progress bar over the steps.
            controller: a `crossattn.control.Controller` (optional), called before and after each scheduler step;
                it may return a changed latent. Without one the loop is unchanged.
            guidance_min_t, guidance_max_t: guide only at timesteps in [min_t, max_t] (default: the config's).
            guidance_rescale: 0 (plain guidance) to 1 (the guided prediction's std pulled back to the
                conditional one's) (default: the config's).
            latents: the initial noise, (B, C, H, W) for the B images of the batch, instead of drawing it from
                `generator` (as diffusers' `latents`): the same noise under other prompts, row by row.

        Returns:
            `PipelineOutput` with `images`.
        """
        # 1. check inputs, and fill in what the pipeline's config decides
        prompts = self.check_inputs(prompt, num_inference_steps, num_images_per_prompt, output_type)
        size = self.unet.config.sample_size
        height, width = height or size, width or size
        prompts = [p for p in prompts for _ in range(num_images_per_prompt)]
        B = len(prompts)
        if guidance_scale is None:
            guidance_scale = default_guidance(self)
        guided = guidance_scale > 1.0
        if guidance_min_t is None:
            guidance_min_t = self.config.get("guidance_min_t", 0)
        if guidance_rescale is None:
            guidance_rescale = self.config.get("guidance_rescale", 0.0)
        if guidance_max_t is None:
            guidance_max_t = self.config.get("guidance_max_t")

        # 2. encode the prompts (and the empty prompt, for guidance)
        context = self.encode_prompt(prompts)  # (B, T, D)
        if guided:
            context = torch.cat([self.encode_prompt([""] * B), context])  # (2B, T, D): [uncond, cond]

        # 3. timesteps and the initial noise
        channels = self.unet.config.in_channels
        shape = (B, channels, height, width)
        if latents is None:
            x = torch.randn(shape, generator=generator, dtype=context.dtype,
                            device="cpu" if generator is None else generator.device).to(self.device)
        elif tuple(latents.shape) != shape:
            raise ValueError(f"latents must have the shape (images, channels, height, width) = {shape}, got "
                             f"{tuple(latents.shape)}")
        else:
            x = latents.to(device=self.device, dtype=context.dtype)
        self.scheduler.set_timesteps(num_inference_steps, device=self.device)
        x = x * self.scheduler.init_noise_sigma

        # 4. the denoising loop
        for t in self.progress_bar(self.scheduler.timesteps) if show_progress else self.scheduler.timesteps:
            if controller is not None:
                x = controller.before_step(self, t, x, context)  # e.g. attend-and-excite moves x
            guide_now = guided and guidance_min_t <= int(t) and (guidance_max_t is None or int(t) <= guidance_max_t)
            model_in = torch.cat([x, x]) if guide_now else x
            model_in = self.scheduler.scale_model_input(model_in, t)
            step_context = context if guide_now or not guided else context[B:]  # (B or 2B, T, D)
            pred = self.unet(model_in, t, encoder_hidden_states=step_context)  # noise or v, as the scheduler says
            pred = pred.sample if hasattr(pred, "sample") else pred
            if guide_now:
                pred_uncond, pred_cond = pred.chunk(2)
                pred = pred_uncond + guidance_scale * (pred_cond - pred_uncond)
                if guidance_rescale > 0:
                    std_cond = pred_cond.std(dim=(1, 2, 3), keepdim=True)  # (B, 1, 1, 1)
                    rescaled = pred * std_cond / pred.std(dim=(1, 2, 3), keepdim=True)
                    pred = guidance_rescale * rescaled + (1 - guidance_rescale) * pred
            x = self.scheduler.step(pred, t, x, generator=generator).prev_sample
            if controller is not None:
                x = controller.after_step(self, t, x)  # e.g. prompt-to-prompt's local blend

        # 5. decode: pixel space, so only from [-1, 1] to the output type
        images = (x / 2 + 0.5).clamp(0, 1)  # (B, C, H, W) in [0, 1]
        if output_type == "pt":
            return PipelineOutput(images=images)
        array = images.permute(0, 2, 3, 1).float().cpu().numpy()
        if output_type == "np":
            return PipelineOutput(images=array)
        return PipelineOutput(images=[Image.fromarray(to_uint8(a)) for a in array])
