import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from crossattn.capture import AttentionStore
from crossattn.maps import word_maps
from crossattn.text import prompt_words
from unet.cli.generate import main
from unet.pipeline import load_pipeline


def gen(tiny_pipeline_dir, out, *args):
    return main([*args, "--model", str(tiny_pipeline_dir), "--out", str(out), "--steps", "3", "--quiet"])


def test_cli_writes_every_file_consistently(tiny_pipeline_dir, tmp_path):
    prompt = "a red circle left of a blue square"
    assert gen(tiny_pipeline_dir, tmp_path, prompt, "--num-images", "2", "--seed", "3") == 0
    (folder,) = [p for p in tmp_path.iterdir()]
    meta = json.loads((folder / "meta.json").read_text())
    words = [w["text"] for w in meta["words"]]
    assert words == prompt.split() and meta["seed"] == 3 and meta["steps"] == 3 and meta["num_images"] == 2
    assert all(k in meta["versions"] for k in ("torch", "diffusers", "transformers"))
    maps = load_file(str(folder / "maps.safetensors"))
    word_keys = sorted(k for k in maps if "/" not in k)
    assert word_keys == sorted(f"{i}_{w}" for i, w in enumerate(words))
    assert all(maps[k].shape == (2, 16, 16) and maps[k].min() >= 0 for k in word_keys)
    assert any(k.startswith("layer/") for k in maps)
    image = Image.open(folder / "image_0.png")
    assert image.size == (16, 16) and image.text["prompt"] == prompt and image.text["seed"] == "3"
    grid = Image.open(folder / "overlay.png")
    assert grid.width > 400 and (folder / "overlay_1.png").exists()
    assert sorted(p.name for p in (folder / "words").iterdir()) == sorted(f"{i}_{w}.png" for i, w in enumerate(words))


def test_same_seed_same_image_and_maps_and_no_overwrite(tiny_pipeline_dir, tmp_path):
    for _ in range(2):
        assert gen(tiny_pipeline_dir, tmp_path, "a green triangle", "--seed", "1") == 0
    a, b = sorted(tmp_path.iterdir())
    assert a.name != b.name  # the second run got a new folder
    assert np.array_equal(np.asarray(Image.open(a / "image_0.png")), np.asarray(Image.open(b / "image_0.png")))
    ma, mb = load_file(str(a / "maps.safetensors")), load_file(str(b / "maps.safetensors"))
    assert all((ma[k] == mb[k]).all() for k in ma)
    assert gen(tiny_pipeline_dir, tmp_path, "a green triangle", "--seed", "1", "--overwrite") == 0
    assert len(list(tmp_path.iterdir())) == 2


def test_non_square_and_word_filter(tiny_pipeline_dir, tmp_path):
    assert gen(tiny_pipeline_dir, tmp_path, "a red square", "--height", "16", "--width", "32",
               "--words", "red", "square") == 0
    (folder,) = list(tmp_path.iterdir())
    maps = load_file(str(folder / "maps.safetensors"))
    assert maps["1_red"].shape == (1, 16, 32)
    assert sorted(p.name for p in (folder / "words").iterdir()) == ["1_red.png", "2_square.png"]


@pytest.mark.parametrize("args, message", [
    (["   "], "empty prompt"),
    (["a red circle and a blue square and a green triangle above a yellow square"], "would be dropped: "),
    (["a red circle", "--words", "blue"], "its words are: ['a', 'red', 'circle']"),
    (["a red circle", "--steps", "0"], "--steps must be a positive integer"),
    (["a red circle", "--num-images", "-1"], "--num-images must be a positive integer"),
])
def test_bad_input_exit_2_and_nothing_written(tiny_pipeline_dir, tmp_path, capsys, args, message):
    out = tmp_path / "out"
    rc = main([*args, "--model", str(tiny_pipeline_dir), "--out", str(out), "--quiet"])
    assert rc == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_truncate_accepts_long_prompt(tiny_pipeline_dir, tmp_path):
    long = "a red circle and a blue square and a green triangle above a yellow square"
    assert gen(tiny_pipeline_dir, tmp_path, long, "--truncate") == 0


def test_unseen_words_warn_and_continue(tiny_pipeline_dir, tmp_path, capsys):
    assert gen(tiny_pipeline_dir, tmp_path, "a purple circle") == 0
    assert "never saw these words in training: ['purple']" in capsys.readouterr().err


@pytest.mark.parametrize("make, message", [
    (lambda p: None, "does not exist"),
    (lambda p: p.mkdir(), "no model_index.json"),
])
def test_unreadable_model_folder(tmp_path, capsys, make, message):
    make(tmp_path / "model")
    rc = main(["a red circle", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "out")])
    assert rc == 2 and message in capsys.readouterr().err and not (tmp_path / "out").exists()


def test_corrupt_weights_clear_message(tiny_pipeline_dir, tmp_path, capsys):
    import shutil
    broken = tmp_path / "model"
    shutil.copytree(tiny_pipeline_dir, broken)
    (broken / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(b"not a safetensors file")
    rc = main(["a red circle", "--model", str(broken), "--out", str(tmp_path / "out")])
    assert rc == 2 and "could not load the model" in capsys.readouterr().err


def test_saved_maps_equal_word_maps_of_the_same_run(tiny_pipeline_dir, tmp_path):
    """maps.safetensors holds exactly what `word_maps` computes from a store attached to the same sampling run."""
    prompt = "a red circle left of a blue square"
    assert gen(tiny_pipeline_dir, tmp_path, prompt, "--seed", "5", "--num-images", "2") == 0
    (folder,) = list(tmp_path.iterdir())
    saved = load_file(str(folder / "maps.safetensors"))
    pipe = load_pipeline(tiny_pipeline_dir, show_progress=False)
    store = AttentionStore.for_pipeline(pipe)
    with store.attach(pipe.unet):
        pipe(prompt, num_inference_steps=3, generator=torch.Generator().manual_seed(5), num_images_per_prompt=2,
             output_type="np", show_progress=False)
    words = prompt_words(pipe.tokenizer, prompt)
    for k in range(2):
        expected = word_maps(store, words, size=(16, 16), index=k)  # (words, H, W)
        for w in words:
            assert torch.equal(saved[f"{w.index}_{w.text}"][k], expected[w.index]), (k, w.text)


def test_given_latents_are_the_noise_the_images_start_from(tiny_pipeline):
    """`latents` replaces the generator's draw: the generator's own noise passed as latents gives its images, bit
    for bit, and one noise under two prompts is that noise row by row. A wrong shape is refused, naming the one
    accepted."""
    pipe = tiny_pipeline
    size, channels = pipe.unet.config.sample_size, pipe.unet.config.in_channels
    prompts = ["a red circle", "a blue square"]
    drawn = pipe(prompts, num_inference_steps=2, generator=torch.Generator().manual_seed(3), output_type="pt",
                 show_progress=False).images
    noise = torch.randn((2, channels, size, size), generator=torch.Generator().manual_seed(3))
    given = pipe(prompts, num_inference_steps=2, latents=noise, output_type="pt", show_progress=False).images
    assert torch.equal(given, drawn)
    one = pipe(prompts[:1], num_inference_steps=2, latents=noise[:1], output_type="pt", show_progress=False).images
    shared = pipe(prompts, num_inference_steps=2, latents=noise[:1].expand(2, -1, -1, -1), output_type="pt",
                  show_progress=False).images
    # (a batch of two against a batch of one: the same noise, up to the float sums of another batch size)
    assert torch.allclose(shared[:1], one, atol=1e-5) and not torch.allclose(shared[1:], drawn[1:], atol=1e-2)
    with pytest.raises(ValueError, match=rf"latents must have the shape .* = \(2, {channels}, {size}, {size}\)"):
        pipe(prompts, num_inference_steps=2, latents=noise[:1], show_progress=False)
