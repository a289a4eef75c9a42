"""scripts/attend.py: the maps of an image you already have, checked against the evaluation's dataset
read-out on the same scenes, timestep and seed; bad input is one line, exit 2, nothing written."""

import json
from importlib.metadata import entry_points

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from crossattn.metrics import pointing
from crossattn.text import prompt_words
from unet.attend import fit_image, read_image
from unet.cli.attend import main as attend_main
from unet.eval.map_scoring import collect, dataset_batch, dataset_scenes, method_maps

TIMESTEP, SEED, SCENES = 300, 123, 3


def run(args, capsys):
    rc = attend_main([str(a) for a in args] + ["--quiet"])
    out = capsys.readouterr()
    return rc, out.out.strip(), out.err


def test_attend_on_saved_scenes_matches_the_evaluations_dataset_read_out(tiny_pipeline_dir, tiny_pipeline,
                                                                          tmp_path, capsys):
    scenes = dataset_scenes(tiny_pipeline, SCENES, SEED)
    batch = dataset_batch(tiny_pipeline, SCENES, TIMESTEP, SEED)  # the evaluation's: scene i noised with SEED + i
    evaluated = method_maps("ours", batch.store, (16, 16))  # (B, T, H, W): all layers, heads, the one pass
    hits_eval, hits_attend = [], []
    for i, scene in enumerate(scenes):
        png = tmp_path / f"scene_{i}.png"
        Image.fromarray(scene.image).save(png)
        rc, folder, err = run([png, scene.caption, "--model", tiny_pipeline_dir, "--timestep", TIMESTEP,
                               "--seed", SEED + i, "--out", tmp_path / "out"], capsys)
        assert rc == 0, err
        folder = tmp_path / "out" / folder.split("/")[-1]
        assert sorted(p.name for p in folder.iterdir()) == ["image_0.png", "index.html", "maps.safetensors",
                                                           "meta.json", "overlay.png", "viewer_data.js", "words"]
        assert np.array_equal(np.asarray(Image.open(folder / "image_0.png")), scene.image)  # as given: no resize
        meta = json.loads((folder / "meta.json").read_text())
        assert (meta["timestep"], meta["seed"], meta["maps"], meta["prompt"]) == (TIMESTEP, SEED + i, "plain",
                                                                                  scene.caption)
        saved = load_file(str(folder / "maps.safetensors"))
        words = prompt_words(tiny_pipeline.tokenizer, scene.caption)
        for w_index, obj in scene.word_objects.items():
            w = words[w_index]
            expected = evaluated[i, w.tokens].sum(0)  # the evaluation's heat map of this word
            torch.testing.assert_close(saved[f"{w.index}_{w.text}"][0], expected, atol=1e-5, rtol=1e-4)
            mask = torch.as_tensor(scene.objects[obj].mask)
            hits_eval.append(pointing(expected, mask))
            hits_attend.append(pointing(saved[f"{w.index}_{w.text}"][0], mask))
    assert hits_attend == hits_eval and len(hits_eval) >= SCENES
    pairs = collect([batch], "ours", (16, 16))  # the same pairs the evaluation scores
    assert len(pairs["shape_words"]) + len(pairs["color_words"]) == len(hits_eval)
    assert sorted(pointing(h, m) for kind in pairs.values() for h, m in kind) == sorted(hits_eval)


def test_grayscale_and_rgba_are_converted_and_said_so(tiny_pipeline_dir, tmp_path, capsys):
    rgba = np.zeros((16, 16, 4), np.uint8)
    rgba[4:12, 4:12] = (255, 0, 0, 128)  # half-transparent red on a transparent background
    Image.fromarray(rgba, "RGBA").save(tmp_path / "rgba.png")
    rc, folder, err = run([tmp_path / "rgba.png", "a red square", "--model", tiny_pipeline_dir, "--out",
                           tmp_path / "out"], capsys)
    assert rc == 0 and "RGBA image: alpha composited on black" in err
    seen = np.asarray(Image.open(tmp_path / "out" / folder.split("/")[-1] / "image_0.png"))
    assert seen[0, 0].tolist() == [0, 0, 0] and abs(int(seen[8, 8, 0]) - 128) <= 1 and seen[8, 8, 1:].max() == 0
    Image.fromarray(np.full((32, 24), 200, np.uint8), "L").save(tmp_path / "gray.png")
    rc, folder, err = run([tmp_path / "gray.png", "a circle", "--model", tiny_pipeline_dir, "--out",
                           tmp_path / "out"], capsys)
    assert rc == 0 and "L image converted to RGB" in err and "resized from 24x32 to the model's 16x16" in err
    meta = json.loads((tmp_path / "out" / folder.split("/")[-1] / "meta.json").read_text())
    assert meta["source_notes"] == ["L image converted to RGB", "resized from 24x32 to the model's 16x16"]
    assert (meta["height"], meta["width"]) == (16, 16)


def test_fit_image_resizes_only_other_sizes():
    image = Image.fromarray(np.arange(16 * 16 * 3, dtype=np.uint8).reshape(16, 16, 3) % 251)
    same, notes = fit_image(image, (16, 16))
    assert notes == [] and np.array_equal(same, np.asarray(image))
    small, notes = fit_image(image, (8, 8))
    assert small.shape == (8, 8, 3) and notes == ["resized from 16x16 to the model's 8x8"]


@pytest.mark.parametrize("make, prompt, extra, message", [
    (lambda d: d.joinpath("notes.png").write_text("not an image") and d / "notes.png", "a circle", [],
     "is not an image file"),
    (lambda d: d / "missing.png", "a circle", [], "does not exist"),
    (lambda d: d, "a circle", [], "is a folder"),
    (lambda d: _truncated(d), "a circle", [], "could not be read whole"),
    (lambda d: _png(d), "   ", [], "empty prompt"),
    (lambda d: _png(d), "a circle", ["--timestep", "1000"], "--timestep must be a training timestep from 0 to 999"),
    (lambda d: _png(d), "a circle", ["--timestep", "-1"], "--timestep must be"),
    (lambda d: _png(d), "a circle", ["--seed", "-3"], "--seed must be"),
])
def test_bad_input_is_one_line_exit_2_nothing_written(tiny_pipeline_dir, tmp_path, capsys, make, prompt, extra,
                                                     message):
    source = tmp_path / "in"
    source.mkdir()
    out = tmp_path / "out"
    rc, stdout, err = run([make(source), prompt, "--model", tiny_pipeline_dir, "--out", out, *extra], capsys)
    assert rc == 2 and stdout == ""
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
    assert not out.exists()


def _png(folder):
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(folder / "ok.png")
    return folder / "ok.png"


def _truncated(folder):
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(folder / "t.png")
    data = (folder / "t.png").read_bytes()
    (folder / "t.png").write_bytes(data[: len(data) // 2])
    return folder / "t.png"


def test_read_image_refuses_truncated_files_before_any_model(tmp_path):
    from crossattn.errors import UsageError
    with pytest.raises(UsageError, match="could not be read whole"):
        read_image(_truncated(tmp_path))


def test_attend_on_a_stable_diffusion_folder_encodes_with_the_vae(tmp_path, capsys):
    from test_diffusers import tiny_pipeline as tiny_sd
    tiny_sd("sd").save_pretrained(tmp_path / "sd", safe_serialization=True)
    Image.fromarray(np.full((40, 50, 3), 90, np.uint8)).save(tmp_path / "photo.jpg")
    rc, folder, err = run([tmp_path / "photo.jpg", "a red cat", "--model", tmp_path / "sd", "--timestep", "100",
                           "--maps", "refined", "--out", tmp_path / "out"], capsys)
    assert rc == 0, err
    assert "resized from 50x40 to the model's 64x64" in err
    folder = tmp_path / "out" / folder.split("/")[-1]
    saved = load_file(str(folder / "maps.safetensors"))
    assert saved["2_cat"].shape == (1, 64, 64) and torch.isfinite(saved["2_cat"]).all()
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["maps"] == "refined" and meta["timestep"] == 100
    assert any(name.endswith("attn1") for name in meta["layers"])  # the self-attention refined maps read


def test_console_command_installed():
    (entry,) = [e for e in entry_points(group="console_scripts") if e.name == "crossattn-attend"]
    assert entry.value == "crossattn_launcher:attend"  # through the launcher, as scripts/attend.py


def test_attend_refuses_an_sdxl_folder_in_one_line(tmp_path, capsys):
    from test_diffusers import tiny_pipeline as tiny_sd
    tiny_sd("sdxl").save_pretrained(tmp_path / "sdxl", safe_serialization=True)
    capsys.readouterr()  # the saving's progress bars
    rc, stdout, err = run([_png(tmp_path), "a red cat", "--model", tmp_path / "sdxl", "--out", tmp_path / "out"],
                          capsys)
    assert rc == 2 and stdout == "" and "is not supported by attend" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()
