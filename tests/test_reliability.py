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
from unet.folders import publish

ROOT = Path(__file__).resolve().parents[1]


def default_sigint() -> None:
    """A child's SIGINT at its default: started from a background job, it would inherit SIGINT as ignored (and
    rightly keep ignoring it), so a test that sends SIGINT must undo that in the child."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


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
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint)


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


def test_a_run_is_trained_when_its_checkpoint_reached_its_steps_and_its_pipeline_is_written(tmp_path):
    # what both a resume's refusal and the rounds (which round to train next) read
    from unet.train import Trainer, is_trained
    run = tmp_path / "run"
    assert not is_trained(run, 3)  # nothing there
    Trainer(tiny_config(run, steps=3)).train(progress=False)
    assert is_trained(run, 3) and is_trained(run, 2) and not is_trained(run, 4)
    (run / "pipeline" / "model_index.json").unlink()  # a pipeline only half written is not a trained run
    assert not is_trained(run, 3)


# --- 3. checkpoint integrity
def test_committed_parts_join_and_resume_where_the_run_stopped(tmp_path):
    """The training checkpoint the repository carries (outputs/examples/training/checkpoint-text-lr-grounding) joins,
    checks and resumes, with the CLIP folder its config names."""
    from unet.cli import checkpoint_parts
    from unet.train import TrainConfig, Trainer
    parts = ROOT / "outputs" / "examples" / "training" / "checkpoint-text-lr-grounding"
    run = tmp_path / "words"
    run.mkdir()
    config = json.loads((parts / "train_config.json").read_text())
    assert (ROOT / config["clip"]).is_dir()  # relative to the repository's root, where the guide runs it
    (run / "train_config.json").write_text(json.dumps(config | {"clip": str(ROOT / config["clip"])}))
    assert checkpoint_parts.main(["join", str(parts), str(run / "checkpoint.safetensors")]) == 0
    rows = (parts / "loss.csv").read_text().splitlines()
    last = int(rows[-1].split(",")[0])
    trainer = Trainer(TrainConfig.from_flat(out=str(run), steps=last + 1, resume=True))
    assert trainer.step == last == trainer.saved_step and len(rows) == last  # one log row per step, none missing


def test_checkpoint_without_hashes_is_read_as_the_older_format(tmp_path):
    """Checkpoints written before the hashes (no 'sha256' metadata) still resume."""
    from safetensors.torch import load_file, save_file

    from unet.checkpoint import HASH, read_metadata
    from unet.train import Trainer
    run = tmp_path / "run"
    Trainer(tiny_config(run, steps=2)).train(progress=False)
    path = run / "checkpoint.safetensors"
    metadata, _ = read_metadata(path)
    save_file(load_file(str(path)), str(path), {k: v for k, v in metadata.items() if k != HASH})
    assert HASH not in read_metadata(path)[0]
    assert Trainer(tiny_config(run, steps=3, resume=True)).step == 2


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    from unet.train import Trainer
    run = tmp_path_factory.mktemp("finished") / "run"
    Trainer(tiny_config(run, steps=2)).train(progress=False)
    return run


def _damage(path: Path) -> None:
    """4 KB of garbage in the tensor data (the header, first, stays readable)."""
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header + 100:header + 4196] = os.urandom(4096)
    path.write_bytes(bytes(data))


def _parts(finished_run, tmp_path) -> Path:
    from unet.checkpoint import split
    split(finished_run / "checkpoint.safetensors", tmp_path / "parts", part_bytes=100_000)
    return tmp_path / "parts"


def test_join_refuses_a_damaged_part(finished_run, tmp_path, capsys):
    from unet.cli import checkpoint_parts
    parts = _parts(finished_run, tmp_path)
    _damage(sorted(parts.iterdir())[1])
    target = tmp_path / "checkpoint.safetensors"
    assert checkpoint_parts.main(["join", str(parts), str(target)]) == 2
    one_line(capsys.readouterr().err, "is damaged: its tensors do not match the SHA-256 it records")
    assert list(tmp_path.glob("*.safetensors")) == [] and list(tmp_path.glob(".*")) == []


def test_join_refuses_a_part_from_another_checkpoint(finished_run, tmp_path, capsys):
    from unet.checkpoint import load, save
    from unet.cli import checkpoint_parts
    parts = _parts(finished_run, tmp_path)
    first = sorted(parts.iterdir())[0]
    tensors, metadata = load(first)
    tensors = {k: v + 1 if v.is_floating_point() else v for k, v in tensors.items()}
    save(tensors, first, metadata)  # a whole, self-consistent part, of some other checkpoint
    assert checkpoint_parts.main(["join", str(parts), str(tmp_path / "c.safetensors")]) == 2
    one_line(capsys.readouterr().err, "do not make the checkpoint they were cut from")


def test_split_never_overwrites_parts(finished_run, tmp_path, capsys):
    from unet.cli import checkpoint_parts
    parts = _parts(finished_run, tmp_path)
    before = {p.name: p.read_bytes() for p in parts.iterdir()}
    assert checkpoint_parts.main(["split", str(finished_run / "checkpoint.safetensors"), str(parts)]) == 2
    one_line(capsys.readouterr().err, "already holds checkpoint parts")
    assert {p.name: p.read_bytes() for p in parts.iterdir()} == before


@pytest.mark.parametrize("how", ["text", "truncated", "garbled header"])
def test_unreadable_checkpoint_files_give_one_line(finished_run, tmp_path, capsys, how):
    from unet.cli import checkpoint_parts
    bad = tmp_path / "bad.safetensors"
    data = (finished_run / "checkpoint.safetensors").read_bytes()
    bad.write_bytes({"text": b"just some notes\n", "truncated": data[:len(data) // 2],
                     "garbled header": data[:8] + b"{garbage" + data[16:]}[how])
    assert checkpoint_parts.main(["split", str(bad), str(tmp_path / "parts")]) == 2
    one_line(capsys.readouterr().err, "is not a readable safetensors checkpoint")
    assert not (tmp_path / "parts").exists()
    (tmp_path / "parts2").mkdir()
    bad.rename(tmp_path / "parts2" / "checkpoint-01-of-01.safetensors")
    assert checkpoint_parts.main(["join", str(tmp_path / "parts2"), str(tmp_path / "c.safetensors")]) == 2
    one_line(capsys.readouterr().err, "is not a readable safetensors checkpoint")
    assert not (tmp_path / "c.safetensors").exists()


def _copy_run(finished_run, tmp_path) -> Path:
    import shutil
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    shutil.rmtree(run / "pipeline")
    return run


def test_resume_refuses_a_damaged_checkpoint(finished_run, tmp_path, capsys):
    from unet.cli import train as train_script
    run = _copy_run(finished_run, tmp_path)
    _damage(run / "checkpoint.safetensors")
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    assert train_script.main(["--out", str(run), *TINY_TRAIN, "--resume", "--steps", "3"]) == 2
    one_line(capsys.readouterr().err, "is damaged")
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


def test_resume_refuses_non_finite_weights_naming_the_tensor(finished_run, tmp_path, capsys):
    from unet.checkpoint import load, save
    from unet.cli import train as train_script
    run = _copy_run(finished_run, tmp_path)
    tensors, metadata = load(run / "checkpoint.safetensors")
    tensors["ema.conv_in.weight"][0, 0, 0, 0] = float("nan")
    save(tensors, run / "checkpoint.safetensors", {"step": metadata["step"]})  # a valid hash of bad weights
    assert train_script.main(["--out", str(run), *TINY_TRAIN, "--resume", "--steps", "3"]) == 2
    one_line(capsys.readouterr().err, "non-finite values (NaN or inf) in tensor 'ema.conv_in.weight'")


def test_generate_refuses_a_pipeline_with_nan_weights(tiny_pipeline_dir, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    from unet.cli import generate
    model = tmp_path / "model"
    shutil.copytree(tiny_pipeline_dir, model)
    weights = model / "text_encoder" / "model.safetensors"
    tensors = load_file(str(weights))
    name = next(k for k in tensors if "token_embedding" in k)
    tensors[name][3] = float("nan")
    save_file(tensors, str(weights), metadata={"format": "pt"})
    rc = generate.main(["a red circle", "--model", str(model), "--out", str(tmp_path / "out"), "--quiet"])
    assert rc == 2
    one_line(capsys.readouterr().err, "non-finite values (NaN or inf) in tensor 'text_encoder.")
    assert not (tmp_path / "out").exists()


# --- 4. evaluate.py checks everything before sampling, and never replaces a report silently
def _never_sample(monkeypatch):
    import unet.cli.evaluate as evaluate

    def never(*args, **kwargs):
        raise AssertionError("sampled before checking the input")

    monkeypatch.setattr(evaluate, "run_evaluation", never)
    monkeypatch.setattr(evaluate, "run_control_evaluation", never)
    return evaluate


@pytest.mark.parametrize("args, message", [
    (["--dataset-images", "-5"], "--dataset-images must be a positive integer, got -5"),
    (["--dataset-images", "0"], "--dataset-images must be a positive integer, got 0"),
    (["--seeds", "0"], "--seeds must be a positive integer, got 0"),
    (["--steps", "0"], "--steps must be a positive integer, got 0"),
    (["--dataset-timestep", "5000"], "--dataset-timestep must be a training timestep from 0 to 999, got 5000"),
    (["--dataset-timestep", "-1"], "--dataset-timestep must be a training timestep from 0 to 999"),
    (["--steps", "100000"], "--steps must be at most 1000"),
    (["--guidance", "nan"], "--guidance must be a finite number from 0 to 100 (<= 1 turns guidance off), got nan"),
    (["--control", "reweight", "--reweight-factor", "1e30"], "must be a finite number from -1000 to 1000, got 1e+30"),
    (["--out", "/proc/x"], "--out /proc/x cannot be written"),
    (["--out", ""], "--out is empty"),
])
def test_evaluate_bad_input_before_sampling(tiny_pipeline_dir, tmp_path, capsys, monkeypatch, args, message):
    evaluate = _never_sample(monkeypatch)
    out = ["--out", str(tmp_path / "eval")] if "--out" not in args else []
    rc = evaluate.main(["--model", str(tiny_pipeline_dir), "--quiet", *out, *args])
    assert rc == 2
    one_line(capsys.readouterr().err, message)
    assert list(tmp_path.iterdir()) == []


def test_evaluate_out_a_file_or_an_existing_report(tiny_pipeline_dir, tmp_path, capsys, monkeypatch):
    evaluate = _never_sample(monkeypatch)
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep")
    assert evaluate.main(["--model", str(tiny_pipeline_dir), "--out", str(a_file)]) == 2
    one_line(capsys.readouterr().err, "is a file, not a folder")
    report = tmp_path / "eval"
    report.mkdir()
    (report / "report.json").write_text("{}")
    assert evaluate.main(["--model", str(tiny_pipeline_dir), "--out", str(report)]) == 2
    one_line(capsys.readouterr().err, "already holds a report; pass --overwrite")
    assert a_file.read_text() == "keep" and (report / "report.json").read_text() == "{}"


def test_evaluate_publishes_the_report_whole(tiny_pipeline_dir, tmp_path, capsys, monkeypatch):
    import unet.cli.evaluate as evaluate
    monkeypatch.setattr(evaluate, "run_evaluation", lambda pipe, **kw: (
        {"prompt_following": {"overall": 0.5}, "maps": {"shape_words": {"miou": 0.1, "pointing": 0.2}},
         "settings": dict(kw)}, [], [], None))

    def write_then_fail(report, records, batches, selection, folder, title):
        (folder / "report.json").write_text("{}")
        raise OSError(28, "No space left on device", str(folder / "tasks.png"))

    monkeypatch.setattr(evaluate, "write", write_then_fail)
    out = tmp_path / "eval"
    assert evaluate.main(["--model", str(tiny_pipeline_dir), "--out", str(out), "--quiet"]) == 2
    one_line(capsys.readouterr().err, "could not write the report: No space left on device")
    assert list(tmp_path.iterdir()) == []  # no partial folder, no empty --out

    def write_report(report, records, batches, selection, folder, title):
        (folder / "report.json").write_text(str(report["settings"]["seeds"]))

    monkeypatch.setattr(evaluate, "write", write_report)
    assert evaluate.main(["--model", str(tiny_pipeline_dir), "--out", str(out), "--quiet", "--seeds", "1"]) == 0
    assert evaluate.main(["--model", str(tiny_pipeline_dir), "--out", str(out), "--quiet", "--seeds", "3",
                          "--overwrite"]) == 0
    assert (out / "report.json").read_text() == "3" and [p.name for p in tmp_path.iterdir()] == ["eval"]


# --- 5./6. interrupts, write failures and memory limits
def _limited(resource_name: str, limit: int):
    import resource

    def apply():
        resource.setrlimit(getattr(resource, resource_name), (limit, limit))
    return apply


def test_file_size_limit_while_writing_gives_one_line_and_no_folder(tiny_pipeline_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "earlier").mkdir()  # what was there before stays
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "a red circle", "--model",
                           str(tiny_pipeline_dir), "--out", str(out), "--steps", "2", "--quiet"],
                          capture_output=True, text=True, timeout=300, preexec_fn=_limited("RLIMIT_FSIZE", 3000))
    assert proc.returncode == 2, proc.stderr
    one_line(proc.stderr, "could not write the results: File too large")
    assert [p.name for p in out.iterdir()] == ["earlier"]


def test_address_space_limit_is_part_of_the_memory_estimate(tiny_pipeline_dir, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "generate.py"), "a red circle", "--model",
                           str(tiny_pipeline_dir), "--out", str(out), "--height", "2048", "--width", "2048",
                           "--quiet"], capture_output=True, text=True, timeout=300,
                          preexec_fn=_limited("RLIMIT_AS", 5 * 2 ** 30))  # RAM alone would let it start
    assert proc.returncode == 2, proc.stderr
    line = one_line(proc.stderr, "GiB (2048x2048, 1 images) but cpu has ")
    assert float(line.split("cpu has ")[1].split()[0]) < 5.0 and not out.exists()


def test_allocator_failure_while_sampling_gives_one_line(tiny_pipeline_dir, tmp_path, capsys, monkeypatch):
    from unet.cli import generate
    from unet.pipeline import ScenePipeline

    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 8589934592 bytes. Error code 12 (Cannot allocate memory)")

    monkeypatch.setattr(ScenePipeline, "__call__", no_memory)
    out = tmp_path / "out"
    assert generate.main(["a red circle", "--model", str(tiny_pipeline_dir), "--out", str(out), "--quiet"]) == 2
    one_line(capsys.readouterr().err, "ran out of memory while sampling at the model's size, 1 image(s) (8.0 GiB")
    assert not out.exists()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_the_imports_gives_one_line(tmp_path, signum):
    import time
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "generate.py"), "a red circle", "--out",
                             str(tmp_path / "out")], stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    time.sleep(0.5)  # torch is still being imported
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err
    one_line(err, f"interrupted ({signal.Signals(signum).name}): ")
    assert not (tmp_path / "out").exists()


def test_a_swallowed_interrupt_still_stops_the_run(tiny_pipeline_dir, tmp_path, capsys, monkeypatch):
    """Python may raise the signal's exception inside a weakref callback (matplotlib), which drops it."""
    import time

    import unet.run_folder
    from unet.cli import generate

    def overlay_and_lose_the_signal(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except KeyboardInterrupt:
            pass  # "Exception ignored in: <function WeakKeyDictionary...>"

    monkeypatch.setattr(unet.run_folder, "overlay_grid", overlay_and_lose_the_signal)
    out = tmp_path / "out"
    rc = generate.main(["a red circle", "--model", str(tiny_pipeline_dir), "--out", str(out), "--steps", "2",
                        "--quiet"])
    assert rc == 128 + signal.SIGTERM
    one_line(capsys.readouterr().err, "interrupted (SIGTERM)")
    assert not out.exists()


def test_an_interrupt_that_diffusers_turns_into_a_load_error_is_reported_as_an_interrupt(
        tiny_pipeline_dir, tmp_path, capsys, monkeypatch):
    """diffusers catches the signal's exception inside a weight load and raises OSError("Unable to load
    weights ..."): the command says it was interrupted (exit 143), not that the model is broken (exit 2)."""
    import time

    from unet.cli import generate
    from unet.pipeline import ScenePipeline

    def load_and_lose_the_signal(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
        except KeyboardInterrupt as e:
            raise OSError("Unable to load weights from checkpoint file") from e

    monkeypatch.setattr(ScenePipeline, "from_pretrained", load_and_lose_the_signal)
    out = tmp_path / "out"
    rc = generate.main(["a red circle", "--model", str(tiny_pipeline_dir), "--out", str(out), "--steps", "2",
                        "--quiet"])
    assert rc == 128 + signal.SIGTERM
    one_line(capsys.readouterr().err, "interrupted (SIGTERM)")
    assert not out.exists()


def test_signal_during_the_final_save_leaves_no_half_pipeline(tmp_path, capsys, monkeypatch):
    from unet.cli import train as train_script
    from unet.pipeline import ScenePipeline
    real_save = ScenePipeline.save_pretrained

    def save_half_then_sigterm(self, folder, **kwargs):
        (Path(folder) / "unet").mkdir(parents=True)
        (Path(folder) / "unet" / "config.json").write_text("{}")
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(ScenePipeline, "save_pretrained", save_half_then_sigterm)
    run = tmp_path / "run"
    assert train_script.main(["--out", str(run), *TINY_TRAIN, "--steps", "2"]) == 128 + signal.SIGTERM
    one_line(capsys.readouterr().err, "trained to step 2 (checkpoint ")
    assert not (run / "pipeline").exists() and not list(run.glob(f"{PARTIAL}*"))
    monkeypatch.setattr(ScenePipeline, "save_pretrained", real_save)
    assert train_script.main(["--out", str(run), *TINY_TRAIN, "--steps", "2", "--resume"]) == 0  # writes it
    assert (run / "pipeline" / "model_index.json").is_file()


def test_stale_controlled_partial_folders_are_removed(tiny_pipeline_dir, tmp_path):
    from unet.cli import generate
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = tmp_path / "earlier-run"
    stale, live = run / f"{PARTIAL}{dead.pid}-controlled-abc", run / f"{PARTIAL}{os.getpid()}-controlled-xyz"
    for folder in (stale, live):
        folder.mkdir(parents=True)
        (folder / "compare.png").write_bytes(b"half")
    assert generate.main(["a red circle", "--model", str(tiny_pipeline_dir), "--out", str(tmp_path), "--steps", "2",
                          "--quiet", "--reweight", "red=2"]) == 0
    assert not stale.exists() and live.exists()
    (result,) = [p for p in tmp_path.iterdir() if p != run]
    assert (result / "compare.png").is_file() and not list(result.glob(f"{PARTIAL}*"))


# --- 8. the gallery skips a bad run with one warning and links nothing that can run script
def _run_folder(root: Path, name: str, meta) -> Path:
    run = root / name
    run.mkdir(parents=True)
    (run / "meta.json").write_bytes(meta if isinstance(meta, bytes) else json.dumps(meta).encode())
    (run / "image_0.png").write_bytes(b"png")
    return run


@pytest.mark.parametrize("bad, why", [
    (b'{"prompt": "a red', "not a readable UTF-8 JSON file"),
    ([1, 2], "holds a JSON list, not an object"),
    ({"prompt": 5}, "prompt is not text"),
    (b'{"prompt": "\xff\xfe"}', "not a readable UTF-8 JSON file (UnicodeDecodeError"),
    ("folder", "not a readable UTF-8 JSON file (IsADirectoryError"),
    ("mode 000", "not a readable UTF-8 JSON file (PermissionError"),
])
def test_gallery_skips_a_bad_run_with_one_warning(tmp_path, capsys, monkeypatch, bad, why):
    from crossattn.viewer import gallery_main
    good = _run_folder(tmp_path, "good", {"prompt": "a red circle", "images": ["image_0.png"], "seed": 1})
    if bad == "folder":
        (tmp_path / "broken" / "meta.json").mkdir(parents=True)
    elif bad == "mode 000":
        broken = _run_folder(tmp_path, "broken", {"prompt": "a blue square"})
        (broken / "meta.json").chmod(0)
        real_read = Path.read_text
        if os.geteuid() == 0:  # root reads anything: make the read fail as it would for a user
            def read_text(self, *args, **kwargs):
                if self == broken / "meta.json":
                    raise PermissionError(13, "Permission denied", str(self))
                return real_read(self, *args, **kwargs)
            monkeypatch.setattr(Path, "read_text", read_text)
    else:
        _run_folder(tmp_path, "broken", bad)
    assert gallery_main([str(tmp_path)]) == 0
    captured = capsys.readouterr()
    line = one_line(captured.err, f"warning: skipped {tmp_path / 'broken'}: ")
    assert why in line, line
    page = (tmp_path / "index.html").read_text()
    assert "1 run(s)" in page and "a red circle" in page and f"./{good.name}/" in page
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken", "good", "index.html"]  # no .index.html.tmp


def test_gallery_links_cannot_become_a_scheme(tmp_path, capsys):
    from html.parser import HTMLParser

    from crossattn.viewer import gallery_main
    _run_folder(tmp_path, "javascript:alert(1)", {"prompt": "x", "images": ["image_0.png"]})
    _run_folder(tmp_path, 'q" onmouseover="alert(2)', {"prompt": "y", "images": ["image_0.png"]})
    assert gallery_main([str(tmp_path)]) == 0
    cards = []

    class Cards(HTMLParser):
        def handle_starttag(self, tag, attrs):
            if tag in ("a", "img") and any(k in ("href", "src") for k, _ in attrs):
                cards.append(dict(attrs))

    Cards().feed((tmp_path / "index.html").read_text())
    links = [c.get("href", c.get("src")) for c in cards]
    assert len(cards) == 4 and all(link.startswith("./") for link in links), links
    assert "./javascript%3Aalert%281%29/" in links and not any("onmouseover" in c for c in cards)


def test_gallery_write_failure_keeps_the_old_page(tmp_path, capsys, monkeypatch):
    from crossattn import viewer
    _run_folder(tmp_path, "good", {"prompt": "a red circle", "images": ["image_0.png"]})
    (tmp_path / "index.html").write_text("old page")
    real_replace = os.replace

    def disk_full(src, dst):
        if Path(dst).name == "index.html":
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(viewer.os, "replace", disk_full)
    assert viewer.gallery_main([str(tmp_path)]) == 2
    one_line(capsys.readouterr().err, "could not write the gallery in")
    assert (tmp_path / "index.html").read_text() == "old page"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["good", "index.html"]


# --- 9. minor: an empty --out, explain's long prompts
@pytest.mark.parametrize("command", ["generate", "explain", "train", "make-data"])
def test_an_empty_out_is_refused(tiny_pipeline_dir, tmp_path, capsys, monkeypatch, command):
    from unet.cli import explain, generate
    from unet.cli import train as train_script
    monkeypatch.chdir(tmp_path)  # '' must not mean this folder
    rc = {"generate": lambda: generate.main(["a red circle", "--model", str(tiny_pipeline_dir), "--out", ""]),
          "explain": lambda: explain.main(["heads", "--model", str(tiny_pipeline_dir), "--out", ""]),
          "train": lambda: train_script.main(["--out", "", *TINY_TRAIN]),
          "make-data": lambda: train_script.main(["--make-data", "", "--num-samples", "2"])}[command]()
    assert rc == 2
    one_line(capsys.readouterr().err, "is empty (''); give a folder")
    assert list(tmp_path.iterdir()) == []


def test_explain_refuses_a_prompt_longer_than_the_tokenizer(tiny_pipeline_dir, tmp_path, capsys, monkeypatch):
    from unet.cli import explain
    from unet.pipeline import ScenePipeline

    def never(*a, **k):
        raise AssertionError("sampled before checking the input")

    monkeypatch.setattr(ScenePipeline, "__call__", never)
    rc = explain.main(["heads", "a red circle " * 20, "--model", str(tiny_pipeline_dir), "--out", str(tmp_path / "o")])
    assert rc == 2
    one_line(capsys.readouterr().err, "words would be dropped")
    assert not (tmp_path / "o").exists()


def test_train_file_size_limit_gives_one_line_and_no_half_run(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "train.py"), "--out", str(out), *TINY_TRAIN,
                           "--steps", "2"], capture_output=True, text=True, timeout=300,
                          preexec_fn=_limited("RLIMIT_FSIZE", 20_000))  # the checkpoint is larger
    assert proc.returncode == 2, proc.stderr
    one_line(proc.stderr, "File too large")
    assert not out.exists()


def test_readme_states_these_guarantees():
    readme = (ROOT / "docs" / "reliability.md").read_text()
    section = readme[readme.index("## Guarantees"):]
    for phrase in ("SHA-256", "`--overwrite`", "URL-quoted", "bit for bit", "`-2`", "`ulimit -f`", "`ulimit -v`",
                   "while importing", "`.partial-<pid>-controlled-*`", "−1000 … 1000", "empty `Recording`"):
        assert phrase in section, phrase


def test_make_data_disk_full_gives_one_line_and_no_folder(tmp_path, capsys, monkeypatch):
    from unet.cli import train as train_script

    def save_half_then_fail(self, folder):
        Path(folder).mkdir(parents=True)
        (Path(folder) / "images.safetensors").write_bytes(b"half")
        raise OSError(28, "No space left on device", str(Path(folder) / "images.safetensors"))

    monkeypatch.setattr(train_script.SceneDataset, "save", save_half_then_fail)
    data = tmp_path / "data"
    assert train_script.main(["--make-data", str(data), "--num-samples", "2", "--size", "8"]) == 2
    one_line(capsys.readouterr().err, "could not write the dataset: No space left on device")
    assert not data.exists()


def test_an_interrupt_that_torch_swallows_while_a_checkpoint_loads_is_an_interrupt(tmp_path, monkeypatch):
    """A Ctrl-C landing inside torch's tensor construction comes out of `load_file` as ValueError("could not
    determine the shape of object type ..."); it must stop the command as an interrupt, not call the user's
    checkpoint damaged."""
    import time

    from safetensors.torch import save_file

    from unet import checkpoint
    from unet.signals import Interrupted, sigterm_as_interrupt
    path = tmp_path / "checkpoint.safetensors"
    save_file({"w": torch.ones(2)}, str(path))

    def swallowing(name):
        try:  # SIGTERM: SIGINT is ignored where the suite runs as a background job
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs here
        except KeyboardInterrupt:
            pass  # as torch does
        raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'")

    monkeypatch.setattr(checkpoint, "load_file", swallowing)
    with sigterm_as_interrupt(), pytest.raises(Interrupted):
        checkpoint.load(path)
    with sigterm_as_interrupt(), pytest.raises(ValueError, match="is not a readable safetensors checkpoint"):
        path.write_bytes(b"not safetensors")  # a damaged file, no interrupt: still the one-line error
        checkpoint.load(path)
