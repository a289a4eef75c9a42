"""The layout log of a training run (`--layout-every N`): every N steps the EMA model's layout response and paired
position test, one JSON line in OUT/layout.jsonl, so a run shows when placement starts.

A callback the command line gives the trainer (`Trainer(cfg, callbacks=[LayoutLog()])`), so the training code
imports no evaluation: the arrow runs from evaluation to training only.
"""

from __future__ import annotations

import json

import torch

from ..train import Trainer, TrainerCallback, trim_log
from .evaluate import paired_relations
from .layout import layout_response


class LayoutLog(TrainerCallback):
    """Log every `run.layout_every` steps (none at 0), the paired test at `run.layout_seeds` seeds per prompt. The
    settings are the trainer's own, so a resumed run logs as its folder's config says."""

    def on_train_begin(self, trainer: Trainer) -> None:
        if trainer.cfg.run.layout_every:
            # a resumed run does the steps after its checkpoint again: their rows go, so each step is logged once
            trim_log(trainer.out / "layout.jsonl", trainer.step)

    def after_step(self, trainer: Trainer, step: int, last: bool) -> None:
        every = trainer.cfg.run.layout_every
        if every and step % every == 0:
            self.log(trainer)

    def log(self, trainer: Trainer) -> dict:
        """Append the EMA model's layout response and paired position test at this step to OUT/layout.jsonl.
        Its random numbers never touch the training's."""
        with torch.random.fork_rng(devices=[]):
            pipe = trainer.pipeline()
            response = layout_response(pipe)["pairs"]
            paired = paired_relations(pipe, seeds=trainer.cfg.run.layout_seeds, guidance=1.0)
        row = {"step": trainer.step, "layout_response": {k: v["response"] for k, v in response.items()},
               "paired": {k: v["response"] for k, v in paired.items()}}
        with open(trainer.out / "layout.jsonl", "a") as f:
            f.write(json.dumps(row) + "\n")
        return row
