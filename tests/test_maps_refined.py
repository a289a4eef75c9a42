"""Refined maps (cross-attention propagated through recorded self-attention), the one entry point
`maps_of`, the store's bounded self-attention record, and `word_maps`' input checks."""

import math

import pytest
import torch

from crossattn.attention import CrossAttention, split_heads
from crossattn.capture import AttentionStore
from crossattn.maps import (
    Refinement,
    daam_expand,
    daam_heat_maps,
    daam_word_maps,
    maps_of,
    merge_words,
    propagate,
    refined_store,
    refined_token_maps,
    self_affinity,
    sharpen_affinity,
    token_maps,
    word_maps,
)
from crossattn.text import Word, prompt_words

PROMPT = "a red circle left of a blue square"


def sample(pipe, store, steps=3, prompt=PROMPT, num_images=2, guidance=1.0):
    with store.attach(pipe.unet):
        pipe(prompt, num_inference_steps=steps, guidance_scale=guidance, num_images_per_prompt=num_images,
             generator=torch.Generator().manual_seed(0), output_type="np", show_progress=False)
    return store


@pytest.fixture
def recorded(tiny_pipeline):
    return tiny_pipeline, sample(tiny_pipeline, refined_store(tiny_pipeline))


def test_zero_iterations_are_the_plain_maps(recorded):
    pipe, store = recorded
    words = prompt_words(pipe.tokenizer, PROMPT)
    plain = word_maps(store, words, (16, 16), index=None)
    assert torch.equal(maps_of("refined", store, words, (16, 16), index=None, refinement=Refinement(0)), plain)
    assert torch.equal(maps_of("plain", store, words, (16, 16), index=None), plain)
    assert torch.equal(refined_token_maps(store, (16, 16), Refinement(0), resolutions=[8]),
                       token_maps(store, (16, 16), resolutions=[8]))
    refined = maps_of("refined", store, words, (16, 16), index=None, refinement=Refinement(2))
    assert refined.shape == plain.shape and not torch.allclose(refined, plain, atol=1e-4)


def test_refined_is_plain_propagated_through_the_mean_self_attention(recorded):
    pipe, store = recorded
    affinity, hw = self_affinity(store)  # (B, N, N)
    selfs = [n for n in store.layers if not store.is_cross[n]]
    assert hw == (8, 8) and len(selfs) == 3  # the tiny model self-attends at 8 px (down, up) and in the middle
    torch.testing.assert_close(affinity, torch.stack([store.mean(n) for n in selfs]).mean(0))
    torch.testing.assert_close(affinity.sum(-1), torch.ones(affinity.shape[:2]))  # rows are distributions
    layer = next(n for n in store.layers if store.is_cross[n] and store.layer_shapes[n] == (8, 8))
    mean = store.mean(layer)  # (B, 64, T)
    expected = (affinity @ (affinity @ mean)).transpose(1, 2).reshape(mean.shape[0], -1, 8, 8)
    got = refined_token_maps(store, (8, 8), Refinement(2), layers=[layer])
    torch.testing.assert_close(got, expected.clamp(min=0))


def test_self_attention_sums_equal_a_brute_force_recomputation(tiny_pipeline):
    """Recompute softmax(q k^T / sqrt(d)) of every self-attention call from its input, heads averaged,
    summed per timestep window: the store's sums must be the same."""
    pipe = tiny_pipeline
    store = refined_store(pipe)
    brute, counts, now = {}, {}, {}
    handles = [pipe.unet.register_forward_pre_hook(
        lambda m, a, k: now.update(t=float(torch.as_tensor(a[1] if len(a) > 1 else k["timestep"]).reshape(-1)[0])),
        with_kwargs=True)]
    for name, module in pipe.unet.named_modules():
        if isinstance(module, CrossAttention) and not module.is_cross_attention:
            def record(m, args, name=name):
                x = args[0]
                x = x.flatten(2).transpose(1, 2) if x.dim() == 4 else x  # (B, N, C)
                q, k = split_heads(m.to_q(x), m.heads), split_heads(m.to_k(x), m.heads)  # (B, heads, N, d)
                w = (q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])).softmax(-1).mean(1, keepdim=True)
                key = (name, store.window_of(now["t"]))
                brute[key] = brute.get(key, 0) + w.detach()
                counts[key] = counts.get(key, 0) + 1
            handles.append(module.register_forward_pre_hook(record))
    try:
        sample(pipe, store, steps=4)
    finally:
        for h in handles:
            h.remove()
    self_keys = {k for k in store.sums if not store.is_cross[k[0]]}
    assert self_keys == set(brute) and len(self_keys) >= 4
    for key in self_keys:
        assert store.sums[key].shape[1] == 1 and store.counts[key] == counts[key]
        torch.testing.assert_close(store.sums[key], brute[key], atol=1e-5, rtol=1e-5)


def test_store_memory_is_flat_in_the_number_of_steps(tiny_pipeline):
    sizes = {}
    for steps in (5, 50):
        store = refined_store(tiny_pipeline, windows=5)  # 5 trailing DDIM steps already fill the 5 windows
        sample(tiny_pipeline, store, steps=steps, num_images=1)
        sizes[steps] = store.nbytes()
        assert store.passes() == steps * len(store.layers) and len(store.recorded_windows()) == 5
    assert sizes[5] == sizes[50] > 0


def test_store_keeps_only_the_self_attention_the_read_out_needs(tiny_pipeline):
    full = sample(tiny_pipeline, AttentionStore.for_pipeline(tiny_pipeline, self_attention=True), steps=4)
    lean = sample(tiny_pipeline, refined_store(tiny_pipeline, Refinement(1, self_timesteps=(0, 499))), steps=4)
    selfs = [n for n in full.layers if not full.is_cross[n]]
    assert all(full.heads(n) == 2 and lean.heads(n) == 1 for n in selfs)
    for n in selfs:  # heads averaged as recorded, and only the windows of t <= 499
        assert lean.recorded_windows(n) == [w for w in full.recorded_windows(n) if full.window_range(w)[1] <= 500]
        for w in lean.recorded_windows(n):
            torch.testing.assert_close(lean.sums[(n, w)], full.sums[(n, w)].mean(1, keepdim=True))
    for n in full.layers:  # cross-attention untouched
        if full.is_cross[n]:
            assert all(torch.equal(full.sums[(n, w)], lean.sums[(n, w)]) for w in full.recorded_windows(n))
    none = sample(tiny_pipeline, AttentionStore.for_pipeline(tiny_pipeline, self_attention=True,
                                                             self_resolutions=[16]), steps=2)
    assert all(none.is_cross[n] for n in none.layers)  # the tiny model has no 16 px self-attention
    with pytest.raises(ValueError, match="no self-attention was recorded"):
        refined_token_maps(none, (16, 16), Refinement(1))


def test_propagate_and_sharpen_on_known_affinities():
    maps = torch.rand(1, 3, 4, 4)
    eye = torch.eye(16)[None]
    torch.testing.assert_close(propagate(maps, eye, (4, 4), 3), maps)
    uniform = torch.full((1, 16, 16), 1 / 16)
    flat = propagate(maps, uniform, (4, 4), 1)  # every pixel takes the map's mean
    torch.testing.assert_close(flat, maps.mean(dim=(2, 3), keepdim=True).expand_as(maps))
    coarse = propagate(torch.rand(1, 2, 8, 8), uniform, (4, 4), 1)  # resampled to the affinity and back
    assert coarse.shape == (1, 2, 8, 8) and torch.allclose(coarse, coarse[..., :1, :1].expand_as(coarse), atol=1e-6)
    renormed = propagate(maps, torch.softmax(torch.randn(1, 16, 16), -1), (4, 4), 2, renorm="iseg")
    torch.testing.assert_close(renormed.sum(dim=(2, 3)), torch.ones(1, 3))
    assert renormed.amin(dim=(2, 3)).abs().max() < 1e-6
    soft = torch.softmax(torch.randn(2, 16, 16), -1)
    sharp = sharpen_affinity(soft, 0.2)
    torch.testing.assert_close(sharp.sum(-1), torch.ones(2, 16))

    def entropy(a):
        return -(a * a.clamp(min=1e-12).log()).sum(-1).mean()
    assert entropy(sharp) < entropy(soft) and sharpen_affinity(soft, 0) is soft


def test_default_refinement_falls_back_to_every_step_when_it_sees_none_of_its_own():
    from crossattn.maps import DEFAULT_REFINEMENT, fitted_refinement
    assert DEFAULT_REFINEMENT.self_timesteps == (0, 299)
    assert fitted_refinement(DEFAULT_REFINEMENT, [999, 249]) is DEFAULT_REFINEMENT
    fitted = fitted_refinement(DEFAULT_REFINEMENT, [500])
    assert fitted.self_timesteps is None and fitted.iterations == DEFAULT_REFINEMENT.iterations


def test_refinement_checks_its_arguments():
    for bad, match in ((dict(iterations=-1), "iterations"), (dict(iterations=1.5), "iterations"),
                       (dict(sharpen=float("nan")), "sharpen"), (dict(renorm="max"), "renorm")):
        with pytest.raises(ValueError, match=match):
            Refinement(**bad)
    with pytest.raises(ValueError, match="self_heads"):
        AttentionStore(self_heads="sum")


def test_maps_of_daam_is_daams_word_heat_maps(recorded):
    pipe, store = recorded
    words = prompt_words(pipe.tokenizer, PROMPT)
    heat = daam_heat_maps(store, (16, 16))[1]
    expected = daam_expand(daam_word_maps(heat, words), (16, 16), absolute=True).clamp(min=0)
    torch.testing.assert_close(maps_of("daam", store, words, (16, 16), index=1), expected)
    both = maps_of("daam", store, words, (16, 16), index=None, normalize="minmax")
    assert both.shape == (2, len(words), 16, 16)
    torch.testing.assert_close(both.amax(dim=(2, 3)), torch.ones(2, len(words)))
    with pytest.raises(ValueError, match="kind must be one of"):
        maps_of("raw", store, words, (16, 16))


def test_heads_per_layer_select_the_top_heads(recorded):
    _, store = recorded
    cross = [n for n in store.layers if store.is_cross[n]]
    picked = token_maps(store, (16, 16), heads={cross[0]: [1], cross[-1]: [0, 1]})
    expected = (token_maps(store, (16, 16), layers=[cross[0]], heads=[1])
                + token_maps(store, (16, 16), layers=[cross[-1]])) / 2
    torch.testing.assert_close(picked, expected)


@pytest.mark.parametrize("call, argument", [
    (lambda s, w: word_maps(s, [Word(0, "a", [40])], (16, 16)), "token index"),
    (lambda s, w: word_maps(s, [Word(0, "a", [-1])], (16, 16)), "token index"),
    (lambda s, w: word_maps(s, w, (16, 16), index=5), "index must be"),
    (lambda s, w: word_maps(s, w, (0, 0)), "size must be"),
    (lambda s, w: word_maps(s, w, (16, 16), heads=[]), "heads must name"),
    (lambda s, w: merge_words(torch.zeros(4, 2, 2), []), "words is empty"),
    (lambda s, w: maps_of("refined", s, w, (16, -2)), "size must be"),
])
def test_word_maps_bad_arguments_raise_value_errors_naming_them(recorded, call, argument):
    pipe, store = recorded
    with pytest.raises(ValueError, match=argument):
        call(store, prompt_words(pipe.tokenizer, PROMPT))


def test_refined_maps_on_a_diffusers_unet():
    """processors on attn1 feed the same bounded record; zero iterations equal the plain maps there too."""
    from test_diffusers import tiny_pipeline as tiny_sd
    pipe = tiny_sd("sd")
    store = refined_store(pipe)
    pipe.set_progress_bar_config(disable=True)
    with store.attach(pipe.unet):
        pipe("a red cat", num_inference_steps=2, guidance_scale=4.0, height=64, width=64,
             generator=torch.Generator().manual_seed(0), output_type="np")
    selfs = [n for n in store.layers if not store.is_cross[n]]
    assert selfs and all(n.endswith("attn1") and store.heads(n) == 1 for n in selfs)
    assert store.batch_size == 1  # the prompt half of the guided batch
    words = prompt_words(pipe.tokenizer, "a red cat")
    plain = maps_of("plain", store, words, (64, 64))
    assert torch.equal(maps_of("refined", store, words, (64, 64), refinement=Refinement(0)), plain)
    refined = maps_of("refined", store, words, (64, 64), refinement=Refinement(2))
    assert refined.shape == plain.shape and torch.isfinite(refined).all() and not torch.allclose(refined, plain)


def test_explain_heads_reads_each_cell_as_the_chosen_kind(tiny_pipeline_dir, recorded, tmp_path):
    from crossattn.explain import head_layer_maps
    from unet.cli.explain import main as explain_main
    pipe, store = recorded
    tokens = prompt_words(pipe.tokenizer, PROMPT)[2].tokens  # "circle"
    names, plain = head_layer_maps(store, tokens, (16, 16))
    _, unrefined = head_layer_maps(store, tokens, (16, 16), kind="refined", refinement=Refinement(0))
    _, refined = head_layer_maps(store, tokens, (16, 16), kind="refined", refinement=Refinement(1))
    _, daam = head_layer_maps(store, tokens, (16, 16), kind="daam")
    assert torch.equal(unrefined, plain) and plain.shape == refined.shape == daam.shape == (len(names), 3, 16, 16)
    assert not torch.allclose(refined, plain, atol=1e-4) and not torch.allclose(daam, plain, atol=1e-4)
    layer = names.index(next(n for n in names if store.layer_shapes[n] == (8, 8)))  # one head, propagated by hand
    affinity, _ = self_affinity(store)
    cell = store.mean(names[layer], heads=[0])[0][:, tokens].sum(-1)  # (64,)
    torch.testing.assert_close(refined[layer, 0], torch.nn.functional.interpolate(
        (affinity[0] @ cell).reshape(1, 1, 8, 8), size=(16, 16), mode="bilinear")[0, 0].clamp(min=0))
    assert explain_main(["heads", "--maps", "refined", "--model", str(tiny_pipeline_dir), "--out", str(tmp_path)]) == 0
    assert (tmp_path / "heads_layers.png").stat().st_size > 1000
