"""Does an image follow its prompt? The evaluation's judge (our detector, GenEval's rules) on images you have.

    python scripts/judge.py "a red circle left of a blue square" outputs/*/image_0.png

Prints one line per image (right or wrong, and what the detector found) and the count. For the prompts of the
evaluation's kinds: one or two objects, colours optional, a relation ("left of", "right of", "above", "below")
or "and".

With --maps, each image must be an image_<k>.png of a generate.py run folder: below its line comes each
word's mean map value on each object the detector found and on the background (every pixel more than one
pixel from an object), from the run's maps.safetensors. On the default raw maps a value is the share of a
pixel's attention that goes to the word, so a row says where the word looked, in numbers:

    python scripts/generate.py "a red circle left of a blue square" --seed 0 --out runs/example
    python scripts/judge.py "a red circle left of a blue square" runs/example/*/image_0.png --maps
"""

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from safetensors import SafetensorError

from unet.attend import read_image
from unet.cli import UsageError, shorten, usage_error
from unet.eval.detect import Detection, detect
from unet.eval.map_scoring import attention_on_objects
from unet.eval.prompts import check, parse_prompt
from unet.run_folder import read_run


def verdict(prompt: str, detections: list[Detection]) -> tuple[bool, str]:
    """Whether an image with these `detections` follows `prompt`, and what the detector found, in words."""
    ok, _ = check(parse_prompt(prompt), detections)
    found = ", ".join(f"{d.color} {d.shape}" for d in detections) or "nothing"
    return ok, found


def judge(prompt: str, image: np.ndarray) -> tuple[bool, str]:
    """Whether `image` ((H, W, 3) uint8) follows `prompt`, and what the detector found, in words."""
    return verdict(prompt, detect(image))


def run_maps(path: str, image: np.ndarray) -> tuple[dict, list[str], torch.Tensor]:
    """The run folder's meta, words and maps (words, H, W) of the image at `path`, one of the run's images."""
    path = Path(path)
    if not (path.parent / "maps.safetensors").is_file() or not (path.parent / "meta.json").is_file():
        raise UsageError(f"--maps: {path} is not an image_<k>.png beside a maps.safetensors and a meta.json; "
                         "give the images of a generate.py run folder")
    try:
        meta, words, maps = read_run(path.parent, image=path.name)  # ValueError: not one of the run's images
    # a damaged folder: RuntimeError (a run with no words), TypeError (a meta.json that is not an object of lists),
    # SafetensorError (a truncated or garbage maps.safetensors)
    except (OSError, ValueError, KeyError, IndexError, RuntimeError, TypeError, SafetensorError) as e:
        raise UsageError(f"--maps: cannot read the maps of {path} from its run folder ({type(e).__name__}: "
                         f"{shorten(' '.join(str(e).split()), 120)})") from e
    if tuple(maps.shape[-2:]) != image.shape[:2]:
        raise UsageError(f"--maps: {path} is {image.shape[1]}x{image.shape[0]} but its maps are "
                         f"{maps.shape[-1]}x{maps.shape[-2]}; the image must be the run's own, unresized")
    return meta, words, maps


def maps_table(words: list[str], maps: torch.Tensor, detections: list[Detection]) -> str:
    """Each word's mean map value on each detected object and on the background, as aligned text."""
    table = attention_on_objects(maps, detections)  # (words, objects + 1)
    heads = [f"{d.color} {d.shape}" for d in detections] + ["background"]
    width = max(len(w) for w in words)
    cells = [max(len(h), 6) for h in heads]
    lines = ["  " + " " * width + "".join(f"  {h:>{c}}" for h, c in zip(heads, cells))]
    for word, row in zip(words, table.tolist()):
        lines.append(f"  {word:<{width}}" + "".join(f"  {v:>{c}.3f}" for v, c in zip(row, cells)))
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="the prompt the images were made from")
    p.add_argument("images", nargs="+", help="image files (converted to RGB), e.g. the image_0.png of generate.py runs")
    p.add_argument("--maps", action="store_true",
                   help="also print each word's mean map value on each detected object and on the background, "
                        "from the images' run folders")
    args = p.parse_args(argv)
    try:
        parse_prompt(args.prompt)
        images = [np.asarray(read_image(path)[0]) for path in args.images]  # as attend reads them
        runs = [run_maps(path, image) for path, image in zip(args.images, images)] if args.maps else None
    except (ValueError, UsageError) as e:
        return usage_error(e)
    right = 0
    for n, (path, image) in enumerate(zip(args.images, images)):
        detections = detect(image)
        ok, found = verdict(args.prompt, detections)
        right += ok
        print(f"{'right' if ok else 'wrong'}: {path} (found: {found})")
        if runs:
            meta, words, maps = runs[n]
            if meta.get("prompt") != args.prompt:
                print(f"  (its run's prompt is {meta.get('prompt')!r})")
            print(f"  mean map value ({meta.get('normalize', 'raw')} {meta.get('maps', 'plain')} maps) on each object "
                  "and the background:")
            print(maps_table(words, maps, detections))
    print(f"{right} of {len(images)} follow {args.prompt!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
