"""The training settings in groups (unet/train_config.py): flat names in and out, each group checking itself, and
the flat train_config.json of every run folder written before the groups still reading back."""

import json
from pathlib import Path

import pytest

from unet.train import resumed_config
from unet.train_config import DataConfig, OptimizerConfig, TrainConfig

# a run folder's train_config.json as the code before the groups wrote it (runs/scenes-64's, its folder made relative)
BEFORE_GROUPS = Path(__file__).resolve().parent / "data" / "train_config-before-groups.json"


def test_a_flat_train_config_from_before_the_groups_reads_back_to_the_same_settings():
    saved = json.loads(BEFORE_GROUPS.read_text())
    cfg = TrainConfig.from_flat(**saved)
    cfg.validate()
    assert json.loads(json.dumps(cfg.flat())) == saved  # written back flat, key for key
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
