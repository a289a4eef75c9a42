"""The ONNX export (unet/onnx_export.py, scripts/export_onnx.py) against PyTorch, run with onnxruntime: the text
encoder's hidden states, the U-Net's prediction and its cross-attention probabilities agree to 1e-4, on a tiny
pipeline and on the shipped one; the probabilities are the weights an AttentionStore records."""

import json

import numpy as np
import pytest
import torch

from crossattn.capture import AttentionStore
from unet.cli.export_onnx import main as export_main
from unet.onnx_export import cross_attention_layers, export_onnx
from unet.pipeline import PRETRAINED, load_pipeline

ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (pip install -e '.[dev]')")

TOLERANCE = 1e-4
PROMPTS = ["a red circle left of a blue square", ""]


@pytest.fixture(scope="module", params=["tiny", "shipped"])
def exported(request, tmp_path_factory):
    """(pipeline, export folder, live.json) for the tiny pipeline and the shipped model."""
    folder = request.getfixturevalue("tiny_pipeline_dir") if request.param == "tiny" else PRETRAINED
    out = tmp_path_factory.mktemp(f"onnx_{request.param}")
    live = export_onnx(folder, out)
    return load_pipeline(folder, show_progress=False), out, live


def session(path):
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # the machine's cores are shared
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def test_text_encoder_matches_pytorch(exported):
    pipe, out, live = exported
    ids = pipe.tokenizer(PROMPTS, padding="max_length", max_length=live["max_length"], return_tensors="pt").input_ids
    with torch.no_grad():
        expected = pipe.text_encoder(ids).last_hidden_state.numpy()  # (2, T, D)
    (got,) = session(out / "text_encoder.onnx").run(None, {"input_ids": ids.numpy()})
    assert got.shape == expected.shape == (2, live["max_length"], live["context_dim"])
    assert np.abs(got - expected).max() <= TOLERANCE


@pytest.mark.parametrize("batch, timestep", [(1, 999), (2, 500), (1, 0)])
def test_unet_prediction_and_attention_match_pytorch_and_the_store(exported, batch, timestep):
    pipe, out, live = exported
    size, channels = live["sample_size"], live["channels"]
    ids = pipe.tokenizer(PROMPTS[:batch], padding="max_length", max_length=live["max_length"],
                         return_tensors="pt").input_ids
    sample = torch.randn(batch, channels, size, size, generator=torch.Generator().manual_seed(timestep))
    store = AttentionStore.for_pipeline(pipe)
    with torch.no_grad(), store.attach(pipe.unet):
        context = pipe.text_encoder(ids).last_hidden_state  # (B, T, D)
        expected = pipe.unet(sample, torch.tensor(timestep), encoder_hidden_states=context)  # (B, C, H, W)
    outputs = session(out / "unet.onnx").run(None, {
        "sample": sample.numpy(), "timestep": np.full(batch, timestep, np.float32),
        "encoder_hidden_states": context.numpy()})
    assert outputs[0].shape == tuple(expected.shape)
    assert np.abs(outputs[0] - expected.numpy()).max() <= TOLERANCE
    names = [name for name, _ in cross_attention_layers(pipe.unet)]
    assert [layer["name"] for layer in live["layers"]] == names == [n for n in store.layers if store.is_cross[n]]
    assert len(outputs) == 1 + len(names)
    for layer, probs in zip(live["layers"], outputs[1:]):
        # the store recorded one pass: its sum is that pass's softmax, (B, heads, h*w, T)
        (recorded,) = [s / store.counts[key] for key, s in store.sums.items() if key[0] == layer["name"]]
        assert probs.shape == tuple(recorded.shape) == (batch, layer["heads"], layer["h"] * layer["w"],
                                                        live["max_length"])
        assert tuple(store.layer_shapes[layer["name"]]) == (layer["h"], layer["w"])
        assert np.abs(probs - recorded.numpy()).max() <= TOLERANCE
        np.testing.assert_allclose(probs.sum(axis=-1), 1, atol=1e-5)  # a softmax over the tokens


def test_export_writes_what_the_page_reads(exported):
    pipe, out, live = exported
    assert json.loads((out / "live.json").read_text()) == live
    scheduler = json.loads((out / "scheduler_config.json").read_text())
    # the sampling scheduler load_pipeline builds (DDIM, trailing spacing), not the folder's training config
    assert scheduler["_class_name"] == "DDIMScheduler" == type(pipe.scheduler).__name__
    assert {k: scheduler[k] for k in pipe.scheduler.config} == dict(pipe.scheduler.config)
    assert sorted(p.name for p in (out / "tokenizer").iterdir()) == ["tokenizer.json", "tokenizer_config.json"]
    assert live["max_length"] == pipe.tokenizer.model_max_length
    assert live["guidance_scale"] == pipe.config.guidance_scale
    assert live["trained_words"] == (sorted(pipe.trained_words) if pipe.trained_words is not None else None)


def test_export_command_refuses_bad_folders_in_one_line(tmp_path, capsys):
    not_a_pipeline = tmp_path / "plain"
    not_a_pipeline.mkdir()
    assert export_main(["--model", str(not_a_pipeline), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "is not a pipeline folder" in err and not (tmp_path / "out").exists()
    taken = tmp_path / "taken"
    taken.mkdir()
    assert export_main(["--out", str(taken)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "exists; pass --overwrite" in err and not any(taken.iterdir())
