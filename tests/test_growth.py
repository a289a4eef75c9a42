"""Position embeddings and growing a trained run (#17): new parts start at identity, save and load through
`from_pretrained`, keep `--resume` exact, and configs saved before them load as the old architecture."""

import json
from pathlib import Path

import pytest
import torch
from conftest import OLD_SCENES_32, tiny_config

from crossattn import PositionEmbedding2D, SpatialTransformer
from unet import checkpoint
from unet.cli import train as train_script
from unet.model import UNet
from unet.pipeline import load_pipeline
from unet.train import Trainer

ROOT = Path(__file__).resolve().parents[1]
TINY_UNET = dict(sample_size=16, channels=(8, 16), cross_attention=(True, True), self_attention=(False, True),
                 context_dim=16, heads=2)


def unet_inputs(batch=2, size=16):
    g = torch.Generator().manual_seed(1)
    return (torch.randn(batch, 3, size, size, generator=g), torch.tensor([10, 700][:batch]),
            torch.randn(batch, 5, 16, generator=g))


def test_position_sinusoids_tell_every_token_apart_at_any_size():
    pos = PositionEmbedding2D(8)
    for h, w in ((8, 8), (16, 16), (8, 12)):
        table = pos.sinusoids(h, w)  # (HW, 4F)
        assert table.shape == (h * w, 4 * pos.frequencies)
        assert torch.cdist(table, table).add(torch.eye(h * w) * 1e3).min() > 0.1  # no two tokens alike
    # the lowest frequency is one half-wave across the image: its sine is the sign of x, whatever the size
    for w in (8, 16):
        x_sine = pos.sinusoids(1, w)[:, pos.frequencies]  # (W,): sin(pi/2 * x) of the x coordinate
        assert (x_sine[: w // 2] < 0).all() and (x_sine[w // 2:] > 0).all()
        assert torch.allclose(x_sine, -x_sine.flip(0), atol=1e-6)


def test_position_embedding_starts_as_the_identity_then_learns():
    torch.manual_seed(0)
    plain = SpatialTransformer(16, 8, heads=2, head_dim=8)
    with_pos = SpatialTransformer(16, 8, heads=2, head_dim=8, position_embedding=True)
    missing, unexpected = with_pos.load_state_dict(plain.state_dict(), strict=False)
    assert set(missing) == {"position.proj.weight", "position.proj.bias"} and not unexpected
    torch.nn.init.normal_(plain.proj_out.weight)  # a trained block: its output is not zero
    with_pos.proj_out.load_state_dict(plain.proj_out.state_dict())
    x, context = torch.randn(2, 16, 4, 4), torch.randn(2, 3, 8)
    assert torch.equal(with_pos(x, context), plain(x, context))
    with_pos(x, context).square().sum().backward()
    assert with_pos.position.proj.weight.grad.abs().sum() > 0  # the zero layer gets a gradient
    with torch.no_grad():
        with_pos.position.proj.weight.normal_()
    assert not torch.allclose(with_pos(x, context), plain(x, context))


@pytest.mark.parametrize("part, key, count", [("position_embedding", "position", 2 * 5),  # 4 level blocks + middle
                                               ("pooled_text", "pooled_text_proj", 2)])
def test_unet_new_parts_save_and_load(tmp_path, part, key, count):
    unet = UNet(**TINY_UNET, **{part: True})
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if key in name or "proj_out" in name:
                p.normal_(std=0.1)  # as if trained: zero layers would hide a lost weight
    unet.save_pretrained(tmp_path / "unet")
    loaded = UNet.from_pretrained(tmp_path / "unet")
    assert getattr(loaded.config, part) is True
    assert sum(key in n for n, _ in loaded.named_parameters()) == count
    x, t, c = unet_inputs()
    assert torch.equal(loaded(x, t, c), unet(x, t, c))
    # the trained new weights matter: the same model without them computes something else
    plain = UNet(**TINY_UNET)
    plain.load_state_dict(unet.state_dict(), strict=False)
    assert not torch.allclose(plain(x, t, c), unet(x, t, c), atol=1e-4)


def test_pooled_text_starts_silent_then_reaches_every_resblock():
    unet = UNet(**TINY_UNET, pooled_text=True)
    plain = UNet(**TINY_UNET)
    plain.load_state_dict(unet.state_dict(), strict=False)
    x, t, c = unet_inputs()
    assert torch.equal(unet(x, t, c), plain(x, t, c))  # zero projection: the old model's output
    with torch.no_grad():
        unet.pooled_text_proj.weight.normal_()
    seen = []  # what a ResBlock receives as its timestep embedding
    unet.mid_res1.time_proj.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0]))
    last, first = c.clone(), c.clone()
    last[:, -1] += 1.0
    first[:, 0] += 1.0
    for context in (c, last, first):
        unet(x, t, context)
    assert not torch.allclose(seen[0], seen[1])  # the last token's state is the summary
    assert torch.equal(seen[0], seen[2])  # the other tokens reach the blocks through cross-attention only


def test_config_saved_before_position_embeddings_loads_the_old_architecture(tiny_pipeline_dir, tmp_path):
    """A pipeline folder whose unet config lacks `position_embedding` (the shipped scenes-32 and every folder
    saved before it existed) loads without position modules and samples the images it sampled before."""
    import shutil
    old = tmp_path / "old"
    shutil.copytree(tiny_pipeline_dir, old)
    config_path = old / "unet" / "config.json"
    config = json.loads(config_path.read_text())
    config.pop("position_embedding", None)
    config_path.write_text(json.dumps(config))
    before, after = load_pipeline(tiny_pipeline_dir), load_pipeline(old)
    assert not any("position" in n for n, _ in after.unet.named_parameters())
    assert after.unet.config.position_embedding is False
    images = [p("a red circle", generator=torch.Generator().manual_seed(3), num_inference_steps=3,
                output_type="np", show_progress=False).images for p in (before, after)]
    assert (images[0] == images[1]).all()


def test_old_scenes_32_folder_samples_what_it_sampled_before_the_new_parts():
    """tests/data/shipped_before_growth.png: the scenes-32 of step 15,200 (shipped until 2026-12-02, kept in
    tests/data as a folder saved before position embeddings and pooled text existed) sampled by the code of
    commit c9db371, seed 0, 10 DDIM steps. Other CPUs round differently, so the bound is a little above float
    noise; a changed architecture or sampler moves far more."""
    import numpy as np
    from PIL import Image
    pipe = load_pipeline(OLD_SCENES_32, show_progress=False)
    assert not any("position" in n or "pooled" in n for n, _ in pipe.unet.named_parameters())
    assert not pipe.unet.config.position_embedding and not pipe.unet.config.pooled_text
    images = pipe(["a red circle left of a blue square", "a green triangle"], num_inference_steps=10,
                  generator=torch.Generator().manual_seed(0), output_type="np", show_progress=False).images
    now = np.concatenate(list(images), axis=1) * 255
    before = np.asarray(Image.open(ROOT / "tests" / "data" / "shipped_before_growth.png"), dtype=np.float64)
    assert np.abs(now - before).mean() < 0.6 and np.abs(now - before).max() < 8


TINY_TRAIN = ["--size", "16", "--channels", "8", "16", "16", "--text-width", "16", "--text-layers", "1", "--heads", "2",
              "--max-length", "16", "--batch-size", "4", "--warmup", "1", "--num-samples", "64", "--sample-every",
              "1000", "--checkpoint-every", "1000", "--quiet"]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A tiny run of 3 steps of the old architecture (no position embedding, self-attention at level 2)."""
    run = tmp_path_factory.mktemp("growth") / "base"
    assert train_script.main(["--out", str(run), *TINY_TRAIN, "--steps", "3"]) == 0
    return run


def predictions(trainer: Trainer):
    x, t, c = unet_inputs()
    with torch.no_grad():
        return trainer.unet(x, t, c), trainer.ema(x, t, c)


def test_grown_run_starts_where_its_source_stopped(trained_run, tmp_path, capsys):
    grown = tmp_path / "grown"
    assert train_script.main(["--out", str(grown), "--grow-from", str(trained_run), "--position-embedding",
                              "--pooled-text", "--self-attention-levels", "1", "2", "--single-share", "0.2",
                              "--colourless-share", "0.5", "--and-order", "reading", "--steps", "5", "--quiet"]) == 0
    cfg = json.loads((grown / "train_config.json").read_text())
    assert cfg["and_order"] == "reading"
    assert cfg["position_embedding"] is cfg["pooled_text"] is True and cfg["self_attention"] == [False, True, True]
    assert cfg["single_share"] == 0.2 and cfg["colourless_share"] == 0.5 and cfg["grown_from"] == f"{trained_run}@3"
    assert cfg["channels"] == [8, 16, 16] and cfg["text_width"] == 16  # everything else as the source had it
    assert "grown from the model of step 3" in capsys.readouterr().out
    loss = [line.split(",")[0] for line in (grown / "loss.csv").read_text().splitlines()]
    assert loss == ["1", "2", "3", "4", "5"]  # the source's rows, then this run's
    assert not json.loads((trained_run / "train_config.json").read_text())["position_embedding"]  # only read

    # the grown model at the source's step computes exactly what the source computed
    source = Trainer(tiny_config(trained_run, resume=True, steps=4))
    at_start = grown_trainer(trained_run, tmp_path / "copy", "--pooled-text", "--self-attention-levels", "1", "2")
    assert at_start.step == 3
    for a, b in zip(predictions(source), predictions(at_start)):
        assert torch.equal(a, b)


def grown_trainer(source, out, *args) -> Trainer:
    """The trainer of a --grow-from run, made as the command makes it, before it trains a step."""
    args = train_script.parse_args(["--out", str(out), "--grow-from", str(source), "--position-embedding",
                                    "--steps", "4", *args])
    return Trainer(train_script.start_grown(train_script.training_config(args), source))


def test_grown_run_resumes_exactly(trained_run, tmp_path):
    grow = ["--grow-from", str(trained_run), "--position-embedding", "--quiet"]
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    assert train_script.main(["--out", str(straight), *grow, "--steps", "7"]) == 0
    assert train_script.main(["--out", str(cut), *grow, "--steps", "5"]) == 0
    assert train_script.main(["--out", str(cut), "--resume", "--steps", "7", "--quiet"]) == 0
    a = Trainer(tiny_config(straight, resume=True, steps=8))
    b = Trainer(tiny_config(cut, resume=True, steps=8))
    assert a.step == b.step == 7
    for p, q in zip(a.ema.parameters(), b.ema.parameters()):
        assert torch.equal(p, q)
    moments = [s["exp_avg"] for s in a.optimizer.state_dict()["state"].values()]
    assert moments and all(torch.equal(m, n["exp_avg"]) for m, n in
                           zip(moments, b.optimizer.state_dict()["state"].values()))
    saved = [n for n in a.param_names if "position" in n]
    assert saved and all(a.optimizer.state_dict()["state"][a.param_names.index(n)]["exp_avg"].abs().sum() > 0
                         for n in saved)  # the new parts trained and their moments were saved and reloaded


def test_growth_keeps_the_optimizer_moments_of_every_old_weight(trained_run, tmp_path):
    source = Trainer(tiny_config(trained_run, resume=True, steps=4))
    before = {n: source.optimizer.state_dict()["state"][i]["exp_avg_sq"] for i, n in enumerate(source.param_names)}
    after = grown_trainer(trained_run, tmp_path / "grown", "--self-attention-levels", "1", "2")
    state = after.optimizer.state_dict()["state"]
    assert len(after.param_names) > len(source.param_names)
    for i, name in enumerate(after.param_names):
        if name in before:
            assert torch.equal(state[i]["exp_avg_sq"], before[name]), name
        else:
            assert i not in state  # a new weight starts with fresh moments


@pytest.mark.parametrize("args, message", [
    (["--self-attention-levels", "1"], "must keep the levels"),
    (["--self-attention-levels", "1", "5"], "levels 0 to 2"),
    (["--steps", "3"], "at step 3 already"),
    (["--resume"], "give one"),
    (["--side-hint-gain", "5"], "only with --text-variant side-hints"),
    (["--text-variant", "side-hints", "--side-hint-gain", "0"], "must be a finite number > 0"),
])
def test_grow_from_refuses_what_would_lose_weights(trained_run, tmp_path, capsys, args, message):
    out = tmp_path / "grown"
    rc = train_script.main(["--out", str(out), "--grow-from", str(trained_run), "--quiet", "--steps", "6", *args])
    assert rc == 2 and message in capsys.readouterr().err
    assert not out.exists()


def test_resume_refuses_a_checkpoint_of_another_architecture(trained_run, tmp_path, capsys):
    import shutil
    run = tmp_path / "run"
    shutil.copytree(trained_run, run)
    config = json.loads((run / "train_config.json").read_text())
    config["channels"] = [8, 16, 24]  # not something growth can add
    (run / "train_config.json").write_text(json.dumps(config))
    assert train_script.main(["--out", str(run), "--resume", "--steps", "5", "--quiet"]) == 2
    assert "error" in capsys.readouterr().err


def test_side_hints_grow_at_identity_then_learn_the_sides(trained_run, tmp_path):
    """--text-variant side-hints: the trained CLIP weights load under their own names, the side embedding
    starts at zero (the text encoder computes what it computed), then learns a vector for each side seen."""
    from unet.research.text_variants import SIDE_IDS, SideHints
    source = Trainer(tiny_config(trained_run, resume=True, steps=4))
    args = train_script.parse_args(["--out", str(tmp_path / "hints"), "--grow-from", str(trained_run),
                                    "--text-variant", "side-hints", "--steps", "6", "--quiet"])
    hinted = Trainer(train_script.start_grown(train_script.training_config(args), trained_run))
    assert isinstance(hinted.text_encoder, SideHints) and hinted.step == 3
    ids = source.tokenizer(["a red circle left of a blue square"], padding="max_length", max_length=16,
                           return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(hinted.text_encoder(ids).last_hidden_state, source.text_encoder(ids).last_hidden_state)
        assert torch.equal(hinted.ema_text(ids).last_hidden_state, source.ema_text(ids).last_hidden_state)
    hinted.train(progress=False)
    table = hinted.text_encoder.side_hint.weight  # (sides, D)
    assert table[SIDE_IDS[None]].abs().sum() == 0  # tokens of no object get nothing
    assert (table[1:].abs().sum(dim=1) > 0).sum() >= 2  # the sides the 3 batches' captions named
    # the gain multiplies what the table adds: "circle" (token 3) is the left object, "of" (token 5) no object's
    fast = SideHints(source.text_encoder, source.tokenizer, gain=10.0)
    with torch.no_grad():
        fast.side_hint.weight[1:].fill_(1.0)
        added = fast(ids).last_hidden_state - source.text_encoder(ids).last_hidden_state  # (1, T, D)
    assert torch.allclose(added[0, 3], torch.full_like(added[0, 3], 10.0)) and added[0, 5].abs().max() == 0


def test_grow_from_keeps_the_text_side_except_for_side_hints(trained_run, tmp_path, capsys):
    out = tmp_path / "grown"
    assert train_script.main(["--out", str(out), "--grow-from", str(trained_run), "--text-variant", "oracle",
                              "--steps", "5", "--quiet"]) == 2
    assert "keeps its text side" in capsys.readouterr().err and not out.exists()


def test_a_run_folder_evaluates_as_its_checkpoints_ema_pipeline(trained_run, tmp_path, capsys):
    """`evaluate.py --model RUN`: the same model `Trainer.pipeline()` makes, from the folder, which it only reads;
    --relations-only writes the paired relation response, the words' similarity and the layout response."""
    from unet.cli import evaluate as evaluate_script
    from unet.train import run_pipeline
    trainer = Trainer(tiny_config(trained_run, resume=True, steps=4))
    before = {p: p.stat().st_mtime_ns for p in trained_run.rglob("*") if p.is_file()}
    pipe = run_pipeline(trained_run)
    images = [p("a red circle", generator=torch.Generator().manual_seed(2), num_inference_steps=3, output_type="np",
                show_progress=False).images for p in (pipe, trainer.pipeline())]
    assert (images[0] == images[1]).all()
    # --last-step: the checkpoint's own weights, as the trainer holds them after its last step
    tensors, _ = checkpoint.load(trained_run / "checkpoint.safetensors")
    last = run_pipeline(trained_run, ema=False).unet.state_dict()
    assert all(torch.equal(v, tensors[f"unet.{k}"]) for k, v in last.items())
    assert not all(torch.equal(v, tensors[f"ema.{k}"]) for k, v in last.items())
    assert evaluate_script.main(["--model", str(trained_run), "--last-step", "--fresh-seeds", "50000", "--seeds", "1",
                                 "--steps", "2", "--tasks", "two_object", "--out", str(tmp_path / "last"),
                                 "--quiet"]) == 0
    assert json.loads((tmp_path / "last" / "report.json").read_text())["model"] == f"{trained_run} (last-step weights)"
    assert evaluate_script.main(["--model", "scenes-32", "--last-step", "--out", str(tmp_path / "x")]) == 2
    assert "--last-step reads a training run folder's checkpoint" in capsys.readouterr().err
    out = tmp_path / "relations"
    assert evaluate_script.main(["--model", str(trained_run), "--relations-only", "--seeds", "1", "--steps", "2",
                                 "--out", str(out), "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    from unet.eval.prompts import PAIRED_AXES
    assert set(report["relation_response_paired"]) == set(PAIRED_AXES)
    assert report["relation_response_paired"]["horizontal"]["images"] == 12  # 6 prompt pairs, 1 seed
    assert set(report["relation_word_similarity"]) == {"left/right", "above/below"}
    assert len(report["layout_response"]["pairs"]) == 4 and report["key_separation"]["layers"]
    assert "## Layout response" in (out / "report.md").read_text()
    assert evaluate_script.main(["--model", str(trained_run), "--relations-only", "--control", "excite",
                                 "--out", str(tmp_path / "x")]) == 2
    assert "--relations-only is a measurement of its own; leave out --control" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in trained_run.rglob("*") if p.is_file()} == before


def test_fresh_seeds_score_prompt_following_alone_on_noise_the_report_never_uses(trained_run, tmp_path, capsys):
    """`evaluate.py --fresh-seeds BASE`: only the chosen tasks, `--seeds` images per prompt, counted; the same
    seeds give the same counts, and it refuses to be mixed with the other measurements."""
    from unet.cli import evaluate as evaluate_script
    from unet.eval.prompts import eval_prompts
    runs = []
    for name in ("a", "b"):
        out = tmp_path / name
        assert evaluate_script.main(["--model", str(trained_run), "--fresh-seeds", "50000", "--seeds", "2",
                                     "--steps", "2", "--tasks", "color_attr", "two_object", "--out", str(out),
                                     "--quiet"]) == 0
        runs.append(json.loads((out / "report.json").read_text())["prompt_following"])
    result = runs[0]
    assert set(result["right_of"]) == {"color_attr", "two_object"} and "position" not in result
    for task, (right, images) in result["right_of"].items():
        assert images == 2 * sum(p.task == task for p in eval_prompts()) and result[task] == right / images
    assert runs[0]["right_of"] == runs[1]["right_of"]
    # each image's verdict, kept for scripts/compare.py: the counts above, image for image, from seed 50000
    assert result["judged"]["base_seed"] == 50000 and result["settings"]["scheduler"] == "ddim"
    assert sum(ok for task, _, _, ok in result["judged"]["images"] if task == "two_object") == \
        result["right_of"]["two_object"][0]
    assert {sample for _, _, sample, _ in result["judged"]["images"]} == {0, 1}
    assert "| color_attr |" in (tmp_path / "a" / "report.md").read_text()
    assert "guidance 1.0." in (tmp_path / "a" / "report.md").read_text()
    # guided at some timesteps only: the report says which, or it could not be told from guidance at every step
    assert evaluate_script.main(["--model", str(trained_run), "--fresh-seeds", "50000", "--seeds", "1", "--steps",
                                 "2", "--tasks", "two_object", "--guidance", "2", "--guidance-max-t", "550",
                                 "--out", str(tmp_path / "g"), "--quiet"]) == 0
    guided = json.loads((tmp_path / "g" / "report.json").read_text())["prompt_following"]["settings"]
    assert (guided["guidance"], guided["guidance_max_t"]) == (2.0, 550)
    assert "guidance 2.0 at t <= 550." in (tmp_path / "g" / "report.md").read_text()
    capsys.readouterr()
    assert evaluate_script.main(["--model", str(trained_run), "--fresh-seeds", "1", "--relations-only",
                                 "--out", str(tmp_path / "c")]) == 2
    assert "two measurements; give one" in capsys.readouterr().err
    assert evaluate_script.main(["--model", str(trained_run), "--fresh-seeds", "-1", "--out", str(tmp_path / "d")]) == 2
    assert "--fresh-seeds must be a seed from 0" in capsys.readouterr().err
    assert evaluate_script.main(["--model", str(trained_run), "--tasks", "position", "--out", str(tmp_path / "e")]) == 2
    assert "--tasks chooses what --fresh-seeds samples" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in "cde")


def test_a_folder_just_grown_evaluates_before_its_first_save(trained_run, tmp_path):
    """Until it saves, a --grow-from folder holds its source's checkpoint: the run's pipeline grows it as
    training would (side hints at zero), instead of failing on the weights the source never had."""
    from unet.research.text_variants import SideHints
    from unet.train import run_pipeline
    args = train_script.parse_args(["--out", str(tmp_path / "hints"), "--grow-from", str(trained_run),
                                    "--text-variant", "side-hints", "--side-hint-gain", "4", "--steps", "6"])
    folder = Path(train_script.start_grown(train_script.training_config(args), trained_run).out)
    (folder / "tokenizer").mkdir()
    for f in (trained_run / "tokenizer").iterdir():
        (folder / "tokenizer" / f.name).write_bytes(f.read_bytes())  # what the Trainer writes when it starts
    pipe = run_pipeline(folder)
    assert isinstance(pipe.text_encoder, SideHints) and pipe.text_encoder.gain == 4.0
    assert pipe.text_encoder.side_hint.weight.abs().sum() == 0


def test_a_run_started_from_a_pipeline_begins_at_its_weights(tiny_pipeline_dir, tmp_path):
    """--start-from: a new round on a trained model whose run folder is gone. Step 0, the model's weights (the
    EMA's too), fresh optimizer moments; the source folder is only read."""
    pipe = load_pipeline(tiny_pipeline_dir, show_progress=False)
    trainer = Trainer(tiny_config(tmp_path / "round2", started_from=str(tiny_pipeline_dir), steps=2))
    assert trainer.step == 0 and not trainer.optimizer.state_dict()["state"]
    for ours, theirs in ((trainer.unet, pipe.unet), (trainer.ema, pipe.unet), (trainer.text_encoder, pipe.text_encoder),
                         (trainer.ema_text, pipe.text_encoder)):
        saved = theirs.state_dict()
        assert all(torch.equal(v, saved[k]) for k, v in ours.state_dict().items())
    trainer.train(progress=False)
    assert not torch.equal(trainer.unet.conv_in.weight, pipe.unet.conv_in.weight)  # it trained on from there
    cfg = json.loads((tmp_path / "round2" / "train_config.json").read_text())
    assert cfg["started_from"] == str(tiny_pipeline_dir)
    # a resume continues from the checkpoint, not from the pipeline again
    resumed = Trainer(tiny_config(tmp_path / "round2", resume=True, steps=3))
    assert resumed.step == 2 and torch.equal(resumed.unet.conv_in.weight, trainer.unet.conv_in.weight)


@pytest.mark.parametrize("settings, message", [
    (dict(channels=(8, 32)), "its U-Net is not the one this run builds"),
    (dict(text_layers=2), "its text encoder is not the one this run builds"),
    (dict(world="scenes-64", num_samples=0), "is a model of world scenes-32; this run trains world scenes-64"),
])
def test_start_from_refuses_a_model_the_settings_do_not_rebuild(tiny_pipeline_dir, tmp_path, settings, message):
    with pytest.raises(ValueError, match=message):
        Trainer(tiny_config(tmp_path / "run", started_from=str(tiny_pipeline_dir), **settings))


def test_start_from_on_the_command_line(tiny_pipeline_dir, tmp_path, capsys):
    out = tmp_path / "run"
    # TINY_TRAIN's U-Net has three levels, the pipeline's two: refused in one line, and no run folder is left
    assert train_script.main(["--out", str(out), *TINY_TRAIN, "--steps", "2", "--start-from",
                              str(tiny_pipeline_dir)]) == 2
    err = capsys.readouterr().err
    assert "its U-Net is not the one this run builds" in err and "Traceback" not in err
    assert not out.exists() or not any(out.iterdir())
    for flag in (["--resume"], ["--grow-from", str(tmp_path)]):
        assert train_script.main(["--out", str(out), "--start-from", str(tiny_pipeline_dir), *flag, "--quiet"]) == 2
        assert f"--start-from with {flag[0]}" in capsys.readouterr().err
    assert train_script.main(["--out", str(out), "--start-from", str(tmp_path / "none"), *TINY_TRAIN]) == 2
    assert "--start-from" in capsys.readouterr().err
