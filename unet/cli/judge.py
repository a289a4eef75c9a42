"""Does an image follow its prompt? The evaluation's judge (our detector, GenEval's rules) on images you have.

    python scripts/judge.py "a red circle left of a blue square" outputs/*/image_0.png

Prints one line per image (right or wrong, and what the detector found) and the count. For the prompts of the
evaluation's kinds: one or two objects, colours optional, a relation ("left of", "right of", "above", "below")
or "and".
"""

import argparse
import sys

import numpy as np

from unet.attend import read_image
from unet.cli import UsageError, usage_error
from unet.eval.detect import detect
from unet.eval.prompts import check, parse_prompt


def judge(prompt: str, image: np.ndarray) -> tuple[bool, str]:
    """Whether `image` ((H, W, 3) uint8) follows `prompt`, and what the detector found, in words."""
    detections = detect(image)
    ok, _ = check(parse_prompt(prompt), detections)
    found = ", ".join(f"{d.color} {d.shape}" for d in detections) or "nothing"
    return ok, found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", help="the prompt the images were made from")
    p.add_argument("images", nargs="+", help="image files (converted to RGB), e.g. the image_0.png of generate.py runs")
    args = p.parse_args(argv)
    try:
        parse_prompt(args.prompt)
        images = [np.asarray(read_image(path)[0]) for path in args.images]  # as attend reads them
    except (ValueError, UsageError) as e:
        return usage_error(e)
    right = 0
    for path, image in zip(args.images, images):
        ok, found = judge(args.prompt, image)
        right += ok
        print(f"{'right' if ok else 'wrong'}: {path} (found: {found})")
    print(f"{right} of {len(images)} follow {args.prompt!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
