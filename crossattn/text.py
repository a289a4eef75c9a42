"""The text side: a CLIP-format BPE vocabulary of our own, the real CLIP classes, and word positions.

No hub is reachable, so we build the vocabulary (`vocab.json` + `merges.txt`, CLIP's format) from
a word list: every listed word becomes one token, anything else falls back to sub-words and, at
worst, single bytes -- never to one unknown token. A real CLIP folder on disk loads through the
same `load_tokenizer` / `load_text_encoder`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from transformers import CLIPTextConfig, CLIPTextModel, CLIPTokenizer

BOS, EOS = "<|startoftext|>", "<|endoftext|>"


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP's reversible map from bytes to printable unicode characters."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


def _bpe(word: str, ranks: dict[tuple[str, str], int]) -> list[str]:
    """CLIP's BPE on one word: repeatedly merge the adjacent pair with the lowest rank."""
    parts = list(word[:-1]) + [word[-1] + "</w>"]
    while len(parts) > 1:
        pairs = [(ranks.get((a, b), float("inf")), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
        rank, i = min(pairs)
        if rank == float("inf"):
            break
        parts = parts[:i] + [parts[i] + parts[i + 1]] + parts[i + 2:]
    return parts


def build_vocabulary(words: list[str]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """CLIP-format vocab and merges in which each of `words` (lower-case ASCII) is a single token.

    BPE applies merges in global rank order, so merges are added only after simulating the
    tokenizer with the merges so far; later merges never split a word that is already whole.
    """
    symbols = list(bytes_to_unicode().values())
    vocab_list = symbols + [s + "</w>" for s in symbols]
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    for word in dict.fromkeys(w.lower() for w in words):
        while len(parts := _bpe(word, ranks)) > 1:
            pair = (parts[0], parts[1])
            ranks[pair] = len(merges)
            merges.append(pair)
            vocab_list.append(pair[0] + pair[1])
    for word in dict.fromkeys(w.lower() for w in words):
        assert _bpe(word, ranks) == [word + "</w>"], word
    vocab_list += [BOS, EOS]
    return {token: i for i, token in enumerate(vocab_list)}, merges


def save_vocabulary(words: list[str], folder: str | Path, max_length: int = 24) -> CLIPTokenizer:
    """Build the vocabulary for `words`, write `vocab.json` + `merges.txt`, and return the tokenizer.

    The tokenizer's own `save_pretrained` files are written too, so transformers 4.x and 5.x both load it.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    vocab, merges = build_vocabulary(words)
    (folder / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges))
    tokenizer = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=max_length)
    tokenizer.save_pretrained(folder)
    return tokenizer


def load_tokenizer(path: str | Path) -> CLIPTokenizer:
    """A CLIP tokenizer from a folder on disk (ours, or a real CLIP/Stable Diffusion `tokenizer/`)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"tokenizer folder {path} does not exist")
    if not ((path / "vocab.json").exists() or (path / "tokenizer.json").exists()):
        raise FileNotFoundError(f"{path} holds no vocab.json or tokenizer.json; not a CLIP tokenizer folder")
    tokenizer = CLIPTokenizer.from_pretrained(path, local_files_only=True)
    if tokenizer.model_max_length > 10_000:
        raise ValueError(f"tokenizer in {path} sets no model_max_length; add it to tokenizer_config.json")
    return tokenizer


def new_text_encoder(tokenizer: CLIPTokenizer, hidden_size: int = 64, layers: int = 2, heads: int = 4,
                     intermediate_size: int = 256) -> CLIPTextModel:
    """A small, randomly initialised CLIP text encoder sized to `tokenizer`."""
    config = CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=layers, num_attention_heads=heads, max_position_embeddings=tokenizer.model_max_length,
        projection_dim=hidden_size,
        # CLIP's defaults (49406/49407) lie outside a small vocabulary and would pool the wrong token.
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    return CLIPTextModel(config)


def load_text_encoder(path: str | Path) -> CLIPTextModel:
    """A CLIP text encoder from a folder on disk (safetensors weights only)."""
    path = Path(path)
    if not (path / "config.json").exists():
        raise FileNotFoundError(f"{path} holds no config.json; not a CLIP text encoder folder")
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"{path} holds no .safetensors weights; only safetensors checkpoints are loaded")
    return CLIPTextModel.from_pretrained(path, local_files_only=True, use_safetensors=True)


@dataclass
class Word:
    """One whitespace word of a prompt and the token positions (in the padded sequence) it became."""
    index: int
    text: str
    tokens: list[int]


def prompt_words(tokenizer: CLIPTokenizer, prompt: str) -> list[Word]:
    """Split `prompt` at whitespace and map each word to its token positions via the offsets.

    Positions count the start token, so they index the text encoder's sequence directly. A token
    belongs to the word holding its first character; specials and padding have (0, 0) offsets.
    Words whose tokens fell past the tokenizer's maximum length get an empty list.
    """
    spans, start = [], None
    for i, ch in enumerate(prompt + " "):
        if not ch.isspace() and start is None:
            start = i
        elif ch.isspace() and start is not None:
            spans.append((start, i))
            start = None
    encoding = tokenizer(prompt, return_offsets_mapping=True, truncation=True,
                         max_length=tokenizer.model_max_length)
    words = [Word(i, prompt[a:b], []) for i, (a, b) in enumerate(spans)]
    for position, (a, b) in enumerate(encoding["offset_mapping"]):
        if a == b:
            continue
        for word, (s, e) in zip(words, spans):
            if s <= a < e:
                word.tokens.append(position)
                break
    return words


def dropped_words(tokenizer: CLIPTokenizer, prompt: str) -> list[str]:
    """The words of `prompt` that would be cut, wholly or in part, by the tokenizer's maximum length."""
    return [w.text for w in prompt_words(tokenizer, prompt)
            if len(w.tokens) < len(tokenizer(w.text, add_special_tokens=False)["input_ids"])]
