"""The judge: the evaluation's reading of a prompt, on images drawn with known ground truth."""

import json

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from unet.cli.judge import judge, main
from unet.data import SceneSampler
from unet.eval.detect import detect
from unet.eval.map_scoring import attention_on_objects
from unet.eval.prompts import eval_prompts, parse_prompt

OPPOSITE = {"left of": "right of", "right of": "left of", "above": "below", "below": "above"}


def test_parse_prompt_reads_every_evaluation_prompt_as_the_evaluation_does():
    for p in eval_prompts():
        assert parse_prompt(p.prompt) == p


@pytest.mark.parametrize("prompt", ["a red", "a circle and a square and a triangle", "a circle left of"])
def test_parse_prompt_refuses_what_it_cannot_judge(prompt):
    with pytest.raises(ValueError, match="judged prompt|needs two objects"):
        parse_prompt(prompt)


def test_judge_accepts_the_caption_and_refuses_the_opposite_relation():
    sampler = SceneSampler(seed=3, split="all")
    for relation in OPPOSITE:
        scene = sampler.pair(("red", "circle", "blue", "square"), relation=relation, with_colors=True)
        assert judge(scene.caption, scene.image)[0], scene.caption
        assert not judge(scene.caption.replace(relation, OPPOSITE[relation]), scene.image)[0]


def test_judge_command_counts_and_refuses_bad_files(tmp_path, capsys):
    scene = SceneSampler(seed=1, split="all").pair(("green", "triangle", "yellow", "circle"), relation="above",
                                                   with_colors=True)
    path = tmp_path / "scene.png"
    Image.fromarray(scene.image).save(path)
    assert main([scene.caption, str(path), str(path)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == f"2 of 2 follow {scene.caption!r}"
    (tmp_path / "text.png").write_text("not an image")
    assert main([scene.caption, str(tmp_path / "text.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not an image file PIL can read" in err[0]  # as attend reads images


def _scene_run(folder, scene, maps: dict):
    """A minimal generate.py run folder: image_0.png, maps.safetensors ("<i>_<word>": (1, H, W)), meta.json."""
    folder.mkdir()
    Image.fromarray(scene.image).save(folder / "image_0.png")
    save_file({f"{i}_{w}": m[None].float().contiguous() for i, (w, m) in enumerate(maps.items())},
              str(folder / "maps.safetensors"))
    meta = {"prompt": scene.caption, "normalize": "raw", "maps": "plain", "images": ["image_0.png"],
            "words": [{"index": i, "text": w} for i, w in enumerate(maps)]}
    (folder / "meta.json").write_text(json.dumps(meta))
    return folder / "image_0.png"


def test_attention_on_objects_reads_each_words_mean_on_each_object_and_the_background():
    scene = SceneSampler(seed=2, split="all").pair(("red", "circle", "blue", "square"), relation="left of",
                                                   with_colors=True)
    found = detect(scene.image)
    assert len(found) == 2
    first, second = (torch.as_tensor(d.mask, dtype=torch.float32) for d in found)
    maps = torch.stack([first, 0.5 * second, torch.full_like(first, 0.2), 1 - first - second])  # (words, H, W)
    table = attention_on_objects(maps, found)  # (words, objects + background)
    assert table.shape == (4, 3)
    expected = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.5, 0.0], [0.2, 0.2, 0.2]])
    assert torch.allclose(table[:3], expected)
    # the background leaves out a pixel's margin around each object, so a word on everything else reads 1 there
    assert table[3, 2] == 1.0 and table[3, :2].max() == 0.0


def test_judge_maps_prints_where_each_word_looked_and_refuses_what_is_not_a_run(tmp_path, capsys):
    scene = SceneSampler(seed=1, split="all").pair(("green", "triangle", "yellow", "circle"), relation="above",
                                                   with_colors=True)
    found = detect(scene.image)
    triangle = next(torch.as_tensor(d.mask, dtype=torch.float32) for d in found if d.shape == "triangle")
    path = _scene_run(tmp_path / "run", scene, {"green": 0.3 * triangle, "circle": torch.zeros_like(triangle)})
    assert main([scene.caption, str(path), "--maps"]) == 0
    out = capsys.readouterr().out.splitlines()
    header = out[2].split()
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in out[3:5]}
    assert header[-1] == "background" and len(rows["green"]) == len(found) + 1
    assert rows["green"][[d.shape for d in found].index("triangle")] == 0.3 and rows["green"][-1] == 0.0
    assert rows["circle"] == [0.0] * (len(found) + 1)

    plain = tmp_path / "scene.png"  # an image that is not a run's
    Image.fromarray(scene.image).save(plain)
    assert main([scene.caption, str(plain), "--maps"]) == 2
    assert "is not an image_<k>.png beside a maps.safetensors" in capsys.readouterr().err
    small = _scene_run(tmp_path / "small", scene, {"green": torch.zeros(16, 16)})  # maps not at the image's size
    assert main([scene.caption, str(small), "--maps"]) == 2
    assert "its maps are 16x16" in capsys.readouterr().err
