"""Generate images from prompts and save, for every word, where the image attended to it.

    python scripts/generate.py "a red circle left of a blue square" --seed 0

Writes one new folder per prompt under --out: image PNGs (prompt and seed in text chunks),
overlay.png, words/<i>_<word>.png, maps.safetensors and meta.json. Works with the shipped model
(default), any folder this project's training wrote, or a Stable Diffusion folder on disk.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from crossattn.maps import (
    DEFAULT_MAP_KIND,
    DEFAULT_REFINEMENT,
    MAP_KINDS,
    NORMALIZATIONS,
    fitted_refinement,
)
from crossattn.overlay import to_uint8
from crossattn.text import prompt_words

from ..control import control_one
from ..folders import WRITE_ERRORS, write_failed
from ..pipeline import PRETRAINED, SCHEDULERS, ScenePipeline, Settings, default_guidance, load_pipeline
from ..run_folder import map_store, run_maps, run_name, write_run_files
from . import (
    UsageError,
    add_model_argument,
    check_model_settings,
    check_out_dir,
    check_prompt,
    check_settings,
    interrupted,
    partial_folder,
    publish,
    sigterm_as_interrupt,
    usage_error,
)
from .control import add_control_args, plan_control
from .memory import MEMORY_ERRORS, out_of_memory


def generate_one(pipe, prompt: str, settings: Settings, out_dir: Path, model_name: str,
                 words_filter: list[str] | None = None, overwrite: bool = False, show_progress: bool = True,
                 maps: str = DEFAULT_MAP_KIND) -> Path:
    """Generate `settings.num_images` images for `prompt` and write its folder; returns the folder.
    `maps`: the map kind the overlays and maps.safetensors hold (`crossattn.maps.MAP_KINDS`)."""
    check_settings(settings)
    if maps not in MAP_KINDS:
        raise UsageError(f"--maps must be one of {', '.join(MAP_KINDS)}, got {maps!r:.60}")
    if settings.guidance is None:
        settings = dataclasses.replace(settings, guidance=default_guidance(pipe))
    check_model_settings(pipe, settings)
    timings = {}
    words = prompt_words(pipe.tokenizer, prompt)
    generator = torch.Generator(device="cpu").manual_seed(settings.seed)
    pipe.scheduler.set_timesteps(settings.steps)  # the steps this run will see (the pipeline sets them again)
    refinement = fitted_refinement(DEFAULT_REFINEMENT, pipe.scheduler.timesteps)
    store = map_store(pipe, maps, settings.self_attention, refinement)
    t0 = time.perf_counter()
    with store.attach(pipe.unet):  # the store tells the guided halves apart by itself
        kwargs = dict(num_inference_steps=settings.steps, guidance_scale=settings.guidance, generator=generator,
                      num_images_per_prompt=settings.num_images, height=settings.height, width=settings.width,
                      output_type="np")
        if isinstance(pipe, ScenePipeline):
            images = pipe(prompt, show_progress=show_progress, **kwargs).images
        else:
            pipe.set_progress_bar_config(disable=not show_progress)
            images = pipe(prompt, **kwargs).images
    timings["sampling_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    images = to_uint8(images)  # (N, H, W, 3)
    size = images.shape[1:3]
    try:
        word_tensor, tensors, kinds = run_maps(pipe, store, words, size, maps, settings.normalize, refinement)
    except ValueError as e:  # e.g. refined maps of an image too small to have self-attention to refine with
        raise UsageError(f"--maps {maps}: {e}") from e
    timings["maps_s"] = time.perf_counter() - t0

    with partial_folder(out_dir) as tmp:  # renamed into place only when complete; removed on any error
        meta = {"prompt": prompt, "seed": settings.seed, "steps": settings.steps, "guidance": settings.guidance,
                "scheduler": type(pipe.scheduler).__name__, "normalize": settings.normalize, "maps": maps,
                **({"refinement": asdict(refinement)} if maps == "refined" else {}),
                "model": model_name, "timings": timings}
        write_run_files(tmp, images, word_tensor, tensors, words, words_filter, meta, store, kinds)
        # the folder is claimed only now, atomically: a run started beside this one gets "-2"
        return publish(tmp, out_dir / run_name(prompt, settings.seed), replace=overwrite)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="generate.py",
        description="Generate images from prompts and save each word's cross-attention map over the image.",
        epilog="Each prompt gets a new folder under --out with image_*.png, overlay.png, words/, "
               "maps.safetensors and meta.json. Existing folders are never overwritten unless --overwrite.")
    p.add_argument("prompts", nargs="+", help="one or more prompts, each in quotes")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed, prompt, device: same image and maps)")
    p.add_argument("--steps", type=int, default=25, help="denoising steps (default 25)")
    p.add_argument("--guidance", type=float, default=None,
                   help="classifier-free guidance scale; <=1 turns it off (default: the model's own: 1 for the "
                        "shipped model, which samples best unguided; 7.5 for Stable Diffusion folders)")
    p.add_argument("--num-images", type=int, default=1, help="images per prompt (default 1)")
    p.add_argument("--height", type=int, default=None, help="image height (default: the model's size)")
    p.add_argument("--width", type=int, default=None, help="image width (default: the model's size)")
    p.add_argument("--words", nargs="+", default=None, help="only these words in the overlays (default: all)")
    add_model_argument(p, "pipeline folder: ours or a Stable Diffusion folder")
    p.add_argument("--scheduler", default="ddim", choices=list(SCHEDULERS), help="sampler (default ddim)")
    p.add_argument("--normalize", default="raw", choices=NORMALIZATIONS, help="map normalisation (default raw: "
                   "each pixel's share of attention on the word)")
    p.add_argument("--maps", default=DEFAULT_MAP_KIND, choices=MAP_KINDS,
                   help=f"which maps the overlays and maps.safetensors hold (default {DEFAULT_MAP_KIND}, which "
                        "measures best): plain cross-attention, refined through self-attention, or DAAM's recipe")
    p.add_argument("--out", default="outputs", help="parent folder for the results (default outputs/)")
    p.add_argument("--device", default=None, help="torch device, e.g. cuda (default: cpu)")
    p.add_argument("--self-attention", action="store_true", help="also record self-attention (more memory)")
    p.add_argument("--truncate", action="store_true", help="accept prompts longer than the tokenizer allows")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder of the same name")
    p.add_argument("--quiet", action="store_true", help="no progress or loading bars")
    add_control_args(p)  # --reweight, --excite, --edit: a controlled run beside the plain one
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = Settings(args.seed, args.steps, args.guidance, args.num_images, args.height, args.width,
                        args.normalize, args.scheduler, args.self_attention, args.truncate)
    with sigterm_as_interrupt():
        try:
            # every check before any model work: a bad value costs nothing and leaves nothing behind
            check_settings(settings)
            check_out_dir(args.out)
            pipe = load_pipeline(args.model, args.scheduler, args.device, show_progress=not args.quiet)
            if settings.guidance is None:
                settings = dataclasses.replace(settings, guidance=default_guidance(pipe))
            check_model_settings(pipe, settings)
            notes = [n for prompt in args.prompts for n in check_prompt(pipe, prompt, settings, args.words)]
            notes += check_prompt(pipe, args.edit, settings, None) if args.edit is not None else []
            plan = plan_control(pipe, args)
        except UsageError as e:
            return usage_error(e)
        except KeyboardInterrupt as e:
            return interrupted(e, "nothing was written")
        for note in notes:
            print(f"warning: {note}", file=sys.stderr)
        model_name = str(args.model or "shipped:" + PRETRAINED.name)
        try:  # a UsageError here comes after sampling (what the maps need is known only then); nothing is written
            for prompt in args.prompts:
                folder = generate_one(pipe, prompt, settings, Path(args.out), model_name, args.words, args.overwrite,
                                      show_progress=not args.quiet, maps=args.maps)
                print(folder)
                if plan is not None:
                    folder = control_one(pipe, plan, prompt, settings, folder, show_progress=not args.quiet)
                    print(folder / "compare.png")
        except UsageError as e:
            return usage_error(e)
        except KeyboardInterrupt as e:
            return interrupted(e, "no half-written folder left; the folders printed above are complete")
        except WRITE_ERRORS as e:  # a full disk or a file-size limit: the partial folder is gone already
            return write_failed(e, "the results")
        except MEMORY_ERRORS as e:
            return out_of_memory(e, settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
