"""The key-separation term (train.py --key-separation-weight): a caption's two different colour words get Keys
whose cosine stays under --key-margin in every cross-attention layer, so their maps can differ."""

import json

import pytest
import torch
from conftest import straight_and_resumed, tiny_config

from unet.recipe import colour_pairs, key_separation_loss
from unet.train import TrainConfig, Trainer, resumed_config


@pytest.fixture
def trainer(tmp_path):
    return Trainer(tiny_config(tmp_path / "run", key_separation_weight=1.0))


def colour_key_cosine(trainer, caption="a red circle left of a blue square") -> float:
    """The largest cosine between the Keys of `caption`'s two colour words over the cross-attention layers."""
    ids = trainer.tokenizer([caption], padding="max_length", max_length=trainer.tokenizer.model_max_length,
                            return_tensors="pt").input_ids
    (b, i, j), = colour_pairs([caption], trainer.tokenizer).tolist()
    with torch.no_grad():
        context = trainer.text_encoder(ids).last_hidden_state
        return max(torch.cosine_similarity(k[b, i], k[b, j], dim=0).item()
                   for k in (m.to_k(context) for m in trainer.unet.modules() if getattr(m, "is_cross_attention", 0)))


def test_colour_pairs_find_two_different_colour_words_and_nothing_else(trainer):
    captions = ["a red circle left of a blue square", "a red circle and a red square", "",
                "a circle left of a square", "a green triangle"]
    # "a"=1 "red"=2 ... "a"=6 "blue"=7: positions count the start token
    assert colour_pairs(captions, trainer.tokenizer).tolist() == [[0, 2, 7]]
    assert colour_pairs([""], trainer.tokenizer).shape == (0, 3)


def test_the_term_is_the_squared_excess_over_the_margin_in_every_layer(trainer):
    pairs = torch.tensor([[0, 1, 2]])
    context = torch.randn(1, 4, trainer.cfg.text.text_width, requires_grad=True)
    alike = context.detach().clone()
    alike[0, 2] = 2 * alike[0, 1]  # the same direction: every layer's Keys have cosine 1
    assert key_separation_loss(trainer.unet, alike, pairs, 0.3).item() == pytest.approx(0.49)
    alike[0, 2] = -alike[0, 1]  # opposite: cosine -1, below any margin
    assert key_separation_loss(trainer.unet, alike, pairs, 0.3).item() == 0
    key_separation_loss(trainer.unet, context, pairs, -1.0).backward()
    assert context.grad.abs().sum() > 0
    none = key_separation_loss(trainer.unet, context, torch.zeros(0, 3, dtype=torch.long), 0.3)
    assert none.item() == 0 and none.requires_grad


def test_training_with_the_term_pulls_the_colour_keys_apart(tmp_path):
    def cosine_after(weight):
        trainer = Trainer(tiny_config(tmp_path / f"w{weight}", steps=30, lr=3e-3, warmup=1, caption_dropout=0.0,
                                      key_separation_weight=weight, key_margin=0.0))
        trainer.train(progress=False)
        return colour_key_cosine(trainer)
    assert cosine_after(10.0) < cosine_after(0.0) - 0.5  # measured: -0.86 against 1.00


def test_a_run_with_the_term_resumes_exactly_and_old_configs_mean_none(tmp_path):
    cfg = dict(steps=6, checkpoint_every=3, key_separation_weight=0.5, key_margin=0.2)
    straight, resumed = straight_and_resumed(tmp_path, **cfg)
    assert (resumed.cfg.losses.key_separation_weight, resumed.cfg.losses.key_margin) == (0.5, 0.2)
    assert all(torch.equal(p, q) for p, q in zip(straight.ema.parameters(), resumed.ema.parameters()))
    saved = json.loads((tmp_path / "a" / "train_config.json").read_text())
    del saved["key_separation_weight"], saved["key_margin"]
    assert resumed_config(TrainConfig(out=str(tmp_path)), saved).losses.key_separation_weight == 0.0


@pytest.mark.parametrize("setting, message", [
    (dict(key_separation_weight=-0.5), "--key-separation-weight must be a finite number >= 0"),
    (dict(key_margin=1.0), r"--key-margin is a cosine in \[-1, 1\)"),
])
def test_bad_key_separation_settings_are_refused_by_name(setting, message):
    with pytest.raises(ValueError, match=message.replace("--", r"\-\-")):
        TrainConfig.from_flat(**setting).validate()
