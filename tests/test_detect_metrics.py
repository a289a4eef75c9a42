import numpy as np
import pytest
import torch

from crossattn.metrics import coverage, iou, mass, pointing, score_maps
from unet.data import SceneSampler, render
from unet.eval.detect import Detection, detect
from unet.eval.prompts import EvalPrompt, check, eval_prompts, relation_response, word_objects
from unet.relations import relative_position


def test_detector_on_known_scenes():
    sampler = SceneSampler(seed=7, split="all")
    hits = total = 0
    for _ in range(300):
        scene = sampler()
        found = detect(scene.image)
        for obj in scene.objects:
            total += 1
            hits += any(d.color == obj.color and d.shape == obj.shape and (d.mask & obj.mask).sum() > obj.mask.sum() / 2
                        for d in found)
    assert hits / total >= 0.99


def test_detector_rejects_bad_shape():
    with pytest.raises(ValueError, match=r"\(H, W, 3\)"):
        detect(np.zeros((8, 8)))


def det(x, y, size=4):
    h = size / 2
    return Detection("red", "circle", (x, y), (int(x - h), int(y - h), int(x + h), int(y + h)), np.zeros((1, 1), bool))


@pytest.mark.parametrize("a, b, expected", [
    ((5, 16), (25, 16), {"left of"}),
    ((25, 16), (5, 16), {"right of"}),
    ((16, 4), (16, 26), {"above"}),
    ((16, 26), (16, 4), {"below"}),
    ((16, 16), (16.5, 16.2), set()),  # centres closer than 0.1 x summed sizes: a tie, no relation
    ((5, 5), (25, 25), {"left of", "above"}),  # diagonal: both directions hold
])
def test_position_rule(a, b, expected):
    assert relative_position(det(*a), det(*b)) == expected


def test_prompt_check_needs_every_clause():
    image, _ = render([("red", "circle", 8, 16, 10), ("blue", "square", 24, 16, 10)])
    found = detect(image)
    assert check(EvalPrompt("position", "a circle left of a square", [(None, "circle"), (None, "square")],
                            "left of"), found)[0]
    assert not check(EvalPrompt("position", "a circle right of a square", [(None, "circle"), (None, "square")],
                                "right of"), found)[0]
    assert check(EvalPrompt("color_attr", "", [("red", "circle"), ("blue", "square")]), found)[0]
    assert not check(EvalPrompt("color_attr", "", [("blue", "circle"), ("red", "square")]), found)[0]


def test_eval_prompts_and_word_objects():
    prompts = eval_prompts()
    assert {p.task for p in prompts} == {"single_object", "two_object", "colors", "position", "color_attr"}
    assert word_objects("a red circle and a blue square") == {1: 0, 2: 0, 5: 1, 6: 1}
    assert word_objects("a circle above a square") == {1: 0, 4: 1}


def test_iou_pointing_mass_known_answers():
    mask = torch.zeros(8, 8, dtype=torch.bool)
    mask[:4, :4] = True
    perfect = mask.float()
    assert iou(perfect, mask, 0.5) == 1.0 and pointing(perfect, mask) == 1.0 and mass(perfect, mask) == 1.0
    half = torch.zeros(8, 8)
    half[:4, :8] = 1.0  # covers the mask and as much again
    assert iou(half, mask, 0.5) == pytest.approx(0.5) and mass(half, mask) == pytest.approx(0.5)
    uniform = torch.ones(8, 8)
    assert pointing(uniform, mask) == pytest.approx(16 / 64)  # ties: a random guess
    wrong = torch.zeros(8, 8)
    wrong[7, 7] = 1.0
    assert pointing(wrong, mask) == 0.0 and iou(wrong, mask, 0.5) == 0.0
    scores = score_maps([(perfect, mask), (wrong, mask)], 0.5)
    assert scores["miou"] == pytest.approx(0.5) and scores["pointing"] == pytest.approx(0.5) and scores["n"] == 2
    assert set(scores["sweep"]) == {"0.02", "0.05", "0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8"}


def test_recall_and_precision_tell_a_region_cut_inside_its_mask_from_one_spilt_over_it():
    mask = torch.zeros(8, 8, dtype=torch.bool)
    mask[:4, :4] = True
    peaked = mask.float()
    peaked[1, 1] = 4.0  # at 0.5 of the peak only this pixel is marked: all of it on the mask, 1/16 of the mask
    assert coverage(peaked, mask, 0.5) == (pytest.approx(1 / 16), 1.0)
    assert coverage(peaked, mask, 0.2) == (1.0, 1.0)  # a lower threshold marks the whole mask
    spilt = torch.zeros(8, 8)
    spilt[:4, :8] = 1.0  # the mask and as much again
    assert coverage(spilt, mask, 0.5) == (1.0, pytest.approx(0.5))
    scores = score_maps([(peaked, mask), (spilt, mask)], 0.5)
    assert scores["recall"] == pytest.approx((1 / 16 + 1) / 2) and scores["precision"] == pytest.approx(0.75)


def test_relation_response_tells_an_ignored_word_from_an_obeyed_one():
    def record(relation, first, second):  # centres (x, y) of the first- and second-named objects
        return {"relation": relation, "centers": [first, second]}
    left, right, top, bottom = (5.0, 16.0), (27.0, 16.0), (16.0, 5.0), (16.0, 27.0)
    obeyed = [record("left of", left, right), record("right of", right, left), record("above", top, bottom),
              record("below", bottom, top)] * 3
    r = relation_response(obeyed)
    assert r["horizontal"] == {"response": 1.0, "images": 6} and r["vertical"]["response"] == 1.0
    # the same layouts whatever the word (the noise alone places the objects): 0, though half are "right"
    ignored = [record(rel, left, right) for rel in ("left of", "right of")] + \
              [record(rel, right, left) for rel in ("left of", "right of")]
    assert relation_response(ignored)["horizontal"]["response"] == 0.0
    reversed_ = [record("left of", right, left), record("right of", left, right)]
    assert relation_response(reversed_)["horizontal"]["response"] == -1.0
    # an object not found, or no image of one of the words: not counted / no response
    partial = [record("left of", left, None), record("left of", left, right), {"relation": None}]
    assert relation_response(partial)["horizontal"] == {"response": None, "images": 1}


def test_and_order_counts_the_first_named_object_first_as_read_only_on_and_prompts():
    from unet.eval.prompts import and_order
    from unet.relations import first_as_read

    left, right, top, bottom = (5.0, 16.0), (27.0, 16.0), (16.0, 5.0), (16.0, 27.0)
    assert first_as_read(left, right) and first_as_read(top, bottom)
    assert not first_as_read(right, left) and not first_as_read(bottom, top)
    assert first_as_read((5.0, 20.0), (27.0, 10.0))  # further apart across than down: left to right decides

    def record(task, first, second, relation=None):
        return {"task": task, "relation": relation, "centers": [first, second]}
    reading = [record("two_object", left, right), record("color_attr", top, bottom)] * 2
    assert and_order(reading) == {"first_as_read": 1.0, "images": 4}
    either = reading + [record("two_object", right, left), record("color_attr", bottom, top)] * 2
    assert and_order(either)["first_as_read"] == 0.5
    # relation prompts, single objects and images missing an object do not count; none left: no share
    others = [record("position", right, left, "right of"), record("two_object", left, None),
              {"task": "single_object", "relation": None, "centers": [left]}]
    assert and_order(others) == {"first_as_read": None, "images": 0}
    assert and_order(reading + others)["images"] == 4


class _LayoutPipe:
    """Draws each prompt's two objects where its noise says, or where its relation says (`obey`): what a model
    that ignores relation words does, and what one that follows them does, with the evaluation's call."""

    def __init__(self, obey: bool):
        self.obey = obey

    def __call__(self, prompts, num_images_per_prompt, generator, **_):
        from types import SimpleNamespace

        from unet.eval.prompts import parse_prompt
        from unet.relations import POSITION_SIDES, RELATION_SIDES
        images = []
        coins = torch.rand(len(prompts) * num_images_per_prompt, 2, generator=generator)  # the "noise"
        for i, coin in enumerate(coins.tolist()):
            text = prompts[i // num_images_per_prompt]
            p = parse_prompt(text)
            word = next(w for w in (*POSITION_SIDES, *RELATION_SIDES) if f" {w}" in text)
            axis, side = {**RELATION_SIDES, **POSITION_SIDES}[word]
            first_low = coin[0] < 0.5 if not self.obey else side < 0
            spots = [[16.0, 16.0], [16.0, 16.0]]
            spots[0][axis], spots[1][axis] = (8.0, 24.0) if first_low else (24.0, 8.0)
            noise_colours = ("red", "blue") if coin[1] < 0.5 else ("green", "yellow")
            colours = [c or noise for (c, _), noise in zip(p.objects, noise_colours)]
            image, _ = render([(c, s, *xy, 9.0) for c, (_, s), xy in zip(colours, p.objects, spots)])
            images.append(image / 255.0)
        return SimpleNamespace(images=np.stack(images))


def test_paired_relations_give_exactly_zero_for_an_ignored_word_and_one_for_an_obeyed_one():
    from unet.eval.evaluate import paired_relations
    ignored = paired_relations(_LayoutPipe(obey=False), seeds=3, guidance=1.0)
    obeyed = paired_relations(_LayoutPipe(obey=True), seeds=3, guidance=1.0)
    from unet.eval.evaluate import paired_prompts
    from unet.eval.prompts import PAIRED_AXES
    assert set(ignored) == set(obeyed) == set(PAIRED_AXES)
    for axis in PAIRED_AXES:
        # each prompt and its opposite, 3 seeds; the pairs share their noise, so an ignored word gives the same
        # image twice, whatever side the noise put the first object on
        images = 2 * 3 * len(paired_prompts(axis))
        assert ignored[axis]["images"] == obeyed[axis]["images"] == images > 0
        assert ignored[axis]["pairs"] == obeyed[axis]["pairs"] == images // 2
        assert ignored[axis] | {"pairs": 0} == {"response": 0.0, "moved": 0.0, "pixel_difference": 0.0,
                                                "pairs": 0, "images": images}
        assert obeyed[axis]["response"] == 1.0 and obeyed[axis]["moved"] == 1.0
        assert obeyed[axis]["pixel_difference"] > 1.0


def test_paired_relation_response_counts_only_pairs_with_both_objects():
    from unet.eval.prompts import paired_relation_response
    # (offset under "left of", offset under "right of", pixel difference): negative = first object on the left
    pairs = [(-10.0, 10.0, 4.0), (-10.0, -10.0, 0.0), (None, 10.0, 2.0), (10.0, None, 2.0)]
    r = paired_relation_response(pairs, "horizontal")
    assert r == {"response": 0.5, "moved": 0.5, "pixel_difference": 2.0, "pairs": 2, "images": 8}
    assert paired_relation_response([(None, None, 1.0)], "vertical")["response"] is None
