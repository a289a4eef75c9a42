import pytest
import torch

from crossattn.capture import AttentionStore, layer_hw
from crossattn.maps import merge_words, token_maps, word_maps
from crossattn.text import Word, prompt_words


def run(pipe, store=None, steps=3, guidance=3.0, prompt="a red circle left of a blue square", **kw):
    gen = torch.Generator().manual_seed(0)
    return pipe(prompt, num_inference_steps=steps, guidance_scale=guidance, generator=gen, output_type="pt",
                show_progress=False, **kw).images


def test_layer_hw_non_square():
    assert layer_hw(16 * 24, (16, 24)) == (16, 24)
    assert layer_hw(8 * 12, (16, 24)) == (8, 12)
    assert layer_hw(3 * 4, (5, 7)) == (3, 4)
    with pytest.raises(ValueError, match="cannot place"):
        layer_hw(7, (16, 24))


def test_store_memory_does_not_grow_with_steps(tiny_pipeline):
    sizes = []
    for steps in (10, 40, 120):
        store = AttentionStore(windows=10)
        with store.attach(tiny_pipeline.unet):
            run(tiny_pipeline, store, steps=steps)
        sizes.append(store.nbytes())
        assert store.passes() == steps * len(store.layers)  # every step was recorded
    assert sizes[0] == sizes[1] == sizes[2] > 0
    one_window = sum(s.numel() * 4 for layer in store.layers for w, _, s in store.window_sums(layer) if w == 0)
    assert sizes[2] == 10 * one_window  # bounded by windows x layers, not by steps


def test_detaching_leaves_outputs_bit_identical(tiny_pipeline):
    before = run(tiny_pipeline)
    store = AttentionStore(self_attention=True)
    with store.attach(tiny_pipeline.unet):
        during = run(tiny_pipeline, store)
    after = run(tiny_pipeline)
    assert torch.equal(before, after)
    assert torch.allclose(before, during, atol=1e-4)  # explicit softmax path, same maths
    assert any(not c for c in store.is_cross.values()) and any(store.is_cross.values())


def test_only_conditioned_half_kept_under_guidance(tiny_pipeline):
    store = AttentionStore()
    with store.attach(tiny_pipeline.unet):
        run(tiny_pipeline, store, prompt=["a red circle", "a blue square"], guidance=3.0)
    assert store.guided
    assert store.batch_size == 2


def test_word_maps_shapes_non_square_and_normalisations(tiny_pipeline):
    store = AttentionStore()
    with store.attach(tiny_pipeline.unet):
        images = run(tiny_pipeline, store, height=16, width=32)
    assert images.shape[-2:] == (16, 32)
    words = prompt_words(tiny_pipeline.tokenizer, "a red circle left of a blue square")
    raw = word_maps(store, words, (16, 32))
    assert raw.shape == (8, 16, 32) and torch.isfinite(raw).all() and (raw >= 0).all()
    assert raw.sum(0).max() <= 1 + 1e-5  # shares of attention: words plus specials sum to 1
    mm = word_maps(store, words, (16, 32), normalize="minmax")
    assert torch.allclose(mm.amax(dim=(1, 2)), torch.ones(8), atol=1e-5)
    sm = word_maps(store, words, (16, 32), normalize="softmax")
    assert torch.allclose(sm.sum(0), torch.ones(16, 32), atol=1e-4)
    by_res = word_maps(store, words, (16, 32), resolutions=[8])
    assert not torch.allclose(by_res, raw)
    one_head = word_maps(store, words, (16, 32), heads=[0], timesteps=(0, 500))
    assert one_head.shape == raw.shape
    with pytest.raises(ValueError, match="heads"):
        word_maps(store, words, (16, 32), heads=[7])
    with pytest.raises(ValueError, match="normalize"):
        word_maps(store, words, (16, 32), normalize="max")


def test_specials_available_but_not_words(tiny_pipeline):
    store = AttentionStore()
    with store.attach(tiny_pipeline.unet):
        run(tiny_pipeline, store, prompt="a red circle")
    tokens = token_maps(store, (16, 16))
    assert tokens.shape[1] == tiny_pipeline.tokenizer.model_max_length  # start, words, end, padding
    words = prompt_words(tiny_pipeline.tokenizer, "a red circle")
    assert [w.tokens for w in words] == [[1], [2], [3]]  # position 0 is the start token


def test_merging_sums_subword_tokens():
    tokens = torch.rand(6, 4, 4)
    words = [Word(0, "a", [1]), Word(1, "greenish", [2, 3, 4])]
    merged = merge_words(tokens, words)
    assert torch.allclose(merged[1], tokens[2] + tokens[3] + tokens[4])
    assert torch.equal(merged[0], tokens[1])


def test_attach_twice_and_empty_model_errors(tiny_pipeline):
    store = AttentionStore().attach(tiny_pipeline.unet)
    with pytest.raises(RuntimeError, match="already attached"):
        store.attach(tiny_pipeline.unet)
    store.detach()
    with pytest.raises(ValueError, match="no attention layers"):
        AttentionStore().attach(torch.nn.Linear(2, 2))


def test_read_api_and_reset_forgets_everything(tiny_pipeline):
    store = AttentionStore.for_pipeline(tiny_pipeline, windows=4)
    with store.attach(tiny_pipeline.unet):
        run(tiny_pipeline, store, steps=4, prompt=["a red circle"] * 3)
        layer = store.layers[0]
        assert store.batch_size == 3
        assert store.heads(layer) == tiny_pipeline.unet.config.heads
        assert store.keys(layer) == tiny_pipeline.tokenizer.model_max_length
        assert store.recorded_windows() == [0, 1, 2, 3]  # trailing DDIM: 4 steps over the whole range
        assert store.window_range(1) == (250.0, 500.0)
        assert store.passes(layer) == 4 and store.passes() == 4 * len(store.layers)
        assert [(w, n) for w, n, _ in store.window_sums(layer)] == [(0, 1), (1, 1), (2, 1), (3, 1)]
        with pytest.raises(ValueError, match="window must be in 0..3"):
            store.window_range(4)
        with pytest.raises(ValueError, match="nothing was recorded for layer 'nope'"):
            store.heads("nope")
        store.reset()
        assert (store.layers, store.batch_size, store.passes(), store.recorded_windows()) == ([], 0, 0, [])
        run(tiny_pipeline, store, steps=2, height=16, width=32)  # still attached; no stale shapes
    assert store.layer_shapes[layer][1] == 2 * store.layer_shapes[layer][0] and store.batch_size == 1
