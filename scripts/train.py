"""Train the text-to-image model from scratch on synthetic scenes.

    python scripts/train.py --out runs/scenes-32 --steps 3500          # CPU
    accelerate launch scripts/train.py --out runs/scenes-32            # GPUs / machines
    python scripts/train.py --out runs/scenes-32 --steps 5000 --resume  # continue (or extend) a run
    python scripts/train.py --make-data data/scenes --num-samples 30000 # write a dataset folder
"""

import argparse
import sys
from dataclasses import fields

from unet.data import SceneDataset
from unet.train import TrainConfig, Trainer


def parse_args(argv=None):
    defaults = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=defaults.out, help="run folder: checkpoint, samples, loss log, final pipeline")
    p.add_argument("--data", default=None,
                   help="dataset folder written by --make-data (default: draw scenes in memory)")
    p.add_argument("--make-data", metavar="DIR", help="only write --num-samples scenes to DIR and exit")
    p.add_argument("--clip", default=None, help="local CLIP folder (tokenizer + text encoder) to use frozen")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.safetensors")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    for f in fields(TrainConfig):
        if f.name in ("out", "data", "clip", "resume", "sample_prompts") or isinstance(f.default, tuple):
            continue
        if isinstance(f.default, bool):
            p.add_argument("--" + f.name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=f.default,
                           help=f"(default: {f.default})")
            continue
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                       help=f"(default: {f.default})")
    p.add_argument("--channels", type=int, nargs="+", default=list(defaults.channels), help="width per level")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        if args.make_data:
            if args.num_samples <= 0:
                raise ValueError("--make-data needs --num-samples N > 0")
            SceneDataset.generate(args.num_samples, args.seed, args.size, args.size).save(args.make_data)
            print(f"wrote {args.num_samples} scenes to {args.make_data}")
            return 0
        values = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
        values["channels"] = tuple(values["channels"])
        trainer = Trainer(TrainConfig(**values))
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        trainer.train(progress=not args.quiet)
    except KeyboardInterrupt:
        return 130
    print(f"done: pipeline saved to {trainer.out / 'pipeline'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
