"""Learning-rate schedules: a cooldown (constant, then linearly down to min_lr over a fixed number of steps) that a
long constant run can be grown into at any step, which resumes exactly and which extending the run never restarts."""

import pytest
import torch
from conftest import straight_and_resumed, tiny_config

from unet.cli import train as train_script
from unet.recipe import lr_at
from unet.train import TrainConfig, Trainer


def cooldown(**kw):
    cfg = TrainConfig.from_flat(lr=6e-4, min_lr=1e-4, warmup=10, lr_schedule="cooldown", decay_start=100,
                                decay_steps=50, **kw)
    cfg.validate()
    return cfg


def rate(step: int, cfg: TrainConfig) -> float:
    return lr_at(step, cfg.optimizer, cfg.schedule)


def test_cooldown_holds_then_falls_linearly_to_min_lr_and_stays_there():
    cfg = cooldown()
    assert rate(5, cfg) == pytest.approx(6e-4 * 6 / 10)  # warm-up as before
    assert rate(99, cfg) == rate(100, cfg) == pytest.approx(6e-4)
    assert rate(125, cfg) == pytest.approx(3.5e-4)  # half way down
    assert rate(150, cfg) == rate(10_000, cfg) == pytest.approx(1e-4)
    rates = [rate(s, cfg) for s in range(100, 151)]
    assert all(a > b for a, b in zip(rates, rates[1:]))


def test_cooldown_does_not_depend_on_the_run_length():
    """Extending a cooldown run (--resume --steps more) must not move its rate, as a cosine's would."""
    short, long = cooldown(steps=200), cooldown(steps=5000)
    assert [rate(s, short) for s in range(0, 200, 7)] == [rate(s, long) for s in range(0, 200, 7)]


@pytest.mark.parametrize("setting, message", [
    (dict(lr_schedule="cooldown", decay_start=100), "--decay-steps > 0"),
    (dict(lr_schedule="cooldown", decay_start=5, decay_steps=10, warmup=10), "at or after the warm-up"),
    (dict(decay_start=100, decay_steps=10), "apply only with --lr-schedule cooldown"),
    (dict(lr_schedule="cooldown", decay_start=100, decay_steps=10, lr=1e-4, min_lr=2e-4), "above --lr"),
    (dict(lr_schedule="linear"), "lr_schedule must be one of"),
])
def test_bad_schedules_are_refused_by_name(setting, message):
    with pytest.raises(ValueError, match=message.replace("-", r"\-")):
        TrainConfig.from_flat(**setting).validate()


def test_a_cooldown_run_resumes_exactly(tmp_path):
    cfg = dict(steps=6, checkpoint_every=3, warmup=1, lr_schedule="cooldown", decay_start=2, decay_steps=3)
    straight, resumed = straight_and_resumed(tmp_path, **cfg)
    schedule = resumed.cfg.schedule
    assert (schedule.lr_schedule, schedule.decay_start, schedule.decay_steps) == ("cooldown", 2, 3)
    for p, q in zip(straight.ema.parameters(), resumed.ema.parameters()):
        assert torch.equal(p, q)
    assert [g["lr"] for g in resumed.optimizer.param_groups][0] == pytest.approx(rate(5, resumed.cfg))


def test_grow_from_turns_a_constant_run_into_a_cooldown(tmp_path):
    source = tmp_path / "source"
    Trainer(tiny_config(source, steps=4, warmup=1)).train(progress=False)
    args = train_script.parse_args(["--out", str(tmp_path / "grown"), "--grow-from", str(source), "--steps", "8",
                                    "--lr-schedule", "cooldown", "--decay-start", "4", "--decay-steps", "4",
                                    "--min-lr", "1e-5"])
    cfg = train_script.training_config(args)
    schedule = cfg.schedule
    assert (schedule.lr_schedule, schedule.decay_start, schedule.decay_steps) == ("cooldown", 4, 4)
    assert schedule.min_lr == 1e-5
    assert cfg.optimizer.lr == tiny_config(source).optimizer.lr  # the peak stays the source's
    cfg.validate()
    not_grown = train_script.training_config(train_script.parse_args(["--out", str(tmp_path / "plain")]))
    schedule = not_grown.schedule
    assert (schedule.lr_schedule, schedule.min_lr, schedule.decay_steps) == ("constant", 1e-4, 0)


def test_schedule_flags_are_refused_where_they_would_be_ignored_or_start_part_way(tmp_path, capsys):
    source = tmp_path / "source"
    Trainer(tiny_config(source, steps=4, warmup=1)).train(progress=False)
    # --resume keeps the saved schedule (so that it continues exactly): a new one there would be silently dropped
    assert train_script.main(["--out", str(source), "--resume", "--steps", "8", "--lr-schedule", "cooldown",
                              "--decay-start", "4", "--decay-steps", "4"]) == 2
    assert "--lr-schedule with --resume" in capsys.readouterr().err
    # a cooldown that began before the source's step would start part-way down
    assert train_script.main(["--out", str(tmp_path / "late"), "--grow-from", str(source), "--steps", "8",
                              "--lr-schedule", "cooldown", "--decay-start", "2", "--decay-steps", "4"]) == 2
    assert "give --decay-start 4 or later" in capsys.readouterr().err
    assert not (tmp_path / "late").exists()
    # a cooldown run grown back to a constant rate drops its decay steps instead of refusing flags never given
    cooled = tmp_path / "cooled"
    Trainer(tiny_config(cooled, steps=4, warmup=1, lr_schedule="cooldown", decay_start=2, decay_steps=2)).train(
        progress=False)
    args = train_script.parse_args(["--out", str(tmp_path / "again"), "--grow-from", str(cooled), "--steps", "8",
                                    "--lr-schedule", "constant"])
    cfg = train_script.training_config(args)
    assert (cfg.schedule.lr_schedule, cfg.schedule.decay_start, cfg.schedule.decay_steps) == ("constant", 0, 0)
    cfg.validate()
