import os
import tempfile
from pathlib import Path

import pytest
import torch

# accelerate must never read a user's config, and nothing may reach a hub
os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="hf_home_"))
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
torch.set_num_threads(max(1, min(2, len(os.sched_getaffinity(0)))))  # the cores this process may use


# the scenes-32 shipped until 2026-12-02 (step 15,200): a folder saved before position embeddings, pooled text
# and guidance_max_t existed, which must still load and sample as it did
OLD_SCENES_32 = Path(__file__).resolve().parent / "data" / "scenes-32-step15200"


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def tiny_config(out, **overrides):
    from unet.train import TrainConfig
    values = dict(out=str(out), num_samples=64, size=16, steps=4, batch_size=4, channels=(8, 16),
                  cross_attention=(True, True), self_attention=(False, True), text_width=16, text_layers=1,
                  heads=2, max_length=16, warmup=2, sample_every=1000, checkpoint_every=1000,
                  sample_prompts=["a red circle"])
    values.update(overrides)
    return TrainConfig.from_flat(**values)


def straight_and_resumed(tmp_path, **cfg):
    """A tiny run trained straight to cfg's `steps` (in tmp_path/a), and the same run stopped half-way (in
    tmp_path/b) and resumed from its saved config to the end: the two trained Trainers (straight, resumed)."""
    from unet.train import Trainer
    straight = Trainer(tiny_config(tmp_path / "a", **cfg))
    straight.train(progress=False)
    Trainer(tiny_config(tmp_path / "b", **{**cfg, "steps": cfg["steps"] // 2})).train(progress=False)
    resumed = Trainer(tiny_config(tmp_path / "b", steps=cfg["steps"], resume=True))
    resumed.train(progress=False)
    return straight, resumed


@pytest.fixture(scope="session")
def tiny_pipeline_dir(tmp_path_factory):
    """A tiny pipeline folder written by the real training code (4 steps: enough to be a real model)."""
    from unet.train import Trainer
    out = tmp_path_factory.mktemp("tiny_run")
    trainer = Trainer(tiny_config(out))
    trainer.train(progress=False)
    return out / "pipeline"


@pytest.fixture
def tiny_pipeline(tiny_pipeline_dir):
    from unet.pipeline import load_pipeline
    return load_pipeline(tiny_pipeline_dir)


TINY_64 = Path(__file__).resolve().parent / "data" / "tiny-recipe-64.toml"


@pytest.fixture(scope="session")
def tiny64_run(tmp_path_factory) -> Path:
    """A tiny scenes-64 run folder trained from nothing by the one command (4 steps), with its pipeline."""
    from unet.cli.train import main as train_main
    run = tmp_path_factory.mktemp("tiny64") / "run"
    assert train_main(["--recipe", str(TINY_64), "--out", str(run), "--quiet"]) == 0
    return run
