"""Recipe files: one file holds every setting that makes a model; `train.py --recipe` trains it from nothing,
keeps it in the run and pipeline folders, and refuses a bad one with one line naming the field."""

import json
from pathlib import Path

import pytest
import torch
from test_bad_input import one_line_error

from unet import checkpoint
from unet.cli import train as train_script
from unet.recipe_file import CALL_ONLY, SECTIONS, RecipeError, dump_recipe, known_recipes, read_recipe
from unet.train import TrainConfig

TINY = Path(__file__).resolve().parent / "data" / "tiny-recipe.toml"


def test_every_setting_has_one_home():
    """Each TrainConfig field is in exactly one section, or is a setting of one call: a new field cannot be left
    out of the recipes by accident."""
    homes = [key for keys in SECTIONS.values() for key in keys] + list(CALL_ONLY)
    assert sorted(homes) == sorted(TrainConfig().flat())


@pytest.mark.parametrize("name", ["scenes-32", "scenes-32-untaught"])
def test_the_shipped_recipes_are_valid(name):
    assert name in known_recipes()
    path, values = read_recipe(name)
    cfg = TrainConfig.from_flat(**values)
    cfg.validate()
    assert path.name == f"{name}.toml"
    assert values["channels"] == (16, 64, 128)


def test_untaught_differs_from_the_default_only_by_the_attention_terms():
    taught, untaught = (TrainConfig.from_flat(**read_recipe(name)[1]) for name in ("scenes-32", "scenes-32-untaught"))
    changed = {name for name, value in taught.flat().items() if value != untaught.flat()[name]}
    # the key term's margin is left out with the term: it reads nothing else
    assert changed == {"grounding_weight", "pixel_grounding_weight", "key_separation_weight", "key_margin"}
    losses = untaught.losses
    assert losses.grounding_weight == losses.pixel_grounding_weight == losses.key_separation_weight == 0


def test_the_quick_recipe_is_the_default_smaller_and_shorter():
    """scenes-32-quick keeps every lesson of scenes-32 (losses, data, diffusion, optimizer kind, precision) and
    changes only the model's size, the run's length, batch and rate, and how often it looks."""
    quick, default = (TrainConfig.from_flat(**read_recipe(name)[1]) for name in ("scenes-32-quick", "scenes-32"))
    quick.validate()
    changed = {name for name, value in quick.flat().items() if value != default.flat()[name]}
    assert changed == {"channels", "text_width", "text_layers", "batch_size", "lr", "warmup", "steps", "decay_start",
                       "decay_steps", "sample_every", "checkpoint_every"}
    images = [cfg.schedule.steps * cfg.optimizer.batch_size for cfg in (quick, default)]
    assert images[0] < images[1] / 10
    schedule = quick.schedule
    assert schedule.decay_start + schedule.decay_steps == schedule.steps  # the cooldown ends the run, as the default's


def test_a_resolved_recipe_reads_back_to_the_same_config(tmp_path):
    _, values = read_recipe("scenes-32")
    cfg = TrainConfig.from_flat(**values).replace(lr=1.25e-3, self_attention=(False, True, True), seed=7,
                                                  sample_prompts=['a "quoted" circle'])
    path = tmp_path / "resolved.toml"
    path.write_text(dump_recipe(cfg, "a header\nof two lines"))
    _, again = read_recipe(path)
    assert TrainConfig.from_flat(**{**again, "out": cfg.out}) == cfg


def test_an_older_resolved_recipe_still_reads_without_its_retired_settings(tmp_path):
    """A run's recipe.resolved.toml from before the overlap loss and logit-normal left the code spells them out at
    the values that changed nothing: it reads as the same recipe. One that used them names the commit that has them."""
    _, values = read_recipe("scenes-32")
    old = dump_recipe(TrainConfig.from_flat(**values), "").replace(
        "[losses]\n", "[losses]\noverlap_weight = 0.0\n").replace("[diffusion]\n", "[diffusion]\nlogit_mean = 1.0\n")
    path = tmp_path / "old.toml"
    path.write_text(old)
    assert TrainConfig.from_flat(**read_recipe(path)[1]) == TrainConfig.from_flat(**values)
    path.write_text(old.replace("overlap_weight = 0.0", "overlap_weight = 0.1"))
    with pytest.raises(RecipeError) as e:
        read_recipe(path)
    assert "overlap_weight 0.1" in str(e.value) and "after commit" in str(e.value) and str(path) in str(e.value)


@pytest.mark.parametrize("text, message", [
    ("[model]\nsize = 16\n[optimiser]\nlr = 1e-3\n", "unknown section or key 'optimiser'"),
    ("[model]\nlr = 1e-3\n", "unknown key 'lr' in [model]; it belongs in [optimizer]"),
    ("[run]\nout = 'x'\n", "unknown key 'out' in [run]; it is a setting of one call"),
    ("[model]\nwidth = 8\n", "[model] accepts size, channels"),
    ("[optimizer]\nlr = 'fast'\n", "[optimizer] lr must be a number, got \"fast\""),
    ("[schedule]\nsteps = 10.5\n", "[schedule] steps must be a whole number, got 10.5"),
    ("[model]\nchannels = [8, true]\n", "[model] channels must be a list of whole numbers"),
    ("[model]\npooled_text = 1\n", "[model] pooled_text must be true or false, got 1"),
    ("[model]\nsize = \n", "not a readable TOML file"),
    ("model = 3\n", "model must be a section ([model])"),
])
def test_a_bad_recipe_names_its_field(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(RecipeError, match=None) as e:
        read_recipe(path)
    assert message in str(e.value) and str(path) in str(e.value)


def test_a_bad_recipe_is_one_line_at_the_door(tmp_path, capsys):
    path = tmp_path / "bad.toml"
    path.write_text("[optimizer]\nlr = 'fast'\n")
    one_line_error(capsys, train_script.main(["--recipe", str(path), "--out", str(tmp_path / "run")]),
                   "[optimizer] lr must be a number")
    one_line_error(capsys, train_script.main(["--recipe", "scenes-64x", "--out", str(tmp_path / "run")]),
                   "no recipe of that name; known: scenes-32")
    one_line_error(capsys, train_script.main(["--recipe", str(tmp_path / "missing.toml"), "--out",
                                              str(tmp_path / "run")]), "no such file")
    one_line_error(capsys, train_script.main(["--recipe", str(TINY), "--out", str(tmp_path / "run"), "--resume"]),
                   "--recipe with --resume")
    assert not (tmp_path / "run").exists()


def test_a_tiny_recipe_trains_from_nothing_and_keeps_its_recipe(tmp_path):
    """Every lesson of scenes-32 (grounding, pixel and key terms, layout-share t, reading order, position
    embedding, pooled text, bf16, a cooldown) in one command; flags override single fields; the recipe as written
    and the resolved one land in the run and the pipeline folders, and the resolved one reads back to the run's
    config."""
    run = tmp_path / "run"
    assert train_script.main(["--recipe", str(TINY), "--out", str(run), "--lr", "1e-3", "--quiet"]) == 0
    saved = json.loads((run / "train_config.json").read_text())
    assert saved["lr"] == 1e-3 and saved["precision"] == "bf16" and saved["grounding_weight"] == 0.01
    assert saved["steps"] == 4 and saved["out"] == str(run)
    for folder in (run, run / "pipeline"):
        assert (folder / "recipe.toml").read_text() == TINY.read_text()
        _, resolved = read_recipe(folder / "recipe.resolved.toml")
        assert json.loads(json.dumps(TrainConfig.from_flat(**{**resolved, "out": str(run)}).flat())) == saved
    assert json.loads((run / "pipeline" / "train_config.json").read_text()) == saved


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_a_resolved_recipe_retrains_and_resumes_bit_for_bit(tmp_path, optimizer):
    """The run folder's resolved recipe trains the same run again; stopped half-way and resumed, it ends on the
    very same weights, optimizer moments and random streams (bf16 autocast included)."""
    first, again = tmp_path / "first", tmp_path / "again"
    assert train_script.main(["--recipe", str(TINY), "--out", str(first), "--optimizer", optimizer, "--quiet"]) == 0
    resolved = first / "recipe.resolved.toml"
    assert train_script.main(["--recipe", str(resolved), "--out", str(again), "--steps", "2", "--quiet"]) == 0
    assert train_script.main(["--out", str(again), "--resume", "--steps", "4", "--quiet"]) == 0
    a, _ = checkpoint.load(first / "checkpoint.safetensors")
    b, _ = checkpoint.load(again / "checkpoint.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]


def test_two_cpu_processes_under_accelerate_train_a_tiny_recipe(tmp_path):
    """`accelerate launch` (an existing engine, not a home-made one) runs the recipe on two CPU processes (gloo):
    each trains on its share of every batch, and the main process writes one run folder and its pipeline."""
    import os
    import shutil
    import subprocess
    import sys

    from unet.pipeline import load_pipeline

    launcher = shutil.which("accelerate", path=str(Path(sys.executable).parent))
    if launcher is None:
        pytest.skip("the accelerate command is not installed beside this Python")
    run = tmp_path / "run"
    # accelerate's `--cpu` runs one process, and a MULTI_CPU config file wants MPI; torchrun's processes (what
    # --multi_gpu starts) told to use the CPU join one gloo group
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
    proc = subprocess.run([launcher, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                           "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "29517",
                           str(Path(__file__).resolve().parents[1] / "scripts" / "train.py"),
                           "--recipe", str(TINY), "--out", str(run), "--quiet"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "training on 2 processes (cpu)" in proc.stdout and proc.stdout.count("done:") == 1, proc.stdout
    assert len((run / "loss.csv").read_text().splitlines()) == 4  # one writer: each step logged once
    weights, _ = checkpoint.load(run / "checkpoint.safetensors")
    assert all(torch.isfinite(v).all() for k, v in weights.items() if v.is_floating_point())
    pipe = load_pipeline(run / "pipeline")
    image = pipe("a red circle", generator=torch.Generator().manual_seed(0), num_inference_steps=2,
                 show_progress=False).images[0]
    assert image.size == (16, 16)
