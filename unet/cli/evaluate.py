"""Measure prompt following and map accuracy, with baselines, and write a report.

    python scripts/evaluate.py                 # the shipped model, full run
    python scripts/evaluate.py --quick         # a few prompts, for development (< 5 min on 2 cores)
    python scripts/evaluate.py --model runs/scenes-32/pipeline --out outputs/eval/mine
    python scripts/evaluate.py --model runs/v2 --out outputs/eval/latest   # a run folder: its last checkpoint
    python scripts/evaluate.py --model runs/v3 --fresh-seeds 50000 --seeds 24 --tasks color_attr two_object
"""

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

from crossattn.control import check_factor
from crossattn.text import dropped_words
from unet.cli import (
    MAX_SEED,
    UsageError,
    add_model_argument,
    check_guidance,
    check_out_dir,
    interrupted,
    partial_folder,
    publish,
    sigterm_as_interrupt,
    usage_error,
)
from unet.eval.control import CONTROLS, fmt, run_control_evaluation
from unet.eval.control import write as write_control
from unet.eval.evaluate import (
    paired_prompts,
    paired_relations,
    prompt_following_on_fresh_seeds,
    relation_word_similarity,
    run_evaluation,
)
from unet.eval.evaluate64 import prompt_following64_on_fresh_seeds, run_evaluation64
from unet.eval.layout import COMBOS, POSITION_PAIRS, key_separation, layout_prompt, layout_response
from unet.eval.prompts import PAIRED_AXES, TASKS, eval_prompts
from unet.eval.prompts64 import eval_prompts64
from unet.eval.report import (
    and_order_markdown,
    check_readme,
    guidance_words,
    guided_at,
    layout_markdown,
    refresh_readme,
    relations_markdown,
    write,
    write64,
)
from unet.folders import WRITE_ERRORS, write_failed
from unet.pipeline import SCHEDULERS, default_guidance, load_pipeline, model_label
from unet.train import run_pipeline


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_argument(p, "pipeline folder, or a training run folder (its checkpoint's EMA weights, any text side)")
    p.add_argument("--out", default=None, help="report folder (default: outputs/eval/<date>, or <date>-2 ... if taken)")
    p.add_argument("--overwrite", action="store_true", help="replace the report already in --out")
    p.add_argument("--seeds", type=int, default=None, help="images per prompt (default 8, quick 2)")
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the model's own)")
    p.add_argument("--guidance-max-t", type=int, default=None,
                   help="guide only at timesteps <= this (default: the model's own; none for the shipped model)")
    p.add_argument("--scheduler", default="ddim", choices=list(SCHEDULERS),
                   help="sampler (default ddim; dpm = DPM-Solver++, which needs fewer --steps)")
    p.add_argument("--dataset-images", type=int, default=None,
                   help="dataset scenes for exact-mask maps (default 128, quick 32)")
    p.add_argument("--dataset-timestep", type=int, default=300)
    p.add_argument("--quick", action="store_true", help="3 prompts per task, fewer seeds")
    p.add_argument("--relations-only", action="store_true",
                   help="only whether relation words move the objects (paired from the same noise) and how alike "
                        "the text encoder makes them: a few minutes, for watching a run (a snapshot or --model RUN)")
    p.add_argument("--fresh-seeds", type=int, default=None, metavar="BASE",
                   help="only prompt following (no maps), on --seeds images per prompt from seed BASE: noise the "
                        "report's seeds never use, the same for every model, to tell a difference from noise "
                        "(e.g. --fresh-seeds 50000 --seeds 24); a scenes-64 model: all seven of its tasks")
    p.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS),
                   help="with --fresh-seeds, a scenes-32 model: the tasks to sample (default: all)")
    p.add_argument("--last-step", action="store_true",
                   help="with --model RUN (a training run folder): evaluate the checkpoint's last-step weights, "
                        "not their EMA (which the run's pipeline holds)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--readme", default=None, metavar="PAGE",
                   help="also rewrite the maps tables of this page (its '<!-- maps: begin -->' ... "
                        "'<!-- maps: end -->' block) from the new report, e.g. docs/model-card.md (then copy it to "
                        "the model folder's README.md)")
    p.add_argument("--control", choices=CONTROLS, default=None,
                   help="measure one control instead: with and without it on the same prompts and seeds "
                        "(unet/eval/control.py)")
    p.add_argument("--reweight-factor", type=float, default=2.0,
                   help="--control reweight: factor on the colour and shape words (default 2)")
    args = p.parse_args(argv)
    # 0 is a value, not "the default": only a missing flag takes the default
    args.seeds = (2 if args.quick else 8) if args.seeds is None else args.seeds
    args.dataset_images = (32 if args.quick else 128) if args.dataset_images is None else args.dataset_images
    return args


def default_out(args) -> Path:
    date = datetime.date.today().isoformat()
    if args.relations_only:
        return Path("outputs/eval") / f"relations-{date}"
    if args.fresh_seeds is not None:
        return Path("outputs/eval") / f"fresh-seeds-{date}"
    return Path("outputs/eval") / (date if args.control is None else f"control-{args.control}-{date}")


def check_fresh_seeds(base: int, prompts: int) -> None:
    """Both worlds seed each batch with BASE + its first prompt's index: the last one must be a seed too."""
    last = prompts - 1
    if not 0 <= base <= MAX_SEED - last:
        raise UsageError(f"--fresh-seeds must be a seed from 0 to {MAX_SEED - last} (the evaluation seeds its "
                         f"batches from BASE to BASE + {last}), got {base}")


def check_args(args) -> None:
    """Everything that needs no model, before it is loaded: raise UsageError naming the value and what is accepted."""
    for flag, value in (("--seeds", args.seeds), ("--steps", args.steps), ("--dataset-images", args.dataset_images)):
        if value < 1:
            raise UsageError(f"{flag} must be a positive integer, got {value}")
    check_guidance(args.guidance)
    try:
        check_factor("--reweight-factor", args.reweight_factor)
    except ValueError as e:
        raise UsageError(str(e)) from e
    check_out_dir(default_out(args) if args.out is None else args.out)
    for alone, flag in (("--relations-only", args.relations_only), ("--fresh-seeds", args.fresh_seeds is not None)):
        if flag and (args.control is not None or args.readme is not None):
            raise UsageError(f"{alone} is a measurement of its own; leave out "
                             f"{'--control' if args.control is not None else '--readme'}")
    if args.relations_only and args.fresh_seeds is not None:
        raise UsageError("--relations-only and --fresh-seeds are two measurements; give one")
    if args.tasks != list(TASKS) and args.fresh_seeds is None:
        raise UsageError("--tasks chooses what --fresh-seeds samples; a full evaluation runs every task")
    if args.fresh_seeds is not None:
        check_fresh_seeds(args.fresh_seeds, len([p for p in eval_prompts() if p.task in args.tasks]))
    if args.readme is not None:
        try:
            check_readme(Path(args.readme))
        except ValueError as e:
            raise UsageError(f"--readme: {e}") from e
    if args.out is not None:
        out = Path(args.out)
        if out.is_dir() and any(out.iterdir()) and not args.overwrite:
            raise UsageError(f"--out {out} already holds a report; pass --overwrite to replace it, or choose "
                             "another --out")


def check_model_args(pipe, args) -> None:
    """What needs the model: steps and the dataset timestep within the scheduler's training timesteps, a tokenizer
    long enough for every prompt the evaluation samples (a cut prompt would be judged on words the model never
    saw), and for a model of world scenes-64 (`pipe.world`), only the measurement that has its prompts."""
    if pipe.world == "scenes-64":
        scenes_32_only = (("--relations-only", args.relations_only), ("--tasks", args.tasks != list(TASKS)),
                          ("--control", args.control is not None), ("--readme", args.readme is not None))
        for flag, given in scenes_32_only:
            if given:
                raise UsageError(f"{flag} measures scenes-32's prompts; {model_label(args.model)} is a model of world "
                                 "scenes-64, which takes the full evaluation of its own world (leave out the flag)")
        prompts = [p.prompt for p in eval_prompts64()]
        if args.fresh_seeds is not None:
            check_fresh_seeds(args.fresh_seeds, len(prompts))
    else:
        prompts = [p.prompt for p in eval_prompts()] + [p.prompt for axis in PAIRED_AXES for p in paired_prompts(axis)]
        prompts += [layout_prompt(template, combo, word) for first, second, _, template in POSITION_PAIRS
                    for combo in COMBOS for word in (first, second)]
    for prompt in dict.fromkeys(prompts):
        dropped = dropped_words(pipe.tokenizer, prompt)
        if dropped:
            raise UsageError(f"the model's tokenizer ({pipe.tokenizer.model_max_length} tokens) cuts the evaluation "
                             f"prompt {prompt!r} after {' '.join(prompt.split()[:-len(dropped)])!r}: this model "
                             "cannot be evaluated on it")
    limit = pipe.scheduler.config.num_train_timesteps
    if args.steps > limit:
        raise UsageError(f"--steps must be at most {limit} (the scheduler's training timesteps), got {args.steps}")
    if not 0 <= args.dataset_timestep < limit:
        raise UsageError(f"--dataset-timestep must be a training timestep from 0 to {limit - 1}, "
                         f"got {args.dataset_timestep}")


def load_model(args):
    """A pipeline folder, or a training run folder (train_config.json and checkpoint.safetensors, no pipeline)."""
    folder = Path(args.model) if args.model else None
    if folder is not None and (folder / "train_config.json").is_file() and not (folder / "model_index.json").exists():
        if not (folder / "checkpoint.safetensors").is_file():
            raise UsageError(f"--model {folder} is a run folder without a checkpoint.safetensors to evaluate")
        try:
            return run_pipeline(folder, args.scheduler, ema=not args.last_step)
        except (ValueError, TypeError, RuntimeError, OSError) as e:  # TypeError: a config key this code lacks
            raise UsageError(f"--model {folder}: not a run folder this code can load: {e}") from e
    if args.last_step:
        raise UsageError(f"--last-step reads a training run folder's checkpoint; --model {args.model} is not one "
                         "(give the run folder, the one with train_config.json and checkpoint.safetensors)")
    return load_pipeline(args.model, scheduler=args.scheduler, show_progress=not args.quiet)


def evaluated_model(args) -> str:
    """What the report calls the model: the folder (or shipped name) given, and whether it is a run's last step."""
    return model_label(args.model) + (" (last-step weights)" if args.last_step else "")


def main(argv=None) -> int:
    args = parse_args(argv)
    with sigterm_as_interrupt():
        try:
            check_args(args)
            pipe = load_model(args)
            check_model_args(pipe, args)
            if args.guidance_max_t is not None:
                pipe.register_to_config(guidance_max_t=args.guidance_max_t)
        except UsageError as e:
            return usage_error(e)
        except KeyboardInterrupt as e:
            return interrupted(e, "nothing was written")
        torch.manual_seed(0)
        try:
            main_of = (relations_main if args.relations_only else
                       evaluation64_main if pipe.world == "scenes-64" else
                       fresh_seeds_main if args.fresh_seeds is not None else evaluation_main)
            return (main_of if args.control is None else control_main)(pipe, args)
        except WRITE_ERRORS as e:
            return write_failed(e, "the report")
        except KeyboardInterrupt as e:
            return interrupted(e, "no report written (reports appear only when complete)")


def publish_report(args, write_into) -> Path:
    """Write the report into a partial folder with `write_into(folder)`, then rename it into place whole: --out
    (replaced only with --overwrite, or when empty), or the default folder (a new -2, -3 ... if taken)."""
    out = Path(args.out) if args.out is not None else default_out(args)
    replace = args.out is not None and (args.overwrite or (out.is_dir() and not any(out.iterdir())))
    with partial_folder(out.parent) as tmp:
        write_into(tmp)
        return publish(tmp, out, replace=replace)


def evaluation_main(pipe, args) -> int:
    report, records, batches, selection = run_evaluation(
        pipe, seeds=args.seeds, steps=args.steps, guidance=args.guidance, dataset_images=args.dataset_images,
        dataset_timestep=args.dataset_timestep, quick=args.quick, progress=not args.quiet)
    report["model"] = evaluated_model(args)
    report["settings"]["scheduler"] = args.scheduler
    report["settings"].update(guided_at(pipe))
    report["date"] = datetime.date.today().isoformat()
    title = f"Evaluation of {report['model']} ({report['date']})"
    out = publish_report(args, lambda folder: write(report, records, batches, selection, folder, title))
    if args.readme is not None:
        refresh_readme(Path(args.readme), report, str(out / "report.json"))
        print(f"maps tables rewritten in {args.readme}")
    pf = report["prompt_following"]
    print(f"prompt following overall {pf['overall']:.3f}; shape-word mIoU {report['maps']['shape_words']['miou']:.3f}"
          f", pointing {report['maps']['shape_words']['pointing']:.3f}")
    print(f"report: {out / 'report.md'}")
    return 0


def evaluation64_main(pipe, args) -> int:
    """The evaluation of a model of world scenes-64 (`run_evaluation64`: seven tasks with held-out prompts apart, the
    maps of count, size, colour and shape words), as report.json and report.md. --quick: fewer seeds and dataset
    images, every prompt. --fresh-seeds BASE: the seven tasks alone on other noise, no maps
    (`prompt_following64_on_fresh_seeds`)."""
    fresh = args.fresh_seeds is not None
    report = (prompt_following64_on_fresh_seeds(pipe, args.seeds, args.fresh_seeds, args.steps, args.guidance)
              if fresh else
              run_evaluation64(pipe, seeds=args.seeds, steps=args.steps, guidance=args.guidance,
                               dataset_images=args.dataset_images, dataset_timestep=args.dataset_timestep))
    report["model"], report["world"] = evaluated_model(args), "scenes-64"
    report["settings"]["scheduler"] = args.scheduler
    report["settings"].update(guided_at(pipe))
    report["date"] = datetime.date.today().isoformat()
    title = (f"Prompt following of {report['model']} on fresh seeds" if fresh else
             f"Evaluation of {report['model']}") + f", world scenes-64 ({report['date']})"
    out = publish_report(args, lambda folder: write64(report, folder, title))
    pf = report["prompt_following"]
    headline = f"prompt following overall {fmt(pf['overall'])} (held-out prompts {fmt(pf['held_out']['overall'])})"
    if fresh:
        print(f"{headline}, {args.seeds} images per prompt from seed {args.fresh_seeds}")
    else:
        shapes = report["maps"]["shape_words"]
        print(f"{headline}; shape-word mIoU {fmt(shapes['miou'])}, pointing {fmt(shapes['pointing'])}")
    print(f"report: {out / 'report.md'}")
    return 0


def relations_main(pipe, args) -> int:
    """`--relations-only`: the paired relation response, the relation words' similarity, the layout response and
    the key separation, as report.json and report.md."""
    guidance = default_guidance(pipe) if args.guidance is None else args.guidance
    report = {"model": evaluated_model(args), "date": datetime.date.today().isoformat(),
              "settings": {"seeds": args.seeds, "steps": args.steps, "guidance": guidance,
                           "scheduler": args.scheduler, "relations_only": True, **guided_at(pipe)},
              "relation_response_paired": paired_relations(pipe, args.seeds, args.steps, guidance),
              "relation_word_similarity": relation_word_similarity(pipe),
              "layout_response": layout_response(pipe, steps=args.steps), "key_separation": key_separation(pipe)}

    def write_into(folder: Path) -> None:
        (folder / "report.json").write_text(json.dumps(report, indent=1))
        (folder / "report.md").write_text("\n".join([f"# Relations of {report['model']} ({report['date']})", "",
                                                     f"{args.seeds} seeds, {args.steps} steps, "
                                                     f"{guidance_words(report['settings'])}.", "",
                                                     *relations_markdown(report), *layout_markdown(report)]))

    out = publish_report(args, write_into)
    print(json.dumps({"relation_response_paired": {k: v["response"] for k, v in
                                                   report["relation_response_paired"].items()},
                      "layout_response": {k: v["response"] for k, v in report["layout_response"]["pairs"].items()}}))
    print(f"report: {out / 'report.json'}")
    return 0


def fresh_seeds_main(pipe, args) -> int:
    """`--fresh-seeds BASE`: prompt following alone on other noise, as report.json and report.md."""
    result = prompt_following_on_fresh_seeds(pipe, args.seeds, args.fresh_seeds, args.steps, args.guidance,
                                             tuple(args.tasks), progress=not args.quiet)
    result["settings"].update(scheduler=args.scheduler, **guided_at(pipe))
    report = {"model": evaluated_model(args), "date": datetime.date.today().isoformat(),
              "prompt_following": result}
    lines = [f"# Prompt following of {report['model']} on fresh seeds ({report['date']})", "",
             f"{args.seeds} images per prompt from seed {args.fresh_seeds}, {args.steps} "
             f"{args.scheduler.upper()} steps, {guidance_words(result['settings'])}.", "",
             "| task | accuracy | right / images |", "|---|---|---|"]
    lines += [f"| {task} | {fmt(result[task])} | {right} / {n} |" for task, (right, n) in result["right_of"].items()]
    lines += ["", *and_order_markdown(result)]

    def write_into(folder: Path) -> None:
        (folder / "report.json").write_text(json.dumps(report, indent=1))
        (folder / "report.md").write_text("\n".join(lines) + "\n")

    out = publish_report(args, write_into)
    print(json.dumps({task: result[task] for task in args.tasks}))
    print(f"report: {out / 'report.md'}")
    return 0


def control_main(pipe, args) -> int:
    """`scripts/evaluate.py --control NAME`: run, write the report, print its headline; returns the exit code."""
    date = datetime.date.today().isoformat()
    report, records = run_control_evaluation(pipe, args.control, args.seeds, args.steps, args.guidance, args.quick,
                                             args.reweight_factor, progress=not args.quiet)
    report["model"], report["date"] = evaluated_model(args), date
    report["settings"].update(guided_at(pipe))
    title = f"Control by {args.control}: {report['model']} ({date})"
    out = publish_report(args, lambda folder: write_control(report, records, folder, title))
    if args.control == "edit":
        print(f"swaps succeeded: {fmt(report['with_replay']['ok'])} with replay, "
              f"{fmt(report['without']['ok'])} without ({report['images']} images)")
    else:
        print(f"prompt following {report['overall_plain']:.3f} plain, {report['overall_controlled']:.3f} with "
              f"{args.control}; {report['seconds_per_image_plain']:.2f} vs "
              f"{report['seconds_per_image_controlled']:.2f} s per image")
    print(f"report: {out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
