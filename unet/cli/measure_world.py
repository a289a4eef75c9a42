"""Measure the scenes-64 world's generator and detector: how long drawing a batch takes, and how often the detector
recovers each drawn object's colour, shape and size and each scene's count.

    python scripts/measure_world.py --scenes 2000 --size 64

Prints the median time to draw a batch (`--batch`, default 32, over `--repeats` batches), beside scenes-32's
generator timed the same way (on a shared machine only the ratio carries over); then the detector's rate per shape
and size, and for colour, shape, size, all three and exact counts; then how often the judge accepts each scene's own
caption. `--size 48` or `32` measure whether a smaller image still tells the six shapes apart at their small size
(the detector must reach 0.98 on each).
"""

import argparse
import statistics
import sys
import time

from unet.cli import usage_error
from unet.data import SceneSampler
from unet.eval.detect64 import detector_rates
from unet.eval.prompts64 import caption_rates
from unet.scenes64 import Scenes64Sampler
from unet.world import SHAPES, SIZES


def drawing_seconds(sampler, batch: int, repeats: int) -> list[float]:
    """Wall-clock seconds for `sampler` (a scene sampler: called, it draws one) to draw each of `repeats` batches of
    `batch` scenes."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(batch):
            sampler()
        times.append(time.perf_counter() - start)
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenes", type=int, default=2000, help="scenes the detector is measured on (default 2000)")
    p.add_argument("--size", type=int, default=64, help="image side in pixels (default 64)")
    p.add_argument("--batch", type=int, default=32, help="scenes per timed batch (default 32)")
    p.add_argument("--repeats", type=int, default=20, help="timed batches (default 20)")
    p.add_argument("--seed", type=int, default=5, help="the scenes' seed (default 5)")
    args = p.parse_args(argv)
    for flag, value in (("--scenes", args.scenes), ("--batch", args.batch), ("--repeats", args.repeats)):
        if value < 1:
            return usage_error(f"{flag} must be a positive integer, got {value}")
    try:
        sampler = Scenes64Sampler(args.seed, "all", args.size)
    except ValueError as e:
        return usage_error(f"--size: {e}")
    times = drawing_seconds(sampler, args.batch, args.repeats)
    # scenes-32's generator timed alongside: on a shared machine only the ratio carries over
    reference = drawing_seconds(SceneSampler(args.seed), args.batch, args.repeats)
    drawn = args.batch * args.repeats
    print(f"drawing {args.batch} scenes of {args.size}x{args.size}: median {statistics.median(times) * 1000:.1f} ms, "
          f"max {max(times) * 1000:.1f} ms over {args.repeats} batches; {sampler.unfit} of {drawn + sampler.unfit} "
          "captions drawn again as their objects did not fit")
    print(f"  scenes-32's generator (unet/data.py, 32x32) meanwhile: median "
          f"{statistics.median(reference) * 1000:.1f} ms")
    start = time.perf_counter()
    drawn = [sampler() for _ in range(args.scenes)]
    rates = detector_rates(drawn)
    print(f"detector on {rates['scenes']} scenes, {rates['objects']} objects "
          f"({(time.perf_counter() - start) / args.scenes * 1000:.1f} ms a scene with drawing):")
    print("  shape      " + "  ".join(f"{size:>6}" for size in SIZES))
    for shape in SHAPES:
        print(f"  {shape:<9}  " + "  ".join(f"{rates.get(f'{shape}/{size}', float('nan')):>6.3f}" for size in SIZES))
    print("  " + ", ".join(f"{key} {rates[key]:.3f}" for key in ("color", "shape", "size", "all", "count")))
    judged = caption_rates(drawn)
    print(f"judge on the same scenes: own caption holds (exact counts, relations, positions) {judged['caption']:.3f}; "
          f"'and' in reading order {judged['reading_order']:.3f} of {judged['and_captions']} that hold")
    return 0


if __name__ == "__main__":
    sys.exit(main())
