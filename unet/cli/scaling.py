"""Quick-evaluate every snapshot of a training run and plot prompt following against training images.

    python scripts/train.py --out runs/v1 --snapshot-every 500 ...   # keeps RUN/snapshots/step_*
    python scripts/scaling.py runs/v1                                 # table + plot in runs/v1/scaling
    python scripts/scaling.py runs/v1 --watch                         # follow a run that is still training

Each snapshot is evaluated once; results are cached in OUT/scaling.json, so re-running only evaluates
new snapshots. The best snapshot by prompt following is named in the table.
"""

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

import torch

from unet.cli import UsageError, check_guidance, usage_error
from unet.eval.evaluate import run_evaluation
from unet.eval.scaling import best_row, scaling_row, snapshots, wall_minutes, write_scaling
from unet.pipeline import load_pipeline


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="training run folder (with snapshots/ and train_config.json)")
    p.add_argument("--out", default=None, help="report folder (default: RUN/scaling)")
    p.add_argument("--seeds", type=int, default=4, help="images per prompt in the quick evaluation (default 4)")
    p.add_argument("--guidance", type=float, default=None,
                   help="guidance scale of the evaluation (default: the model's own, from its model_index.json)")
    p.add_argument("--device", default="cpu", help="where the evaluation runs (and what the table says)")
    p.add_argument("--watch", action="store_true", help="keep evaluating new snapshots until the run has finished")
    p.add_argument("--ship", metavar="DIR", help="copy the best snapshot's pipeline to DIR (must not exist), with the "
                                               "evaluation's guidance scale as its default")
    args = p.parse_args(argv)
    run = Path(args.run)
    if not (run / "train_config.json").exists():
        return usage_error(f"{run} is not a training run folder (no train_config.json)")
    if args.seeds < 1:
        return usage_error(f"--seeds must be a positive integer, got {args.seeds}")
    try:
        check_guidance(args.guidance)
    except UsageError as e:
        return usage_error(e)
    out = Path(args.out) if args.out else run / "scaling"
    cache = out / "scaling.json"
    rows = {r["step"]: r for r in json.loads(cache.read_text())["rows"]} if cache.exists() else {}
    batch_size = json.loads((run / "train_config.json").read_text())["batch_size"]
    device = f"{args.device} ({torch.get_num_threads()} threads)"
    while True:
        todo = [(step, folder) for step, folder in snapshots(run) if step not in rows]
        for step, folder in todo:
            try:
                pipe = load_pipeline(folder, device=args.device)
            except UsageError as e:
                return usage_error(e)
            torch.manual_seed(0)
            report = run_evaluation(pipe, seeds=args.seeds, quick=True, dataset_images=32, progress=False,
                            guidance=args.guidance)[0]
            rows[step] = scaling_row(step, batch_size, wall_minutes(run, step), report)
            write_scaling(list(rows.values()), out, f"Scaling of {run}", device)
            r = rows[step]
            print(f"step {step}: overall {r['overall']:.3f}, position {r['position']:.3f}, "
                  f"colour attribution {r['color_attr']:.3f}, shape mIoU {r['shape_miou']:.3f}, "
                  f"grain {r['grain']:.2f}/255", flush=True)
        if not args.watch or ((run / "pipeline" / "model_index.json").exists() and not todo):
            break
        time.sleep(60)
    if not rows:
        return usage_error(f"{run} has no snapshots (train with --snapshot-every N)")
    write_scaling(list(rows.values()), out, f"Scaling of {run}", device)  # also when every row was cached
    print(f"report: {out / 'scaling.md'}")
    if args.ship:
        best = best_row(list(rows.values()))["step"]
        folder = dict(snapshots(run))[best]
        pipe = load_pipeline(folder)
        if args.guidance is not None:
            pipe.register_to_config(guidance_scale=args.guidance)
        ship_to = Path(args.ship)
        if ship_to.exists():
            return usage_error(f"{ship_to} exists; remove it first (nothing was copied)")
        pipe.save_pretrained(ship_to)
        shutil.copy(folder / "trained_words.json", ship_to / "trained_words.json")
        print(f"shipped step {best} to {ship_to}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
