"""The grounding losses (TokenCompose's): the token loss (train.py --grounding-weight), each word that names an
object attends to that object's pixels; the pixel loss (--pixel-grounding-weight), each pixel reads the words of its
own object and no other object's."""

import json
import math

import pytest
import torch
from conftest import straight_and_resumed, tiny_config

from crossattn.capture import AttentionStore
from crossattn.text import prompt_words
from unet.data import SceneSampler
from unet.recipe import cross_attention_weights, grounding_loss, pixel_grounding_loss, word_masks
from unet.train import TrainConfig, Trainer, resumed_config


@pytest.fixture
def pair_and_tokenizer(tmp_path):
    trainer = Trainer(tiny_config(tmp_path / "run", num_samples=0, grounding_weight=0.1))
    scene = SceneSampler(seed=3, height=16, width=16).pair(("red", "circle", "blue", "square"), "left of", True)
    return scene, trainer


def test_word_masks_put_each_objects_pixels_on_its_colour_and_shape_tokens(pair_and_tokenizer):
    scene, trainer = pair_and_tokenizer
    assert scene.caption == "a red circle left of a blue square"
    masks = word_masks([scene, scene], [scene.caption, ""], trainer.tokenizer)  # the second caption was dropped
    assert masks.shape == (2, trainer.tokenizer.model_max_length, 16, 16)
    assert [w.tokens for w in prompt_words(trainer.tokenizer, scene.caption)] == [[i] for i in range(1, 9)]
    circle, square = (torch.from_numpy(o.mask).float() for o in scene.objects)
    # position 0 is the start token: "a"=1, "red"=2, "circle"=3, "left"=4, "of"=5, "a"=6, "blue"=7, "square"=8
    for position, mask in ((2, circle), (3, circle), (7, square), (8, square)):
        assert torch.equal(masks[0, position], mask)
    assert all(masks[0, t].sum() == 0 for t in range(masks.shape[1]) if t not in (2, 3, 7, 8))
    assert masks[1].sum() == 0 and circle.sum() > 0 and square.sum() > 0


def test_the_loss_is_0_on_the_object_1_off_it_and_carries_a_gradient():
    masks = torch.zeros(1, 3, 4, 4)
    masks[0, 1, :, :2] = 1  # token 1 names an object on the left half
    on = torch.zeros(1, 2, 16, 3)
    on[0, :, :, 0] = 1  # every query attends to token 0 (the start token)...
    left = torch.arange(16) % 4 < 2
    on[0, :, left, 1], on[0, :, left, 0] = 1, 0  # ...except the left half, which attends to token 1
    assert grounding_loss([on], masks) == 0
    off = on.clone()
    off[0, :, :, :] = 0
    off[0, :, :, 0] = 1
    off[0, :, ~left, 1], off[0, :, ~left, 0] = 1, 0  # token 1 read only on the right
    assert grounding_loss([off], masks) == 1
    half = torch.full((1, 2, 16, 3), 1 / 3, requires_grad=True)  # uniform: half its attention on the object
    loss = grounding_loss([half, half], masks)
    assert loss.item() == pytest.approx(0.25)
    loss.backward()
    assert half.grad.abs().sum() > 0


def two_objects_read(circle_reads: str, square_reads: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Masks for "red circle" (tokens 1, 2: left half) and "blue square" (tokens 3, 4: right half) on 4x4 pixels,
    and weights (1, 1, 16, 5) in which each object's pixels read the named tokens and the background token 0."""
    masks = torch.zeros(1, 5, 4, 4)
    left = torch.arange(16) % 4 < 2
    masks[0, 1:3, :, :2] = 1
    masks[0, 3:5, :, 2:] = 1
    weights = torch.zeros(1, 1, 16, 5)
    for pixels, reads in ((left, circle_reads), (~left, square_reads)):
        for t in reads:
            weights[0, 0, pixels, int(t)] += 1 / len(reads)
    return weights, masks


def test_the_pixel_loss_is_0_when_each_object_reads_its_own_words_and_large_when_the_square_reads_circle():
    own, masks = two_objects_read("12", "34")
    assert pixel_grounding_loss([own], masks) == 0
    # one shape drawn twice: the square's pixels read "circle" (with their own colour)
    twice, _ = two_objects_read("12", "32")
    # a read of 0.5 costs log 2 on half the pixels, for the circle's words (off their object) and the square's (on it)
    assert pixel_grounding_loss([twice], masks).item() == pytest.approx(math.log(2) / 2)
    # half the square's attention on the background token: only the square's words pay, half as much
    faint, _ = two_objects_read("12", "0034")
    assert pixel_grounding_loss([faint], masks).item() == pytest.approx(math.log(2) / 4)
    # the token loss cannot see the difference between a faint object and a perfect one: both stay on the object
    assert grounding_loss([faint], masks) == grounding_loss([own], masks) == 0
    grad = torch.full((1, 2, 16, 5), 0.2, requires_grad=True)
    pixel_grounding_loss([grad], masks).backward()
    assert grad.grad.abs().sum() > 0


def test_map_overlap_is_0_for_objects_on_their_own_pixels_and_1_for_one_map():
    """The overlap diagnose.py two-objects reads at every sampling step (`map_overlap`, once the overlap loss's
    measure), on the same worked pairs: how much the maps of the two objects' words share their pixels."""
    from unet.research.diagnose import map_overlap
    objects = torch.tensor([[0, 0], [1, 0], [1, 0], [0, 1], [0, 1]]).float()  # (T, 2): tokens 1, 2 and 3, 4

    def overlap(circle_reads: str, square_reads: str) -> float:
        weights, _ = two_objects_read(circle_reads, square_reads)
        read = weights.mean(1) @ objects  # (1, 16, 2): each pixel's attention on each object's words
        return map_overlap(read[..., 0], read[..., 1]).item()
    assert overlap("12", "34") == 0
    # the square's pixels read "circle" half the time: the circle's map has 1/3 of its mass on the square's pixels,
    # where the square's map has all of its own (smaller of 1/24 and 1/8 on each of 8 pixels)
    assert overlap("12", "32") == pytest.approx(1 / 3)
    assert overlap("1234", "1234") == pytest.approx(1.0)  # both objects' words read everywhere alike: one map
    assert overlap("34", "12") == 0  # it asks nothing of where: maps on each other's pixels are apart too


def test_the_weights_are_collected_with_their_gradient_and_the_model_restored(pair_and_tokenizer):
    _, trainer = pair_and_tokenizer
    images, captions, masks = trainer.batch(0)
    assert masks.shape[:2] == (4, trainer.tokenizer.model_max_length) and masks.sum() > 0
    noise = trainer.noise_gen.get_state()
    loss = trainer.loss(images, captions, masks)
    trainer.noise_gen.set_state(noise)  # the same noise and t: the term alone tells the two apart
    plain = trainer.loss(images, captions)
    assert 0 < loss.item() - plain.item() <= 0.1  # 0.1 x a loss in (0, 1]
    trainer.cfg.losses.grounding_weight, trainer.cfg.losses.pixel_grounding_weight = 0.0, 0.1
    trainer.noise_gen.set_state(noise)
    pixel = trainer.loss(images, captions, masks)
    with cross_attention_weights(trainer.unet) as weights:
        trainer.noise_gen.set_state(noise)
        trainer.loss(images, captions)
    assert pixel.item() - plain.item() == pytest.approx(0.1 * pixel_grounding_loss(weights, masks).item(), rel=1e-4)
    with cross_attention_weights(trainer.unet) as weights:
        trainer.loss(images, captions)
    assert weights and all(w.requires_grad and w.shape[-1] == trainer.tokenizer.model_max_length for w in weights)
    assert all(m.observer is None for m in trainer.unet.modules() if hasattr(m, "observer"))
    store = AttentionStore()  # one attached before: it sees every weight too, and stays attached
    store.attach(trainer.unet)
    with torch.no_grad(), cross_attention_weights(trainer.unet) as weights:
        trainer.loss(images, captions)
    observers = [m.observer for m in trainer.unet.modules() if getattr(m, "is_cross_attention", False)]
    assert store.passes() == len(weights) == len(observers) > 0 and all(o is not None for o in observers)


def grounding_after(tmp_path, term: str, weight: float) -> float:
    """`term`'s value on a probe batch after 30 tiny steps trained with that term at `weight`."""
    trainer = Trainer(tiny_config(tmp_path / f"{term}{weight}", num_samples=0, steps=30, lr=3e-3, warmup=1,
                                  caption_dropout=0.0, **{f"{term}_weight": weight}))
    trainer.train(progress=False)
    probe = Trainer(tiny_config(tmp_path / "probe", num_samples=0, grounding_weight=1.0, seed=9))
    images, captions, masks = probe.batch(0)
    torch.manual_seed(0)
    with torch.no_grad(), cross_attention_weights(trainer.unet) as weights:
        trainer.loss(images, captions)
    return {"grounding": grounding_loss, "pixel_grounding": pixel_grounding_loss}[term](weights, masks).item()


def test_training_with_grounding_moves_the_attention_onto_the_objects(tmp_path):
    """The same fresh batches with and without the term: the grounding loss falls further with it."""
    assert grounding_after(tmp_path, "grounding", 30.0) < grounding_after(tmp_path, "grounding", 0.0) - 0.2
    # measured: 0.37 against 0.86


def test_training_with_the_pixel_loss_keeps_each_pixel_on_its_own_objects_words(tmp_path):
    assert grounding_after(tmp_path, "pixel_grounding", 3.0) < grounding_after(tmp_path, "pixel_grounding", 0.0) - 0.05
    # measured: 0.17 against 0.27


def test_a_run_with_grounding_resumes_exactly_and_old_configs_mean_none(tmp_path):
    cfg = dict(steps=6, checkpoint_every=3, num_samples=0, grounding_weight=0.5, pixel_grounding_weight=0.2)
    straight, resumed = straight_and_resumed(tmp_path, **cfg)
    losses = resumed.cfg.losses
    assert (losses.grounding_weight, losses.pixel_grounding_weight) == (0.5, 0.2)
    assert all(torch.equal(p, q) for p, q in zip(straight.ema.parameters(), resumed.ema.parameters()))
    saved = json.loads((tmp_path / "a" / "train_config.json").read_text())
    saved.pop("grounding_weight")
    saved.pop("pixel_grounding_weight")
    old = resumed_config(TrainConfig(out=str(tmp_path)), saved)
    assert old.losses.grounding_weight == old.losses.pixel_grounding_weight == 0.0


@pytest.mark.parametrize("setting, message", [
    (dict(grounding_weight=-1.0), "--grounding-weight must be a finite number >= 0"),
    (dict(grounding_weight=0.1, num_samples=64), "needs fresh scenes"),
    (dict(pixel_grounding_weight=float("nan")), "--pixel-grounding-weight must be a finite number >= 0"),
    (dict(pixel_grounding_weight=0.1, data="."), "--pixel-grounding-weight needs fresh scenes"),
])
def test_bad_grounding_settings_are_refused_by_name(setting, message):
    with pytest.raises(ValueError, match=message.replace("-", r"\-")):
        TrainConfig.from_flat(**setting).validate()
