"""The attention maps of an image you already have, in the same run folder as generate.py writes.

    python scripts/attend.py scene.png "a red circle left of a blue square" --timestep 300

The image is taken as the model sees it (resized to the model's size; for Stable Diffusion folders,
encoded with the VAE), noised to --timestep with --seed's noise, denoised once with the prompt, and
every word's attention recorded. The folder holds the image as the model saw it (image_0.png),
overlay.png, words/, maps.safetensors, meta.json and index.html.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict
from pathlib import Path

from crossattn.maps import DEFAULT_MAP_KIND, DEFAULT_REFINEMENT, MAP_KINDS, NORMALIZATIONS, fitted_refinement
from crossattn.text import prompt_words

from ..attend import (
    ATTEND_TIMESTEP,
    check_attend_model,
    check_timestep,
    fit_image,
    image_latents,
    model_size,
    read_image,
    record_noised,
)
from ..folders import WRITE_ERRORS, write_failed
from ..pipeline import PRETRAINED, Settings, load_pipeline
from ..run_folder import attend_name, map_store, run_maps, write_run_files
from . import (
    UsageError,
    add_model_argument,
    check_out_dir,
    check_prompt,
    check_seed,
    interrupted,
    partial_folder,
    publish,
    sigterm_as_interrupt,
    usage_error,
)


def attend_one(pipe, image, prompt: str, out_dir: Path, model_name: str, timestep: int = ATTEND_TIMESTEP,
               seed: int = 0, maps: str = DEFAULT_MAP_KIND, normalize: str = "raw", source: str = "",
               notes: list[str] | None = None, overwrite: bool = False) -> Path:
    """Record `prompt`'s attention on `image` ((H, W, 3) uint8 at the model's size) noised to `timestep`,
    and write the run folder under `out_dir`; returns the folder."""
    timings = {}
    words = prompt_words(pipe.tokenizer, prompt)
    refinement = fitted_refinement(DEFAULT_REFINEMENT, [timestep])
    store = map_store(pipe, maps, refinement=refinement)
    t0 = time.perf_counter()
    record_noised(pipe, image_latents(pipe, image[None]), [prompt], timestep, [seed], store)
    timings["denoising_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    word_tensor, tensors, kinds = run_maps(pipe, store, words, image.shape[:2], maps, normalize, refinement)
    timings["maps_s"] = time.perf_counter() - t0
    with partial_folder(out_dir) as tmp:  # renamed into place only when complete; removed on any error
        meta = {"prompt": prompt, "seed": seed, "steps": 1, "guidance": 1.0, "timestep": timestep,
                "scheduler": f"one denoiser pass at t={timestep} ({type(pipe.scheduler).__name__}'s training noise)",
                "normalize": normalize, "maps": maps,
                **({"refinement": asdict(refinement)} if maps == "refined" else {}),
                "model": model_name, "source": source, "source_notes": notes or [], "timings": timings}
        write_run_files(tmp, image[None], word_tensor, tensors, words, None, meta, store, kinds)
        return publish(tmp, out_dir / attend_name(prompt, timestep, seed), replace=overwrite)


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="attend.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("image", help="an image file (PNG, JPEG, ...); grayscale is converted to RGB, an alpha "
                                 "channel composited on black")
    p.add_argument("prompt", help="the prompt whose words' attention to record, in quotes")
    p.add_argument("--out", default="outputs", help="parent folder for the result (default outputs/)")
    add_model_argument(p, "pipeline folder: ours or a Stable Diffusion 1.x/2.x folder")
    p.add_argument("--timestep", type=int, default=ATTEND_TIMESTEP,
                   help=f"noise level to denoise from, 0 .. the scheduler's training timesteps - 1 (default "
                        f"{ATTEND_TIMESTEP}, chosen by measurement: docs/guides/maps.md)")
    p.add_argument("--seed", type=int, default=0, help="seed of the noise added (default 0)")
    p.add_argument("--maps", default=DEFAULT_MAP_KIND, choices=MAP_KINDS,
                   help=f"which maps the overlays and maps.safetensors hold (default {DEFAULT_MAP_KIND})")
    p.add_argument("--normalize", default="raw", choices=NORMALIZATIONS, help="map normalisation (default raw)")
    p.add_argument("--device", default=None, help="torch device, e.g. cuda (default: cpu)")
    p.add_argument("--truncate", action="store_true", help="accept prompts longer than the tokenizer allows")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder of the same name")
    p.add_argument("--quiet", action="store_true", help="no loading bars")
    return p.parse_args(argv)


def check_inputs(args):
    """Every check before any model work (one line, exit 2): returns the pipeline, the image at the model's
    size and notes on what was done to it (and to the prompt)."""
    if not args.prompt.strip():
        raise UsageError("empty prompt: give the words to look for, e.g. \"a red circle\"")
    check_seed(args.seed)
    check_out_dir(Path(args.out))
    image, notes = read_image(args.image)  # before the model loads: a bad file costs nothing
    pipe = load_pipeline(args.model, device=args.device, show_progress=not args.quiet)
    check_attend_model(pipe)
    check_timestep(pipe, args.timestep)
    notes += check_prompt(pipe, args.prompt, Settings(truncate=args.truncate), None)
    array, resized = fit_image(image, model_size(pipe))
    return pipe, array, notes + resized


def main(argv=None) -> int:
    args = parse_args(argv)
    with sigterm_as_interrupt():
        try:
            pipe, image, notes = check_inputs(args)
        except UsageError as e:
            return usage_error(e)
        except KeyboardInterrupt as e:
            return interrupted(e, "nothing was written")
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        try:
            model_name = str(args.model or "shipped:" + PRETRAINED.name)
            folder = attend_one(pipe, image, args.prompt, Path(args.out), model_name, args.timestep, args.seed,
                                args.maps, args.normalize, str(args.image), notes, args.overwrite)
        except KeyboardInterrupt as e:
            return interrupted(e, "no half-written folder left")
        except WRITE_ERRORS as e:  # a full disk or a file-size limit: the partial folder is gone already
            return write_failed(e, "the run folder")
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
