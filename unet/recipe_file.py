"""A recipe file: every setting that makes a model, in one TOML file, grouped by what it configures.

    python scripts/train.py --recipe scenes-32 --out runs/X             # recipes/scenes-32.toml, from nothing
    python scripts/train.py --recipe my.toml --out runs/Y --lr 1e-3     # a flag overrides one field

Each section holds the fields of one group of `TrainConfig` (unet/train_config.py says what each does), by their
flat names. A field a recipe leaves out keeps TrainConfig's default, which is the plain setting: no lesson on.
What belongs to one call and not to the model (the folder, --resume, a time limit, data workers) is never in a
recipe.

A run trained from a recipe keeps it: the file as written (`recipe.toml`, with its comments saying why) and the
resolved recipe, the file with the command line's overrides applied and every field spelt out
(`recipe.resolved.toml`), go into the run folder and into its pipeline folder. `--recipe RUN/recipe.resolved.toml`
trains the same run again.

A recipe may end in rounds: each `[[round]]` table is one more run, started from the last one's pipeline with fresh
optimizer moments (what `--start-from` does), that changes only its schedule and seed (`ROUND_KEYS`); every other
setting is the recipe's, so every round trains the same model. Round 1 is the recipe's own schedule, in the run
folder; round K trains in RUN/round-K, and the last round's pipeline is the recipe's model.

    [[round]]             # round 2: 6,000 more steps from round 1's weights, on other batches
    seed = 1
    steps = 6000

A round with `continues = true` is the run of the round before, going on (what `--grow-from` does): its checkpoint
copied into RUN/round-K with its step, optimizer moments, EMA and random states, and a new schedule. Its `steps` is
the step it trains to, past the round before's last; its batches go on with that round's seed, so it takes none.

    [[round]]             # round 3: round 2's run on to step 9,000, with a cooldown of its own
    continues = true
    steps = 9000
    decay_start = 8000
    decay_steps = 1000
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .train_config import CALL_ONLY, GROUPS, RETIRED, TrainConfig, flat_names, without_retired

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover -- Python 3.10
    import tomli as tomllib

# the recipes that come with the project; `--recipe NAME` is RECIPES / f"{NAME}.toml"
RECIPES = Path(__file__).resolve().parent.parent / "recipes"

# each section's keys: the flat names of the fields of its group in unet/train_config.py (their one home)
SECTIONS = {section: tuple(flat_names(group)) for section, group in GROUPS.items()}
TOP_LEVEL = ("description",)  # a line saying what the recipe makes
ROUND = "round"  # the array of tables [[round]]: the recipe's further rounds
ROUND_KEYS = (*SECTIONS["schedule"], "seed")  # what a round may change: how long, the rate's course, the batches
CONTINUES = "continues"  # a round's key: true for the run of the round before, going on (its seed goes on too)


class RecipeError(ValueError):
    """A recipe that cannot be read: the message names the file, the field and what is accepted."""


def known_recipes() -> list[str]:
    return sorted(p.stem for p in RECIPES.glob("*.toml"))


def recipe_path(recipe: str | Path) -> Path:
    """A recipe's file: a path to a .toml file, or the name of one in recipes/."""
    path = Path(recipe)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise RecipeError(f"--recipe {recipe}: no such file (a recipe is a .toml file, or one of the names "
                              f"{', '.join(known_recipes())})")
        return path
    if (RECIPES / f"{recipe}.toml").is_file():
        return RECIPES / f"{recipe}.toml"
    raise RecipeError(f"--recipe {recipe}: no recipe of that name; known: {', '.join(known_recipes())} (in "
                      f"{RECIPES}), or give the path of a .toml file")


def _table(path: Path) -> dict:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise RecipeError(f"recipe {path}: not a readable TOML file: {e}") from e


def read_recipe(recipe: str | Path) -> tuple[Path, dict]:
    """(the file, its settings by flat name, for `TrainConfig.from_flat`): RecipeError naming the field for an
    unknown section or key, a value of the wrong type, or a file that is not TOML. Its rounds: `read_rounds`."""
    path = recipe_path(recipe)
    table = _table(path)
    defaults = TrainConfig().flat()
    values, retired = {}, {}
    for section, entries in table.items():
        if section in TOP_LEVEL:
            if not isinstance(entries, str):
                raise RecipeError(f"recipe {path}: {section} must be a string")
            continue
        if section == ROUND:  # read by read_rounds
            continue
        if section not in SECTIONS:
            raise RecipeError(f"recipe {path}: unknown section or key {section!r}; a recipe has the sections "
                              f"{', '.join(f'[{s}]' for s in SECTIONS)}, the rounds [[{ROUND}]] and the key "
                              f"{', '.join(TOP_LEVEL)}")
        if not isinstance(entries, dict):
            raise RecipeError(f"recipe {path}: {section} must be a section ([{section}]), not a value")
        for key, value in entries.items():
            if key in RETIRED:  # an older run's resolved recipe spells out the settings since taken out
                retired[key] = value
                continue
            if key not in SECTIONS[section]:
                home = next((s for s, keys in SECTIONS.items() if key in keys), None)
                where = (f"it belongs in [{home}]" if home else "it is a setting of one call (a flag)"
                         if key in CALL_ONLY else f"[{section}] accepts {', '.join(SECTIONS[section])}")
                raise RecipeError(f"recipe {path}: unknown key {key!r} in [{section}]; {where}")
            values[key] = _typed(path, f"[{section}]", key, value, defaults[key])
    try:
        without_retired({**retired, "timestep_sampling": values.get("timestep_sampling")})
    except ValueError as e:
        raise RecipeError(f"recipe {path}: {e}") from e
    return path, values


def read_rounds(recipe: str | Path) -> list[dict]:
    """The recipe's `[[round]]` tables in order (rounds 2, 3, ...), each the flat settings it changes: RecipeError
    naming the round and key for anything but `ROUND_KEYS`, or a value of the wrong type."""
    path = recipe_path(recipe)
    rounds = _table(path).get(ROUND, [])
    if not isinstance(rounds, list) or not all(isinstance(r, dict) for r in rounds):
        raise RecipeError(f"recipe {path}: {ROUND} must be an array of tables, each headed [[{ROUND}]]")
    defaults, read = {**TrainConfig().flat(), CONTINUES: False}, []
    for number, entries in enumerate(rounds, start=2):
        where = f"round {number}"
        for key in entries:
            if key not in (*ROUND_KEYS, CONTINUES):
                raise RecipeError(f"recipe {path}: unknown key {key!r} in {where}; a round changes only "
                                  f"{', '.join(ROUND_KEYS)}, so that every round trains the same model, and may "
                                  f"say {CONTINUES} = true")
        changes = {key: _typed(path, where, key, value, defaults[key]) for key, value in entries.items()}
        if changes.get(CONTINUES) and "seed" in changes:
            raise RecipeError(f"recipe {path}: {where} continues the round before and so draws its batches on from "
                              "that round's seed; leave seed out, or leave out continues to start afresh on new ones")
        read.append(changes)
    return read


def round_configs(recipe: TrainConfig, rounds: list[dict], out: str | Path) -> list[TrainConfig]:
    """The runs of `rounds` (`read_rounds`) after the recipe's own run `recipe`, in the run folder `out`: round K in
    out/round-K, from the pipeline of the round before, with the recipe's settings but those the round changes; a
    round that `continues` is the round before's run going on from its last step (`grown_from` "FOLDER@STEP").
    ValueError naming the round for a setting that does not hold (`TrainConfig.validate`), or for a continued round
    that does not train past the round before or starts its cooldown before it."""
    if rounds and recipe.text.text_variant != "clip":
        raise ValueError(f"[[{ROUND}]] needs a pipeline to start each round from, and a --text-variant "
                         f"{recipe.text.text_variant} run writes none: rounds are for the clip text side")
    configs, before = [], recipe.replace(out=str(out))
    for number, changes in enumerate(rounds, start=2):
        changes, folder = dict(changes), str(Path(out) / f"round-{number}")
        continues = changes.pop(CONTINUES, False)
        if continues:  # from the round before's checkpoint, at its last step
            cfg = before.replace(**leaving_cooldown(changes), out=folder, resume=False,
                                 grown_from=f"{before.out}@{before.schedule.steps}")
        else:
            cfg = recipe.replace(**changes, out=folder, started_from=str(Path(before.out) / "pipeline"),
                                 resume=False, grown_from=None)
        try:
            cfg.validate()
            if continues:
                check_continued(cfg, before.schedule.steps)
        except ValueError as e:
            raise ValueError(f"round {number}: {e}") from e
        configs.append(cfg)
        before = cfg
    return configs


def leaving_cooldown(changes: dict) -> dict:
    """The schedule `changes` of a run that goes on from another (a continued round, `--grow-from`): one that leaves
    a cooldown for another schedule drops the cooldown's steps, which would no longer apply."""
    if changes.get("lr_schedule") not in (None, "cooldown"):
        return {"decay_start": 0, "decay_steps": 0, **changes}
    return changes


def check_continued(cfg: TrainConfig, last: int) -> None:
    """ValueError for a continued round going on from step `last` that would not train past it, or whose cooldown
    would start before it, part-way down."""
    if cfg.schedule.steps <= last:
        raise ValueError(f"steps {cfg.schedule.steps}: it goes on from step {last}, so give a step above it")
    if cfg.schedule.lr_schedule == "cooldown" and cfg.schedule.decay_start < last:
        raise ValueError(f"decay_start {cfg.schedule.decay_start}: it goes on from step {last}, so the decay would "
                         f"start part-way down; give {last} or later")


def _typed(path: Path, where: str, key: str, value, default):
    """`value` as the type of TrainConfig's `default`, or RecipeError saying (`where`: "[optimizer]", "round 2")
    which type is accepted."""
    def wrong(accepted: str):
        return RecipeError(f"recipe {path}: {where} {key} must be {accepted}, got {json.dumps(value)}")

    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise wrong("true or false")
        return value
    if isinstance(default, int):
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("a whole number")
        return value
    if isinstance(default, float):
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise wrong("a number")
        return float(value)
    if isinstance(default, tuple):  # channels (whole numbers) or per-level flags (true/false)
        kind = bool if isinstance(default[0], bool) else int
        if not isinstance(value, list) or not value or any(type(v) is not kind for v in value):
            raise wrong(f"a list of {'true/false' if kind is bool else 'whole numbers'}")
        return tuple(value)
    if isinstance(default, list):  # sample prompts
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise wrong("a list of strings")
        return value
    if not isinstance(value, str):  # str fields, and the paths that default to None
        raise wrong("a string")
    return value


def dump_recipe(cfg, header: str = "", rounds: list[dict] = ()) -> str:
    """`cfg` (a TrainConfig) as a recipe file with every field spelt out, then its `rounds`: read back by
    `read_recipe` and `read_rounds`, it gives the same config and rounds. Fields that are None (no CLIP folder, no
    dataset) are left out, as TOML has no null."""
    lines, values = [f"# {line}" for line in header.splitlines()], cfg.flat()
    for section, keys in SECTIONS.items():
        lines += ["", f"[{section}]"]
        lines += [f"{key} = {_toml_value(values[key])}" for key in keys if values[key] is not None]
    for changes in rounds:
        lines += ["", f"[[{ROUND}]]"] + [f"{key} = {_toml_value(value)}" for key, value in changes.items()]
    return "\n".join(lines).lstrip("\n") + "\n"


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    return "[" + ", ".join(_toml_value(v) for v in value) + "]"
