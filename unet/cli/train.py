"""Train the text-to-image model from scratch on synthetic scenes.

    python scripts/train.py --out runs/scenes-32 --steps 3500          # CPU
    accelerate launch scripts/train.py --out runs/scenes-32            # GPUs / machines
    python scripts/train.py --out runs/scenes-32 --steps 5000 --resume  # continue (or extend) a run
    python scripts/train.py --make-data data/scenes --num-samples 30000 # write a dataset folder
"""

import argparse
import shutil
import sys
from dataclasses import fields
from pathlib import Path

from unet.cli import UsageError, check_out_dir, interrupted, sigterm_as_interrupt, usage_error
from unet.data import SceneDataset
from unet.folders import WRITE_ERRORS, write_failed
from unet.pipeline import progress_bars
from unet.train import TrainConfig, Trainer, check_resumable


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


def check_config(cfg: TrainConfig) -> None:
    """Every setting (`TrainConfig.validate`) and the run folder, checked before anything is written."""
    cfg.validate()
    check_out_dir(cfg.out)
    if cfg.resume:
        check_resumable(Path(cfg.out), cfg.steps)


def _entries(folder: Path) -> set[Path] | None:
    return set(folder.iterdir()) if folder.is_dir() else None


def remove_new(out: Path, before: set[Path] | None) -> None:
    """Undo a failed start: remove what appeared in `out` since `before` (all of `out` if it was new)."""
    if before is None:
        shutil.rmtree(out, ignore_errors=True)
        return
    for path in _entries(out) - before:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def make_data(args) -> int:
    """Write the dataset folder whole, or (on an error or interrupt) leave nothing new in it."""
    folder = Path(args.make_data)
    before = _entries(folder)
    try:
        SceneDataset.generate(args.num_samples, args.seed, args.size, args.size).save(folder)
    except KeyboardInterrupt as e:
        remove_new(folder, before)
        return interrupted(e, "no dataset written")
    except WRITE_ERRORS as e:
        remove_new(folder, before)
        return write_failed(e, "the dataset")
    except BaseException:
        remove_new(folder, before)
        raise
    print(f"wrote {args.num_samples} scenes to {folder}")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    with sigterm_as_interrupt(), progress_bars(not args.quiet):
        return _main(args)


def _main(args) -> int:
    try:
        if args.make_data is not None:
            if args.num_samples <= 0:
                raise ValueError("--make-data needs --num-samples N > 0")
            check_out_dir(args.make_data, "--make-data")
            return make_data(args)
        values = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if hasattr(args, f.name)}
        values["channels"] = tuple(values["channels"])
        cfg = TrainConfig(**values)
        check_config(cfg)
    except (ValueError, OSError, UsageError) as e:
        return usage_error(e)
    except KeyboardInterrupt as e:
        return interrupted(e, "nothing was written")
    out = Path(cfg.out)
    before = _entries(out)
    try:
        trainer = Trainer(cfg)
    except (ValueError, OSError, KeyError, RuntimeError) as e:  # RuntimeError: weights of another shape
        remove_new(out, before)
        return usage_error(e)
    except KeyboardInterrupt as e:
        remove_new(out, before)
        return interrupted(e, "nothing was written")
    try:
        trainer.train(progress=not args.quiet)
    except KeyboardInterrupt as e:  # held to the end of a step; the trainer saved its checkpoint there
        if trainer.saved_step is None:  # stopped before the loop began: nothing to resume from
            remove_new(out, before)
            return interrupted(e, "nothing was written")
        if trainer.saved_step >= trainer.cfg.steps:
            return interrupted(e, f"trained to step {trainer.saved_step} (checkpoint {trainer.ckpt_path}), but the "
                                  "pipeline was not written; the same command with --resume writes it")
        return interrupted(e, f"checkpoint saved at step {trainer.saved_step} in {trainer.ckpt_path}; --resume "
                              "continues")
    except WRITE_ERRORS as e:  # a full disk or a file-size limit: what was written is whole
        if not trainer.ckpt_path.exists():
            remove_new(out, before)
        return write_failed(e, f"the run in {out}")
    except BaseException:
        if not trainer.ckpt_path.exists():  # nothing to resume from: leave no half-made run folder
            remove_new(out, before)
        raise
    print(f"done: pipeline saved to {trainer.out / 'pipeline'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
