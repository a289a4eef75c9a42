"""Train a text-side ablation with the recipe of an existing run and quick-evaluate it.

    python scripts/ablation.py runs/v1 --variant oracle --steps 800 --out runs/ablate-oracle
    python scripts/ablation.py runs/v1 --variant bidirectional --steps 800 --out runs/ablate-bidir

The variant trains with RUN's train_config.json (same U-Net, batch, seed, data), only the text side
differs (unet/research/text_variants.py); compare with RUN's snapshot at the same step (scripts/scaling.py, same
quick evaluation and seeds). Writes OUT/ablation.json.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from unet.cli import UsageError, check_guidance, usage_error
from unet.eval.evaluate import run_evaluation
from unet.eval.layout_log import LayoutLog
from unet.eval.scaling import scaling_row, wall_minutes
from unet.train import TrainConfig, Trainer, resumed_config


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="the run whose recipe to copy (its train_config.json)")
    p.add_argument("--variant", required=True, choices=["clip", "bidirectional", "oracle"])
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True, help="new run folder for the ablation")
    p.add_argument("--seeds", type=int, default=4, help="images per prompt in the quick evaluation (default 4)")
    p.add_argument("--guidance", type=float, default=None,
                   help="guidance scale of the evaluation (default: the model's own, from its model_index.json)")
    p.add_argument("--resume", action="store_true", help="continue OUT")
    args = p.parse_args(argv)
    try:
        check_guidance(args.guidance)
    except UsageError as e:
        return usage_error(e)
    config = Path(args.run) / "train_config.json"
    if not config.exists():
        return usage_error(f"{config} does not exist")
    saved = json.loads(config.read_text())
    try:
        # RUN's settings read as a --resume reads them (a setting of a retired study is refused, not dropped), here
        # trained from nothing with another text side
        run = resumed_config(TrainConfig.from_flat(out=args.out, steps=args.steps), saved)
        cfg = run.replace(text_variant=args.variant, snapshot_every=0, resume=args.resume, grown_from=None)
        trainer = Trainer(cfg, callbacks=[LayoutLog()])
    except (TypeError, ValueError, FileNotFoundError, FileExistsError) as e:
        return usage_error(e)
    trainer.train(progress=False)
    torch.manual_seed(0)
    report = run_evaluation(trainer.pipeline(), seeds=args.seeds, quick=True, dataset_images=32, progress=False,
                            guidance=args.guidance)[0]
    minutes = wall_minutes(Path(args.out), trainer.step)
    row = scaling_row(trainer.step, trainer.cfg.optimizer.batch_size, minutes, report)
    row["variant"] = args.variant
    (Path(args.out) / "ablation.json").write_text(json.dumps(row, indent=1))
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
