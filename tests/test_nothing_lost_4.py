"""Nothing lost, round 4 (issue 43): one writer per run folder, an interrupt that keeps finished work, numbers and
flags checked at the door, damaged inputs and API misuse as one line. One test per class, with real processes and
real signals where the class is about them."""

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_config
from PIL import Image
from test_reliability import TINY_TRAIN, default_sigint, one_line

from unet.cli import PARTIAL, train_clip
from unet.cli import train as train_script

ROOT = Path(__file__).resolve().parents[1]
TINY_CLIP = ["--steps", "3", "--batch-size", "4", "--text-width", "16", "--vision-width", "16", "--text-layers", "1",
             "--vision-layers", "1", "--heads", "2", "--size", "16", "--max-length", "16", "--eval-scenes", "8",
             "--warmup", "1", "--quiet"]


def wait_for(condition, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


# --- 1. one writer per folder: a run holds its folder; every other writer, --resume too, is refused naming it
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    from unet.train import Trainer
    folder = tmp_path_factory.mktemp("run") / "run"
    Trainer(tiny_config(folder, steps=2)).train(progress=False)
    return folder


def test_a_second_writer_into_a_held_run_folder_is_refused_naming_the_holder(run, tmp_path, capsys):
    import shutil

    from unet.folders import hold_folder
    from unet.research import diagnose
    out = tmp_path / "x"
    shutil.copytree(run, out)
    lock = tmp_path / ".x.writer"
    holder = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "train.py"), "--out", str(out), "--resume",
                               "--steps", "100000", "--quiet"],  # --resume takes the same claim as a new run
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        wait_for(lambda: lock.exists() and lock.read_text() == str(holder.pid), holder)
        named = f"--out {out} is being written by process {holder.pid}"
        assert train_script.main(["--out", str(out), *TINY_TRAIN, "--steps", "40", "--seed", "7"]) == 2
        one_line(capsys.readouterr().err, named)
        assert train_script.main(["--out", str(out), "--steps", "100001", "--resume", "--quiet"]) == 2
        one_line(capsys.readouterr().err, named)
        assert train_clip.main(["--out", str(out), *TINY_CLIP]) == 2
        one_line(capsys.readouterr().err, named)
        assert diagnose.main(["words", "--out", str(out), "--model", str(tmp_path / "none")]) == 2
        one_line(capsys.readouterr().err, named)
        assert holder.poll() is None  # still running, in a folder nobody else wrote
    finally:
        holder.send_signal(signal.SIGINT)
        _, err = holder.communicate(timeout=600)
    assert holder.returncode == 130, err
    with hold_folder(out):  # the holder is gone: its claim went with it
        pass
    assert not lock.exists()  # and the claim leaves nothing behind


# --- 2. an interrupt after the work is done keeps the work
def test_an_interrupt_during_train_clips_evaluation_keeps_the_trained_model(tmp_path, capsys, monkeypatch):
    def evaluate_then_interrupted(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # a real signal, as `kill` sends it during a long evaluation
        time.sleep(60)
        raise AssertionError("the signal did not stop the evaluation")

    monkeypatch.setattr(train_clip, "hard_negative_accuracy", evaluate_then_interrupted)
    out = tmp_path / "clip"
    assert train_clip.main(["--out", str(out), *TINY_CLIP]) == 128 + signal.SIGTERM
    one_line(capsys.readouterr().err, f"interrupted (SIGTERM): kept the model trained for 3 steps in {out} (not "
                                      "evaluated")
    report = json.loads((out / "report.json").read_text())
    assert report["steps_done"] == 3 and "hard_negatives" not in report
    assert (out / "text" / "model.safetensors").is_file() and (out / "clip" / "config.json").is_file()
    assert not list(tmp_path.glob(f"{PARTIAL}*"))


def test_workers_killed_by_a_signal_to_the_group_never_hang_the_run(tmp_path):
    """A SIGTERM to the whole process group kills the data workers too, idle ones included; the run must still draw
    its batches and end (multiprocessing.Pool hung in terminate() on the queue lock a killed worker held)."""
    from unet.train import BatchPrefetcher, Trainer
    cfg = tiny_config(tmp_path / "a", steps=50, num_samples=0)
    trainer = Trainer(cfg)
    before = set(multiprocessing.active_children())
    prefetcher = BatchPrefetcher(cfg, trainer.tokenizer, trainer.part, 2)
    workers = [p for p in multiprocessing.active_children() if p not in before]
    assert len(workers) == 2
    deadline = time.monotonic() + 600
    while prefetcher.get(0) is None:  # the workers import torch first
        assert time.monotonic() < deadline
        time.sleep(0.5)
    time.sleep(2)  # both idle, waiting for work
    for worker in workers:
        os.kill(worker.pid, signal.SIGTERM)
    for worker in workers:
        worker.join(60)
    started = time.monotonic()
    assert prefetcher.get(10) is None  # drawn in the loop, at once: a dead worker's pipe reads as closed
    assert time.monotonic() - started < 10
    closing = threading.Thread(target=prefetcher.close, daemon=True)
    closing.start()
    closing.join(60)
    assert not closing.is_alive(), "close() hung on the killed workers"


# --- 3. numbers checked at the door, by one helper, before any model is loaded
@pytest.mark.parametrize("command, args, message", [
    ("generate", ["a red circle", "--guidance", "1e308"], "--guidance must be a finite number from 0 to 100"),
    ("evaluate", ["--guidance", "1e308"], "--guidance must be a finite number from 0 to 100"),
    ("evaluate", ["--fresh-seeds", str(2**64 - 1), "--seeds", "1"], "--fresh-seeds must be a seed from 0 to"),
    ("diagnose", ["first-step", "--guidance", "nan"], "--guidance must be a finite number from 0 to 100"),
    ("train_clip", ["--lr", "inf"], "--lr must be a finite number from 1e-08 to 1, got inf"),
    ("train_clip", ["--seed", "-1"], "--seed must be an integer from 0 to 2**64 - 1, got -1"),
    ("train_clip", ["--seed", str(2**64)], "--seed must be an integer from 0 to 2**64 - 1"),
])
def test_numbers_out_of_range_are_one_line_at_the_door(tmp_path, capsys, command, args, message):
    from unet.cli import evaluate, generate
    from unet.research import diagnose
    main = {"generate": generate.main, "evaluate": evaluate.main, "diagnose": diagnose.main,
            "train_clip": train_clip.main}[command]
    out = tmp_path / "out"
    model = [] if command == "train_clip" else ["--model", str(tmp_path / "no-model")]  # a late check would say so
    assert main([*args, *model, "--out", str(out), *(TINY_CLIP if command == "train_clip" else [])]) == 2
    one_line(capsys.readouterr().err, message)
    assert not out.exists()


# --- 4. flags that cannot take effect are refused, saying why
def test_flags_that_cannot_take_effect_are_refused(run, tmp_path, capsys, monkeypatch):
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    monkeypatch.setattr(train_script, "_train", lambda *args: 0)  # what passes the door trains no further here
    cases = [
        (["--grow-from", str(run), "--out", str(tmp_path / "g"), "--steps", "4", "--channels", "16", "32"],
         "--channels [16, 32] cannot take effect: --grow-from keeps"),
        (["--out", str(run), "--resume", "--steps", "4", "--and-order", "reading"],
         "--and-order reading cannot take effect: --resume continues"),
        (["--out", str(tmp_path / "k"), *TINY_TRAIN, "--key-margin", "0.9"],
         "--key-margin 0.9 applies only with a --key-separation-weight above 0"),
    ]
    for args, message in cases:
        assert train_script.main(args) == 2
        one_line(capsys.readouterr().err, message)
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before and not (tmp_path / "g").exists()
    # the run's own values repeated are fine, and so is a recipe whose key-separation weight is 0 at the default margin
    assert train_script.main(["--out", str(run), "--resume", "--steps", "4", "--channels", "8", "16"]) == 0
    assert train_script.main(["--recipe", "scenes-32-untaught", "--out", str(tmp_path / "u")]) == 0
    assert train_script.main(["--recipe", "scenes-32-untaught", "--out", str(tmp_path / "u"), "--key-margin",
                              "0.5"]) == 2
    one_line(capsys.readouterr().err, "--key-margin 0.5 applies only with a --key-separation-weight above 0")
    assert train_clip.main(["--out", str(tmp_path / "c"), *TINY_CLIP, "--max-length", "3"]) == 2
    one_line(capsys.readouterr().err, "--max-length 3 would cut the scenes' longest captions")


# --- 5. images and damaged folders
def test_a_float_image_is_read_from_its_real_range_and_lab_is_not_alpha(tmp_path):
    from unet.attend import read_image
    from unet.cli import UsageError
    Image.fromarray(np.full((8, 8), 0.8, dtype=np.float32)).save(tmp_path / "f.tiff")
    image, notes = read_image(tmp_path / "f.tiff")
    assert np.asarray(image).mean() == pytest.approx(204, abs=1)  # 0.8 of white, not black
    nan = np.full((8, 8), 0.5, dtype=np.float32)
    nan[0, 0] = np.nan
    Image.fromarray(nan).save(tmp_path / "nan.tiff")
    with pytest.raises(UsageError, match="1 pixels that are inf or NaN"):
        read_image(tmp_path / "nan.tiff")
    Image.new("LAB", (8, 8), (50, 128, 128)).save(tmp_path / "lab.tiff")
    _, notes = read_image(tmp_path / "lab.tiff")
    assert notes == ["LAB image converted to RGB"]


@pytest.mark.parametrize("damage, why", [
    (dict(meta="[1, 2]"), "TypeError"),
    (dict(meta="{not json"), "JSONDecodeError"),
    (dict(maps=b"\x08\x00\x00\x00\x00\x00\x00\x00garbage!"), "SafetensorError"),
    (dict(maps=b"\x00" * 3), "SafetensorError"),
])
def test_judge_maps_on_a_damaged_run_folder_is_one_line(tmp_path, capsys, damage, why):
    import torch
    from safetensors.torch import save_file

    from unet.cli import judge
    folder = tmp_path / "run"
    folder.mkdir()
    Image.new("RGB", (8, 8)).save(folder / "image_0.png")
    meta = {"prompt": "a red circle", "images": ["image_0.png"], "words": [{"text": "red"}]}
    (folder / "meta.json").write_text(damage.get("meta", json.dumps(meta)))
    save_file({"0_red": torch.zeros(1, 8, 8)}, str(folder / "maps.safetensors"))
    if "maps" in damage:
        (folder / "maps.safetensors").write_bytes(damage["maps"])
    assert judge.main(["a red circle", str(folder / "image_0.png"), "--maps"]) == 2
    one_line(capsys.readouterr().err, f"--maps: cannot read the maps of {folder / 'image_0.png'} from its run "
                                      f"folder ({why}")


@pytest.mark.parametrize("out, message", [("", "--out is empty"), ("file", "is a file, not a folder"),
                                          ("read-only/x", "is not writable")])
def test_diagnose_checks_its_out_before_the_work(tmp_path, capsys, out, message):
    from unet.research import diagnose
    (tmp_path / "file").write_text("mine")
    (tmp_path / "read-only").mkdir(mode=0o500)
    if os.geteuid() == 0 and out.startswith("read-only"):
        pytest.skip("root writes into read-only folders")
    target = str(tmp_path / out) if out else ""
    assert diagnose.main(["words", "--out", target, "--model", str(tmp_path / "no-model")]) == 2
    one_line(capsys.readouterr().err, message)
    assert (tmp_path / "file").read_text() == "mine" and not any((tmp_path / "read-only").iterdir())


def test_api_misuse_says_what_was_expected():
    from crossattn import AttentionStore, word_maps
    store = AttentionStore()
    with pytest.raises(ValueError, match="words must be Word objects .* got a str"):
        word_maps(store, ["red"], (8, 8))
    pipe = types.SimpleNamespace(unet=object())  # what a diffusers pipeline looks like to attach: not a Module
    with pytest.raises(TypeError, match=r"for a pipeline pass its U-Net, attach\(pipe.unet\)"):
        store.attach(pipe)


# --- 6. leftovers
def test_train_clip_with_an_empty_out_leaves_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert train_clip.main(["--out", "", *TINY_CLIP]) == 2
    one_line(capsys.readouterr().err, "--out is empty ('')")
    assert list(tmp_path.iterdir()) == []


# --- 7. the page states these promises
def test_reliability_page_states_the_round_4_promises():
    page = (ROOT / "docs" / "reliability.md").read_text()
    for phrase in ("**One writer per folder.**", "**An interrupt keeps finished work.**",
                   "**Every number checked at the door.**", "`crossattn.errors.check_number`", "`.<name>.writer`"):
        assert phrase in page, phrase


def test_a_pipeline_missing_a_weight_tensor_is_one_line(tiny_pipeline_dir, tmp_path):
    """diffusers loads a U-Net file that lacks a tensor with a warning and leaves it on the meta device; the load
    itself must refuse it, naming the tensor, before anything fails deep inside."""
    import shutil

    from safetensors.torch import load_file, save_file

    from unet.cli import UsageError
    from unet.pipeline import load_pipeline

    folder = tmp_path / "broken"
    shutil.copytree(tiny_pipeline_dir, folder)
    weights = folder / "unet" / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(weights))
    del tensors["conv_out.weight"]
    save_file(tensors, str(weights))
    with pytest.raises(UsageError, match=r"lacks 1 weight tensor\(s\) \(unet.conv_out.weight\)"):
        load_pipeline(folder, show_progress=False)
