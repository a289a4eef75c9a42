"""Prompt-to-prompt's alignment of a source and an edited prompt, token by token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..text import Word, prompt_words


@dataclass
class Alignment:
    """Where each token of the edited prompt takes its attention from in the source prompt.

    matrix (T, T): the edited token j's map is sum_i source_map_i * matrix[i, j].
    taken (T,): 1 where token j takes the source's map, 0 where it keeps its own (added words).
    """
    kind: str  # "swap" or "refine"
    matrix: torch.Tensor
    taken: torch.Tensor
    changed: list[tuple[str, str]]  # (source word, edited word); "" for an added word
    source_tokens: list[int]  # token positions of the changed words in the source
    target_tokens: list[int]  # ... and in the edited prompt


def align_prompts(tokenizer, source: str, target: str) -> Alignment:
    """Align the edited prompt `target` with `source`, as prompt-to-prompt does.

    Same number of words: a word swap (differing words exchange maps; a word of k tokens spreads the
    old word's map over them). More words: a refinement, which needs every source word kept in order
    (words only added). Anything else raises ValueError naming the words that do not align.
    """
    T = tokenizer.model_max_length
    src, tgt = prompt_words(tokenizer, source), prompt_words(tokenizer, target)
    for prompt, words in ((source, src), (target, tgt)):
        if not words or any(not w.tokens for w in words):
            raise ValueError(f"cannot align {prompt!r}: it is empty or longer than the tokenizer's {T} tokens")
    matrix, taken = torch.zeros(T, T), torch.ones(T)
    matrix[0, 0] = 1.0  # start token
    changed, source_tokens, target_tokens = [], [], []

    def pair(a: Word, b: Word) -> None:
        if len(a.tokens) == len(b.tokens):
            matrix[a.tokens, b.tokens] = 1.0  # token k of the old word -> token k of the new one
        else:
            for j in b.tokens:
                matrix[a.tokens, j] = 1.0 / len(b.tokens)

    if len(src) == len(tgt):
        kind = "swap"
        for a, b in zip(src, tgt):
            pair(a, b)
            if a.text != b.text:
                changed.append((a.text, b.text))
                source_tokens += a.tokens
                target_tokens += b.tokens
    else:
        kind = "refine"
        k = 0
        for b in tgt:
            if k < len(src) and src[k].text == b.text:
                pair(src[k], b)
                k += 1
            else:
                taken[b.tokens] = 0.0  # an added word keeps its own attention
                changed.append(("", b.text))
                target_tokens += b.tokens
        if k < len(src):
            missing = [w.text for w in src if w.text not in [b.text for b in tgt]]
            raise ValueError(f"cannot align the edit {target!r} with {source!r}: a swap keeps the number of words "
                             "and a refinement only adds words, but " +
                             (f"{missing} are missing" if missing else "the source's words are out of order"))
    # end token and padding follow the last word in both prompts
    last_src, last_tgt = src[-1].tokens[-1], tgt[-1].tokens[-1]
    for j in range(last_tgt + 1, T):
        matrix[min(T - 1, j - last_tgt + last_src), j] = 1.0
    return Alignment(kind, matrix, taken, changed, source_tokens, target_tokens)
