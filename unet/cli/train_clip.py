"""Train a CLIP of our own on the scenes (contrastive, with hard negatives), to freeze as the U-Net's text side.

    python scripts/train_clip.py --out runs/scene-clip --steps 3000
    python scripts/train_clip.py --out runs/scene-clip-words --token-loss 1   # also score each word on its patch
    python scripts/train.py --clip runs/scene-clip/text --out runs/on-scene-clip   # a U-Net on it, frozen

Each image is scored against its caption, the batch's other captions, and captions that swap its colours, its
shapes or its relation; the text encoder must keep those words apart to tell them from the image
(unet/scene_clip.py). --token-loss W adds, with weight W, the same loss on a score that matches every word to
its best image patch, so that each word's own state, which the Keys read, must tell its colour or shape. OUT gets:

    text/         tokenizer + CLIPTextModel, for `train.py --clip OUT/text`
    clip/         the whole CLIPModel (text and vision towers)
    report.json   hard-negative accuracy on held-out colour/shape pairs, how far apart the text output keeps
                  different colour and shape words, the settings
    loss.csv      step, loss, learning rate

The folder appears only when complete; Ctrl-C or SIGTERM stops training after the current step and still
writes it, with the steps done in report.json; one during the evaluation after the last step keeps the trained
model (report.json then has no evaluation). One run writes OUT at a time: a second is refused, naming the first.
"""

import argparse
import csv
import dataclasses
import json
import shutil
import sys
from pathlib import Path

from crossattn.text import save_vocabulary
from unet.cli import UsageError, check_out_dir, interrupted, partial_folder, publish, sigterm_as_interrupt, usage_error
from unet.data import SCENE_WORDS
from unet.eval.layout import encode_pairs, text_separation
from unet.folders import WRITE_ERRORS, hold_folder, write_failed
from unet.pipeline import progress_bars
from unet.scene_clip import SceneClipConfig, hard_negative_accuracy, train_scene_clip
from unet.signals import DeferredSignals, Interrupted, caught


def parse_args(argv=None):
    defaults = SceneClipConfig()
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(SceneClipConfig):
        p.add_argument("--" + f.name.replace("_", "-"), type=type(f.default), default=f.default,
                       help=f"(default: {getattr(defaults, f.name)})")
    p.add_argument("--overwrite", action="store_true", help="replace a finished OUT")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    cfg = SceneClipConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SceneClipConfig)})
    with sigterm_as_interrupt(), progress_bars(not args.quiet):  # --quiet: transformers' saving bars too
        try:
            try:
                cfg.validate()
            except ValueError as e:
                raise UsageError(str(e)) from e
            check_out_dir(cfg.out)  # the text itself: Path('') would be the current folder
            with hold_folder(cfg.out):  # one writer per folder, from the check below to the publishing
                return train_and_publish(cfg, args)
        except UsageError as e:
            return usage_error(e)
        except WRITE_ERRORS as e:
            return write_failed(e, f"the scene CLIP into {cfg.out}")
        except FloatingPointError as e:  # a loss that is not finite: the partial folder is gone already
            return usage_error(f"training diverged: {e}; nothing was written")
        except KeyboardInterrupt as e:
            return interrupted(e, "nothing was written (no step had finished)")


def evaluation(model, tokenizer, cfg: SceneClipConfig) -> dict:
    """What report.json says of the trained model beside its settings."""
    return {"hard_negatives": hard_negative_accuracy(model, tokenizer, cfg),
            "hard_negatives_train_split": hard_negative_accuracy(model, tokenizer, cfg, split="train"),
            "text_separation": text_separation(*encode_pairs(tokenizer, model.text_model))}


def train_and_publish(cfg: SceneClipConfig, args) -> int:
    """Train, evaluate and publish OUT whole. An interrupt after the last step (while evaluating or writing)
    keeps the trained model: it is published without the evaluation it cut short, and the line says so."""
    out = Path(cfg.out)
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        raise UsageError(f"--out {out} already holds a result; pass --overwrite to replace it, or choose "
                         "another --out")
    with partial_folder(out.parent) as tmp:
        tokenizer = save_vocabulary(SCENE_WORDS, tmp / "text", cfg.max_length)
        log = []
        model, steps, stopped_by = train_scene_clip(cfg, tokenizer, progress=not args.quiet, log=log)
        report = {"steps_done": steps, "config": dataclasses.asdict(cfg)}
        try:
            if stopped_by is None:  # an interrupted run is published at once, with the steps it did
                report |= evaluation(model, tokenizer, cfg)
        except KeyboardInterrupt as e:
            stopped_by = caught(e)
        with DeferredSignals() as held:  # the trained model is written whole, whatever arrives meanwhile
            model.save_pretrained(tmp / "clip")
            model.text_model.save_pretrained(tmp / "text")
            for name in ("vocab.json", "merges.txt", "tokenizer.json", "tokenizer_config.json"):
                shutil.copy(tmp / "text" / name, tmp / "clip" / name)
            (tmp / "report.json").write_text(json.dumps(report, indent=1))
            with open(tmp / "loss.csv", "w", newline="") as f:
                csv.writer(f).writerows([("step", "loss", "lr"), *log])
            final = publish(tmp, out, replace=args.overwrite or out.is_dir())
            stopped_by, held.signum = stopped_by or held.signum, None
    if "hard_negatives" in report:
        accuracy = report["hard_negatives"]
        colours = report["text_separation"]["text_output"]["color"]["mean"]
        print(json.dumps({k: v["accuracy"] for k, v in accuracy.items() if isinstance(v, dict)}
                         | {"retrieval_top1": accuracy["retrieval_top1"], "colour words, text output cosine": colours}))
    print(f"done: {final} ({steps} steps); use it with: python scripts/train.py --clip {final / 'text'} ...")
    if stopped_by is not None:
        unevaluated = "" if "hard_negatives" in report else " (not evaluated: report.json holds its steps and settings)"
        return interrupted(Interrupted(stopped_by), f"kept the model trained for {steps} steps in {final}{unevaluated}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
