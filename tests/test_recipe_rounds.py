"""A recipe's rounds: `[[round]]` tables after its own schedule, each one more run from the last one's pipeline with
fresh optimizer moments, or the run of the one before going on (`continues`), so that a model made in rounds is
rebuilt by one command (unet/recipe_file.py)."""

import json
from pathlib import Path

import pytest
import torch
from test_bad_input import one_line_error

from unet import checkpoint
from unet.cli import train as train_script
from unet.recipe_file import RecipeError, read_recipe, read_rounds, round_configs
from unet.train_config import TrainConfig

TINY = Path(__file__).resolve().parent / "data" / "tiny-recipe.toml"
ROUND = {"seed": 1, "steps": 2, "decay_start": 1, "decay_steps": 1}
ROUND_TOML = "\n[[round]]  # one more round\nseed = 1\nsteps = 2\ndecay_start = 1\ndecay_steps = 1\n"


@pytest.fixture
def rounds_recipe(tmp_path) -> Path:
    path = tmp_path / "rounds.toml"
    path.write_text(TINY.read_text() + ROUND_TOML)
    return path


def weights(folder: Path) -> dict:
    return checkpoint.load(folder / "checkpoint.safetensors")[0]


def same_weights(a: Path, b: Path) -> bool:
    x, y = weights(a), weights(b)
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def test_one_command_trains_every_round_as_the_commands_it_replaces(rounds_recipe, tmp_path, capsys):
    """`--recipe` with a [[round]] ends on the very weights of the two commands it stands for: the recipe alone,
    then --start-from its pipeline with the round's seed and schedule. `--rounds 1` stops after the first, and
    `--resume` trains the rest; the run folder keeps the whole recipe, and each round's folder its own settings."""
    one, first, second = tmp_path / "one", tmp_path / "first", tmp_path / "second"
    assert train_script.main(["--recipe", str(rounds_recipe), "--out", str(one), "--quiet"]) == 0
    assert f"round 2 of 2: 2 steps from {one / 'pipeline'}, seed 1" in capsys.readouterr().out
    assert train_script.main(["--recipe", str(TINY), "--out", str(first), "--quiet"]) == 0
    assert train_script.main(["--recipe", str(TINY), "--out", str(second), "--start-from", str(first / "pipeline"),
                              "--seed", "1", "--steps", "2", "--decay-start", "1", "--decay-steps", "1",
                              "--quiet"]) == 0
    assert same_weights(one, first) and same_weights(one / "round-2", second)
    assert not same_weights(one, one / "round-2")  # round 2 trained on from round 1

    saved = json.loads((one / "round-2" / "train_config.json").read_text())
    assert saved["started_from"] == str(one / "pipeline") and saved["seed"] == 1 and saved["steps"] == 2
    assert read_rounds(one / "recipe.resolved.toml") == [ROUND]  # the run folder's recipe trains every round
    _, own = read_recipe(one / "round-2" / "pipeline" / "recipe.resolved.toml")
    assert own["seed"] == 1 and read_rounds(one / "round-2" / "pipeline" / "recipe.resolved.toml") == []
    assert (one / "round-2" / "pipeline" / "recipe.toml").read_text() == rounds_recipe.read_text()

    parts = tmp_path / "parts"
    assert train_script.main(["--recipe", str(rounds_recipe), "--out", str(parts), "--rounds", "1", "--quiet"]) == 0
    assert (parts / "pipeline" / "model_index.json").is_file() and not (parts / "round-2").exists()
    one_line_error(capsys, train_script.main(["--out", str(parts), "--resume", "--rounds", "1"]),
                   "rounds 1 to 1 of its recipe's 2 are trained (--rounds 2 trains the next)")
    assert train_script.main(["--out", str(parts), "--resume", "--quiet"]) == 0
    assert same_weights(parts / "round-2", one / "round-2")
    one_line_error(capsys, train_script.main(["--out", str(parts), "--resume", "--quiet"]),
                   "every round of its recipe is trained; its model is")


def test_a_run_started_from_a_pipeline_names_it_in_its_resolved_recipe(tmp_path):
    """--start-from is a setting of the call, so the resolved recipe cannot hold it: its header gives the command
    that trains the run again, --start-from included, and that command ends on the same weights. A run from nothing
    says nothing of a start."""
    first, second, again = tmp_path / "first", tmp_path / "second", tmp_path / "again"
    assert train_script.main(["--recipe", str(TINY), "--out", str(first), "--quiet"]) == 0
    start = str(first / "pipeline")
    assert train_script.main(["--recipe", str(TINY), "--out", str(second), "--start-from", start, "--seed", "1",
                              "--quiet"]) == 0

    def header(folder: Path) -> str:
        lines = (folder / "recipe.resolved.toml").read_text().splitlines()
        return " ".join(line.lstrip("# ") for line in lines if line.startswith("#"))

    assert f"--recipe THIS_FILE --start-from {start} --out NEW_FOLDER` trains it again" in header(second)
    assert "--start-from" not in header(first)
    assert header(second / "pipeline") == header(second)  # the pipeline keeps the run's record
    assert train_script.main(["--recipe", str(second / "recipe.resolved.toml"), "--start-from", start, "--out",
                              str(again), "--quiet"]) == 0
    assert same_weights(again, second) and not same_weights(second, first)


def test_a_run_stopped_in_each_round_resumes_to_the_same_weights(rounds_recipe, tmp_path, capsys):
    """Stopped by --max-minutes after one step of round 1, then after one step of round 2, and resumed each time,
    the run ends on the weights of the uninterrupted command; a round that stops short holds back the next."""
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert train_script.main(["--recipe", str(rounds_recipe), "--out", str(whole), "--quiet"]) == 0
    stop = ["--max-minutes", "1e-6", "--quiet"]
    assert train_script.main(["--recipe", str(rounds_recipe), "--out", str(cut), *stop]) == 0
    assert checkpoint.read_metadata(cut / "checkpoint.safetensors")[0]["step"] == "1"
    assert not (cut / "round-2").exists()
    assert train_script.main(["--out", str(cut), "--resume", *stop]) == 0  # round 1 stops again, at step 2
    assert train_script.main(["--out", str(cut), "--resume", "--quiet"]) == 0  # the rest of round 1, all of round 2
    assert same_weights(cut, whole) and same_weights(cut / "round-2", whole / "round-2")
    capsys.readouterr()

    again = tmp_path / "again"
    assert train_script.main(["--recipe", str(rounds_recipe), "--out", str(again), "--rounds", "1", "--quiet"]) == 0
    assert train_script.main(["--out", str(again), "--resume", *stop]) == 0  # round 2 stops after one step
    assert checkpoint.read_metadata(again / "round-2" / "checkpoint.safetensors")[0]["step"] == "1"
    assert train_script.main(["--out", str(again), "--resume", "--quiet"]) == 0
    assert same_weights(again / "round-2", whole / "round-2")


def test_a_round_never_overwrites_a_folder_that_holds_files(rounds_recipe, tmp_path, capsys):
    """A new round's folder that holds files (a round of another run) is refused at the door, before round 1
    trains; so is --steps with --resume of a run with rounds (each keeps its recipe's length)."""
    out = tmp_path / "run"
    (out / "round-2").mkdir(parents=True)
    (out / "round-2" / "loss.csv").write_text("0,1.0,0.1\n")
    one_line_error(capsys, train_script.main(["--recipe", str(rounds_recipe), "--out", str(out)]),
                   f"round 2's folder {out / 'round-2'} holds files already")
    assert sorted(p.name for p in out.iterdir()) == ["round-2"] and (out / "round-2" / "loss.csv").read_text()
    done = tmp_path / "done"
    assert train_script.main(["--recipe", str(rounds_recipe), "--out", str(done), "--rounds", "1", "--quiet"]) == 0
    one_line_error(capsys, train_script.main(["--out", str(done), "--resume", "--steps", "8"]),
                   "--steps with --resume of")
    assert not (done / "round-2").exists()


@pytest.mark.parametrize("text, message", [
    ("[[round]]\nchannels = [8, 16, 16]\n", "unknown key 'channels' in round 2; a round changes only steps"),
    ("[round]\nseed = 1\n", "round must be an array of tables, each headed [[round]]"),
    ("[[round]]\nseed = 'one'\n", "round 2 seed must be a whole number"),
    ("[[round]]\nsteps = 2\n[[round]]\nsteps = 0\n", "round 3: steps must be a positive integer"),
    ("[[round]]\nmin_lr = 1.0\n", "round 2: --min-lr 1.0 is above --lr"),
    ("[[round]]\ncontinues = true\nseed = 2\nsteps = 8\n", "round 2 continues the round before and so draws its "
                                                           "batches on from that round's seed; leave seed out"),
    ("[[round]]\ncontinues = true\nsteps = 4\n", "round 2: steps 4: it goes on from step 4, so give a step above it"),
    ("[[round]]\ncontinues = true\nsteps = 8\ndecay_start = 3\ndecay_steps = 5\n",
     "round 2: decay_start 3: it goes on from step 4, so the decay would start part-way down; give 4 or later"),
    ("[[round]]\ncontinues = 1\nsteps = 8\n", "round 2 continues must be true or false"),
])
def test_a_bad_round_is_one_line_at_the_door(tmp_path, capsys, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(TINY.read_text() + text)
    one_line_error(capsys, train_script.main(["--recipe", str(path), "--out", str(tmp_path / "run")]), message)
    assert not (tmp_path / "run").exists()


def test_rounds_the_recipe_does_not_have_are_refused(rounds_recipe, tmp_path, capsys):
    for count in ("0", "3"):
        one_line_error(capsys, train_script.main(["--recipe", str(rounds_recipe), "--out", str(tmp_path / "run"),
                                                  "--rounds", count]), f"--rounds {count}: the recipe has 2 rounds")
    one_line_error(capsys, train_script.main(["--recipe", str(TINY), "--out", str(tmp_path / "run"), "--rounds",
                                              "2"]), "--rounds 2: this run has no [[round]]s")
    one_line_error(capsys, train_script.main(["--recipe", str(rounds_recipe), "--out", str(tmp_path / "run"),
                                              "--text-variant", "side-hints"]), "rounds are for the clip text side")
    assert not (tmp_path / "run").exists()
    with pytest.raises(RecipeError, match="unknown key 'lr' in round 2"):
        path = tmp_path / "lr.toml"
        path.write_text(TINY.read_text() + "[[round]]\nlr = 1e-3\n")
        read_rounds(path)


CONTINUED_TOML = "\n[[round]]  # round 2's run, on\ncontinues = true\nsteps = 4\ndecay_start = 3\ndecay_steps = 1\n"


def test_a_round_that_continues_is_the_grow_from_it_stands_for(rounds_recipe, tmp_path, capsys):
    """A `continues = true` round ends on the very weights of `--grow-from` the round before with its schedule:
    the same checkpoint going on (step, optimizer moments, EMA, random states), its batches on the same seed.
    Its folder keeps the recipe, and a resolved recipe saying where it went on from."""
    recipe = tmp_path / "continued.toml"
    recipe.write_text(rounds_recipe.read_text() + CONTINUED_TOML)
    one, two = tmp_path / "one", tmp_path / "two"
    assert train_script.main(["--recipe", str(recipe), "--out", str(one), "--quiet"]) == 0
    assert (f"round 3 of 3: on to step 4 from the checkpoint {one / 'round-2'}@2, seed 1"
            in capsys.readouterr().out)
    assert train_script.main(["--recipe", str(rounds_recipe), "--out", str(two), "--quiet"]) == 0
    grown = tmp_path / "grown"
    assert train_script.main(["--grow-from", str(two / "round-2"), "--out", str(grown), "--steps", "4",
                              "--decay-start", "3", "--decay-steps", "1", "--quiet"]) == 0
    assert same_weights(one / "round-3", grown) and not same_weights(one / "round-3", one / "round-2")
    assert checkpoint.read_metadata(one / "round-3" / "checkpoint.safetensors")[0]["step"] == "4"

    saved = json.loads((one / "round-3" / "train_config.json").read_text())
    assert saved["grown_from"] == f"{one / 'round-2'}@2" and saved["seed"] == 1 and saved["steps"] == 4
    ours, theirs = (json.loads((f / "train_config.json").read_text()) for f in (one / "round-3", grown))
    assert {k for k in ours if ours[k] != theirs[k]} == {"out", "grown_from", "started_from"}  # only the folders
    assert read_rounds(one / "recipe.resolved.toml")[-1] == {"continues": True, "steps": 4, "decay_start": 3,
                                                             "decay_steps": 1}
    resolved = (one / "round-3" / "pipeline" / "recipe.resolved.toml").read_text()
    assert f"going on\n# from the checkpoint of {one / 'round-2'} at step 2" in resolved
    assert read_recipe(one / "round-3" / "pipeline" / "recipe.resolved.toml")[1]["steps"] == 4
    assert (one / "round-3" / "pipeline" / "recipe.toml").read_text() == recipe.read_text()


def test_a_continued_round_stopped_part_way_resumes_to_the_same_weights(rounds_recipe, tmp_path):
    """Stopped after one step of the continued round (its checkpoint the round before's, going on) and resumed,
    the run ends where the uninterrupted one does."""
    recipe = tmp_path / "continued.toml"
    recipe.write_text(rounds_recipe.read_text() + CONTINUED_TOML)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    assert train_script.main(["--recipe", str(recipe), "--out", str(whole), "--quiet"]) == 0
    assert train_script.main(["--recipe", str(recipe), "--out", str(cut), "--rounds", "2", "--quiet"]) == 0
    assert train_script.main(["--out", str(cut), "--resume", "--rounds", "3", "--max-minutes", "1e-6",
                              "--quiet"]) == 0
    assert checkpoint.read_metadata(cut / "round-3" / "checkpoint.safetensors")[0]["step"] == "3"
    assert train_script.main(["--out", str(cut), "--resume", "--quiet"]) == 0
    assert same_weights(cut / "round-3", whole / "round-3")


def test_continued_rounds_go_on_from_the_round_before_whatever_it_was(tmp_path):
    """A round continued right after round 1 goes on from the run folder itself; a second continued round from the
    first; one that leaves the cooldown for a constant rate drops the cooldown's steps, as --grow-from does."""
    path = tmp_path / "chain.toml"
    path.write_text(TINY.read_text() + "[[round]]\ncontinues = true\nsteps = 6\ndecay_start = 4\ndecay_steps = 2\n"
                    "[[round]]\ncontinues = true\nsteps = 8\nlr_schedule = 'constant'\n")
    first = TrainConfig.from_flat(**read_recipe(path)[1])
    two, three = round_configs(first, read_rounds(path), tmp_path / "run")
    assert two.grown_from == f"{tmp_path / 'run'}@4" and three.grown_from == f"{tmp_path / 'run' / 'round-2'}@6"
    assert (three.schedule.lr_schedule, three.schedule.decay_start, three.schedule.decay_steps) == ("constant", 0, 0)
    assert two.run.seed == three.run.seed == first.run.seed
