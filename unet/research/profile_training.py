"""Where a training step's time goes: torch.profiler over a few steps of a recipe, by phase and by operator.

    python scripts/profile_training.py --recipe scenes-32                      # as the machine's threads allow
    OMP_NUM_THREADS=1 taskset -c 1 python scripts/profile_training.py --precision fp32   # one core, float32

Trains --warmup steps unmeasured (the first steps allocate memory and pick kernels), then --steps steps under the
profiler, in a temporary run folder that is removed afterwards. Prints two markdown tables: the phases of a step
(named in unet/train.py's Trainer.train_step and Trainer.loss) and the operators that take the most time, each
in ms a step and as a share of the step's wall time.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

from unet.cli import UsageError, interrupted, sigterm_as_interrupt, usage_error
from unet.recipe_file import read_recipe
from unet.train import Trainer
from unet.train_config import PRECISIONS, TrainConfig

PHASES = ("data", "text encoder", "U-Net", "attention losses", "backward", "optimizer", "EMA")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--recipe", default="scenes-32", help="recipe name or .toml file (default: %(default)s)")
    p.add_argument("--precision", choices=PRECISIONS, default=None, help="override the recipe's precision")
    p.add_argument("--batch-size", type=int, default=None, help="override the recipe's batch size")
    p.add_argument("--steps", type=int, default=10, help="steps measured (default: %(default)s)")
    p.add_argument("--warmup", type=int, default=3, help="steps run first, unmeasured (default: %(default)s)")
    p.add_argument("--top", type=int, default=12, help="operators listed (default: %(default)s)")
    return p.parse_args(argv)


def step_profile(cfg: TrainConfig, steps: int, warmup: int, top: int) -> str:
    """The markdown tables of `steps` training steps of `cfg` (trained in a temporary folder)."""
    with tempfile.TemporaryDirectory(prefix="profile-") as folder:
        cfg = cfg.replace(out=folder, steps=warmup + steps, sample_every=10**9, checkpoint_every=10**9,
                          snapshot_every=0, layout_every=0)
        trainer = Trainer(cfg)
        for _ in range(warmup):
            trainer.train_step()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            start = time.perf_counter()
            for _ in range(steps):
                trainer.train_step()
            wall_ms = 1000 * (time.perf_counter() - start) / steps
    events = prof.key_averages()
    per_step = {e.key: e.cpu_time_total / 1000 / steps for e in events}  # ms, inclusive of what each phase calls
    settings = cfg.optimizer
    lines = [f"{steps} steps at batch {settings.batch_size}, {settings.precision}, {torch.get_num_threads()} "
             f"thread(s): {wall_ms:.0f} ms a step", "", "| phase | ms a step | share |", "|---|---|---|"]
    phased = 0.0
    for name in PHASES:
        ms = per_step.get(name, 0.0)
        phased += ms
        lines.append(f"| {name} | {ms:.1f} | {ms / wall_ms:.1%} |")
    lines += [f"| rest (lr, loss checks, Python) | {wall_ms - phased:.1f} | {(wall_ms - phased) / wall_ms:.1%} |", "",
              "| operator (self time) | calls a step | ms a step | share |", "|---|---|---|---|"]
    ops = sorted((e for e in events if e.key not in PHASES), key=lambda e: e.self_cpu_time_total, reverse=True)
    for e in ops[:top]:
        ms = e.self_cpu_time_total / 1000 / steps
        lines.append(f"| `{e.key}` | {e.count / steps:.0f} | {ms:.1f} | {ms / wall_ms:.1%} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    with sigterm_as_interrupt():
        try:
            if args.steps < 1 or args.warmup < 0 or args.top < 1:
                raise UsageError(f"--steps and --top must be >= 1 and --warmup >= 0, got {args.steps}, {args.top} "
                                 f"and {args.warmup}")
            _, values = read_recipe(args.recipe)
            overrides = {k: v for k, v in (("precision", args.precision), ("batch_size", args.batch_size))
                         if v is not None}
            cfg = TrainConfig.from_flat(**{**values, **overrides})
            cfg.validate()
        except (ValueError, UsageError) as e:
            return usage_error(e)
        try:
            print(step_profile(cfg, args.steps, args.warmup, args.top))
        except KeyboardInterrupt as e:
            return interrupted(e, "nothing was written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
