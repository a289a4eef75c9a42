"""Our capture on diffusers' own pipelines: Stable Diffusion 1.x (epsilon), an SD-2-style one
(v-prediction, linear projections) and SDXL (two text encoders), with tiny random components built
here (no download), square and 512x768. The VAEs have SD's four levels, so 512x768 images have
64x96 latents, and a U-Net with attention only at half the latent size keeps every run fast.
"""

import json

import numpy as np
import pytest
import torch
from diffusers import (
    AutoencoderKL,
    DDIMScheduler,
    EulerDiscreteScheduler,
    StableDiffusionPipeline,
    StableDiffusionXLPipeline,
    UNet2DConditionModel,
)
from safetensors.torch import load_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection, CLIPTokenizer

from crossattn.capture import AttentionStore, guided_batch
from crossattn.maps import word_maps
from crossattn.text import build_vocabulary, prompt_words
from unet.cli.generate import main as generate_main

PROMPT = "a red cat on the mat"
KINDS = ("sd", "sd2-v", "sdxl")
SQUARE, PORTRAIT = (64, 64), (512, 768)
STEPS = 2


def tiny_tokenizer(words=("a", "red", "cat", "on", "the", "mat"), pad: str | None = None) -> CLIPTokenizer:
    vocab, merges = build_vocabulary(list(words))
    return CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=12, **({"pad_token": pad} if pad else {}))


def tiny_text_encoder(tokenizer, cls=CLIPTextModel, **extra):
    return cls(CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                              num_attention_heads=2, max_position_embeddings=12, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **extra))


def tiny_vae() -> AutoencoderKL:
    return AutoencoderKL(block_out_channels=(4, 4, 4, 4), in_channels=3, out_channels=3, latent_channels=4,
                         down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                         norm_num_groups=2, layers_per_block=1, sample_size=64)  # vae_scale_factor 8, as SD's


def tiny_unet(**extra) -> UNet2DConditionModel:
    return UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=4, **{"cross_attention_dim": 16, "attention_head_dim": 4, **extra})


def tiny_pipeline(kind: str, tokenizer_2=None):
    """'sd': SD 1.x-style, epsilon; 'sd2-v': SD 2-style, v-prediction; 'sdxl': two text encoders."""
    torch.manual_seed(0)
    betas = dict(beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012, steps_offset=1)
    if kind == "sdxl":
        tokenizer, tokenizer_2 = tiny_tokenizer(), tokenizer_2 or tiny_tokenizer(pad="!")  # SDXL pads with "!"
        unet = tiny_unet(attention_head_dim=(2, 4), use_linear_projection=True, transformer_layers_per_block=(1, 2),
                         cross_attention_dim=32,  # both encoders' hidden states side by side: 16 + 16
                         addition_embed_type="text_time", addition_time_embed_dim=8,
                         projection_class_embeddings_input_dim=6 * 8 + 16)  # 6 size/crop numbers + pooled text
        return StableDiffusionXLPipeline(
            vae=tiny_vae(), unet=unet, scheduler=EulerDiscreteScheduler(timestep_spacing="leading", **betas),
            text_encoder=tiny_text_encoder(tokenizer), tokenizer=tokenizer, tokenizer_2=tokenizer_2,
            text_encoder_2=tiny_text_encoder(tokenizer_2, CLIPTextModelWithProjection, projection_dim=16))
    v = kind == "sd2-v"
    tokenizer = tiny_tokenizer()
    unet = tiny_unet(attention_head_dim=(2, 4), use_linear_projection=True) if v else tiny_unet()
    scheduler = DDIMScheduler(clip_sample=False, set_alpha_to_one=False,
                              prediction_type="v_prediction" if v else "epsilon", **betas)
    text = tiny_text_encoder(tokenizer, hidden_act="gelu" if v else "quick_gelu")
    return StableDiffusionPipeline(vae=tiny_vae(), unet=unet, text_encoder=text, tokenizer=tokenizer,
                                   scheduler=scheduler, safety_checker=None, feature_extractor=None,
                                   requires_safety_checker=False)


@pytest.fixture(scope="module")
def pipes():
    built = {kind: tiny_pipeline(kind) for kind in KINDS}
    for pipe in built.values():
        pipe.set_progress_bar_config(disable=True)
    return built


def sample(pipe, size, guidance=5.0, **kw):
    return pipe(PROMPT, num_inference_steps=STEPS, guidance_scale=guidance, height=size[0], width=size[1],
                generator=torch.Generator().manual_seed(0), output_type="np", **kw).images


@pytest.mark.parametrize("size", [SQUARE, PORTRAIT], ids=["64x64", "512x768"])
@pytest.mark.parametrize("kind", KINDS)
def test_capture_on_gives_the_same_images_as_capture_off(pipes, kind, size):
    pipe = pipes[kind]
    expected = sample(pipe, size)
    store = AttentionStore.for_pipeline(pipe)
    with store.attach(pipe.unet):
        got = sample(pipe, size)
    assert got.shape == (1, *size, 3)
    assert np.abs(got - expected).max() <= 1e-4
    assert store.guided and store.batch_size == 1  # the prompt half only, found by the store itself
    assert store.layers and all(name.endswith("attn2") for name in store.layers)
    assert {store.layer_shapes[n] for n in store.layers} == {(size[0] // 16, size[1] // 16)}  # latents / 2
    maps = word_maps(store, prompt_words(pipe.tokenizer, PROMPT), size)
    assert maps.shape == (6, *size) and torch.isfinite(maps).all() and (maps >= 0).all()
    if size == SQUARE:  # detached: the default processors again, bit for bit
        assert np.array_equal(sample(pipe, size), expected)


def test_guided_batch_is_two_identical_halves():
    x = torch.randn(3, 4, 8, 8)
    assert guided_batch(torch.cat([x, x])) and guided_batch(torch.cat([x[:1], x[:1]]))
    assert not guided_batch(x[:2]) and not guided_batch(x) and not guided_batch(torch.cat([x, x + 1e-6]))


def _second_half(value, batch: int):
    """The prompt half of one U-Net input: tensors (and dicts of them, SDXL's added_cond_kwargs) with a
    batch dimension are cut; anything else (the timestep) is kept."""
    if isinstance(value, dict):
        return {k: _second_half(v, batch) for k, v in value.items()}
    if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == batch:
        return value[batch // 2:]
    return value


@pytest.mark.parametrize("kind", KINDS)
def test_the_store_keeps_the_prompt_conditioned_half(pipes, kind):
    """Re-running the U-Net on the second half of every guided call must give the same sums: the store
    kept [cond], not [uncond]. Without guidance nothing is cut."""
    pipe = pipes[kind]
    calls = []
    hook = pipe.unet.register_forward_pre_hook(lambda m, args, kwargs: calls.append((args, kwargs)), with_kwargs=True)
    guided = AttentionStore.for_pipeline(pipe)
    try:
        with guided.attach(pipe.unet):
            sample(pipe, SQUARE)
    finally:
        hook.remove()
    assert len(calls) == STEPS and calls[0][0][0].shape[0] == 2
    alone = AttentionStore.for_pipeline(pipe)
    with torch.no_grad(), alone.attach(pipe.unet):
        for args, kwargs in calls:
            pipe.unet(*[_second_half(a, 2) for a in args], **_second_half(kwargs, 2))
    assert guided.guided and not alone.guided
    assert guided.sums.keys() == alone.sums.keys()
    for key in guided.sums:
        assert torch.allclose(guided.sums[key], alone.sums[key], atol=1e-5), key
    unguided = AttentionStore.for_pipeline(pipe)
    with unguided.attach(pipe.unet):
        sample(pipe, SQUARE, guidance=1.0, num_images_per_prompt=2)
    assert not unguided.guided and unguided.batch_size == 2


def test_sdxl_words_have_the_same_positions_in_both_tokenizers(pipes):
    """SDXL's context is both encoders' hidden states side by side, position by position, so a word's
    positions from the first tokenizer are its positions in the second encoder too -- when both split
    the prompt alike (real SDXL: the same CLIP vocabulary; only the padding token differs)."""
    pipe = pipes["sdxl"]
    assert pipe.tokenizer.pad_token != pipe.tokenizer_2.pad_token
    first, second = prompt_words(pipe.tokenizer, PROMPT), prompt_words(pipe.tokenizer_2, PROMPT)
    assert [w.tokens for w in first] == [w.tokens for w in second] == [[i] for i in range(1, 7)]


def _files(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def ours(tiny_pipeline_dir, tmp_path_factory):
    """What generate.py writes for our own (tiny) model on the same prompt."""
    out = tmp_path_factory.mktemp("ours")
    assert generate_main([PROMPT, "--model", str(tiny_pipeline_dir), "--out", str(out), "--steps", str(STEPS),
                          "--quiet"]) == 0
    return next(out.iterdir())


@pytest.mark.parametrize("kind,size", [("sd", PORTRAIT), ("sd2-v", SQUARE), ("sdxl", SQUARE)])
def test_generate_script_on_each_folder_writes_what_it_writes_for_ours(pipes, ours, tmp_path, kind, size):
    pipes[kind].save_pretrained(tmp_path / kind, safe_serialization=True)
    rc = generate_main([PROMPT, "--model", str(tmp_path / kind), "--out", str(tmp_path / "out"), "--steps",
                        str(STEPS), "--height", str(size[0]), "--width", str(size[1]), "--quiet"])
    assert rc == 0
    folder = next((tmp_path / "out").iterdir())
    assert _files(folder) == _files(ours)
    meta, meta_ours = json.loads((folder / "meta.json").read_text()), json.loads((ours / "meta.json").read_text())
    assert meta.keys() == meta_ours.keys()
    assert [w["text"] for w in meta["words"]] == PROMPT.split() and (meta["height"], meta["width"]) == size
    maps = load_file(str(folder / "maps.safetensors"))
    assert {k for k in maps if "/" not in k} == {k for k in load_file(str(ours / "maps.safetensors")) if "/" not in k}
    assert maps["1_red"].shape == (1, *size) and torch.isfinite(maps["1_red"]).all()
    assert all(k.split("/")[1].endswith("attn2") for k in maps if k.startswith("layer/"))


def test_sdxl_tokenizers_that_split_words_differently_are_refused(tmp_path, capsys):
    other = tiny_tokenizer(words=("a", "red", "on", "the", "mat"), pad="!")  # no "cat": it splits into pieces
    tiny_pipeline("sdxl", tokenizer_2=other).save_pretrained(tmp_path / "sdxl", safe_serialization=True)
    rc = generate_main([PROMPT, "--model", str(tmp_path / "sdxl"), "--out", str(tmp_path / "out"), "--steps", "1",
                        "--quiet"])
    assert rc == 2
    assert "tokenizer_2" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_explain_heads_on_a_stable_diffusion_folder(pipes, tmp_path):
    from unet.cli import explain as explain_script
    pipes["sd"].save_pretrained(tmp_path / "sd", safe_serialization=True)
    rc = explain_script.main(["heads", PROMPT, "--word", "cat", "--model", str(tmp_path / "sd"),
                              "--out", str(tmp_path / "explain")])
    assert rc == 0 and (tmp_path / "explain" / "heads_layers.png").stat().st_size > 0


def test_pickled_weights_are_refused(tmp_path, capsys):
    tiny_pipeline("sd").save_pretrained(tmp_path / "sd", safe_serialization=False)
    rc = generate_main([PROMPT, "--model", str(tmp_path / "sd"), "--out", str(tmp_path / "out")])
    assert rc == 2
    assert "safetensors" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
