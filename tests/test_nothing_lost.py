"""Nothing lost, for the newer commands too (levers, attend, judge, --grow-from, the console commands): each case
is a command as a user runs it, with its exit code, its single line, and the files on disk before and after."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from test_reliability import TINY_TRAIN, default_sigint, one_line

from unet.cli import train as train_script

ROOT = Path(__file__).resolve().parents[1]


def files(folder: Path) -> dict[str, int]:
    """Every file under `folder` with its modification time: what "nothing changed" is checked against."""
    return {str(p.relative_to(folder)): p.stat().st_mtime_ns for p in folder.rglob("*") if p.is_file()}


def report(**overrides) -> dict:
    pf = dict(single_object=1.0, two_object=0.75, colors=1.0, position=0.5, color_attr=0.5, overall=0.75,
              background_grain={"mean": 1.25})
    value = {"prompt_following": pf, "maps": {"shape_words": {"miou": 0.3, "pointing": 0.6}},
             "settings": {"seeds": 8}}
    value["prompt_following"].update(overrides)
    return value


def write_report(folder: Path, content) -> Path:
    folder.mkdir(parents=True)
    (folder / "report.json").write_text(content if isinstance(content, str) else json.dumps(content))
    return folder


# --- levers: 1 (an earlier table), 10 (a full disk), 11 (missing keys), 17 (bad UTF-8)
def test_levers_refuse_to_overwrite_an_earlier_table_unless_told(tmp_path, capsys):
    from unet.research import levers
    a = write_report(tmp_path / "a", report())
    out = tmp_path / "levers"
    assert levers.main([f"x={a}@1", f"y={a}@2", "--out", str(out)]) == 0
    before = {name: (out / name).read_bytes() for name in ("levers.md", "levers.json", "levers.png")}
    capsys.readouterr()
    assert levers.main([f"x={a}@1", "--out", str(out)]) == 2
    one_line(capsys.readouterr().err, f"--out {out} already holds levers.json, levers.md, levers.png; pass "
                                      "--overwrite")
    assert {name: (out / name).read_bytes() for name in before} == before  # the 2-row table is untouched
    assert levers.main([f"x={a}@1", "--out", str(out), "--overwrite"]) == 0
    assert len(json.loads((out / "levers.json").read_text())["rows"]) == 1


def test_levers_on_a_full_disk_publish_nothing_half(tmp_path, capsys, monkeypatch):
    from unet.research import levers
    a = write_report(tmp_path / "a", report())
    out = tmp_path / "levers"
    out.mkdir()
    (out / "notes.txt").write_text("mine")

    def savefig_fails(self, path, *args, **kwargs):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr("matplotlib.figure.Figure.savefig", savefig_fails)
    assert levers.main([f"x={a}@1", "--out", str(out)]) == 2
    one_line(capsys.readouterr().err, "could not write the levers table: No space left on device")
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]  # no levers.json/.md without levers.png


@pytest.mark.parametrize("content, message", [
    (report() | {"maps": {}}, "lacks maps.shape_words.miou"),
    ({"prompt_following": {"overall": 0.5}}, "lacks prompt_following.single_object"),
    (b"\xff\xfe not json", "is not UTF-8 text"),
])
def test_levers_name_the_report_that_is_bad(tmp_path, capsys, content, message):
    from unet.research import levers
    folder = tmp_path / "bad"
    folder.mkdir()
    path = folder / "report.json"
    path.write_bytes(content) if isinstance(content, bytes) else path.write_text(json.dumps(content))
    assert levers.main([f"x={folder}@1", "--out", str(tmp_path / "out")]) == 2
    line = one_line(capsys.readouterr().err, message)
    assert str(path) in line
    assert not (tmp_path / "out").exists()


# --- training: 2 (a NaN loss), 5 ("pipeline saved"), 6 and 17 (--side-hint-gain), 17 (--grow-from's words)
@pytest.fixture(scope="module")
def base_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("lost") / "base"
    assert train_script.main(["--out", str(run), *TINY_TRAIN, "--steps", "3"]) == 0
    return run


def test_a_non_finite_loss_stops_the_run_and_keeps_the_last_good_checkpoint(base_run, tmp_path, capsys):
    from unet.checkpoint import load
    out = tmp_path / "grown"
    assert train_script.main(["--grow-from", str(base_run), "--out", str(out), "--steps", "8",
                              "--text-variant", "side-hints", "--side-hint-gain", "1e300", "--quiet"]) == 1
    line = one_line(capsys.readouterr().err, "error: training stopped at step ")
    assert "is not finite" not in line and ("nan" in line or "inf" in line)
    assert "done" not in line and not (out / "pipeline").exists()
    tensors, metadata = load(out / "checkpoint.safetensors")  # hash-checked and finite, or it raises
    assert all(torch.isfinite(t).all() for t in tensors.values() if t.is_floating_point())
    assert f"the checkpoint of step {metadata['step']}" in line


def test_a_run_without_a_pipeline_says_what_it_wrote(base_run, tmp_path, capsys):
    out = tmp_path / "hints"
    assert train_script.main(["--grow-from", str(base_run), "--out", str(out), "--steps", "4",
                              "--text-variant", "side-hints", "--quiet"]) == 0
    said = capsys.readouterr().out
    assert "pipeline saved" not in said and "no pipeline folder is written" in said
    assert not (out / "pipeline").exists() and (out / "checkpoint.safetensors").exists()


@pytest.mark.parametrize("args, message", [
    (["--text-variant", "clip", "--side-hint-gain", "5"], "--side-hint-gain 5.0: it applies only with --text-variant "
                                                          "side-hints"),
    (["--text-variant", "side-hints", "--side-hint-gain", "-1"], "--side-hint-gain must be a finite number > 0"),
    (["--text-variant", "side-hints", "--side-hint-gain", "0"], "--side-hint-gain must be a finite number > 0"),
])
def test_side_hint_gain_refusals_say_what_is_accepted(tmp_path, capsys, args, message):
    out = tmp_path / "run"
    assert train_script.main(["--out", str(out), *TINY_TRAIN, "--steps", "2", *args]) == 2
    one_line(capsys.readouterr().err, message)
    assert not out.exists()


def test_grow_from_a_folder_without_a_run_names_grow_from(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert train_script.main(["--grow-from", str(tmp_path / "empty"), "--out", str(tmp_path / "out"),
                              "--position-embedding"]) == 2
    line = one_line(capsys.readouterr().err, f"--grow-from {tmp_path / 'empty'}: ")
    assert "--resume" not in line and not (tmp_path / "out").exists()


# --- 14: Ctrl-C during the final save
def test_an_interrupt_while_the_pipeline_is_saved_says_what_is_on_disk_and_the_command_works(
        base_run, tmp_path, capsys, monkeypatch):
    import shutil

    from unet.train import Trainer
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    real_save = Trainer.save_pipeline

    def save_then_interrupt(self, folder):
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "save_pipeline", save_then_interrupt)
    shutil.rmtree(run / "pipeline")
    assert train_script.main(["--out", str(run), "--resume", "--steps", "3", "--quiet"]) == 130
    line = one_line(capsys.readouterr().err, "but the pipeline was not written; ")
    command = line.split("`")[1]
    assert command == f"python scripts/train.py --out {run} --resume --steps 3"
    assert (run / "loss_curve.png").exists() and not (run / "pipeline").exists()
    monkeypatch.setattr(Trainer, "save_pipeline", real_save)
    assert train_script.main(command.split()[2:] + ["--quiet"]) == 0  # the command it names works
    assert (run / "pipeline" / "model_index.json").exists()


def test_resume_without_steps_trains_to_the_length_the_run_was_started_with(base_run, tmp_path, capsys):
    """A run stopped part-way keeps the --steps it was started with in its config: `--resume` alone finishes
    it, rather than refusing because the default length is behind the checkpoint."""
    import json
    import shutil

    from unet.checkpoint import read_metadata
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    shutil.rmtree(run / "pipeline")
    config = json.loads((run / "train_config.json").read_text())
    (run / "train_config.json").write_text(json.dumps({**config, "steps": 5}))  # as a 5-step run stopped at 3
    assert train_script.main(["--out", str(run), "--resume", "--quiet"]) == 0
    assert read_metadata(run / "checkpoint.safetensors")[0]["step"] == "5"
    assert [line.split(",")[0] for line in (run / "loss.csv").read_text().splitlines()][-1] == "5"
    assert (run / "pipeline" / "model_index.json").exists()
    # finished now: `--resume` alone has nothing left to train, and says how to go on
    assert train_script.main(["--out", str(run), "--resume", "--quiet"]) == 2
    one_line(capsys.readouterr().err, "give --steps above 5 to train on")


# --- 16: a dead run's temp file
def test_resume_removes_a_dead_runs_checkpoint_temp_file(base_run, tmp_path):
    import shutil

    from unet.train import Trainer
    run = tmp_path / "run"
    shutil.copytree(base_run, run)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = run / f".checkpoint.safetensors.{int(dead.stdout)}.tmp"
    stale.write_bytes(b"x" * 1000)
    live = run / f".checkpoint.safetensors.{os.getpid()}.tmp"  # a process that is still running: kept
    live.write_bytes(b"y")
    from conftest import tiny_config
    cfg = json.loads((run / "train_config.json").read_text())
    Trainer(tiny_config(run, resume=True, steps=4, channels=tuple(cfg["channels"]), cross_attention=tuple(
        cfg["cross_attention"]), self_attention=tuple(cfg["self_attention"])))
    assert not stale.exists() and live.exists()


# --- 3 and 8: images attend and judge cannot read as they are
def sixteen_bit_png(path: Path) -> Path:
    ramp = np.linspace(0, 65535, 32 * 32).reshape(32, 32).astype(np.uint16)
    Image.fromarray(ramp).save(path)
    assert Image.open(path).mode == "I;16"
    return path


def bomb_png(path: Path) -> Path:
    """A PNG header that declares 20000 x 20000 pixels, with no pixel data."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 20000, 20000, 8, 2, 0, 0, 0))
                     + chunk(b"IEND", b""))
    return path


def test_a_16_bit_grayscale_image_keeps_its_grays(tmp_path):
    from unet.attend import read_image
    image, notes = read_image(sixteen_bit_png(tmp_path / "gray16.png"))
    values = np.asarray(image)
    assert image.mode == "RGB" and values.min() == 0 and values.max() == 255
    assert len(np.unique(values)) > 200  # PIL's own conversion leaves 2: black and white
    assert notes == ["I;16 image converted to 8-bit RGB by its value range"]


def test_judge_reads_a_16_bit_image_as_attend_does(tmp_path, capsys):
    from unet.cli import judge
    assert judge.main(["a red circle", str(sixteen_bit_png(tmp_path / "gray16.png"))]) == 0
    assert "0 of 1 follow" in capsys.readouterr().out


@pytest.mark.parametrize("command", ["attend", "judge"])
def test_a_decompression_bomb_is_one_line(tiny_pipeline_dir, tmp_path, capsys, command):
    from unet.cli import attend, judge
    bomb = bomb_png(tmp_path / "bomb.png")
    out = tmp_path / "out"
    if command == "attend":
        rc = attend.main([str(bomb), "a red circle", "--model", str(tiny_pipeline_dir), "--out", str(out)])
    else:
        rc = judge.main(["a red circle", str(bomb)])
    assert rc == 2
    one_line(capsys.readouterr().err, "declares 400,000,000 pixels, more than the")
    assert not out.exists()


# --- 9: attend's write failures
@pytest.mark.parametrize("errno, words", [(28, "No space left on device"), (27, "File too large")])
def test_attend_write_failures_are_one_line_and_leave_nothing(tiny_pipeline_dir, tmp_path, capsys, monkeypatch,
                                                               errno, words):
    import unet.run_folder
    from unet.cli import attend
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(tmp_path / "scene.png")
    out = tmp_path / "out"
    out.mkdir()

    def fail(*args, **kwargs):
        raise OSError(errno, words, str(out / "maps.safetensors"))

    monkeypatch.setattr(unet.run_folder, "save_file", fail)
    assert attend.main([str(tmp_path / "scene.png"), "a red circle", "--model", str(tiny_pipeline_dir), "--out",
                        str(out), "--quiet"]) == 2
    one_line(capsys.readouterr().err, f"could not write the run folder: {words}")
    assert list(out.iterdir()) == []


# --- 4: refined maps of an image too small to refine
def test_refined_maps_at_4x4_are_refused_and_8x8_work(tmp_path, capsys):
    """The shipped model self-attends at a quarter of the image's side: 1x1 at 4x4, nothing to refine with."""
    from unet.cli import generate
    out = tmp_path / "out"
    args = ["a red circle", "--steps", "1", "--maps", "refined", "--out", str(out), "--quiet"]
    assert generate.main([*args, "--height", "4", "--width", "4"]) == 2
    one_line(capsys.readouterr().err, "--maps refined: refined maps need self-attention over at least 2 pixels")
    assert not out.exists()
    assert generate.main([*args, "--height", "8", "--width", "8"]) == 0
    folder = Path(capsys.readouterr().out.strip())
    from safetensors.torch import load_file
    assert float(load_file(str(folder / "maps.safetensors"))["1_red"].sum()) > 0


# --- 7: an evaluation whose prompts the tokenizer would cut
def test_evaluation_refuses_a_tokenizer_that_cuts_its_prompts(tiny_pipeline_dir, tmp_path, capsys):
    import shutil

    from unet.cli import evaluate
    model = tmp_path / "short"
    shutil.copytree(tiny_pipeline_dir, model)
    config = model / "tokenizer" / "tokenizer_config.json"
    config.write_text(json.dumps(json.loads(config.read_text()) | {"model_max_length": 6}))
    before = files(model)
    assert evaluate.main(["--model", str(model), "--relations-only", "--seeds", "1", "--out", str(tmp_path / "r"),
                          "--quiet"]) == 2
    one_line(capsys.readouterr().err, "the model's tokenizer (6 tokens) cuts the evaluation prompt")
    assert files(model) == before and not (tmp_path / "r").exists()


# --- 15: the Python API
def test_the_unet_without_a_timestep_under_a_store_is_a_value_error(tiny_pipeline):
    from crossattn import AttentionStore
    store = AttentionStore.for_pipeline(tiny_pipeline)
    size = tiny_pipeline.unet.config.sample_size
    context = tiny_pipeline.encode_prompt(["a red circle"])
    with store.attach(tiny_pipeline.unet), pytest.raises(ValueError, match="without its timestep"):
        tiny_pipeline.unet(torch.zeros(1, 3, size, size), encoder_hidden_states=context)


# --- 12 and 13: signals, in child processes with SIGINT at its default
@pytest.mark.parametrize("command", ["crossattn-generate", "crossattn-attend"])
def test_console_commands_interrupted_while_importing_give_one_line(tmp_path, command):
    executable = Path(sys.executable).with_name(command)
    if not executable.exists():
        pytest.skip(f"{command} is not installed beside {sys.executable} (pip install -e .)")
    args = ["a red circle"] if command == "crossattn-generate" else [str(tmp_path / "x.png"), "a red circle"]
    proc = subprocess.Popen([str(executable), *args, "--out", str(tmp_path / "out")], stderr=subprocess.PIPE,
                            text=True, preexec_fn=default_sigint)
    time.sleep(1.0)  # torch is still being imported
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGINT, err
    one_line(err, "interrupted (SIGINT): ")
    assert not (tmp_path / "out").exists()


def launched(folder, module: str) -> subprocess.CompletedProcess:
    """`module` (a file in `folder`) started as the commands start: through crossattn_launcher.run."""
    script = f"import sys; sys.path.insert(0, {str(folder)!r}); import crossattn_launcher; " \
             f"sys.exit(crossattn_launcher.run({module!r}))"
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          preexec_fn=default_sigint)


def test_an_interrupt_lost_in_a_weakref_callback_while_importing_prints_one_line(tmp_path):
    """Python may run the signal handler inside importlib's module-lock weakref callback, where the
    KeyboardInterrupt it raises is "ignored": the launcher still prints only its one line."""
    (tmp_path / "slow_module.py").write_text(
        "import os, signal, time, weakref\n"
        "class Thing:\n    pass\n"
        "thing = Thing()\n"
        "weakref.finalize(thing, lambda: os.kill(os.getpid(), signal.SIGINT) or time.sleep(2))\n"
        "del thing\n"
        "def main():\n    return 0\n")
    proc = launched(tmp_path, "slow_module")
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr
    one_line(proc.stderr, "interrupted (SIGINT): while starting")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_an_interrupt_inside_an_extension_import_exits_with_one_line_not_an_abort(tmp_path, signum):
    """A signal that lands while an extension module initialises (torch's pybind11 imports) must not raise
    there: C++ turns the KeyboardInterrupt into std::terminate, an abort with "terminate called ...". The
    module here does what C++ does with it, so a handler that raises aborts and one that exits does not."""
    (tmp_path / "extension_like.py").write_text(
        "import os, signal, sys, time\n"
        "try:\n"
        f"    os.kill(os.getpid(), {int(signum)})\n"
        "    time.sleep(5)\n"
        "except BaseException as e:\n"
        "    print(f'terminate called after throwing {e!r}', file=sys.stderr)\n"
        "    os.abort()\n"
        "def main():\n    return 0\n")
    proc = launched(tmp_path, "extension_like")
    assert proc.returncode == 128 + signum, proc.stderr
    one_line(proc.stderr, f"interrupted ({signal.Signals(signum).name}): while starting")


def test_an_interrupt_lost_in_a_weakref_callback_prints_no_traceback_block(tiny_pipeline_dir, tmp_path):
    """SIGTERM raised inside a callback Python cannot propagate from: the run stops with one line, and the
    "Exception ignored ... Traceback" block Python would print is not there."""
    script = f"""
import os, signal, sys, weakref
import unet.run_folder
from unet.cli import generate
real = unet.run_folder.overlay_grid

class Thing:
    pass

def overlay_and_lose_the_signal(*args, **kwargs):
    thing = Thing()
    weakref.finalize(thing, lambda: os.kill(os.getpid(), signal.SIGTERM) or __import__("time").sleep(2))
    del thing  # the finalizer runs here; the Interrupted it raises is "ignored" by Python
    return real(*args, **kwargs)

unet.run_folder.overlay_grid = overlay_and_lose_the_signal
sys.exit(generate.main(["a red circle", "--model", {str(tiny_pipeline_dir)!r}, "--out", {str(tmp_path / 'out')!r},
                        "--steps", "1", "--quiet"]))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          preexec_fn=default_sigint)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    one_line(proc.stderr, "interrupted (SIGTERM): ")
    assert "Exception ignored" not in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_sample_grid_that_cannot_write_keeps_the_old_grid_and_leaves_no_partial(tiny_pipeline_dir, tmp_path,
                                                                                 capsys, monkeypatch):
    import errno

    from unet.cli import sample_grid
    out = tmp_path / "grid.png"
    out.write_bytes(b"the old grid")

    def half_then_disk_full(self, fp, *args, **kwargs):
        Path(fp).write_bytes(b"half")
        raise OSError(errno.ENOSPC, "No space left on device", str(fp))

    monkeypatch.setattr(Image.Image, "save", half_then_disk_full)
    assert sample_grid.main(["a red circle", "--model", str(tiny_pipeline_dir), "--seeds", "1", "--steps", "1",
                             "--overwrite", "--out", str(out)]) == 2
    err = capsys.readouterr().err  # the loading bars, then one line
    assert "Traceback" not in err and "could not write" in err.splitlines()[-1], err
    assert "No space left on device" in err.splitlines()[-1], err
    assert out.read_bytes() == b"the old grid" and sorted(p.name for p in tmp_path.iterdir()) == ["grid.png"]


def test_sample_grid_replaces_a_grid_only_when_told_and_names_what_it_writes(tiny_pipeline_dir, tmp_path, capsys):
    from unet.cli import sample_grid
    out = tmp_path / "grid.png"
    args = ["a red circle", "--model", str(tiny_pipeline_dir), "--seeds", "2", "--steps", "2", "--scale", "1"]
    assert sample_grid.main([*args, "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    first = np.asarray(Image.open(out))
    assert first.shape[:2] == (2 * 16, 16)  # a row per seed, a column per prompt, of the tiny model's 16 px
    before = files(tmp_path)
    assert sample_grid.main([*args, "--seeds", "1", "--out", str(out)]) == 2
    one_line(capsys.readouterr().err, "pass --overwrite")
    assert files(tmp_path) == before
    for bad, message in ((tmp_path, "is a folder"), (tmp_path / "grid.pngx", "unknown image type")):
        assert sample_grid.main([*args, "--out", str(bad)]) == 2
        one_line(capsys.readouterr().err, message)
    assert sample_grid.main([*args, "--seeds", "1", "--overwrite", "--out", str(out)]) == 0
    assert np.array_equal(np.asarray(Image.open(out)), first[:16])  # seed 0 again, alone, and nothing else left
    assert sorted(p.name for p in tmp_path.iterdir()) == ["grid.png"]
