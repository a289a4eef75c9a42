"""Our capture on diffusers' own models: tiny random components built here, no download."""

import json

import torch
from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline, UNet2DConditionModel
from safetensors.torch import load_file
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from crossattn.capture import AttentionStore
from crossattn.maps import word_maps
from crossattn.text import build_vocabulary, prompt_words
from unet.generate import main as generate_main


def tiny_sd_pipeline():
    torch.manual_seed(0)
    unet = UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=4, norm_num_groups=4)
    vae = AutoencoderKL(block_out_channels=(8,), in_channels=3, out_channels=3,
                        down_block_types=("DownEncoderBlock2D",),
                        up_block_types=("UpDecoderBlock2D",), latent_channels=4, norm_num_groups=4, sample_size=16)
    vocab, merges = build_vocabulary(["a", "red", "cat", "on", "the", "mat"])
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=12)
    text = CLIPTextModel(CLIPTextConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                        num_hidden_layers=1, num_attention_heads=2, max_position_embeddings=12,
                                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                        pad_token_id=tokenizer.pad_token_id))
    scheduler = DDIMScheduler(num_train_timesteps=1000, clip_sample=False, steps_offset=1)
    return StableDiffusionPipeline(vae=vae, unet=unet, text_encoder=text, tokenizer=tokenizer, scheduler=scheduler,
                                   safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def sample(pipe):
    return pipe("a red cat on the mat", num_inference_steps=3, guidance_scale=5.0, height=16, width=16,
                generator=torch.Generator().manual_seed(0), output_type="np").images


def test_capture_processor_matches_default_and_gives_maps():
    pipe = tiny_sd_pipeline()
    pipe.set_progress_bar_config(disable=True)
    expected = sample(pipe)
    store = AttentionStore()
    with store.attach(pipe.unet):
        got = sample(pipe)
    assert abs(got - expected).max() < 1e-4
    assert all(name.endswith("attn2") for name in store.layers) and store.layers
    assert torch.equal(torch.as_tensor(sample(pipe)), torch.as_tensor(expected))  # detached: default again
    words = prompt_words(pipe.tokenizer, "a red cat on the mat")
    maps = word_maps(store, words, (16, 16))
    assert maps.shape == (6, 16, 16) and torch.isfinite(maps).all() and (maps >= 0).all()
    assert all(s.shape[0] == 1 for s in store.sums.values())  # the conditioned half only


def test_generate_script_runs_on_a_stable_diffusion_folder(tmp_path, capsys):
    pipe = tiny_sd_pipeline()
    pipe.save_pretrained(tmp_path / "sd", safe_serialization=True)
    rc = generate_main(["a red cat", "--model", str(tmp_path / "sd"), "--out", str(tmp_path / "out"),
                        "--steps", "2", "--height", "16", "--width", "16", "--quiet"])
    assert rc == 0
    folder = next((tmp_path / "out").iterdir())
    meta = json.loads((folder / "meta.json").read_text())
    maps = load_file(str(folder / "maps.safetensors"))
    assert [w["text"] for w in meta["words"]] == ["a", "red", "cat"]
    assert maps["1_red"].shape == (1, 16, 16)


def test_pickled_weights_are_refused(tmp_path, capsys):
    pipe = tiny_sd_pipeline()
    pipe.save_pretrained(tmp_path / "sd", safe_serialization=False)
    rc = generate_main(["a red cat", "--model", str(tmp_path / "sd"), "--out", str(tmp_path / "out")])
    assert rc == 2
    assert "safetensors" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
