"""The judge: the evaluation's reading of a prompt, on images drawn with known ground truth."""

import pytest
from PIL import Image

from unet.cli.judge import judge, main
from unet.data import SceneSampler
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
