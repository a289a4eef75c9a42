import json

import pytest
import torch
from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

from crossattn.text import (
    build_vocabulary,
    dropped_words,
    load_text_encoder,
    load_tokenizer,
    new_text_encoder,
    prompt_words,
    save_vocabulary,
)
from unet.data import SCENE_WORDS


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return save_vocabulary(SCENE_WORDS, tmp_path_factory.mktemp("tok"), max_length=16)


def test_every_scene_word_is_one_token(tokenizer):
    for word in SCENE_WORDS:
        ids = tokenizer(word, add_special_tokens=False).input_ids
        assert tokenizer.convert_ids_to_tokens(ids) == [word + "</w>"], word


def test_round_trip_and_specials(tokenizer):
    prompt = "a red circle left of a blue square"
    ids = tokenizer(prompt).input_ids
    assert ids[0] == tokenizer.bos_token_id and ids[-1] == tokenizer.eos_token_id
    assert len(ids) == len(prompt.split()) + 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == prompt


def test_unknown_words_fall_back_to_subwords_not_unk(tokenizer):
    tokens = tokenizer.convert_ids_to_tokens(tokenizer("greenish", add_special_tokens=False).input_ids)
    assert len(tokens) > 1 and tokenizer.unk_token not in tokens
    assert "".join(tokens).replace("</w>", "") == "greenish"
    assert tokens[0] == "gree"  # the learned sub-word of "green" is reused


def test_merges_never_split_earlier_words():
    vocab, merges = build_vocabulary(["red", "green", "re"])
    tok = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=8)
    for w in ("red", "green", "re"):
        assert len(tok(w, add_special_tokens=False).input_ids) == 1


def test_prompt_words_map_subwords_to_their_word(tokenizer):
    words = prompt_words(tokenizer, "a  greenish square")
    assert [w.text for w in words] == ["a", "greenish", "square"]
    assert words[0].tokens == [1]
    assert words[1].tokens == list(range(2, 2 + len(tokenizer("greenish", add_special_tokens=False).input_ids)))
    assert words[2].tokens == [words[1].tokens[-1] + 1]


def test_dropped_words_name_what_does_not_fit(tokenizer):
    assert dropped_words(tokenizer, "a red circle") == []
    long = "a red circle and a blue square and a green triangle above a yellow square"
    dropped = dropped_words(tokenizer, long)
    assert dropped and dropped == long.split()[-len(dropped):]


def test_text_encoder_ids_follow_tokenizer(tokenizer):
    enc = new_text_encoder(tokenizer, hidden_size=32, layers=1, heads=2, intermediate_size=64)
    assert enc.config.eos_token_id == tokenizer.eos_token_id and enc.config.vocab_size == len(tokenizer)
    ids = tokenizer(["a red circle"], padding="max_length", return_tensors="pt").input_ids
    assert enc(ids).last_hidden_state.shape == (1, 16, 32)


def test_real_clip_folder_loads_through_same_functions(tmp_path):
    """A CLIP folder as transformers writes it (tokenizer.json, config.json, safetensors) loads offline."""
    vocab, merges = build_vocabulary(["cat", "dog"])
    tok = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=12)
    tok.save_pretrained(tmp_path)
    (tmp_path / "vocab.json").unlink(missing_ok=True)  # only the fast tokenizer file, as many hub folders
    config = CLIPTextConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                            num_attention_heads=2, max_position_embeddings=12, bos_token_id=tok.bos_token_id,
                            eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = CLIPTextModel(config).eval()
    model.save_pretrained(tmp_path)
    loaded_tok, loaded = load_tokenizer(tmp_path), load_text_encoder(tmp_path).eval()
    ids = loaded_tok(["a cat"], return_tensors="pt").input_ids
    assert ids.tolist() == tok(["a cat"], return_tensors="pt").input_ids.tolist()
    assert torch.equal(loaded(ids).last_hidden_state, model(ids).last_hidden_state)


def test_text_loading_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="vocab.json or tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "clip_text_model"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")
    with pytest.raises(ValueError, match="safetensors"):
        load_text_encoder(tmp_path)
