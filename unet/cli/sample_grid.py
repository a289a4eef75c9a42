"""A grid of samples: one row per seed, one column per prompt (by default the prompts the model was watched learning
with: its run's sample prompts, or those of its world's recipe).

    python scripts/sample_grid.py --out outputs/examples/training/samples_shipped.png
    python scripts/sample_grid.py --model runs/v1/pipeline --guidance 4 --out grid.png
"""

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from crossattn.overlay import to_uint8
from unet.cli import UsageError, add_model_argument, check_guidance, usage_error
from unet.folders import write_failed
from unet.pipeline import load_pipeline
from unet.recipe_file import RecipeError, read_recipe
from unet.train_config import RunConfig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompts", nargs="*", help="prompts (default: the sample prompts of the model's training run, "
                   "or of its world's recipe)")
    add_model_argument(p)
    p.add_argument("--seeds", type=int, default=4, help="rows (default 4)")
    p.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the model's own)")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--scale", type=int, default=4, help="pixel magnification (default 4)")
    p.add_argument("--out", required=True, help="image to write, e.g. grid.png (refused if it exists)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    args = p.parse_args(argv)
    out = Path(args.out)
    if out.is_dir():
        return usage_error(f"--out {out} is a folder; give an image file, e.g. {out / 'grid.png'}")
    if out.exists() and not args.overwrite:
        return usage_error(f"{out} exists; pass --overwrite to replace it, or choose another --out")
    if out.suffix.lower() not in Image.registered_extensions():
        return usage_error(f"--out {out}: unknown image type {out.suffix!r}; use .png, .jpg or .webp")
    if args.seeds < 1 or args.steps < 1 or args.scale < 1:
        return usage_error("--seeds, --steps and --scale must be positive")
    try:
        check_guidance(args.guidance)
        pipe = load_pipeline(args.model)
    except UsageError as e:
        return usage_error(e)
    prompts = args.prompts or training_sample_prompts(pipe)
    rows = []
    for seed in range(args.seeds):
        images = pipe(prompts, num_inference_steps=args.steps, guidance_scale=args.guidance, output_type="np",
                      generator=torch.Generator().manual_seed(seed), show_progress=False).images
        rows.append(np.concatenate(list(images), axis=1))  # (H, W * prompts, 3)
    grid = to_uint8(np.concatenate(rows, axis=0))
    image = Image.fromarray(grid)
    partial = out.with_name(f".{out.name}.partial")  # a grid stopped half-written never replaces the old one
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        image.resize((image.width * args.scale, image.height * args.scale), Image.NEAREST).save(
            partial, format=Image.registered_extensions()[out.suffix.lower()])
        os.replace(partial, out)
    except BaseException as e:
        partial.unlink(missing_ok=True)
        if isinstance(e, OSError):
            return write_failed(e, str(out))
        raise
    print(out)
    return 0


def training_sample_prompts(pipe) -> list[str]:
    """The prompts `pipe` was sampled with while it trained: its run's (the pipeline folder's train_config.json),
    else its world's recipe's (the shipped scenes-32 folder carries no config), else scenes-32's."""
    config = Path(pipe.name_or_path) / "train_config.json"
    if config.is_file():
        saved = json.loads(config.read_text())  # load_pipeline has read it already: valid JSON
        if isinstance(saved, dict) and saved.get("sample_prompts"):
            return list(saved["sample_prompts"])
    world = getattr(pipe, "world", None)
    if world is not None:
        try:
            _, settings = read_recipe(world)  # recipes/<world>.toml, its settings by flat name
        except RecipeError:  # the package without the repository's recipes folder
            pass
        else:
            if settings.get("sample_prompts"):
                return list(settings["sample_prompts"])
    return RunConfig().sample_prompts


if __name__ == "__main__":
    sys.exit(main())
