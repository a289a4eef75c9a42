"""Train the text-to-image model from scratch on synthetic scenes.

    python scripts/train.py --recipe scenes-32 --out runs/scenes-32   # the shipped model's recipe, from nothing
    python scripts/train.py --recipe scenes-64 --out runs/s64 --rounds 1  # only the first of the recipe's rounds
    python scripts/train.py --recipe scenes-32 --out runs/lr --lr 1e-3  # the recipe with one field changed
    accelerate launch scripts/train.py --recipe scenes-32 --out runs/g  # GPUs / machines / CPU processes
    python scripts/train.py --out runs/scenes-32 --steps 5000 --resume  # continue (or extend) a run
    python scripts/train.py --make-data data/scenes --num-samples 30000 # write a dataset folder
    python scripts/train.py --grow-from runs/v1 --out runs/v1-pos --position-embedding --steps 16600

--grow-from, a research tool (no recipe needs it), continues a trained run in a new folder (the old one is only
read) with parts added that start at identity -- position embeddings, pooled text, self-attention at more levels,
side hints on the text (`--text-variant side-hints`, a study's ablation: unet/research/text_variants.py) -- or
another data mix: the same step, batches, optimizer moments and random streams, so it pairs step for step with the
run it came from. That is how the levers are measured on a trained model
(docs/experiments/levers-grown-from-the-trained-model.md).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path

from crossattn.text import load_text_encoder, load_tokenizer
from unet import checkpoint
from unet.cli import UsageError, check_out_dir, interrupted, sigterm_as_interrupt, usage_error
from unet.data import SceneDataset
from unet.eval.layout_log import LayoutLog
from unet.folders import WRITE_ERRORS, hold_folder, write_failed
from unet.pipeline import progress_bars
from unet.recipe_file import dump_recipe, known_recipes, leaving_cooldown, read_recipe, read_rounds, round_configs
from unet.train import NonFiniteLoss, TrainConfig, Trainer, check_resumable, is_trained, resolved_header, resumed_config

SCHEDULE = ("lr_schedule", "min_lr", "decay_start", "decay_steps")  # the learning-rate schedule's settings
# what --grow-from may change in the run it continues; None in the parser means "as that run had it"
GROWTH = ("position_embedding", "pooled_text", "self_attention", "single_share", "colourless_share", "and_order",
          "caption_dropout", "text_variant", "side_hint_gain", "timestep_sampling", "layout_share", "layout_fraction",
          "layout_every", "layout_seeds", "text_lr", "grounding_weight", "pixel_grounding_weight",
          "key_separation_weight", "key_margin", *SCHEDULE)
# every setting by its flat name (the flag's, `TrainConfig.from_flat`'s), at its default
DEFAULTS = TrainConfig().flat()


HELP = {  # the settings whose name alone does not say enough; every other one shows its default
    "and_order": "where an \"and\" caption puts its first object: 'any' side of the second, or 'reading': left "
                 "of or above it, so \"a circle and a square\" reads left to right or top to bottom "
                 "(default: {default})",
    "world": "the synthetic world the scenes come from: 'scenes-32' (4 colours, 3 shapes, one or two objects) or "
             "'scenes-64' (8 colours, 6 shapes, 2 sizes, counts 1-4; docs/guides/scenes-64.md) (default: {default})",
    "steps": "step to train to (default: {default}; with --resume or --grow-from, the run's own)",
    "muon_update_rms": "with --optimizer muon, the RMS of a hidden matrix's update per unit of --lr: 0.2 matches "
                       "AdamW's, so --lr means the same for both; a larger one steps the matrices faster than the "
                       "embeddings, norms and biases (default: {default})",
    "data_workers": "draw the fresh scenes of the coming steps in N worker processes while the model trains: the "
                    "same batches, so the same run. Worth it on a GPU, where drawing scenes in the loop leaves it "
                    "idle; on a 2-core CPU the workers only take the training's core (default: {default}: in the "
                    "loop; a --resume uses its own call's count)",
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", metavar="NAME|FILE", default=None,
                   help="train from a recipe file: a name in recipes/ (" + ", ".join(known_recipes()) + ") or the "
                        "path of a .toml file (a run's recipe.resolved.toml trains that run again); the flags below "
                        "override single fields of it. Without --recipe the defaults are the plain setting, no "
                        "lesson on (not the shipped model's recipe)")
    p.add_argument("--out", default=DEFAULTS["out"], help="run folder: checkpoint, samples, loss log, final pipeline")
    p.add_argument("--data", default=None,
                   help="dataset folder written by --make-data (default: draw scenes in memory)")
    p.add_argument("--make-data", metavar="DIR", help="only write --num-samples scenes to DIR and exit")
    p.add_argument("--clip", default=None,
                   help="local CLIP folder (tokenizer + text encoder) to use, frozen unless --text-lr is above 0")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint.safetensors")
    p.add_argument("--grow-from", metavar="RUN", default=None,
                   help="continue the run folder RUN in the new folder --out, with the changes given among "
                        "--position-embedding, --pooled-text, --self-attention-levels, --single-share, "
                        "--colourless-share, --and-order, --caption-dropout, --text-variant side-hints, "
                        "--side-hint-gain, "
                        "--timestep-sampling (with --layout-share, --layout-fraction), "
                        "--clip (the U-Net continues on that frozen text side), --text-lr (RUN's CLIP text encoder "
                        "trains too), --grounding-weight, --pixel-grounding-weight, "
                        "--key-separation-weight (with --key-margin), --lr-schedule (with --min-lr, --decay-start, "
                        "--decay-steps: a cooldown of a constant run) (everything else as RUN has it); RUN is only "
                        "read")
    p.add_argument("--start-from", metavar="MODEL", default=None,
                   help="start this new run from the weights of a trained pipeline (a folder, or a shipped model's "
                        "name such as scenes-64) instead of from nothing: step 0, the recipe's or flags' schedule, "
                        "fresh optimizer moments, and the settings must rebuild MODEL's world, vocabulary and "
                        "architecture. For a model whose run folder is gone; a run folder continues with --resume "
                        "or --grow-from")
    p.add_argument("--rounds", type=int, metavar="N", default=None,
                   help="train only the first N rounds of the recipe: round 1 is its own schedule, in --out; each "
                        "[[round]] after it trains on from the pipeline of the one before, in OUT/round-K "
                        "(default: all it has; a flag changes every round but what a [[round]] gives itself; "
                        "--max-minutes holds for each round; --resume continues the round it stopped in, then the "
                        "rest)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    for name, value in DEFAULTS.items():
        if name in ("out", "data", "clip", "resume", "sample_prompts", "grown_from", "started_from") or isinstance(
                value, tuple):
            continue
        default = None if name in GROWTH or name == "steps" else value
        if isinstance(value, bool):
            p.add_argument("--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=default,
                           help=f"(default: {value})")
            continue
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=default,
                       help=HELP.get(name, f"(default: {value})").format(default=value))
    p.add_argument("--channels", type=int, nargs="+", default=list(DEFAULTS["channels"]), help="width per level")
    p.add_argument("--self-attention-levels", type=int, nargs="*", default=None, metavar="LEVEL",
                   help="levels (0 = full resolution) whose transformers self-attend before they cross-attend; "
                        f"the middle always does (default: {levels(DEFAULTS['self_attention'])})")
    args = p.parse_args(argv)
    for action in p._actions:  # parse again with no defaults: what is left is what the command line gave
        action.default = argparse.SUPPRESS
    args.given = set(vars(p.parse_args(argv)))
    return args


def levels(flags) -> list[int]:
    return [i for i, on in enumerate(flags) if on]


def self_attention_flags(chosen: list[int], count: int) -> tuple:
    """--self-attention-levels as one flag per level; UsageError for a level the U-Net does not have."""
    bad = [i for i in chosen if not 0 <= i < count]
    if bad:
        raise UsageError(f"--self-attention-levels {bad[0]}: the U-Net has levels 0 to {count - 1} "
                         f"(one per --channels entry)")
    return tuple(i in chosen for i in range(count))


def given_settings(args, channels: tuple) -> dict:
    """The settings (flat names) the command line gave: --channels as a tuple, and --self-attention-levels as one
    flag per level of the given --channels, else of `channels` (the run's or the recipe's)."""
    given = {name: getattr(args, name) for name in args.given if name in DEFAULTS}
    if "channels" in given:
        given["channels"] = tuple(given["channels"])
    if "self_attention_levels" in args.given:
        count = len(given.get("channels", channels))
        given["self_attention"] = self_attention_flags(args.self_attention_levels, count)
    return given


def saved_config(out: Path) -> dict | None:
    """A run folder's train_config.json; None where it cannot be read (check_resumable then says why)."""
    try:
        saved = json.loads((out / "train_config.json").read_text())
    except (OSError, ValueError):
        return None
    return saved if isinstance(saved, dict) else None


def saved_steps(out: Path) -> int | None:
    """The length a run folder was started with, which a --resume without --steps trains to; None where the
    folder's config cannot say."""
    steps = (saved_config(out) or {}).get("steps")
    return steps if isinstance(steps, int) and not isinstance(steps, bool) else None


# settings of one call, not of the run: a continued run takes them from its command line
CALL_SETTINGS = ("out", "steps", "max_minutes", "data_workers", "resume", "grown_from", "started_from")


def refuse_dropped(args, run: TrainConfig, may_change: tuple, why: str) -> None:
    """UsageError for a setting the command line gave that differs from the continued `run`'s and that the call
    cannot change (it would be dropped without a word). A flag repeated with the run's own value is fine."""
    given, settings = given_settings(args, run.model.channels), run.flat()
    for name, value in given.items():
        if name in CALL_SETTINGS or name in may_change:
            continue
        have = settings[name]
        if (list(value) == list(have)) if name in ("channels", "self_attention") else value == have:
            continue
        flag = "self-attention-levels" if name == "self_attention" else name.replace("_", "-")
        shown = levels(value) if name == "self_attention" else list(value) if name == "channels" else value
        kept = levels(have) if name == "self_attention" else list(have) if name == "channels" else have
        raise UsageError(f"--{flag} {shown} cannot take effect: {why} (here {kept})")


def training_config(args) -> TrainConfig:
    """The TrainConfig the command line asks for; with --grow-from, RUN's own, changed only as given."""
    if args.recipe is not None:
        return recipe_config(args)
    values = {name: getattr(args, name) for name in DEFAULTS if hasattr(args, name)}
    values["channels"] = tuple(values["channels"])
    schedule_flags = [name for name in SCHEDULE if values.get(name) is not None]
    if args.resume and schedule_flags:
        raise UsageError(f"--{schedule_flags[0].replace('_', '-')} with --resume: a resumed run keeps its saved "
                         "learning-rate schedule, so that it continues exactly; to change it (e.g. a cooldown), "
                         "--grow-from the run into a new folder")
    if args.grow_from is None:
        if values["steps"] is None:
            values["steps"] = (args.resume and saved_steps(Path(args.out))) or DEFAULTS["steps"]
        if values.get("side_hint_gain") is not None and values.get("text_variant") != "side-hints":
            raise UsageError(f"--side-hint-gain {values['side_hint_gain']}: it applies only with --text-variant "
                             "side-hints (or when --grow-from adds them)")
        for name in GROWTH:
            if values.get(name) is None:
                values[name] = DEFAULTS[name]
        if args.self_attention_levels is not None:
            values["self_attention"] = self_attention_flags(args.self_attention_levels, len(values["channels"]))
        return TrainConfig.from_flat(**values)
    if args.resume:
        raise UsageError("--grow-from starts a new run folder from RUN; --resume continues --out itself: give one")
    source = Path(args.grow_from)
    check_resumable(source, flag="--grow-from")
    saved = json.loads((source / "train_config.json").read_text())
    steps = args.steps if args.steps is not None else saved.get("steps", DEFAULTS["steps"])
    cfg = resumed_config(TrainConfig.from_flat(out=args.out, steps=steps, max_minutes=args.max_minutes,
                                               data_workers=args.data_workers), saved)
    step = checkpoint.read_metadata(source / "checkpoint.safetensors")[0]["step"]
    if cfg.grown_from is not None and cfg.grown_from.rsplit("@", 1)[-1] == step:
        raise UsageError(f"{source} was grown from {cfg.grown_from} and has not saved a step of its own: its "
                         f"checkpoint's text weights may still be its source's; train {source} first, or grow "
                         "from its source")
    refuse_dropped(args, cfg, (*GROWTH, "clip", "self_attention"),
                   f"--grow-from keeps what {source} has except the settings its help lists")
    changes = leaving_cooldown({name: values[name] for name in GROWTH if values.get(name) is not None})
    cooldown = changes.get("lr_schedule", cfg.schedule.lr_schedule) == "cooldown"
    if cooldown and changes.get("decay_start", int(step)) < int(step):
        raise UsageError(f"--decay-start {changes['decay_start']}: {source} is at step {step} already, so the decay "
                         f"would start part-way down; give --decay-start {step} or later")
    if args.self_attention_levels is not None:
        flags = self_attention_flags(args.self_attention_levels, len(cfg.model.channels))
        dropped = [i for i in levels(cfg.model.self_attention) if not flags[i]]
        if dropped:
            raise UsageError(f"--self-attention-levels must keep the levels {source} self-attends at "
                             f"({levels(cfg.model.self_attention)}); dropping level {dropped[0]} would lose trained "
                             "weights")
        changes["self_attention"] = flags
    for name in ("position_embedding", "pooled_text"):
        if getattr(cfg.model, name) and changes.get(name) is False:
            flag = name.replace("_", "-")
            raise UsageError(f"{source} has --{flag}; --no-{flag} would lose trained weights")
    variant = changes.get("text_variant", cfg.text.text_variant)
    if variant != cfg.text.text_variant and (cfg.text.text_variant, variant) != ("clip", "side-hints"):
        raise UsageError(f"--text-variant {variant}: a run grown from {source} ({cfg.text.text_variant}) keeps its "
                         "text side, or adds side hints to CLIP's (--text-variant side-hints); any other change would "
                         "not start where the run stopped")
    gain = changes.get("side_hint_gain", cfg.text.side_hint_gain)
    if gain != cfg.text.side_hint_gain and (variant != "side-hints" or cfg.text.text_variant == "side-hints"):
        why = ("it applies only with --text-variant side-hints" if variant != "side-hints" else
               f"{source} has side hints at gain {cfg.text.side_hint_gain}; another would change what its table adds")
        raise UsageError(f"--side-hint-gain {gain}: {why}")
    if int(step) >= cfg.schedule.steps:
        raise UsageError(f"--steps {cfg.schedule.steps}: {source} is at step {step} already; give --steps above it")
    if args.clip is not None:
        changes["clip"] = frozen_text_side(args.clip, cfg, source, variant)
    text_lr = changes.get("text_lr", cfg.text.text_lr)
    if cfg.text.text_lr and not text_lr:
        raise UsageError(f"--text-lr 0: {source} trained its CLIP's text encoder, and a frozen one would be the "
                         f"folder's {cfg.text.clip}, losing what it learned")
    if text_lr and cfg.text.clip is None and args.clip is not None:
        raise UsageError(f"--text-lr with --clip {args.clip}: grow {source} onto that frozen CLIP first, then grow "
                         "that run with --text-lr (the checkpoint's text weights are its source's own until then)")
    return cfg.replace(**changes, grown_from=f"{source}@{step}", resume=False)


def command_config(args) -> TrainConfig:
    """The TrainConfig of the whole command line: `training_config`'s, starting from the trained pipeline
    --start-from names (its weights are loaded by the Trainer, which checks that this config rebuilds them).
    UsageError for --start-from with --resume or --grow-from: those continue a run folder."""
    if args.start_from is None:
        return training_config(args)
    for flag in ("resume", "grow_from"):
        if flag in args.given:
            raise UsageError(f"--start-from with --{flag.replace('_', '-')}: --start-from begins a new run from a "
                             f"pipeline's weights, --{flag.replace('_', '-')} continues a run folder; give one")
    if not str(args.start_from).strip():
        raise UsageError("--start-from is empty (''): give a pipeline folder or a shipped model's name")
    return training_config(args).replace(started_from=str(args.start_from))


def refuse_changes_on_resume(args) -> None:
    """UsageError for a setting given with --resume that differs from the run's: the run continues with its own."""
    saved, run = saved_config(Path(args.out)), None
    try:
        run = saved and resumed_config(TrainConfig(out=args.out), saved)
    except (TypeError, ValueError):  # a config check_resumable let pass but not a TrainConfig's: nothing to compare
        return
    if run:
        refuse_dropped(args, run, (), f"--resume continues {args.out} with the settings it started with, so that it "
                                      "continues exactly; to change one, --grow-from the run into a new folder")


def recipe_config(args) -> TrainConfig:
    """The TrainConfig of --recipe: the file's fields over TrainConfig's defaults, then each flag the command line
    gave over them."""
    if "resume" in args.given:
        raise UsageError("--recipe with --resume: a resumed run continues with the recipe it started with "
                         "(OUT/recipe.resolved.toml); give --resume alone")
    if "grow_from" in args.given:
        raise UsageError("--recipe with --grow-from: a recipe trains from nothing, --grow-from continues a trained "
                         "run; give one")
    args.recipe_file, values = read_recipe(args.recipe)
    cfg = TrainConfig.from_flat(**values)
    return cfg.replace(**given_settings(args, cfg.model.channels))


def frozen_text_side(clip: str, cfg: TrainConfig, source: Path, variant: str) -> str:
    """--grow-from RUN --clip FOLDER: RUN's U-Net continues on FOLDER's text encoder, frozen (a CLIP trained by
    scripts/train_clip.py, or any CLIP text encoder as wide as the U-Net's Keys expect). UsageError otherwise."""
    if variant != "clip":
        raise UsageError(f"--clip with --grow-from replaces {source}'s text side; --text-variant {variant} cannot "
                         "run on a frozen CLIP")
    if cfg.text.clip is not None and Path(clip).resolve() != Path(cfg.text.clip).resolve():
        raise UsageError(f"{source} trained on the frozen CLIP {cfg.text.clip}; a second replacement is not "
                         "supported")
    try:
        width = load_text_encoder(clip).config.hidden_size
        load_tokenizer(clip)
    except (OSError, ValueError) as e:
        raise UsageError(f"--clip {clip}: {e}") from e
    if width != cfg.text.text_width:
        raise UsageError(f"--clip {clip} encodes text {width} wide; {source}'s U-Net reads Keys and Values from "
                         f"{cfg.text.text_width}: give a CLIP of that width (scripts/train_clip.py --text-width "
                         f"{cfg.text.text_width})")
    return str(clip)


def start_grown(cfg: TrainConfig, source: Path) -> TrainConfig:
    """Make the run folder of a --grow-from: RUN's checkpoint and loss log, this run's config. Returns the
    config to resume it with."""
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source / "checkpoint.safetensors", out / "checkpoint.safetensors")
    if (source / "loss.csv").exists():
        shutil.copy2(source / "loss.csv", out / "loss.csv")  # trimmed to the checkpoint's step when training starts
    (out / "train_config.json").write_text(json.dumps(cfg.flat(), indent=1))
    return cfg.replace(resume=True)


def check_config(cfg: TrainConfig) -> None:
    """Every setting (`TrainConfig.validate`) and the run folder, checked before anything is written."""
    cfg.validate()
    check_out_dir(cfg.out)
    if cfg.resume:
        check_resumable(Path(cfg.out), cfg.schedule.steps)


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
            if args.world != "scenes-32":
                raise ValueError(f"--make-data writes scenes-32's scenes only, not {args.world}'s: a scenes-64 run "
                                 "draws fresh scenes every batch")
            check_out_dir(args.make_data, "--make-data")
            with hold_folder(args.make_data, "--make-data"):  # written in place: one writer at a time
                return make_data(args)
        cfg = command_config(args)
        rounds = Rounds.of(args, cfg)
        plan = rounds.left_to_train(cfg)
        for _, leg in plan:  # every round's settings and folder, before the first is trained
            check_config(leg)
        if cfg.resume:
            refuse_changes_on_resume(args)
        losses = cfg.losses
        unused = not losses.key_separation_weight and losses.key_margin != DEFAULTS["key_margin"]
        if "key_margin" in args.given and unused:
            # (a recipe's weight of 0 with the default margin is fine: only a margin asked for and unused is refused)
            raise UsageError(f"--key-margin {losses.key_margin} applies only with a --key-separation-weight above 0 "
                             "(the margin is where that loss starts pushing two colour words' Keys apart)")
    except (ValueError, OSError, UsageError) as e:
        return usage_error(e)
    except KeyboardInterrupt as e:
        return interrupted(e, "nothing was written")
    # one writer per run folder, for the whole run; only the main process claims it: under `accelerate launch` the
    # others write into it beside that one
    main_process = os.environ.get("RANK", "0") == "0"
    done = []  # the rounds this call trained to their end
    try:
        with hold_folder(cfg.out) if main_process else contextlib.nullcontext():
            for number, leg in plan:
                if number > 1:
                    start = (f"on to step {leg.schedule.steps} from the checkpoint {leg.grown_from}" if leg.grown_from
                             else f"{leg.schedule.steps} steps from {leg.started_from}")
                    print(f"round {number} of {rounds.count}: {start}, seed {leg.run.seed}, in {leg.out}")
                with hold_folder(leg.out) if main_process and number > 1 else contextlib.nullcontext():
                    code = _train(args, leg, rounds.recipe_file, rounds.resolved(number, leg))
                if code or not trained(leg):  # a failure, an interrupt or --max-minutes: the next round waits
                    return code
                done.append(number)
            return 0
    except (UsageError, ValueError) as e:  # the folder is held by another run, or not a new one for --grow-from
        return usage_error(e)
    except KeyboardInterrupt as e:  # while claiming, or between two rounds
        return interrupted(e, f"round {done[-1]} is trained; `python scripts/train.py --out {cfg.out} --resume` "
                              "trains the rest" if done else "nothing was written")


def trained(cfg: TrainConfig) -> bool:
    """Whether the run of `cfg` is done: its checkpoint at its last step and its pipeline written."""
    return is_trained(Path(cfg.out), cfg.schedule.steps)


ROUND_HEADER = ("Round {number} of the recipe in its run folder's recipe.resolved.toml: these settings, started from\n"
                "the pipeline {source}. `python scripts/train.py --recipe RUN/recipe.resolved.toml --out NEW_FOLDER`\n"
                "trains every round again; this file alone trains this round's settings from nothing.")
CONTINUED_HEADER = ("Round {number} of the recipe in its run folder's recipe.resolved.toml: these settings, going on\n"
                    "from the checkpoint of {source} at step {step} (its weights, optimizer moments, EMA and random\n"
                    "states). `python scripts/train.py --recipe RUN/recipe.resolved.toml --out NEW_FOLDER` trains\n"
                    "every round again; this file alone trains these settings from nothing.")


@dataclasses.dataclass
class Rounds:
    """A recipe's rounds (unet/recipe_file.py): its own run (round 1, `first`) and the `[[round]]`s after it, as
    many as --rounds asks (`configs`, rounds 2, 3, ...); `changes` are all of the recipe's, as written."""
    first: TrainConfig
    changes: list
    configs: list
    recipe_file: Path | None  # the recipe as written, which every round's folder keeps

    @classmethod
    def of(cls, args, cfg: TrainConfig) -> Rounds:
        """The rounds of --recipe's file, or on --resume those the run folder's resolved recipe lists: its own
        settings, the call's (--max-minutes, --data-workers) over them. UsageError for a --rounds it does not
        have, or for --steps with --resume of a run with rounds."""
        out, recipe_file = Path(cfg.out), getattr(args, "recipe_file", None)
        first, changes = cfg, []
        if recipe_file is not None:
            changes = read_rounds(recipe_file)
        elif cfg.resume and (out / "recipe.resolved.toml").is_file():
            resolved = out / "recipe.resolved.toml"
            changes = read_rounds(resolved)
            recipe_file = out / "recipe.toml" if (out / "recipe.toml").is_file() else None
            if changes:
                first = TrainConfig.from_flat(**read_recipe(resolved)[1]).replace(
                    out=cfg.out, max_minutes=cfg.max_minutes, data_workers=cfg.data_workers)
                if "steps" in args.given:
                    raise UsageError(f"--steps with --resume of {out}, a run of a recipe with rounds: each round keeps "
                                     "the length its recipe gives; give --resume alone")
        wanted = len(changes) + 1 if args.rounds is None else args.rounds
        if not changes and wanted != 1:
            raise UsageError(f"--rounds {args.rounds}: this run has no [[round]]s (the tables at the end of a recipe "
                             "that train on from its model); give 1, or leave --rounds out")
        if not 1 <= wanted <= len(changes) + 1:
            raise UsageError(f"--rounds {args.rounds}: the recipe has {len(changes) + 1} rounds (its own schedule "
                             f"and {len(changes)} [[round]]); give 1 to {len(changes) + 1}")
        configs = round_configs(first, changes, out)  # every round checked, even those --rounds leaves for later
        return cls(first, changes, configs[:wanted - 1], recipe_file)

    @property
    def count(self) -> int:
        return 1 + len(self.configs)

    def left_to_train(self, cfg: TrainConfig) -> list[tuple[int, TrainConfig]]:
        """(round number, config) of each round to train: all of them, or on --resume those not yet trained, the
        first resumed where its folder has a checkpoint. UsageError when every round is trained already."""
        plan = [(1, cfg)] + list(enumerate(self.configs, start=2))
        if cfg.resume and self.changes:
            left = [i for i, (_, leg) in enumerate(plan) if not trained(leg)]
            if not left:
                rest = len(self.changes) + 1 - self.count  # the rounds --rounds left out
                what = (f"rounds 1 to {self.count} of its recipe's {self.count + rest} are trained (--rounds "
                        f"{self.count + 1} trains the next)" if rest else "every round of its recipe is trained")
                raise UsageError(f"--resume {cfg.out}: {what}; its model is {plan[-1][1].out}/pipeline")
            plan = plan[left[0]:]
            number, leg = plan[0]
            if number > 1 and (Path(leg.out) / "checkpoint.safetensors").is_file():
                plan[0] = (number, leg.replace(resume=True))
        for number, leg in plan:  # a new round's folder holds nothing yet: what is there would be overwritten
            folder = Path(leg.out)
            if number > 1 and not leg.resume and folder.is_dir() and any(folder.iterdir()):
                raise UsageError(f"round {number}'s folder {folder} holds files already (a round of another run?): "
                                 "move it away, or give --resume to continue the run it belongs to")
        return plan

    def resolved(self, number: int, cfg: TrainConfig) -> str | None:
        """The resolved recipe the folder of round `number` keeps: round 1's lists every round, a later round's
        is its own settings (None: no rounds, the Trainer's own)."""
        if not self.changes:
            return None
        if number == 1:
            return dump_recipe(self.first, resolved_header(self.first), self.changes)
        if cfg.grown_from is not None:
            source, step = cfg.grown_from.rsplit("@", 1)
            return dump_recipe(cfg, CONTINUED_HEADER.format(number=number, source=source, step=step))
        return dump_recipe(cfg, ROUND_HEADER.format(number=number, source=cfg.started_from))


def _train(args, cfg: TrainConfig, recipe_file: Path | None = None, resolved: str | None = None) -> int:
    """Train in the claimed run folder, keeping the recipe as written (`recipe_file`) and, where given, the
    `resolved` one in it; undo a failed start."""
    out = Path(cfg.out)
    if args.grow_from is not None and out.exists() and any(out.iterdir()):
        raise UsageError(f"--out {cfg.out} is not empty: --grow-from starts a new run folder")
    before = _entries(out)
    grown = cfg.grown_from is not None and not cfg.resume  # --grow-from, or a round that continues the one before
    try:
        if grown:
            cfg = start_grown(cfg, Path(cfg.grown_from.rsplit("@", 1)[0]))
        trainer = Trainer(cfg, callbacks=[LayoutLog()])  # logs only if the run's settings ask (--layout-every)
        main_process = trainer.accelerator.is_main_process
        if (grown or not cfg.resume) and main_process:
            if recipe_file is not None:  # the file as written, its comments saying why
                shutil.copy(recipe_file, out / "recipe.toml")
            if resolved is not None:
                (out / "recipe.resolved.toml").write_text(resolved)
        if trainer.accelerator.num_processes > 1 and main_process:
            accelerator = trainer.accelerator
            print(f"training on {accelerator.num_processes} processes ({accelerator.device.type}), each on its share "
                  f"of every batch of {trainer.cfg.optimizer.batch_size}")
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
        if trainer.saved_step >= trainer.cfg.schedule.steps:
            return interrupted(e, finish_left(trainer))
        return interrupted(e, f"checkpoint saved at step {trainer.saved_step} in {trainer.ckpt_path}; --resume "
                              "continues")
    except NonFiniteLoss as e:
        if trainer.saved_step is None and not trainer.ckpt_path.exists():
            remove_new(out, before)
            kept = "nothing was written"
        else:
            kept = (f"the checkpoint of step {e.kept if e.kept is not None else trainer.step} in {trainer.ckpt_path} "
                    "is kept as it was")
        print(f"error: training stopped at {e}: {kept}; lower --lr (or the setting that made it diverge) and "
              "train again", file=sys.stderr)
        return 1
    except WRITE_ERRORS as e:  # a full disk or a file-size limit: what was written is whole
        if not trainer.ckpt_path.exists():
            remove_new(out, before)
        return write_failed(e, f"the run in {out}")
    except BaseException:
        if not trainer.ckpt_path.exists():  # nothing to resume from: leave no half-made run folder
            remove_new(out, before)
        raise
    # every process sees the main one's pipeline before it judges the round trained and goes on to the next
    trainer.accelerator.wait_for_everyone()
    if not trainer.accelerator.is_main_process:  # the main process wrote the run folder and says so
        return 0
    if trainer.writes_pipeline:
        print(f"done: pipeline saved to {trainer.out / 'pipeline'}")
    else:
        print(f"done: checkpoint of step {trainer.step} in {trainer.ckpt_path} (a {trainer.cfg.text.text_variant} "
              "text side is not a diffusers part, so no pipeline folder is written; evaluate it with "
              f"scripts/evaluate.py --model {trainer.out})")
    return 0


def finish_left(trainer: Trainer) -> str:
    """What an interrupt during the last writes of a finished run left on disk, and the command that ends it."""
    out = trainer.out
    if not trainer.writes_pipeline or (out / "pipeline" / "model_index.json").is_file():
        return (f"trained to step {trainer.saved_step}; the run is complete (checkpoint {trainer.ckpt_path}"
                f"{', pipeline ' + str(out / 'pipeline') if trainer.writes_pipeline else ''})"
                f"{'' if (out / 'loss_curve.png').is_file() else '; only loss_curve.png was not drawn'}")
    return (f"trained to step {trainer.saved_step} (checkpoint {trainer.ckpt_path}), but the pipeline was not "
            f"written; `python scripts/train.py --out {out} --resume --steps {trainer.cfg.schedule.steps}` writes "
            "it")

if __name__ == "__main__":
    sys.exit(main())
