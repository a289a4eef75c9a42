"""Export a pipeline folder to ONNX for the live page (docs/guides/live.md): the text encoder, the U-Net with
its cross-attention probabilities as extra outputs, and the configs the page reads.

What `export_onnx(folder, out)` writes into `out`:
- text_encoder.onnx: input_ids (B, T) int64 -> last_hidden_state (B, T, D);
- unet.onnx: sample (B, C, H, W) float32, timestep (B,) float32, encoder_hidden_states (B, T, D) ->
  prediction (B, C, H, W) (noise, v or x0, as the scheduler's prediction_type says) and, per cross-attention
  layer k, attention_k (B, heads, h*w, T): the softmax over the prompt's tokens, heads kept apart, exactly
  the weights an `AttentionStore` records;
- scheduler_config.json: the sampling scheduler's config as `load_pipeline` builds it (DDIM with its
  overrides), so the page steps with the values Python samples with;
- tokenizer/tokenizer.json + tokenizer_config.json: the tokenizer, for tokenizers.js;
- live.json: what else the page needs (layers and their shapes, token ids, the model's guidance settings,
  the trained words for scenes-32's unknown-word warning, the world's words for scenes-64's warnings).

Batch is dynamic (1 image, or 2 for guidance's [uncond, cond]); the token axis is fixed at the tokenizer's
model_max_length, since prompts are always padded to it (as `ScenePipeline.encode_prompt` does).
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from torch import nn

from crossattn.attention import CrossAttention
from crossattn.capture import layer_hw
from crossattn.errors import UsageError

from .pipeline import ScenePipeline, load_pipeline, model_folder, model_label
from .world import COUNTS_ABOVE, MAX_OBJECTS, NUMBER_WORDS, NUMERALS, WORLD_KNOWS, known_words

OPSET = 17  # onnxruntime-web 1.31 runs it; the legacy exporter's best-tested opset
FORMAT = 1  # live.json's layout; the page refuses another


def cross_attention_layers(unet: nn.Module) -> list[tuple[str, CrossAttention]]:
    """(name, module) of every cross-attention layer of our U-Net, in forward order (= module order)."""
    return [(name, m) for name, m in unet.named_modules() if isinstance(m, CrossAttention) and m.is_cross_attention]


class UNetWithAttention(nn.Module):
    """Our U-Net, returning its prediction and every cross-attention layer's softmax (B, heads, N, T).

    The weights come from the layers' `observer` hook (the one `AttentionStore` uses), set only during a
    forward: the explicit softmax path runs, as it does while a store records, so the exported graph holds
    the same maths the Python maps are made from."""

    def __init__(self, unet: nn.Module):
        super().__init__()
        self.unet = unet
        self.layers = cross_attention_layers(unet)
        if not self.layers:
            raise ValueError(f"{type(unet).__name__} has no cross-attention layers to export")

    def forward(self, sample, timestep, encoder_hidden_states):
        seen: dict[str, torch.Tensor] = {}
        for name, module in self.layers:
            module.observer = lambda _module, weights, name=name: seen.__setitem__(name, weights)
        try:
            prediction = self.unet(sample, timestep, encoder_hidden_states)
        finally:
            for _, module in self.layers:
                module.observer = None
        return (prediction, *[seen[name] for name, _ in self.layers])


class TextEncoderHidden(nn.Module):
    """The text encoder's last_hidden_state alone: (B, T) ids -> (B, T, D), what the U-Net reads."""

    def __init__(self, text_encoder: nn.Module):
        super().__init__()
        self.text_encoder = text_encoder

    def forward(self, input_ids):
        return self.text_encoder(input_ids).last_hidden_state


def check_exportable(pipe, folder: Path) -> None:
    """UsageError (one line) unless `pipe` is one of our ScenePipelines with our U-Net and a DDIM scheduler."""
    from .model import UNet
    if not isinstance(pipe, ScenePipeline) or not isinstance(pipe.unet, UNet):
        raise UsageError(f"{folder} is not one of this project's pipelines (ScenePipeline with unet.model.UNet); "
                         "only those export to the live page")
    config = pipe.scheduler.config
    if config.get("thresholding"):
        raise UsageError(f"{folder}'s scheduler uses dynamic thresholding, which the page's DDIM does not do")


def compact_names(path: Path) -> None:
    """Drop node names and give intermediate values short names ("v12"): the exporter's names spell the module path
    of every op (~165 bytes a node), about 0.3 MB the browser would download for nothing. Graph inputs, outputs
    and weights keep their names."""
    import onnx
    model = onnx.load(str(path))
    graph = model.graph
    keep = {v.name for v in graph.input} | {v.name for v in graph.output} | {i.name for i in graph.initializer}
    short: dict[str, str] = {}
    for node in graph.node:
        node.name = ""
        for names in (node.input, node.output):
            for k, name in enumerate(names):
                if name and name not in keep:
                    names[k] = short.setdefault(name, f"v{len(short)}")
    del graph.value_info[:]  # shape annotations under the old names; onnxruntime infers them again
    onnx.save(model, str(path))


def _export(module: nn.Module, args: tuple, path: Path, inputs: list[str], outputs: list[str],
            dynamic: dict[str, dict[int, str]]) -> None:
    with warnings.catch_warnings():  # tracer warnings about Python-side shape checks, which hold for these shapes
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), input_names=inputs, output_names=outputs,
                          dynamic_axes=dynamic, opset_version=OPSET, dynamo=False, do_constant_folding=True)
    compact_names(path)


def load_exportable(model: str | Path | None):
    """The pipeline in folder `model` (None: the shipped one), loaded; UsageError (one line) for a folder that is
    not a pipeline or not one of ours."""
    folder = model_folder(model)
    pipe = load_pipeline(folder, show_progress=False)
    check_exportable(pipe, folder)
    return pipe


def warning_words(pipe) -> dict:
    """What the page's prompt warnings read (web/warnings.js), as the CLI's (`world_warnings`): a scenes-64 model
    warns as unet/world.py `prompt_warnings` does, from the world's words; any other from its trained words."""
    world_words = None
    if pipe.world == "scenes-64":
        world_words = {"known": known_words(), "counts_above": list(COUNTS_ABOVE), "numerals": NUMERALS,
                       "max_objects": MAX_OBJECTS, "max_count_word": NUMBER_WORDS[MAX_OBJECTS], "knows": WORLD_KNOWS}
    return {"trained_words": sorted(pipe.trained_words) if pipe.trained_words is not None else None,
            "world": pipe.world, "world_words": world_words}


def export_onnx(model: str | Path | None, out: Path, pipe=None) -> dict:
    """Export pipeline folder `model` (None: the shipped one) into folder `out` (created; files in it replaced).
    `pipe`: that folder already loaded by `load_exportable`. Returns live.json's contents. UsageError (one line)
    for a folder that is not one of our pipelines."""
    pipe = pipe if pipe is not None else load_exportable(model)
    out = Path(out)
    (out / "tokenizer").mkdir(parents=True, exist_ok=True)
    unet, text_encoder, tokenizer = pipe.unet.eval(), pipe.text_encoder.eval(), pipe.tokenizer
    T = tokenizer.model_max_length
    size, channels = unet.config.sample_size, unet.config.in_channels

    ids = tokenizer(["a"], padding="max_length", max_length=T, return_tensors="pt").input_ids  # (1, T)
    with torch.no_grad():
        _export(TextEncoderHidden(text_encoder), (ids,), out / "text_encoder.onnx", ["input_ids"],
                ["last_hidden_state"], {"input_ids": {0: "batch"}, "last_hidden_state": {0: "batch"}})
        context = text_encoder(ids).last_hidden_state  # (1, T, D)
        wrapped = UNetWithAttention(unet)
        sample, timestep = torch.zeros(1, channels, size, size), torch.tensor([500.0])
        probs = wrapped(sample, timestep, context)[1:]  # each (1, heads, N, T)
        attention = [f"attention_{k}" for k in range(len(wrapped.layers))]
        dynamic = {name: {0: "batch"} for name in ["sample", "timestep", "encoder_hidden_states", "prediction",
                                                   *attention]}
        _export(wrapped, (sample, timestep, context), out / "unet.onnx",
                ["sample", "timestep", "encoder_hidden_states"], ["prediction", *attention], dynamic)

    scheduler = {"_class_name": type(pipe.scheduler).__name__, **dict(pipe.scheduler.config)}
    (out / "scheduler_config.json").write_text(json.dumps(scheduler, indent=2) + "\n")
    tokenizer.save_pretrained(out / "tokenizer")  # tokenizer.json + tokenizer_config.json
    for extra in ("vocab.json", "merges.txt", "special_tokens_map.json", "chat_template.jinja"):
        (out / "tokenizer" / extra).unlink(missing_ok=True)  # the page reads tokenizer.json alone: no dead weight

    layers = []
    for (name, module), output, p in zip(wrapped.layers, attention, probs):
        h, w = layer_hw(p.shape[2], (size, size))
        layers.append({"name": name, "output": output, "h": h, "w": w, "heads": module.heads})
    live = {
        "format": FORMAT,
        "model": model_label(model),
        "sample_size": size, "channels": channels, "context_dim": int(context.shape[-1]),
        "max_length": T, "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        # how this model is sampled by default (model_index.json), as ScenePipeline.__call__ reads it
        "guidance_scale": float(pipe.config.guidance_scale),
        "guidance_min_t": pipe.config.get("guidance_min_t", 0), "guidance_max_t": pipe.config.get("guidance_max_t"),
        "guidance_rescale": float(pipe.config.get("guidance_rescale", 0.0)),
        **warning_words(pipe),
        "layers": layers,
    }
    (out / "live.json").write_text(json.dumps(live, indent=2) + "\n")
    return live
