
import pytest
import torch
from PIL import Image

from crossattn import explain
from crossattn.capture import AttentionStore
from crossattn.walkthrough import describe, walk
from unet.cli import attention_walkthrough
from unet.cli import explain as explain_script


def test_four_steps_numbers():
    w = walk(tokens=32, dim=16, seed=0)
    assert w.q.shape == w.k.shape == w.v.shape == (32, 4)
    assert torch.allclose(w.weights.sum(-1), torch.ones(32), atol=1e-6)
    assert torch.allclose(w.context, w.block_context, atol=1e-6)
    assert torch.allclose(w.block_output, w.projected, atol=1e-5)  # the block's output is built from them
    lines = describe(w, 0)
    assert any(line.startswith("largest: token") for line in lines)
    assert "same as crossattn.CrossAttention's attention: True" in lines
    assert lines[-1].endswith("True")
    assert walk(seed=0).weights.equal(w.weights)  # seeded: reproducible


def test_walkthrough_script_prints_and_saves_figure(tmp_path, capsys):
    assert attention_walkthrough.main(["--out", str(tmp_path), "--tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "context vector of token 0: [" in out and "row 0 sums to 1.000000" in out
    assert "same as crossattn.CrossAttention's attention: True" in out
    assert "CrossAttention's output = its output layer applied to these context vectors: True" in out
    image = Image.open(tmp_path / "four_steps.png")
    assert image.size == (1000, 600)
    assert attention_walkthrough.main(["--tokens", "1"]) == 2


def test_text_attention_is_causal_and_rows_sum_to_one(tiny_pipeline):
    tokens, weights = explain.text_attention(tiny_pipeline.tokenizer, tiny_pipeline.text_encoder, "a red circle")
    assert tokens[0] == "<|startoftext|>" and tokens[1:4] == ["a", "red", "circle"]
    assert torch.allclose(weights.sum(-1), torch.ones(weights.shape[:-1]), atol=1e-5)
    assert torch.all(weights.triu(diagonal=1) == 0)  # nobody looks forward
    row = explain.look_back(tiny_pipeline.tokenizer, weights, "a red circle", "red")
    assert row.shape == (weights.shape[0], len(tokens)) and torch.all(row[:, 3:] == 0)
    with pytest.raises(ValueError, match="its words are"):
        explain.look_back(tiny_pipeline.tokenizer, weights, "a red circle", "blue")


def test_pixel_self_attention_sums_to_one(tiny_pipeline):
    store = AttentionStore(self_attention=True)
    with store.attach(tiny_pipeline.unet):
        tiny_pipeline("a red circle", num_inference_steps=2, show_progress=False)
    maps = explain.pixel_maps(store, (3, 5), (16, 16))
    assert maps
    for name, heat in maps.items():
        h, w = store.layer_shapes[name]
        assert heat.shape == (16, 16) and heat.min() >= 0
        assert heat.sum().item() == pytest.approx((16 * 16) / (h * w), rel=0.05)  # a distribution, upsampled
    with pytest.raises(ValueError, match="outside"):
        explain.pixel_maps(store, (16, 0), (16, 16))


@pytest.mark.parametrize("what, files", [
    ("text", ["text_attention.png", "positions.png"]),
    ("heads", ["heads_layers.png"]),
    ("pixel", ["pixel_self_attention.png"]),
])
def test_explain_script_figures(tiny_pipeline_dir, tmp_path, what, files):
    rc = explain_script.main([what, "a red circle left of a blue square", "--model", str(tiny_pipeline_dir),
                              "--out", str(tmp_path)])
    assert rc == 0
    for name in files:
        image = Image.open(tmp_path / name)
        image.verify()
        assert image.width > 200 and image.height > 200


def test_explain_script_bad_word(tiny_pipeline_dir, tmp_path, capsys):
    rc = explain_script.main(["heads", "a red circle", "--word", "blue", "--model", str(tiny_pipeline_dir),
                              "--out", str(tmp_path)])
    assert rc == 2 and "its words are" in capsys.readouterr().err
