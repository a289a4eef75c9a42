"""Generate images from prompts and save, for every word, where the image attended to it.

    python scripts/generate.py "a red circle left of a blue square" --seed 0

Writes one new folder per prompt under --out: image PNGs (prompt and seed in text chunks),
overlay.png, words/<i>_<word>.png, maps.safetensors and meta.json. Works with the shipped model
(default), any folder this project's training wrote, or a Stable Diffusion folder on disk.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, PngImagePlugin
from safetensors.torch import save_file

from crossattn.capture import AttentionStore
from crossattn.maps import NORMALIZATIONS, merge_words, token_maps
from crossattn.overlay import overlay_grid, word_overlay
from crossattn.text import dropped_words, prompt_words

from .pipeline import PRETRAINED, ScenePipeline, make_scheduler

TRAINED_WORDS = "trained_words.json"


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit code 2."""


def load_pipeline(model: str | Path | None = None, scheduler: str = "ddim", device: str | None = None):
    """Our pipeline folder (default: the shipped model) or a Stable Diffusion folder, offline, safetensors only."""
    folder = Path(model) if model else PRETRAINED
    index = folder / "model_index.json"
    if not folder.is_dir():
        raise UsageError(f"model folder {folder} does not exist")
    if not index.exists():
        raise UsageError(f"{folder} is not a pipeline folder: it has no model_index.json")
    pickled = [p.name for p in folder.rglob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl")]
    if not any(folder.rglob("*.safetensors")):
        raise UsageError(f"{folder} has no .safetensors weights{f' (found {pickled})' if pickled else ''}; "
                         "only safetensors checkpoints are loaded, never pickles")
    try:
        class_name = json.loads(index.read_text()).get("_class_name")
    except json.JSONDecodeError as e:
        raise UsageError(f"{index} is not valid JSON: {e}") from e
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if class_name == "ScenePipeline":
                pipe = ScenePipeline.from_pretrained(folder, local_files_only=True, use_safetensors=True)
            else:
                from diffusers import DiffusionPipeline
                pipe = DiffusionPipeline.from_pretrained(folder, local_files_only=True, use_safetensors=True,
                                                         safety_checker=None, feature_extractor=None,
                                                         requires_safety_checker=False)
    except Exception as e:  # diffusers raises many types; the user needs the message, not the trace
        raise UsageError(f"could not load the model in {folder}: {type(e).__name__}: {e}") from e
    pipe.scheduler = make_scheduler(scheduler, pipe.scheduler.config)
    if device:
        pipe.to(device)
    pipe.trained_words = (set(json.loads((folder / TRAINED_WORDS).read_text()))
                          if (folder / TRAINED_WORDS).exists() else None)
    return pipe


@dataclass
class Settings:
    seed: int = 0
    steps: int = 25
    guidance: float = 4.0
    num_images: int = 1
    height: int | None = None
    width: int | None = None
    normalize: str = "raw"
    scheduler: str = "ddim"
    self_attention: bool = False
    truncate: bool = False


def unseen_words(pipe, words: list[str]) -> list[str]:
    """The words no training caption used ([] when the model does not say what it was trained on)."""
    if pipe.trained_words is None:
        return []
    return [w for w in words if re.sub(r"\W", "", w.lower()) not in pipe.trained_words]


def check_prompt(pipe, prompt: str, settings: Settings, words: list[str] | None) -> list[str]:
    """Validate one prompt; returns warnings. Raises UsageError naming the problem."""
    if not prompt.strip():
        raise UsageError("empty prompt: give some words, e.g. \"a red circle\"")
    cut = dropped_words(pipe.tokenizer, prompt)
    if cut and not settings.truncate:
        raise UsageError(f"prompt is longer than the tokenizer's {pipe.tokenizer.model_max_length} tokens; these "
                         f"words would be dropped: {' '.join(cut)} (shorten it, or pass --truncate to accept)")
    prompt_list = [w.text for w in prompt_words(pipe.tokenizer, prompt)]
    missing = [w for w in words or [] if w not in prompt_list]
    if missing:
        raise UsageError(f"--words {missing} not in the prompt; its words are: {prompt_list}")
    notes = []
    unseen = unseen_words(pipe, prompt_list)
    if unseen:
        notes.append(f"the model never saw these words in training: {unseen}; their maps show what an "
                     "untrained embedding attracts")
    return notes


def _slug(prompt: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:60] or "prompt"


def _new_folder(out: Path, name: str, overwrite: bool) -> Path:
    target = out / name
    if overwrite or not target.exists():
        return target
    k = 2
    while (out / f"{name}-{k}").exists():
        k += 1
    return out / f"{name}-{k}"


def _versions() -> dict:
    from importlib.metadata import version
    return {"python": platform.python_version(), "torch": torch.__version__, "diffusers": version("diffusers"),
            "transformers": version("transformers"), "crossattn": version("crossattn"), "machine": platform.machine()}


def generate_one(pipe, prompt: str, settings: Settings, out_dir: Path, model_name: str,
                 words_filter: list[str] | None = None, overwrite: bool = False, show_progress: bool = True) -> Path:
    """Generate `settings.num_images` images for `prompt` and write its folder; returns the folder."""
    timings = {}
    words = prompt_words(pipe.tokenizer, prompt)
    generator = torch.Generator(device="cpu").manual_seed(settings.seed)
    store = AttentionStore(self_attention=settings.self_attention,
                           num_train_timesteps=pipe.scheduler.config.num_train_timesteps)
    t0 = time.perf_counter()
    with store.attach(pipe.unet):  # the store tells the guided halves apart by itself
        kwargs = dict(num_inference_steps=settings.steps, guidance_scale=settings.guidance, generator=generator,
                      num_images_per_prompt=settings.num_images, height=settings.height, width=settings.width,
                      output_type="np")
        if isinstance(pipe, ScenePipeline):
            images = pipe(prompt, attention_store=store, show_progress=show_progress, **kwargs).images
        else:
            pipe.set_progress_bar_config(disable=not show_progress)
            images = pipe(prompt, **kwargs).images
    timings["sampling_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    images = (np.asarray(images) * 255).round().astype(np.uint8)  # (N, H, W, 3)
    size = images.shape[1:3]
    tokens = token_maps(store, size)  # (N, T, H, W)
    maps = torch.stack([merge_words(t, words, settings.normalize) for t in tokens])  # (N, words, H, W)
    tensors = {f"{w.index}_{w.text}": maps[:, w.index].contiguous() for w in words}
    for layer in sorted(store.layers):
        if not store.is_cross[layer]:
            continue
        per_layer = token_maps(store, size, layers=[layer])
        for w in words:
            tensors[f"layer/{layer}/{w.index}_{w.text}"] = torch.stack(
                [merge_words(t, [w], settings.normalize)[0] for t in per_layer]).contiguous()
    timings["maps_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    final = _new_folder(out_dir, f"{_slug(prompt)}-s{settings.seed}", overwrite)
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=out_dir))  # renamed into place only when complete
    try:
        names = []
        for k, image in enumerate(images):
            info = PngImagePlugin.PngInfo()
            info.add_text("prompt", prompt)
            info.add_text("seed", str(settings.seed))
            info.add_text("index", str(k))
            names.append(f"image_{k}.png")
            Image.fromarray(image).save(tmp / names[-1], pnginfo=info)
        shown = [w for w in words if words_filter is None or w.text in words_filter]
        vmax = float(maps[0, [w.index for w in shown]].max()) if shown else None
        for k, image in enumerate(images):
            overlay_grid(image, maps[k, [w.index for w in shown]], [w.text for w in shown],
                         tmp / ("overlay.png" if k == 0 else f"overlay_{k}.png"), title=prompt, vmax=vmax)
        (tmp / "words").mkdir()
        for w in shown:
            word_overlay(images[0], maps[0, w.index], w.text, tmp / "words" / f"{w.index}_{_slug(w.text)}.png",
                         vmax=vmax)
        save_file(tensors, str(tmp / "maps.safetensors"), metadata={"prompt": prompt, "normalize": settings.normalize})
        timings["write_s"] = time.perf_counter() - t0
        meta = {
            "prompt": prompt, "words": [asdict(w) for w in words], "shown_words": [w.text for w in shown],
            "seed": settings.seed, "steps": settings.steps, "guidance": settings.guidance,
            "scheduler": type(pipe.scheduler).__name__, "num_images": len(images), "height": int(size[0]),
            "width": int(size[1]), "normalize": settings.normalize, "model": model_name, "images": names,
            "layers": {name: list(store.layer_shapes[name]) for name in store.layers},
            "timings": {k: round(v, 3) for k, v in timings.items()}, "versions": _versions(),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        if final.exists():  # --overwrite
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="generate.py",
        description="Generate images from prompts and save each word's cross-attention map over the image.",
        epilog="Each prompt gets a new folder under --out with image_*.png, overlay.png, words/, "
               "maps.safetensors and meta.json. Existing folders are never overwritten unless --overwrite.")
    p.add_argument("prompts", nargs="+", help="one or more prompts, each in quotes")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed, prompt, device: same image and maps)")
    p.add_argument("--steps", type=int, default=25, help="denoising steps (default 25)")
    p.add_argument("--guidance", type=float, default=4.0, help="classifier-free guidance scale; <=1 turns it off")
    p.add_argument("--num-images", type=int, default=1, help="images per prompt (default 1)")
    p.add_argument("--height", type=int, default=None, help="image height (default: the model's size)")
    p.add_argument("--width", type=int, default=None, help="image width (default: the model's size)")
    p.add_argument("--words", nargs="+", default=None, help="only these words in the overlays (default: all)")
    p.add_argument("--model", default=None, help="pipeline folder: ours or a Stable Diffusion folder "
                                                 "(default: the shipped model)")
    p.add_argument("--scheduler", default="ddim", choices=["ddim", "dpm", "ddpm"], help="sampler (default ddim)")
    p.add_argument("--normalize", default="raw", choices=NORMALIZATIONS, help="map normalisation (default raw: "
                   "each pixel's share of attention on the word)")
    p.add_argument("--out", default="outputs", help="parent folder for the results (default outputs/)")
    p.add_argument("--device", default=None, help="torch device, e.g. cuda (default: cpu)")
    p.add_argument("--self-attention", action="store_true", help="also record self-attention (more memory)")
    p.add_argument("--truncate", action="store_true", help="accept prompts longer than the tokenizer allows")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder of the same name")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = Settings(args.seed, args.steps, args.guidance, args.num_images, args.height, args.width,
                        args.normalize, args.scheduler, args.self_attention, args.truncate)
    try:
        if settings.steps < 1:
            raise UsageError(f"--steps must be a positive integer, got {settings.steps}")
        if settings.num_images < 1:
            raise UsageError(f"--num-images must be a positive integer, got {settings.num_images}")
        pipe = load_pipeline(args.model, args.scheduler, args.device)
        notes = [n for prompt in args.prompts for n in check_prompt(pipe, prompt, settings, args.words)]
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"warning: {note}", file=sys.stderr)
    model_name = str(args.model or "shipped:" + PRETRAINED.name)
    for prompt in args.prompts:
        folder = generate_one(pipe, prompt, settings, Path(args.out), model_name, args.words, args.overwrite,
                              show_progress=not args.quiet)
        print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
