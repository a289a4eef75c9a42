"""The scene CLIP (unet/scene_clip.py, scripts/train_clip.py) and a U-Net grown onto it, frozen (train.py
--grow-from RUN --clip FOLDER)."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from crossattn.text import load_text_encoder, load_tokenizer
from unet.cli import train as train_script
from unet.cli import train_clip
from unet.scene_clip import (
    SceneClipConfig,
    caption_targets,
    contrastive_loss,
    encode,
    hard_negatives,
    new_scene_clip,
    word_and_patch_features,
    word_to_patch_scores,
)
from unet.train import Trainer, run_pipeline

TINY_CLIP = ["--steps", "3", "--batch-size", "4", "--text-width", "16", "--vision-width", "16", "--text-layers", "1",
             "--vision-layers", "1", "--heads", "2", "--size", "16", "--max-length", "16", "--eval-scenes", "8",
             "--warmup", "1", "--quiet"]
TINY_TRAIN = ["--size", "16", "--channels", "8", "16", "16", "--text-width", "16", "--text-layers", "1", "--heads", "2",
              "--max-length", "16", "--batch-size", "4", "--warmup", "1", "--sample-every", "1000",
              "--checkpoint-every", "1000", "--quiet"]


def test_hard_negatives_change_one_thing():
    rng = np.random.default_rng(0)
    found = hard_negatives("a red circle left of a blue square", rng)
    assert found == {"relation": "a red circle right of a blue square",
                     "colours": "a blue circle left of a red square",
                     "shapes": "a red square left of a blue circle"}
    one = hard_negatives("a green triangle on the top", rng)
    assert one["relation"] == "a green triangle on the bottom"
    colour, shape = one["colours"].split()[1], one["shapes"].split()[2]
    assert colour != "green" and one["colours"] == f"a {colour} triangle on the top"
    assert shape != "triangle" and one["shapes"] == f"a green {shape} on the top"
    assert hard_negatives("a circle and a circle", rng) == {}  # nothing to swap: no negative is made up
    assert hard_negatives("a square above a square", rng) == {"relation": "a square below a square"}


def test_a_caption_repeated_in_the_batch_is_not_its_own_negative():
    """A hard negative of one image can be another image's caption: it is a positive for that image only."""
    captions = ["a red circle", "a blue circle", "a red circle"]
    texts = captions + ["a blue circle", "a red circle"]  # the colour swaps of the first two
    third = [1 / 3, 0, 1 / 3, 0, 1 / 3]
    assert torch.allclose(caption_targets(captions, texts), torch.tensor([third, [0, 0.5, 0, 0.5, 0], third]))


@pytest.fixture
def tiny_clip(tmp_path):
    """A tiny untrained scene CLIP, its tokenizer, and images of a red circle and a blue square."""
    from crossattn.text import save_vocabulary
    from unet.data import SCENE_WORDS, SceneSampler, scenes_to_tensor, to_model_range
    tokenizer = save_vocabulary(SCENE_WORDS, tmp_path / "tokenizer", 16)
    cfg = SceneClipConfig(text_width=16, vision_width=16, text_layers=1, vision_layers=1, heads=2, size=16,
                          max_length=16, batch_size=2)
    torch.manual_seed(0)
    sampler = SceneSampler(0, 16, 16)
    scenes = [sampler.single("red", "circle"), sampler.single("blue", "square")]
    return new_scene_clip(tokenizer, cfg), tokenizer, to_model_range(scenes_to_tensor(scenes))


def test_the_loss_trains_both_towers_and_prefers_the_right_caption(tiny_clip):
    model, tokenizer, images = tiny_clip
    right = contrastive_loss(model, tokenizer, images, ["a red circle", "a blue square"], [{}, {}])
    right.backward()
    assert model.text_model.embeddings.token_embedding.weight.grad.abs().sum() > 0
    assert model.vision_model.embeddings.patch_embedding.weight.grad.abs().sum() > 0
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(30):  # a few steps on one batch: its own captions become the likelier ones
        optimizer.zero_grad()
        contrastive_loss(model, tokenizer, images, ["a red circle", "a blue square"], [{}, {}]).backward()
        optimizer.step()
    with torch.no_grad():
        trained = contrastive_loss(model, tokenizer, images, ["a red circle", "a blue square"], [{}, {}])
        swapped = contrastive_loss(model, tokenizer, images, ["a blue square", "a red circle"], [{}, {}])
    assert trained < right.detach() and trained < swapped


def test_word_to_patch_scores_average_each_words_best_patch_over_the_words_only():
    axes = torch.eye(4)
    patches = axes[None, :3]  # (1 image, 3 patches, D = 4): along axes 0, 1 and 2
    tokens = torch.stack([axes[[0, 1, 3]], axes[[0, 3, 3]]])  # (2 texts, 3 tokens, 4)
    words = torch.tensor([[True, True, False], [True, True, True]])
    # text 0: both words have a patch of their own, and its third token is not a word; text 1: one word of three
    assert torch.allclose(word_to_patch_scores(tokens, words, patches), torch.tensor([[1.0, 1 / 3]]))


def test_the_word_loss_reaches_the_words_own_states_which_the_end_token_loss_never_does(tiny_clip):
    """The Keys read every token's output state. The end token's loss leaves the others' untouched (the last layer's
    other outputs feed nothing it reads); `token_loss` trains them."""
    model, tokenizer, images = tiny_clip
    encoded = encode(model, tokenizer, ["a red circle", "a circle"], images)
    tokens, words, patches = word_and_patch_features(model, tokenizer, *encoded)
    assert words.sum(1).tolist() == [3, 2]  # the words; not the start, end or padding tokens
    assert patches.shape == (2, (16 // 4) ** 2, 16) and tokens.shape[:2] == words.shape \
        and torch.allclose(tokens.norm(dim=-1), torch.ones(words.shape))
    states, grads = [], {}

    def keep(module, inputs, output):  # the text output, every call: the captions, then the word features
        output.retain_grad()
        states.append(output)

    hook = model.text_model.final_layer_norm.register_forward_hook(keep)
    for weight in (0.0, 1.0):
        model.zero_grad()
        states.clear()
        contrastive_loss(model, tokenizer, images, ["a red circle", "a blue square"], [{}, {}], weight).backward()
        grads[weight] = sum(s.grad[:, 1:3].abs().sum() for s in states)  # at "a" and "red" / "blue"
    hook.remove()
    assert grads[0.0] == 0 and grads[1.0] > 0


@pytest.fixture(scope="module")
def scene_clip(tmp_path_factory):
    out = tmp_path_factory.mktemp("clip") / "scene-clip"
    assert train_clip.main(["--out", str(out), *TINY_CLIP]) == 0
    return out


def test_train_clip_writes_a_frozen_text_side_and_its_report(scene_clip, capsys):
    report = json.loads((scene_clip / "report.json").read_text())
    assert report["steps_done"] == 3
    for split in ("hard_negatives", "hard_negatives_train_split"):
        for kind in ("relation", "colours", "shapes"):
            assert 0 <= report[split][kind]["accuracy"] <= 1 and report[split][kind]["scenes"] > 0
    assert report["text_separation"]["text_output"]["color"]["pairs"] > 0
    text = load_text_encoder(scene_clip / "text")
    assert text.config.hidden_size == 16 and load_tokenizer(scene_clip / "text").model_max_length == 16
    assert (scene_clip / "clip" / "config.json").is_file() and (scene_clip / "loss.csv").read_text().count("\n") == 4


def test_train_clip_refuses_what_it_would_overwrite_or_cannot_train(scene_clip, tmp_path, capsys):
    before = {p: p.stat().st_mtime_ns for p in scene_clip.rglob("*")}
    assert train_clip.main(["--out", str(scene_clip), *TINY_CLIP]) == 2
    assert "already holds a result; pass --overwrite" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in scene_clip.rglob("*")} == before
    assert train_clip.main(["--out", str(tmp_path / "x"), *TINY_CLIP, "--batch-size", "1"]) == 2
    assert "batch_size must be >= 2" in capsys.readouterr().err
    assert train_clip.main(["--out", str(tmp_path / "y"), *TINY_CLIP, "--patch-size", "5"]) == 2
    assert "not a multiple of patch_size" in capsys.readouterr().err
    assert train_clip.main(["--out", str(tmp_path / "z"), *TINY_CLIP, "--token-loss", "-1"]) == 2
    assert "--token-loss must be a finite number from 0 to 1000 (0 turns it off), got -1" in capsys.readouterr().err
    assert not any((tmp_path / name).exists() for name in "xyz")


@pytest.fixture(scope="module")
def source_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("source") / "run"
    assert train_script.main(["--out", str(run), *TINY_TRAIN, "--steps", "3"]) == 0
    return run


def test_a_run_grown_onto_a_frozen_clip_keeps_its_unet_and_never_trains_the_text(source_run, scene_clip, tmp_path,
                                                                                   capsys):
    grown = tmp_path / "grown"
    clip = scene_clip / "text"
    assert train_script.main(["--out", str(grown), "--grow-from", str(source_run), "--clip", str(clip),
                              "--steps", "3", "--quiet"]) == 2  # the source is at step 3 already
    capsys.readouterr()
    frozen = load_text_encoder(clip).state_dict()
    from unet import checkpoint
    source, _ = checkpoint.load(source_run / "checkpoint.safetensors")
    assert train_script.main(["--out", str(grown), "--grow-from", str(source_run), "--clip", str(clip),
                              "--steps", "5", "--quiet"]) == 0
    assert "optimizer moments start afresh" in capsys.readouterr().out
    cfg = json.loads((grown / "train_config.json").read_text())
    assert cfg["clip"] == str(clip) and cfg["grown_from"] == f"{source_run}@3"
    saved, metadata = checkpoint.load(grown / "checkpoint.safetensors")
    assert metadata["step"] == "5"
    for prefix in ("text", "ema_text"):  # frozen: the CLIP's own weights, exactly, after training
        assert all(torch.equal(saved[f"{prefix}.{k}"], v) for k, v in frozen.items())
    assert not torch.equal(saved["text.embeddings.token_embedding.weight"],
                           source["text.embeddings.token_embedding.weight"])
    from unet.pipeline import load_pipeline
    pipe = load_pipeline(grown / "pipeline", show_progress=False)
    assert all(torch.equal(pipe.text_encoder.state_dict()[k], v) for k, v in frozen.items())
    # resuming it is exact: the moments it saved are for its own parameters
    trainer = Trainer(dataclasses.replace(train_script.training_config(
        train_script.parse_args(["--out", str(grown), "--resume", "--steps", "6"])), resume=True))
    assert trainer.step == 5 and trainer.optimizer.state


def test_a_just_grown_folder_evaluates_on_the_frozen_clip_and_the_sources_unet(source_run, scene_clip, tmp_path):
    """Until its first save the folder holds its source's checkpoint, text weights included: the frozen CLIP's
    weights are what it must use, and the source's EMA U-Net."""
    grown = tmp_path / "grown"
    cfg = train_script.training_config(train_script.parse_args(
        ["--out", str(grown), "--grow-from", str(source_run), "--clip", str(scene_clip / "text"), "--steps", "9"]))
    train_script.start_grown(cfg, source_run)
    pipe = run_pipeline(grown)
    frozen = load_text_encoder(scene_clip / "text").state_dict()
    assert all(torch.equal(pipe.text_encoder.state_dict()[k], v) for k, v in frozen.items())
    source = run_pipeline(source_run)
    assert all(torch.equal(v, source.unet.state_dict()[k]) for k, v in pipe.unet.state_dict().items())


def test_growing_onto_a_clip_of_another_width_is_refused(source_run, tmp_path, capsys):
    wide = tmp_path / "wide"
    assert train_clip.main(["--out", str(wide), *TINY_CLIP, "--text-width", "32", "--steps", "1"]) == 0
    capsys.readouterr()
    out = tmp_path / "grown"
    assert train_script.main(["--out", str(out), "--grow-from", str(source_run), "--clip", str(wide / "text"),
                              "--steps", "5", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "encodes text 32 wide" in err and "--text-width 16" in err
    assert not out.exists()


@pytest.fixture(scope="module")
def on_clip(source_run, scene_clip, tmp_path_factory):
    """`source_run` grown onto the frozen scene CLIP: the run a text learning rate is then given to."""
    run = tmp_path_factory.mktemp("on-clip") / "run"
    assert train_script.main(["--out", str(run), "--grow-from", str(source_run), "--clip", str(scene_clip / "text"),
                              "--steps", "5", "--quiet"]) == 0
    return run


def test_a_text_lr_trains_the_clip_at_its_own_rate_and_keeps_the_unets_moments(on_clip, scene_clip, tmp_path):
    from unet import checkpoint
    from unet.pipeline import load_pipeline
    grown = tmp_path / "grown"
    assert train_script.main(["--out", str(grown), "--grow-from", str(on_clip), "--text-lr", "3e-4", "--steps", "7",
                              "--quiet"]) == 0
    frozen = load_text_encoder(scene_clip / "text").state_dict()
    saved, _ = checkpoint.load(grown / "checkpoint.safetensors")
    for prefix in ("text", "ema_text"):  # both the weights and their average moved off the CLIP's
        assert not torch.equal(saved[f"{prefix}.embeddings.token_embedding.weight"],
                               frozen["embeddings.token_embedding.weight"])
    pipe = load_pipeline(grown / "pipeline", show_progress=False)  # the pipeline holds the trained EMA text side
    assert all(torch.equal(pipe.text_encoder.state_dict()[k], saved[f"ema_text.{k}"]) for k in frozen)
    assert torch.equal(run_pipeline(grown).text_encoder.embeddings.token_embedding.weight,
                       saved["ema_text.embeddings.token_embedding.weight"])

    before = Trainer(dataclasses.replace(train_script.training_config(
        train_script.parse_args(["--out", str(on_clip), "--resume", "--steps", "6"])), resume=True))
    after = train_script.start_grown(train_script.training_config(train_script.parse_args(
        ["--out", str(tmp_path / "fresh"), "--grow-from", str(on_clip), "--text-lr", "3e-4", "--steps", "7"])), on_clip)
    after = Trainer(after)
    old, new = before.optimizer.state_dict()["state"], after.optimizer.state_dict()["state"]
    for i, name in enumerate(after.param_names):  # the U-Net's moments carry over; the text's start afresh
        if name.startswith("unet."):
            assert torch.equal(new[i]["exp_avg"], old[before.param_names.index(name)]["exp_avg"]), name
        else:
            assert i not in new, name
    scales = {(g["lr_scale"], any(p is q for q in after.text_encoder.parameters() for p in g["params"]))
              for g in after.optimizer.param_groups}
    assert scales == {(1.0, False), (3e-4 / 6e-4, True)}  # (rate / --lr, holds text weights)


def test_a_run_training_its_clip_resumes_exactly(on_clip, tmp_path):
    straight, cut = tmp_path / "straight", tmp_path / "cut"
    grow = ["--grow-from", str(on_clip), "--text-lr", "3e-4", "--quiet"]
    assert train_script.main(["--out", str(straight), *grow, "--steps", "8"]) == 0
    assert train_script.main(["--out", str(cut), *grow, "--steps", "6"]) == 0
    assert train_script.main(["--out", str(cut), "--resume", "--steps", "8", "--quiet"]) == 0
    from unet import checkpoint
    a, _ = checkpoint.load(straight / "checkpoint.safetensors")
    b, _ = checkpoint.load(cut / "checkpoint.safetensors")
    assert a.keys() == b.keys() and any(k.startswith("opt.") for k in a)
    assert all(torch.equal(a[k], b[k]) for k in a if not k.startswith("rng."))


@pytest.mark.parametrize("args, message", [
    (["--text-lr", "1e-4"], "applies only with --clip"),
    (["--text-lr", "-1"], "--text-lr must be a finite number >= 0"),
    (["--text-lr", "1e-4", "--clip", "CLIP"], "grow"),
    (["--text-lr", "1e-4", "--text-variant", "side-hints"], "applies only with --clip"),
])
def test_a_text_lr_is_refused_where_it_would_not_train_the_clip_it_names(source_run, scene_clip, tmp_path, capsys,
                                                                        args, message):
    args = [str(scene_clip / "text") if a == "CLIP" else a for a in args]
    out = tmp_path / "grown"
    assert train_script.main(["--out", str(out), "--grow-from", str(source_run), "--steps", "6", "--quiet",
                              *args]) == 2
    assert message in capsys.readouterr().err and not out.exists()


def test_freezing_a_trained_clip_again_is_refused(on_clip, tmp_path, capsys):
    trained = tmp_path / "trained"
    assert train_script.main(["--out", str(trained), "--grow-from", str(on_clip), "--text-lr", "3e-4", "--steps", "6",
                              "--quiet"]) == 0
    out = tmp_path / "frozen"
    assert train_script.main(["--out", str(out), "--grow-from", str(trained), "--text-lr", "0", "--steps", "7",
                              "--quiet"]) == 2
    assert "losing what it learned" in capsys.readouterr().err and not out.exists()


def test_side_hints_on_a_frozen_clip_train_at_the_runs_rate_and_resume_from_the_checkpoint(on_clip, tmp_path, capsys):
    from unet import checkpoint
    grown = tmp_path / "hints"
    assert train_script.main(["--out", str(grown), "--grow-from", str(on_clip), "--text-variant", "side-hints",
                              "--steps", "7", "--quiet"]) == 0
    saved, _ = checkpoint.load(grown / "checkpoint.safetensors")
    assert saved["text.side_hint.weight"].abs().sum() > 0  # trained from zero, at --lr
    trainer = Trainer(dataclasses.replace(train_script.training_config(
        train_script.parse_args(["--out", str(grown), "--resume", "--steps", "8"])), resume=True))
    assert torch.equal(trainer.text_encoder.side_hint.weight, saved["text.side_hint.weight"])
    assert torch.equal(run_pipeline(grown).text_encoder.side_hint.weight, saved["ema_text.side_hint.weight"])
    assert all(g["lr_scale"] == 1.0 for g in trainer.optimizer.param_groups)
    hint = trainer.param_names.index("text.side_hint.weight")
    assert trainer.optimizer.state_dict()["state"][hint]["exp_avg"].abs().sum() > 0  # its moments came back too


def test_growing_from_a_folder_that_never_saved_a_step_of_its_own_is_refused(on_clip, scene_clip, tmp_path, capsys):
    fresh = tmp_path / "fresh"
    train_script.start_grown(train_script.training_config(train_script.parse_args(
        ["--out", str(fresh), "--grow-from", str(on_clip), "--steps", "9"])), on_clip)  # as a run killed at once
    out = tmp_path / "again"
    assert train_script.main(["--out", str(out), "--grow-from", str(fresh), "--text-lr", "1e-4", "--steps", "9",
                              "--quiet"]) == 2
    assert "has not saved a step of its own" in capsys.readouterr().err and not out.exists()
