"""Steering flags and the Python API: bad values fail at the door with one line (CLI, exit 2) or a
ValueError naming the argument (API), and repeated flags merge instead of keeping only the last."""

import json

import pytest
import torch

from crossattn import CrossAttention, attention
from crossattn.control import Controller, Edit, Recording, Reweight, align_prompts, parse_weights


def generate(tiny_pipeline_dir, out, *args):
    from unet.cli.generate import main
    return main([*args, "--model", str(tiny_pipeline_dir), "--out", str(out), "--steps", "3", "--quiet"])


def one_line_error(capsys, rc, message):
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], err


@pytest.mark.parametrize("args, message", [
    (["--reweight", "red=1e30"], "a re-weighting factor must be a finite number from -1000 to 1000, got 1e+30"),
    (["--reweight", "red=1e300"], "from -1000 to 1000, got 1e+300"),
    (["--reweight", "red=2", "--reweight", "red=3"], "gives 'red' two factors (2 and 3)"),
    (["--reweight", "red=2", "--reweight-steps", "0.3", "0.3"], "--reweight-steps 0.3 0.3 is empty"),
    (["--reweight", "red=2", "--reweight-steps", "0.6", "0.2"], "--reweight-steps 0.6 0.2 is reversed"),
    (["--reweight-steps", "0.2", "0.6"], "--reweight-steps needs --reweight, which is not given"),
    (["--excite", "--cross-replace-steps", "0.5"], "--cross-replace-steps needs --edit, which is not given"),
    (["--self-replace-steps", "0.5"], "--self-replace-steps needs --edit"),
])
def test_bad_control_flags_fail_before_any_work(tiny_pipeline_dir, tmp_path, capsys, monkeypatch, args, message):
    from unet.pipeline import ScenePipeline

    def never(*a, **k):
        raise AssertionError("sampled before checking the input")

    monkeypatch.setattr(ScenePipeline, "__call__", never)
    out = tmp_path / "out"
    one_line_error(capsys, generate(tiny_pipeline_dir, out, "a red circle", *args), message)
    assert not out.exists()


def test_repeated_control_flags_merge(tiny_pipeline_dir, tmp_path):
    out = tmp_path / "out"
    assert generate(tiny_pipeline_dir, out, "a red circle left of a blue square", "--reweight", "red=2",
                    "--reweight", "circle=3", "red=2", "--excite", "circle", "--excite", "square") == 0
    (folder,) = out.iterdir()
    control = json.loads((folder / "meta.json").read_text())["control"]
    assert control["reweight"] == {"red": 2.0, "circle": 3.0}
    assert control["excite"] == ["circle", "square"]


def test_merge_words_with_no_words_names_the_argument():
    from crossattn.maps import merge_words
    with pytest.raises(ValueError, match="words is empty"):
        merge_words(torch.rand(4, 2, 2), [])


def test_parse_weights_range_and_merging():
    assert parse_weights(["red=2", "blue=-1000", "red=2"]) == {"red": 2.0, "blue": -1000.0}
    with pytest.raises(ValueError, match="from -1000 to 1000, got 1e\\+300"):
        parse_weights(["red=1e300"])  # a Python float, but not a float32
    with pytest.raises(ValueError, match="two factors"):
        parse_weights(["red=2", "red=3"])


# --- Python API: ValueError naming the argument
@pytest.mark.parametrize("kwargs, message", [
    (dict(query_dim=16, heads=0), "heads must be a positive integer, got 0"),
    (dict(query_dim=-4), "query_dim must be a positive integer, got -4"),
    (dict(query_dim=0), "query_dim must be a positive integer, got 0"),
    (dict(query_dim=16, context_dim=0), "context_dim must be a positive integer or None"),
    (dict(query_dim=16, head_dim=0), "head_dim must be a positive integer"),
])
def test_cross_attention_refuses_bad_sizes(kwargs, message):
    with pytest.raises(ValueError, match=message):
        CrossAttention(**kwargs)


def test_cross_attention_refuses_empty_inputs():
    block = CrossAttention(16, 8, heads=2, head_dim=4)
    with pytest.raises(ValueError, match="context has 0 keys"):
        block(torch.randn(2, 5, 16), torch.randn(2, 0, 8))
    with pytest.raises(ValueError, match="x holds a batch of 0"):
        block(torch.randn(0, 5, 16), torch.randn(0, 4, 8))


def test_attention_heads_must_divide_the_width():
    block = CrossAttention(16, 8, heads=2, head_dim=4)  # projections 8 wide
    with pytest.raises(ValueError, match="heads=3 does not divide the projection width 8"):
        attention(torch.randn(1, 5, 16), torch.randn(1, 4, 8), block.to_q, block.to_k, block.to_v, heads=3)


def test_unet_takes_a_python_float_timestep_by_keyword(tiny_pipeline):
    unet = tiny_pipeline.unet
    x = torch.randn(1, 3, 16, 16)
    context = torch.randn(1, tiny_pipeline.tokenizer.model_max_length, unet.config.context_dim)
    with torch.no_grad():
        as_float = unet(sample=x, timestep=500.0, encoder_hidden_states=context)
        as_tensor = unet(x, torch.tensor([500]), context)
    assert torch.equal(as_float, as_tensor)
    with pytest.raises(ValueError, match="timestep must be"):
        unet(x, torch.zeros(3), context)  # 3 timesteps for 1 image


def test_reweight_refuses_reversed_steps_and_tokens_beyond_the_keys(tiny_pipeline):
    with pytest.raises(ValueError, match="steps \\(0.6, 0.2\\) is a reversed window"):
        Reweight({1: 2.0}, steps=(0.6, 0.2))
    with pytest.raises(ValueError, match="finite number from -1000 to 1000"):
        Reweight({1: 1e30})
    keys = tiny_pipeline.tokenizer.model_max_length
    controller = Controller.for_pipeline(tiny_pipeline, reweight=Reweight({keys + 3: 2.0}))
    with controller.attach(tiny_pipeline.unet), pytest.raises(ValueError, match=f"beyond layer .* {keys} keys"):
        tiny_pipeline("a red circle", num_inference_steps=2, controller=controller, show_progress=False)


def test_edit_refuses_an_empty_recording(tiny_pipeline):
    alignment = align_prompts(tiny_pipeline.tokenizer, "a red circle", "a red square")
    with pytest.raises(ValueError, match="recording: the Recording is empty"):
        Edit(Recording(), alignment)
