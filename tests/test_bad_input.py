"""Every kind of bad input gets one line and exit code 2 (or one exception type in the API), and
leaves nothing behind; interrupts (Ctrl-C, SIGTERM) leave no half-made folder either."""

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

import unet.cli.checks
import unet.cli.generate as generate
import unet.run_folder
from crossattn import CrossAttention
from crossattn.capture import AttentionStore
from unet.cli import PARTIAL, memory_estimate
from unet.cli import explain as explain_script
from unet.cli import train as train_script
from unet.cli.generate import generate_one
from unet.pipeline import ScenePipeline, Settings, UsageError, load_pipeline

ROOT = Path(__file__).resolve().parents[1]


def one_line_error(capsys, rc: int, message: str) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2, err
    assert message in err, err
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def generate_main(tiny_pipeline_dir, out, *args, model=True):
    model_args = ["--model", str(tiny_pipeline_dir)] if model else []
    return generate.main(["--steps", "2", "--quiet", *args, *model_args, "--out", str(out)])


# --- generate.py: values
@pytest.mark.parametrize("args, message", [
    (["--guidance", "inf"], "--guidance must be a finite number"),
    (["--guidance", "nan"], "--guidance must be a finite number"),
    (["--height", "0"], "--height must be a positive number of pixels, got 0"),
    (["--height", "-8"], "--height must be a positive number of pixels, got -8"),
    (["--width", "15"], "--width must be a multiple of 2 for this model, got 15"),
    (["--steps", "100000"], "--steps must be at most 1000"),
    (["--seed", str(2 ** 70)], "--seed must be an integer from 0 to 2**64 - 1"),
    (["--seed", "-1"], "--seed must be an integer from 0 to 2**64 - 1"),
    (["--device", "bogus"], "device 'bogus' is not usable here"),
    (["--device", "cuda:99"], "device 'cuda:99' is not usable here"),
])
def test_generate_bad_values(tiny_pipeline_dir, tmp_path, capsys, args, message):
    out = tmp_path / "out"
    one_line_error(capsys, generate_main(tiny_pipeline_dir, out, "a red circle", *args), message)
    assert not out.exists()


def test_generate_refuses_sizes_beyond_memory(tiny_pipeline_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(unet.cli.checks, "available_memory", lambda device: 2 ** 30)  # 1 GiB free
    out = tmp_path / "out"
    rc = generate_main(tiny_pipeline_dir, out, "a red circle", "--height", "4096", "--width", "4096")
    line = one_line_error(capsys, rc, "this run would need about ")
    assert "4096x4096" in line and "1.0 GiB free" in line and not out.exists()
    # the estimate grows with the size and the number of images
    pipe = load_pipeline(tiny_pipeline_dir)
    small, large = (memory_estimate(pipe, Settings(height=s, width=s)) for s in (16, 64))
    assert 0 < small < large < memory_estimate(pipe, Settings(height=64, width=64, num_images=4))


def test_generate_long_prompt_error_stays_short(tiny_pipeline_dir, tmp_path, capsys):
    prompt = "a red circle " * 7500  # ~98 KB
    line = one_line_error(capsys, generate_main(tiny_pipeline_dir, tmp_path / "out", prompt), "would be dropped")
    assert len(line) < 600 and not (tmp_path / "out").exists()


# --- generate.py: output folder, checked before sampling
def test_generate_out_is_a_file_or_under_one(tiny_pipeline_dir, tmp_path, capsys):
    a_file = tmp_path / "taken"
    a_file.write_text("keep me")
    one_line_error(capsys, generate_main(tiny_pipeline_dir, a_file, "a red circle"), "is a file, not a folder")
    one_line_error(capsys, generate_main(tiny_pipeline_dir, a_file / "sub", "a red circle"), "cannot be created")
    assert a_file.read_text() == "keep me" and sorted(tmp_path.iterdir()) == [a_file]


def test_generate_out_not_writable(tiny_pipeline_dir, tmp_path, capsys, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    real_access = os.access
    if os.geteuid() == 0:  # root may write anywhere: let the check see what a user would
        monkeypatch.setattr(os, "access", lambda path, mode: Path(path) != locked and real_access(path, mode))
    try:
        one_line_error(capsys, generate_main(tiny_pipeline_dir, locked / "out", "a red circle"), "is not writable")
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o700)


# --- model folders
def _broken_model(tiny_pipeline_dir, tmp_path, how):
    model = tmp_path / "model"
    shutil.copytree(tiny_pipeline_dir, model)
    how(model)
    return model


@pytest.mark.parametrize("how, message", [
    (lambda m: (m / "model_index.json").write_text("[]"), 'must be a JSON object with a "_class_name"'),
    (lambda m: ((m / "model_index.json").unlink(), (m / "model_index.json").mkdir()), "has no model_index.json file"),
    (lambda m: (m / "model_index.json").write_text("{not json"), "is not a readable JSON file"),
    (lambda m: (m / "trained_words.json").write_text("{oops"), "trained_words.json is not a readable JSON file"),
    (lambda m: (m / "trained_words.json").write_text('{"a": 1}'), "must be a JSON list of words"),
])
def test_generate_malformed_model_folder(tiny_pipeline_dir, tmp_path, capsys, how, message):
    model = _broken_model(tiny_pipeline_dir, tmp_path, how)
    rc = generate.main(["a red circle", "--model", str(model), "--out", str(tmp_path / "out")])
    one_line_error(capsys, rc, message)
    assert not (tmp_path / "out").exists()


def test_generate_model_empty_or_a_file(tmp_path, capsys):
    rc = generate.main(["a red circle", "--model", "", "--out", str(tmp_path / "out")])
    one_line_error(capsys, rc, "the model folder is empty")
    (tmp_path / "weights.safetensors").write_bytes(b"x")
    rc = generate.main(["a red circle", "--model", str(tmp_path / "weights.safetensors"),
                        "--out", str(tmp_path / "out")])
    one_line_error(capsys, rc, "is a file, not a pipeline folder")
    assert not (tmp_path / "out").exists()


def test_quiet_hides_loading_bars(tiny_pipeline_dir, tmp_path, capsys):
    generate.load_pipeline(tiny_pipeline_dir)
    assert "Loading pipeline components" in capsys.readouterr().err  # the bars this option hides
    assert generate_main(tiny_pipeline_dir, tmp_path, "a red circle") == 0
    err = capsys.readouterr().err
    assert "Loading" not in err and "it/s" not in err


# --- generate.py: interrupts and folders
@pytest.mark.parametrize("interrupt, code", [
    (lambda: os.kill(os.getpid(), signal.SIGTERM), 128 + signal.SIGTERM),
    (lambda: (_ for _ in ()).throw(KeyboardInterrupt), 128 + signal.SIGINT),
])
def test_interrupt_while_writing_leaves_nothing(tiny_pipeline_dir, tmp_path, capsys, monkeypatch, interrupt, code):
    def overlay_then_interrupt(*args, **kwargs):
        interrupt()
        time.sleep(5)  # the signal handler raises before this ends

    monkeypatch.setattr(unet.run_folder, "overlay_grid", overlay_then_interrupt)
    out = tmp_path / "new" / "out"
    assert generate_main(tiny_pipeline_dir, out, "a red circle") == code
    err = capsys.readouterr().err
    assert "interrupted" in err and "Traceback" not in err
    assert not (tmp_path / "new").exists()  # not even the parent folders this run created
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the old handler is back


def test_sigterm_during_sampling_in_a_subprocess(tiny_pipeline_dir, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "generate.py"), "a red circle", "--model",
                             str(tiny_pipeline_dir), "--out", str(out), "--steps", "1000"],
                            stderr=subprocess.PIPE, cwd=tmp_path)
    seen = bytearray()
    reader = threading.Thread(target=lambda: [seen.extend(c) for c in iter(lambda: proc.stderr.read(1), b"")])
    reader.start()
    deadline = time.time() + 120
    while b"/1000 [" not in seen and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)  # wait for the sampling progress bar (its 1000 steps), not the loading bars
    proc.send_signal(signal.SIGTERM)
    rc = proc.wait(timeout=60)
    reader.join(timeout=10)
    err = seen.decode(errors="replace")
    assert rc == 128 + signal.SIGTERM, err
    assert "interrupted (SIGTERM)" in err and "Traceback" not in err
    assert not out.exists()


def test_stale_partial_folders_are_removed_live_ones_kept(tiny_pipeline_dir, tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"{PARTIAL}{dead.pid}-abc"
    live = tmp_path / f"{PARTIAL}{os.getpid()}-xyz"
    legacy = tmp_path / f"{PARTIAL}k3j2h1"  # no pid: ignored, never read
    for folder in (stale, live, legacy):
        folder.mkdir()
        (folder / "image_0.png").write_bytes(b"half")
    assert generate_main(tiny_pipeline_dir, tmp_path, "a red circle") == 0
    assert not stale.exists() and live.exists() and legacy.exists()
    results = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert [p.name for p in results] == ["a-red-circle-s0"]


def test_result_folders_get_normal_permissions(tiny_pipeline_dir, tmp_path):
    old = os.umask(0o022)
    try:
        assert generate_main(tiny_pipeline_dir, tmp_path, "a red circle") == 0
        assert generate_main(tiny_pipeline_dir, tmp_path, "a red circle", "--overwrite") == 0
    finally:
        os.umask(old)
    (folder,) = [p for p in tmp_path.iterdir()]
    assert folder.stat().st_mode & 0o777 == 0o755
    assert (folder / "words").stat().st_mode & 0o777 == 0o755
    assert (folder / "maps.safetensors").stat().st_mode & 0o777 == 0o644
    assert (folder / "image_0.png").stat().st_mode & 0o777 == 0o644
    assert not any(p.name.startswith(PARTIAL) for p in tmp_path.iterdir())


def test_generate_one_api_validates_and_writes_nothing(tiny_pipeline, tmp_path):
    for settings, message in ((Settings(guidance=float("nan")), "--guidance"), (Settings(height=0), "--height"),
                              (Settings(steps=0), "--steps")):
        with pytest.raises(UsageError, match=message):
            generate_one(tiny_pipeline, "a red circle", settings, tmp_path / "out", "tiny")
    assert not (tmp_path / "out").exists()
    with pytest.raises(UsageError, match="empty"):
        load_pipeline("")


# --- explain.py
def explain_main(tiny_pipeline_dir, out, *args):
    return explain_script.main([*args, "--model", str(tiny_pipeline_dir), "--out", str(out)])


@pytest.mark.parametrize("args, message", [
    (["text", ""], "empty prompt"),
    (["heads", "   "], "empty prompt"),
    (["heads", "a red circle", "--word", "zebra"], "--word 'zebra' is not in the prompt; its words are"),
    (["pixel", "a red circle", "--x", "99"], "pixel (x=99, y=8) lies outside the 16x16 image"),
    (["pixel", "a red circle", "--y", "-1"], "lies outside the 16x16 image"),
    (["heads", "--seed", str(2 ** 70)], "--seed must be an integer"),
])
def test_explain_bad_input_before_any_sampling(tiny_pipeline_dir, tmp_path, capsys, monkeypatch, args, message):
    def never(*a, **k):
        raise AssertionError("sampled before checking the input")

    monkeypatch.setattr(ScenePipeline, "__call__", never)
    out = tmp_path / "out"
    one_line_error(capsys, explain_main(tiny_pipeline_dir, out, *args), message)
    assert not out.exists()


def test_explain_model_and_out_errors(tmp_path, capsys):
    rc = explain_script.main(["heads", "--model", "", "--out", str(tmp_path / "out")])
    one_line_error(capsys, rc, "the model folder is empty")
    (tmp_path / "file").write_text("x")
    one_line_error(capsys, explain_script.main(["text", "--out", str(tmp_path / "file")]), "is a file, not a folder")
    assert not (tmp_path / "out").exists()


def test_explain_writes_whole_figures_or_nothing(tiny_pipeline_dir, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    assert explain_main(tiny_pipeline_dir, out, "heads", "a red circle") == 0
    assert [p.name for p in out.iterdir()] == ["heads_layers.png"]
    assert out.stat().st_mode & 0o777 == 0o777 & ~_umask()
    assert (out / "heads_layers.png").stat().st_mode & 0o777 == 0o666 & ~_umask()

    def interrupted_figure(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(explain_script.explain, "heads_figure", interrupted_figure)
    new = tmp_path / "new"
    assert explain_main(tiny_pipeline_dir, new, "heads", "a red circle") == 128 + signal.SIGINT
    assert "interrupted" in capsys.readouterr().err and not new.exists()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


# --- train.py
TINY_TRAIN = ["--size", "16", "--channels", "8", "16", "16", "--text-width", "16", "--text-layers", "1", "--heads", "2",
              "--max-length", "16", "--batch-size", "4", "--steps", "3", "--warmup", "1", "--sample-every", "1000",
              "--checkpoint-every", "1000", "--quiet"]


@pytest.mark.parametrize("args, message", [
    (["--num-samples", "2", "--batch-size", "4"], "--num-samples 2 is smaller than --batch-size 4"),
    (["--size", "15"], "--size must be a multiple of 4"),
    (["--lr", "nan"], "--lr must be a finite number >= 0, got nan"),
    (["--ema-decay", "1.5"], "--ema-decay < 1"),
    (["--channels", "8", "16", "20"], "--channels must be positive multiples of 8"),
    (["--seed", str(2 ** 40)], "--seed must be an integer from 0 to 2**32 - 1"),
])
def test_train_bad_values(tmp_path, capsys, args, message):
    out = tmp_path / "run"
    one_line_error(capsys, train_script.main(["--out", str(out), *TINY_TRAIN, *args]), message)
    assert not out.exists()


def test_make_data_errors_and_interrupts_leave_no_folder(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data"
    one_line_error(capsys, train_script.main(["--make-data", str(data), "--num-samples", "0"]), "--num-samples N > 0")

    def save_half_then_interrupt(self, folder):
        Path(folder).mkdir(parents=True)
        (Path(folder) / "images.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(train_script.SceneDataset, "save", save_half_then_interrupt)
    rc = train_script.main(["--make-data", str(data), "--num-samples", "2", "--size", "8"])
    assert rc == 128 + signal.SIGINT and "interrupted" in capsys.readouterr().err
    assert not data.exists()


def _checkpoint_without(tmp_path, drop_step=False, drop_prefix=None):
    """A finished tiny run whose checkpoint lost its step or some weights."""
    from safetensors.torch import load_file, save_file

    from unet.train import Trainer
    run = tmp_path / "run"
    Trainer(tiny_config(run, steps=1)).train(progress=False)
    ckpt = run / "checkpoint.safetensors"
    tensors = {k: v for k, v in load_file(str(ckpt)).items() if not (drop_prefix and k.startswith(drop_prefix))}
    save_file(tensors, str(ckpt), metadata=None if drop_step else {"step": "1"})
    return run


@pytest.mark.parametrize("drop, message", [
    (dict(drop_step=True), "does not record its step"),
    (dict(drop_prefix="unet."), "lacks the weights of ['unet']"),
])
def test_train_resume_from_broken_checkpoint(tmp_path, capsys, drop, message):
    run = _checkpoint_without(tmp_path, **drop)
    capsys.readouterr()  # the tiny run's own output
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    one_line_error(capsys, train_script.main(["--out", str(run), *TINY_TRAIN, "--resume", "--steps", "2"]), message)
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before  # nothing written or removed


def test_train_failed_start_leaves_no_folder(tmp_path, capsys):
    (tmp_path / "clip").mkdir()  # exists, so validation passes, but holds no CLIP
    out = tmp_path / "run"
    rc = train_script.main(["--out", str(out), *TINY_TRAIN, "--clip", str(tmp_path / "clip")])
    one_line_error(capsys, rc, "error: ")
    assert not out.exists()


def test_train_sigterm_saves_checkpoint_then_exits(tmp_path, capsys, monkeypatch):
    from safetensors import safe_open

    from unet.train import Trainer
    real_update = Trainer.update_ema

    def update_then_sigterm(self):
        real_update(self)
        if self.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(Trainer, "update_ema", update_then_sigterm)
    out = tmp_path / "run"
    assert train_script.main(["--out", str(out), *TINY_TRAIN, "--steps", "5"]) == 128 + signal.SIGTERM
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("interrupted (SIGTERM): checkpoint saved at step 2"), err
    with safe_open(str(out / "checkpoint.safetensors"), "pt") as f:
        assert f.metadata()["step"] == "2"
    assert not (out / "pipeline").exists()


# --- API: attention masks and stores
def _block_and_inputs():
    block = CrossAttention(16, 8, heads=2, head_dim=4)
    return block, torch.randn(2, 5, 16), torch.randn(2, 4, 8)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_integer_masks_keep_and_drop_like_bool_on_both_paths(dtype):
    block, x, ctx = _block_and_inputs()
    keep = torch.tensor([[True, True, False, False], [True, True, True, True]])
    fused_bool, (explicit_bool, w) = block(x, ctx, mask=keep), block(x, ctx, mask=keep, need_weights=True)
    ints = keep.to(dtype)  # what tokenizers return as attention_mask
    assert torch.equal(block(x, ctx, mask=ints), fused_bool)
    explicit_int, w_int = block(x, ctx, mask=ints, need_weights=True)
    assert torch.equal(explicit_int, explicit_bool) and torch.equal(w_int, w)
    assert torch.all(w_int[0, :, :, 2:] == 0)
    assert torch.allclose(fused_bool, explicit_bool, atol=1e-5)


@pytest.mark.parametrize("mask, message", [
    (torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]]), "must be bool or integer 0/1"),
    (torch.tensor([[1, 2, 0, 0], [1, 1, 1, 1]]), "only 0 \\(drop\\) and 1 \\(keep\\)"),
    (torch.tensor([[False] * 4, [True] * 4]), "drops every key of some sample"),
])
@pytest.mark.parametrize("need_weights", [False, True])
def test_bad_masks_raise_the_same_on_both_paths(mask, message, need_weights):
    block, x, ctx = _block_and_inputs()
    with pytest.raises(ValueError, match=message):
        block(x, ctx, mask=mask, need_weights=need_weights)


def test_second_store_on_a_model_is_refused_and_first_keeps_working(tiny_pipeline):
    first, second = AttentionStore(), AttentionStore()
    with first.attach(tiny_pipeline.unet):
        with pytest.raises(RuntimeError, match="already has an AttentionStore attached"):
            second.attach(tiny_pipeline.unet)
        tiny_pipeline("a red circle", num_inference_steps=2, show_progress=False)
        assert first.passes() > 0 and second.passes() == 0
    assert all(m.observer is None for m in tiny_pipeline.unet.modules() if isinstance(m, CrossAttention))
    with second.attach(tiny_pipeline.unet):  # free again once the first is detached
        tiny_pipeline("a red circle", num_inference_steps=2, show_progress=False)
    assert second.passes() == first.passes()


def test_second_store_refused_on_a_diffusers_unet_too():
    from diffusers import UNet2DConditionModel
    unet = UNet2DConditionModel(sample_size=8, in_channels=4, out_channels=4, layers_per_block=1,
                                block_out_channels=(8, 16), down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
                                up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"), cross_attention_dim=8,
                                norm_num_groups=4, attention_head_dim=2)
    first = AttentionStore().attach(unet)
    with pytest.raises(RuntimeError, match="UNet2DConditionModel already has an AttentionStore attached"):
        AttentionStore().attach(unet)
    first.detach()
    AttentionStore().attach(unet).detach()  # free again


def test_store_with_wrong_timestep_count_says_so(tiny_pipeline):
    store = AttentionStore(num_train_timesteps=100)  # the scheduler has 1000
    with store.attach(tiny_pipeline.unet), pytest.raises(ValueError, match="num_train_timesteps"):
        tiny_pipeline("a red circle", num_inference_steps=2, show_progress=False)


def test_bad_input_list_in_readme_matches_these_tests():
    readme = (ROOT / "docs" / "reliability.md").read_text()
    for phrase in ("a `--guidance` outside", "`--seed` outside", "not a multiple of", "memory", "`--device`",
                   "`--out`", "SIGTERM", ".partial-", "float masks", "second `AttentionStore`"):
        assert phrase in readme, phrase
