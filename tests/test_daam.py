"""DAAM 0.2.0's recipe reproduced from our store, checked against real DAAM output.

`tests/data/daam/` holds part of `../shared/daam-reference/` (DAAM 0.2.0 run on a tiny random SD
pipeline; see that folder's README): DAAM's raw per-(layer, head) sums, its global heat map and two
word maps, so CI checks the aggregation. The full check, our capture on that very pipeline, needs
the pipeline's 6 MB of weights and runs only where `../shared/daam-reference/` exists.
"""

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from crossattn.capture import AttentionStore
from crossattn.maps import (
    daam_aggregate,
    daam_expand,
    daam_grid,
    daam_heat_maps,
    daam_layers,
    daam_summed_maps,
    daam_word_maps,
)
from crossattn.metrics import iou, region, score_maps
from crossattn.text import Word, prompt_words

DATA = Path(__file__).parent / "data" / "daam"
REFERENCE = Path(__file__).resolve().parents[1].parent / "shared" / "daam-reference"
RUN = REFERENCE / "a_red_circle_left_of_a_blue_square"
PROMPT = "a red circle left of a blue square"
TOKENS = 8  # every word of PROMPT is one token in the reference vocabulary
GRID = (64, 64)  # DAAM's grid for that pipeline: sample_size 64 x vae_scale_factor 8 = 512


def reference_words() -> list[Word]:
    return [Word(i, text, [i + 1]) for i, text in enumerate(PROMPT.split())]


def test_aggregation_reproduces_daams_global_and_word_maps_from_its_raw_sums():
    raw = torch.from_numpy(np.load(DATA / "raw_summed_maps.npy"))  # (40 = 5 layers x 8 heads, T, 32, 32)
    settings = json.loads((DATA / "settings.json").read_text())
    assert settings["versions"]["daam"] == "0.2.0" and raw.shape[1] == TOKENS + 2
    heat = daam_aggregate([m[None] for m in raw], GRID, tokens=TOKENS)[0]  # (T, 64, 64)
    expected = np.load(DATA / "global_heat_map.npy")
    assert heat.shape == expected.shape
    assert np.abs(heat.numpy() - expected).max() <= 1e-4
    words = daam_word_maps(heat, reference_words())
    assert np.abs(words[1].numpy() - np.load(DATA / "word" / "red.npy")).max() <= 1e-4
    assert np.abs(words[0].numpy() - np.load(DATA / "word" / "a.npy")).max() <= 1e-4  # mean of both "a"s
    assert np.abs(words[0].numpy() - heat[1].numpy()).max() > 1e-3  # ... which is not the first "a" alone


def test_factor_rule_and_clamp():
    raw = torch.from_numpy(np.load(DATA / "raw_summed_maps.npy"))[:8, None]  # (8, 1, T, 32, 32)
    kept = daam_aggregate(list(raw), GRID)
    eight = torch.rand(1, raw.shape[2], 8, 8) * 100  # factor int(sqrt(4096 // 64)) = 8: DAAM skips it
    assert torch.equal(daam_aggregate([*raw, eight], GRID), kept)
    sixteen = torch.rand(1, raw.shape[2], 16, 16) * 100  # factor 4: kept
    assert not torch.allclose(daam_aggregate([*raw, sixteen], GRID), kept)
    spiky = torch.zeros(1, 1, 8, 8)
    spiky[..., 4, 4] = 1.0  # bicubic undershoots next to a spike; DAAM clamps each map at 0
    assert (daam_aggregate([spiky], (32, 32)) >= 0).all()
    with pytest.raises(ValueError, match="no map for DAAM"):
        daam_aggregate([eight], GRID)
    with pytest.raises(ValueError, match="tokens="):
        daam_aggregate(list(raw), GRID, normalize=True)


def test_layers_are_up_then_down_without_the_middle():
    store = AttentionStore()
    for name in ["down.1.attn.0.blocks.0.attn2", "down.2.attn.0.blocks.0.attn2", "mid_attn.blocks.0.attn2",
                 "up.0.attn.0.blocks.0.attn2", "up.0.attn.0.blocks.0.attn1", "mid_block.attentions.0.attn2"]:
        store.layer_shapes[name], store.is_cross[name] = (8, 8), name.endswith("attn2")
    assert daam_layers(store) == ["up.0.attn.0.blocks.0.attn2", "down.1.attn.0.blocks.0.attn2",
                                  "down.2.attn.0.blocks.0.attn2"]


def test_grid_rule():
    def pipe(sample_size, scale, vae=True):
        return SimpleNamespace(unet=SimpleNamespace(config=SimpleNamespace(sample_size=sample_size)),
                               vae=object() if vae else None, vae_scale_factor=scale)
    assert daam_grid(pipe(64, 8)) == (64, 64)  # SD 1.x, SD 2 base
    assert daam_grid(pipe(96, 8)) == (96, 96)  # SD 2 768-v
    assert daam_grid(pipe(128, 8)) == (64, 64)  # SDXL: half its 128x128 latents, as DAAM does
    assert daam_grid(pipe(64, 8), 512, 768) == (64, 96)  # non-square: the same grid, the image's aspect
    assert daam_grid(pipe(128, 8), 1024, 1536) == (64, 96)
    assert daam_grid(pipe(32, 1, vae=False)) == (32, 32)  # pixel space (ours): the image
    assert daam_grid(pipe(32, 1, vae=False), 16, 24) == (16, 24)


def test_word_maps_and_expand():
    heat = torch.rand(6, 8, 8)
    words = [Word(0, "a", [1]), Word(1, "Red", [2, 3]), Word(2, "a", [4]), Word(3, "cut", [])]
    merged = daam_word_maps(heat, words[:3])
    assert torch.allclose(merged[1], heat[[2, 3]].mean(0))  # sub-words: the mean, not the sum
    assert torch.allclose(merged[0], merged[2]) and torch.allclose(merged[0], heat[[1, 4]].mean(0))
    apart = daam_word_maps(heat, words[:3], merge_repeats=False)
    assert torch.allclose(apart[2], heat[4])
    with pytest.raises(ValueError, match="cut"):
        daam_word_maps(heat, words)
    big = daam_expand(merged, (16, 24))
    assert big.shape == (3, 16, 24)
    assert torch.allclose(big.amin(dim=(1, 2)), torch.zeros(3)) and torch.allclose(big.amax(dim=(1, 2)), torch.ones(3))
    absolute = daam_expand(merged[0], (8, 8), absolute=True)  # same size: bicubic changes nothing
    assert torch.allclose(absolute, merged[0], atol=1e-6)


@pytest.mark.skipif(not (REFERENCE / "pipe" / "model_index.json").exists(),
                    reason=f"the DAAM reference pipeline is not on this machine ({REFERENCE}); CI checks the "
                           "aggregation from tests/data/daam only")
def test_our_capture_on_the_reference_pipeline_gives_daams_maps():
    from diffusers import StableDiffusionPipeline
    settings = json.loads((RUN / "settings.json").read_text())
    pipe = StableDiffusionPipeline.from_pretrained(REFERENCE / "pipe", local_files_only=True, safety_checker=None,
                                                   requires_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    store = AttentionStore.for_pipeline(pipe)
    with store.attach(pipe.unet):  # nobody tells the store about guidance: it must keep the prompt half itself
        pipe(PROMPT, height=settings["height"], width=settings["width"], guidance_scale=settings["guidance_scale"],
             num_inference_steps=settings["num_inference_steps"], generator=torch.Generator("cpu").manual_seed(0))
    assert store.guided and store.batch_size == 1
    assert daam_layers(store) == [settings["hooked_modules"][k] for k in settings["hooked_modules"]]
    raw = torch.cat(daam_summed_maps(store))[:, :TOKENS + 2]
    assert np.abs(raw.numpy() - np.load(RUN / "raw_summed_maps.npy")).max() <= 1e-4
    grid = daam_grid(pipe, settings["height"], settings["width"])
    assert grid == GRID
    heat = daam_heat_maps(store, grid, tokens=TOKENS)[0]
    assert np.abs(heat.numpy() - np.load(RUN / "global_heat_map.npy")).max() <= 1e-4
    normalized = daam_heat_maps(store, grid, tokens=TOKENS, normalize=True)[0]
    assert np.abs(normalized.numpy() - np.load(RUN / "global_heat_map_normalized.npy")).max() <= 1e-4
    words = prompt_words(pipe.tokenizer, PROMPT)
    assert [w.tokens for w in words] == [w.tokens for w in reference_words()]
    for word, got in zip(words, daam_word_maps(heat, words)):
        assert np.abs(got.numpy() - np.load(RUN / "word" / f"{word.text}.npy")).max() <= 1e-4, word.text
    for word, got in zip(words, daam_word_maps(heat, words, merge_repeats=False)):
        expected = np.load(RUN / "token_idx" / f"{word.index:02d}_{word.text}.npy")
        assert np.abs(got.numpy() - expected).max() <= 1e-4, word.text


def test_daams_threshold_rule_rescales_by_the_range():
    mask = torch.zeros(8, 8, dtype=torch.bool)
    mask[2:5, 2:5] = True
    heat = torch.full((8, 8), 0.8)
    heat[mask] = 1.0  # a high floor: 0.5 of the peak keeps everything, 0.5 of the range only the object
    assert iou(heat, mask, 0.5, "minmax") == 1.0
    assert iou(heat, mask, 0.5, "peak") == pytest.approx(9 / 64)
    assert score_maps([(heat, mask)], 0.5, "minmax")["sweep"]["0.8"] == 1.0
    with pytest.raises(ValueError, match="minmax"):
        region(heat, 0.5, "range")


def test_evaluation_daam_baseline_is_daams_recipe(tiny_pipeline):
    from unet.eval.map_scoring import THRESHOLD_RULE, Batch, map_scores, method_maps
    store = AttentionStore.for_pipeline(tiny_pipeline)
    with store.attach(tiny_pipeline.unet):
        tiny_pipeline(["a red circle", "a blue square"], num_inference_steps=2, output_type="np",
                      generator=torch.Generator().manual_seed(0), show_progress=False)
    size = (tiny_pipeline.unet.config.sample_size,) * 2
    maps = method_maps("daam", store, size)
    assert maps.shape == (2, store.keys(daam_layers(store)[0]), *size)
    assert torch.allclose(maps, daam_heat_maps(store, daam_grid(tiny_pipeline)))
    middle = [n for n in store.layers if store.is_cross[n] and n.startswith("mid")]
    assert middle and not set(middle) & set(daam_layers(store))
    for key in [k for k in store.sums if k[0] in middle]:
        store.sums[key] = torch.rand_like(store.sums[key])  # DAAM never reads the middle block
    assert torch.equal(method_maps("daam", store, size), maps)
    mask = np.zeros(size, bool)
    mask[: size[0] // 2] = True
    batch = Batch(store, [(0, "circle", [3], mask), (1, "square", [3], mask)])
    scores = map_scores([batch], size, {"daam": (None, 0.4)})["daam"]
    assert THRESHOLD_RULE["daam"] == scores["threshold_rule"] == "minmax"
    expected = np.mean([iou(maps[b, 3], torch.as_tensor(mask), 0.4, "minmax") for b in range(2)])
    assert scores["shape_words"]["miou"] == pytest.approx(expected)
