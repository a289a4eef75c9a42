"""Timestep sampling: where the training t go (layout is decided only at the noisiest steps), saved with the run,
resumed exactly, and uniform for runs that predate the option."""

import json

import pytest
import torch
from conftest import straight_and_resumed, tiny_config

from unet.cli import train as train_script
from unet.recipe import sample_timesteps
from unet.train import TrainConfig, Trainer, resumed_config
from unet.train_config import DiffusionConfig


def draws(mode, n=20000, **kw):
    cfg = TrainConfig.from_flat(timestep_sampling=mode, **kw)
    cfg.validate()
    return sample_timesteps(cfg.diffusion, n, 1000, torch.Generator().manual_seed(0))


def test_uniform_draws_what_training_drew_before_the_option():
    old = torch.randint(0, 1000, (32,), generator=torch.Generator().manual_seed(3))
    assert torch.equal(old, sample_timesteps(DiffusionConfig(), 32, 1000, torch.Generator().manual_seed(3)))


def test_layout_share_puts_its_share_at_the_top_of_the_schedule():
    uniform, layout = draws("uniform"), draws("layout-share", layout_share=0.5, layout_fraction=0.1)
    assert abs((uniform >= 900).float().mean() - 0.10) < 0.01
    # half from [900, 999], and the uniform half lands there a tenth of the time: 0.5 + 0.5 * 0.1
    assert abs((layout >= 900).float().mean() - 0.55) < 0.01
    assert layout.min() >= 0 and layout.max() == 999
    only_top = draws("layout-share", layout_share=1.0, layout_fraction=0.05)
    assert only_top.min() == 950 and only_top.max() == 999


@pytest.mark.parametrize("setting, message", [
    (dict(timestep_sampling="top"), "timestep_sampling must be one of"),
    # a study's sampling, taken out of the code (train_config.RETIRED): a run folder naming it is refused by
    # `without_retired`, a new run by the check
    (dict(timestep_sampling="logit-normal"), "timestep_sampling must be one of 'uniform', 'layout-share', got"),
    (dict(layout_share=0.0), "--layout-share must be in (0, 1]"),
    (dict(layout_fraction=1.5), "--layout-fraction must be in (0, 1]"),
])
def test_bad_timestep_settings_are_refused_by_name(setting, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace("-", r"\-")):
        TrainConfig.from_flat(**setting).validate()


def test_config_saves_and_an_old_config_means_uniform(tmp_path):
    Trainer(tiny_config(tmp_path / "run", timestep_sampling="layout-share", layout_share=0.3))
    saved = json.loads((tmp_path / "run" / "train_config.json").read_text())
    assert saved["timestep_sampling"] == "layout-share" and saved["layout_share"] == 0.3
    for key in ("timestep_sampling", "layout_share", "layout_fraction"):
        saved.pop(key)
    assert resumed_config(TrainConfig(out=str(tmp_path)), saved).diffusion.timestep_sampling == "uniform"


def test_a_run_with_timestep_sampling_resumes_exactly(tmp_path):
    cfg = dict(steps=6, checkpoint_every=3, timestep_sampling="layout-share")
    straight, resumed = straight_and_resumed(tmp_path, **cfg)
    assert resumed.cfg.diffusion.timestep_sampling == "layout-share"  # the saved config's sampling
    for p, q in zip(straight.ema.parameters(), resumed.ema.parameters()):
        assert torch.equal(p, q)


def test_grow_from_changes_the_timestep_sampling(tmp_path):
    source = tmp_path / "source"
    Trainer(tiny_config(source)).train(progress=False)
    args = train_script.parse_args(["--out", str(tmp_path / "grown"), "--grow-from", str(source), "--steps", "6",
                                    "--timestep-sampling", "layout-share", "--layout-share", "0.25"])
    cfg = train_script.training_config(args)
    assert (cfg.diffusion.timestep_sampling, cfg.diffusion.layout_share) == ("layout-share", 0.25)
    assert cfg.schedule.steps == 6
    assert tuple(cfg.model.channels) == tiny_config(source).model.channels  # everything else as the source run has it
