"""The layout log of a training run (`--layout-every N`): every N steps the EMA model's layout response and paired
position test, one JSON line in OUT/layout.jsonl, so a run shows when placement starts.

A callback the command line gives the trainer (`Trainer(cfg, callbacks=layout_log(cfg.run))`), so the training code
imports no evaluation: the arrow runs from evaluation to training only.
"""

from __future__ import annotations

import json

import torch

from ..train import Trainer, TrainerCallback, trim_log
from ..train_config import RunConfig
from .evaluate import paired_relations
from .layout import layout_response


class LayoutLog(TrainerCallback):
    """Log every `every` steps, the paired test at `seeds` seeds per prompt."""

    def __init__(self, every: int, seeds: int = 1):
        self.every, self.seeds = every, seeds

    def on_train_begin(self, trainer: Trainer) -> None:
        # a resumed run does the steps after its checkpoint again: their rows go, so each step is logged once
        trim_log(trainer.out / "layout.jsonl", trainer.step)

    def after_step(self, trainer: Trainer, step: int, last: bool) -> None:
        if step % self.every == 0:
            self.log(trainer)

    def log(self, trainer: Trainer) -> dict:
        """Append the EMA model's layout response and paired position test at this step to OUT/layout.jsonl.
        Its random numbers never touch the training's."""
        with torch.random.fork_rng(devices=[]):
            pipe = trainer.pipeline()
            response = layout_response(pipe)["pairs"]
            paired = paired_relations(pipe, seeds=self.seeds, guidance=1.0)
        row = {"step": trainer.step, "layout_response": {k: v["response"] for k, v in response.items()},
               "paired": {k: v["response"] for k, v in paired.items()}}
        with open(trainer.out / "layout.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        return row


def layout_log(run: RunConfig) -> list[LayoutLog]:
    """The layout log a run's settings ask for, as a list of callbacks: none at `layout_every` 0."""
    return [LayoutLog(run.layout_every, run.layout_seeds)] if run.layout_every else []
