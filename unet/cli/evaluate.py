"""Measure prompt following and map accuracy, with baselines, and write a report.

    python scripts/evaluate.py                 # the shipped model, full run
    python scripts/evaluate.py --quick         # a few prompts, for development (< 5 min on 2 cores)
    python scripts/evaluate.py --model runs/scenes-32/pipeline --out outputs/eval/mine
"""

import argparse
import datetime
import sys
from pathlib import Path

import torch

from unet.cli import UsageError, usage_error
from unet.eval.control import CONTROLS, fmt, run_control_evaluation
from unet.eval.control import write as write_control
from unet.eval.evaluate import run_evaluation
from unet.eval.report import write
from unet.pipeline import SCHEDULERS, load_pipeline


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="pipeline folder (default: the shipped model)")
    p.add_argument("--out", default=None, help="report folder (default: outputs/eval/<date>)")
    p.add_argument("--seeds", type=int, default=None, help="images per prompt (default 8, quick 2)")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the model's own)")
    p.add_argument("--scheduler", default="ddim", choices=list(SCHEDULERS),
                   help="sampler (default ddim; dpm = DPM-Solver++, which needs fewer --steps)")
    p.add_argument("--dataset-images", type=int, default=None,
                   help="dataset scenes for exact-mask maps (default 128, quick 32)")
    p.add_argument("--dataset-timestep", type=int, default=300)
    p.add_argument("--quick", action="store_true", help="3 prompts per task, fewer seeds")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--control", choices=CONTROLS, default=None,
                   help="measure one steering control instead: with and without it on the same prompts and seeds "
                        "(unet/eval/control.py)")
    p.add_argument("--reweight-factor", type=float, default=2.0,
                   help="--control reweight: factor on the colour and shape words (default 2)")
    args = p.parse_args(argv)
    seeds = args.seeds or (2 if args.quick else 8)
    if seeds < 1 or args.steps < 1:
        return usage_error("--seeds and --steps must be positive")
    try:
        pipe = load_pipeline(args.model, scheduler=args.scheduler)
    except UsageError as e:
        return usage_error(e)
    torch.manual_seed(0)
    if args.control is not None:
        return control_main(pipe, args, seeds)
    report, records, batches, selection = run_evaluation(
        pipe, seeds=seeds, steps=args.steps, guidance=args.guidance,
        dataset_images=args.dataset_images or (32 if args.quick else 128),
        dataset_timestep=args.dataset_timestep, quick=args.quick, progress=not args.quiet)
    report["model"] = str(args.model or "shipped")
    report["settings"]["scheduler"] = args.scheduler
    report["date"] = datetime.date.today().isoformat()
    out = Path(args.out) if args.out else Path("outputs/eval") / report["date"]
    write(report, records, batches, selection, out, f"Evaluation of {report['model']} ({report['date']})")
    pf = report["prompt_following"]
    print(f"prompt following overall {pf['overall']:.3f}; shape-word mIoU {report['maps']['shape_words']['miou']:.3f}"
          f", pointing {report['maps']['shape_words']['pointing']:.3f}")
    print(f"report: {out / 'report.md'}")
    return 0


def control_main(pipe, args, seeds: int) -> int:
    """`scripts/evaluate.py --control NAME`: run, write the report, print its headline; returns the exit code."""
    if not (args.reweight_factor == args.reweight_factor and abs(args.reweight_factor) < float("inf")):
        return usage_error(f"--reweight-factor must be a finite number, got {args.reweight_factor}")
    date = datetime.date.today().isoformat()
    out = Path(args.out) if args.out else Path("outputs/eval") / f"control-{args.control}-{date}"
    report, records = run_control_evaluation(pipe, args.control, seeds, args.steps, args.guidance, args.quick,
                                             args.reweight_factor, progress=not args.quiet)
    report["model"], report["date"] = str(args.model or "shipped"), date
    path = write_control(report, records, out, f"Steering by {args.control}: {report['model']} ({date})")
    if args.control == "edit":
        print(f"swaps succeeded: {fmt(report['with_replay']['ok'])} with replay, "
              f"{fmt(report['without']['ok'])} without ({report['images']} images)")
    else:
        print(f"prompt following {report['overall_plain']:.3f} plain, {report['overall_steered']:.3f} with "
              f"{args.control}; {report['seconds_per_image_plain']:.2f} vs {report['seconds_per_image_steered']:.2f} "
              "s per image")
    print(f"report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
