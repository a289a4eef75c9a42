"""The training settings in groups (unet/train_config.py): flat names in and out, each group checking itself, the
flat train_config.json of every run folder written before the groups still reading back, and the settings of studies
taken out of the code dropped at the values that changed nothing and refused at any other."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_config
from test_bad_input import one_line_error

from unet import checkpoint
from unet.cli import train as train_script
from unet.train import Trainer, resumed_config
from unet.train_config import RETIRED, RETIRED_AFTER, DataConfig, OptimizerConfig, TrainConfig, without_retired

# a run folder's train_config.json as the code before the groups wrote it (runs/scenes-64's, its folder made relative)
BEFORE_GROUPS = Path(__file__).resolve().parent / "data" / "train_config-before-groups.json"


def test_a_flat_train_config_from_before_the_groups_reads_back_to_the_same_settings():
    saved = json.loads(BEFORE_GROUPS.read_text())
    assert set(RETIRED) <= set(saved)  # written while the overlap loss and logit-normal sampling were in the code
    cfg = TrainConfig.from_flat(**without_retired(saved))
    cfg.validate()
    kept = {name: value for name, value in saved.items() if name not in RETIRED}
    # written back flat, key for key, less the retired ones, with the settings added since at their defaults
    assert json.loads(json.dumps(cfg.flat())) == {**kept, "muon_update_rms": 0.2, "started_from": None}
    assert (cfg.data.world, cfg.optimizer.algorithm, cfg.data.folder, cfg.schedule.steps) == (
        "scenes-64", "muon", None, 10000)
    # what `--resume --steps 12000 --max-minutes 5` of a copy of the folder trains with
    resumed = resumed_config(TrainConfig.from_flat(out="elsewhere", steps=12000, max_minutes=5.0), saved)
    assert resumed.flat() == {**cfg.flat(), "out": "elsewhere", "steps": 12000, "resume": True, "max_minutes": 5.0}


def test_flat_names_build_and_replace_the_nested_settings():
    cfg = TrainConfig.from_flat(optimizer="muon", data="scenes", lr=1e-3, out="runs/x")
    assert (cfg.optimizer.algorithm, cfg.data.folder, cfg.optimizer.lr, cfg.out) == ("muon", "scenes", 1e-3, "runs/x")
    changed = cfg.replace(optimizer="adamw", steps=7)
    assert (changed.optimizer.algorithm, changed.schedule.steps, changed.optimizer.lr) == ("adamw", 7, 1e-3)
    assert cfg.optimizer.algorithm == "muon"  # a copy: the original is as it was
    with pytest.raises(TypeError, match="unknown training setting optimiser"):
        TrainConfig.from_flat(optimiser="muon")


def test_each_group_checks_its_own_settings():
    with pytest.raises(ValueError, match="optimizer must be one of 'adamw', 'muon', got 'sgd'"):
        OptimizerConfig(algorithm="sgd").check()
    with pytest.raises(ValueError, match="colourless_share must be in"):
        DataConfig(colourless_share=1.5).check()
    with pytest.raises(FileNotFoundError, match="data folder nowhere does not exist"):
        TrainConfig.from_flat(data="nowhere").validate()


@pytest.mark.parametrize("setting, shown", [
    (dict(overlap_weight=0.2), "overlap_weight 0.2: this run trained with the overlap loss"),
    (dict(logit_std=0.5), "logit_std 0.5: this run trained with logit-normal timestep sampling"),
    (dict(timestep_sampling="logit-normal"), "timestep_sampling logit-normal: this run trained with logit-normal"),
])
def test_a_saved_setting_of_a_retired_study_is_refused_naming_the_commit_that_has_it(setting, shown):
    saved = {**json.loads(BEFORE_GROUPS.read_text()), **setting}
    with pytest.raises(ValueError) as refused:
        resumed_config(TrainConfig(out="elsewhere"), saved)
    message = str(refused.value)
    assert message.startswith(shown) and "\n" not in message
    assert f"taken out after commit {RETIRED_AFTER}" in message and f"git worktree add ../crossattn-{RETIRED_AFTER}" \
        in message and "docs/experiments/" in message


def test_a_run_folder_naming_retired_settings_resumes_at_their_old_defaults_and_is_refused_at_others(tmp_path,
                                                                                                     capsys):
    """A folder written while the settings existed resumes as ever; one that trained with them stops at the door
    with one line, leaving the folder as it was."""
    run = tmp_path / "run"
    Trainer(tiny_config(run, steps=2, checkpoint_every=1)).train(progress=False)
    config = run / "train_config.json"
    written_then = {**json.loads(config.read_text()), "overlap_weight": 0.0, "logit_mean": 1.0, "logit_std": 1.0}
    config.write_text(json.dumps(written_then))
    assert train_script.main(["--out", str(run), "--resume", "--steps", "3", "--quiet"]) == 0
    assert checkpoint.read_metadata(run / "checkpoint.safetensors")[0]["step"] == "3"
    capsys.readouterr()  # that run's own output
    config.write_text(json.dumps({**written_then, "overlap_weight": 0.2}))
    before = sorted(p.name for p in run.iterdir())
    rc = train_script.main(["--out", str(run), "--resume", "--steps", "4", "--quiet"])
    line = one_line_error(capsys, rc, f"overlap_weight 0.2: this run trained with the overlap loss, a study's code "
                                      f"taken out after commit {RETIRED_AFTER}")
    assert "git worktree add" in line and sorted(p.name for p in run.iterdir()) == before


def test_the_shipping_path_never_imports_the_text_side_ablations(tmp_path):
    """Training a "clip" run (the CLI, its config, its parts) leaves unet/research/text_variants.py unimported; an
    ablation's setting is what imports it."""
    code = (f"import sys, pathlib; import unet.cli.train; from unet.train import TrainConfig, build_components; "
            f"cfg = TrainConfig.from_flat(size=16, channels=(8, 16), cross_attention=(True, True), "
            f"self_attention=(False, True), text_width=16, text_layers=1, heads=2, max_length=16); cfg.validate(); "
            f"build_components(cfg, pathlib.Path({str(tmp_path)!r})); "
            f"shipping = 'unet.research.text_variants' in sys.modules; "
            f"cfg.replace(text_variant='oracle').validate(); "
            f"print(shipping, 'unet.research.text_variants' in sys.modules)")
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).resolve().parent.parent)
    assert found.stdout.split() == ["False", "True"], found.stderr
