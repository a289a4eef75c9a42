"""Nothing lost, ever: concurrent runs, interrupted training, damaged checkpoints, write failures.

Each test checks the exit code, that there is exactly one line to read, that nothing half-made is left and
that nothing that was there before is lost."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

from unet.cli import PARTIAL
from unet.cli.folders import publish

ROOT = Path(__file__).resolve().parents[1]


def one_line(err: str, message: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err, err
    return lines[0]


# --- 1. two runs into the same --out
def test_publish_never_replaces_a_result_it_did_not_make(tmp_path):
    finals = []
    for k in range(3):
        tmp = tmp_path / f"{PARTIAL}{os.getpid()}-{k}"
        tmp.mkdir()
        (tmp / "meta.json").write_text(str(k))
        finals.append(publish(tmp, tmp_path / "a-red-circle-s0"))
    assert [f.name for f in finals] == ["a-red-circle-s0", "a-red-circle-s0-2", "a-red-circle-s0-3"]
    assert [(f / "meta.json").read_text() for f in finals] == ["0", "1", "2"]


def test_two_generate_processes_into_one_out_both_survive(tiny_pipeline_dir, tmp_path):
    out = tmp_path / "out"
    procs = [subprocess.Popen([sys.executable, str(ROOT / "scripts" / "generate.py"), "a red circle", "--model",
                               str(tiny_pipeline_dir), "--out", str(out), "--steps", str(steps), "--quiet"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for steps in (1, 3)]
    printed = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 0, stderr
        printed.append(stdout.strip())
    assert len(set(printed)) == 2  # each run names the folder it really wrote
    steps = sorted(json.loads((Path(p) / "meta.json").read_text())["steps"] for p in printed)
    assert steps == [1, 3]
    assert sorted(p.name for p in out.iterdir()) == ["a-red-circle-s0", "a-red-circle-s0-2"]


# --- 2. an interrupted run resumes bit for bit
TINY_TRAIN = ["--size", "16", "--channels", "8", "16", "16", "--text-width", "16", "--text-layers", "1", "--heads", "2",
              "--max-length", "16", "--batch-size", "4", "--warmup", "1", "--num-samples", "64", "--sample-every",
              "1000", "--checkpoint-every", "1000", "--quiet"]


def train_process(out: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train.py"), "--out", str(out), *TINY_TRAIN,
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def loss_rows(run: Path) -> list[tuple[str, str]]:
    return [tuple(line.split(",")[:2]) for line in (run / "loss.csv").read_text().splitlines()]


def test_sigint_at_a_random_moment_then_resume_is_bit_identical(tmp_path):
    import random
    import time

    from safetensors.torch import load_file
    steps = "150"
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    reference = train_process(whole, "--steps", steps)
    proc = train_process(cut, "--steps", steps)
    while not (cut / "loss.csv").exists() and proc.poll() is None:
        time.sleep(0.02)  # training has begun
    time.sleep(random.uniform(0.1, 1.0))
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 128 + signal.SIGINT, err
    line = one_line(err, "interrupted (SIGINT): checkpoint saved at step ")
    step = int(line.split("at step ")[1].split()[0])
    assert 0 < step < 150 and not (cut / "pipeline").exists()
    assert [int(s) for s, _ in loss_rows(cut)] == list(range(1, step + 1))  # flushed with the checkpoint
    resumed = train_process(cut, "--steps", steps, "--resume")
    assert resumed.wait(timeout=300) == 0 and reference.wait(timeout=300) == 0, resumed.stderr.read()
    for name in ("checkpoint.safetensors", "pipeline/unet/diffusion_pytorch_model.safetensors",
                 "pipeline/text_encoder/model.safetensors"):
        a, b = load_file(str(whole / name)), load_file(str(cut / name))
        assert a.keys() == b.keys() and [k for k in a if not torch.equal(a[k], b[k])] == [], name
    assert loss_rows(cut) == loss_rows(whole)  # every step logged exactly once, with the same loss


def test_resume_drops_log_rows_after_the_checkpoint(tmp_path):
    """After a SIGKILL the log may hold steps past the checkpoint (and a torn last row): resume redoes them once."""
    from unet.train import Trainer
    run = tmp_path / "run"
    Trainer(tiny_config(run, steps=4, checkpoint_every=2)).train(progress=False)
    whole = loss_rows(run)
    ckpt = run / "checkpoint.safetensors"
    Trainer(tiny_config(tmp_path / "at2", steps=2)).train(progress=False)
    os.replace(tmp_path / "at2" / "checkpoint.safetensors", ckpt)  # the same run's checkpoint at step 2
    with open(run / "loss.csv", "a") as f:
        f.write("5,0.1")  # a row torn by the kill
    Trainer(tiny_config(run, steps=4, resume=True)).train(progress=False)
    assert loss_rows(run) == whole


@pytest.mark.parametrize("steps, message", [("2", "the checkpoint is at step 3 already"),
                                            ("3", "and its pipeline is written")])
def test_resume_to_a_step_already_reached_is_refused(tmp_path, capsys, steps, message):
    from unet.cli import train as train_script
    from unet.train import Trainer
    run = tmp_path / "run"
    Trainer(tiny_config(run, steps=3)).train(progress=False)
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    capsys.readouterr()
    rc = train_script.main(["--out", str(run), *TINY_TRAIN, "--resume", "--steps", steps])
    assert rc == 2
    one_line(capsys.readouterr().err, message)
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


# --- 3. checkpoint integrity
def test_committed_v1_parts_without_hashes_still_join_and_resume(tmp_path):
    from unet.cli import checkpoint_parts
    from unet.train import TrainConfig, Trainer
    run = tmp_path / "v1"
    run.mkdir()
    (run / "train_config.json").write_bytes((ROOT / "checkpoints" / "v1" / "train_config.json").read_bytes())
    assert checkpoint_parts.main(["join", str(ROOT / "checkpoints" / "v1"), str(run / "checkpoint.safetensors")]) == 0
    trainer = Trainer(TrainConfig(out=str(run), steps=3591, resume=True))
    assert trainer.step == 3590 and trainer.saved_step == 3590
