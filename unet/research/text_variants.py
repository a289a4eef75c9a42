"""Text sides the U-Net can train with (`TextConfig.text_variant`): CLIP's causal encoder, as shipped, and the
ablations that asked whether the text encoder or the image model limits relations and binding
(docs/experiments/text-side-ablations.md, docs/experiments/side-hints.md: neither changed what ships).

- "clip": transformers' CLIPTextModel itself, causal as in Stable Diffusion (what ships).

- "bidirectional": the same CLIP text model without its causal mask, so the first object's tokens
  can see the relation ("left of") that comes after them.
- "oracle": no text encoder at all. Each token is a learned embedding of its word, plus which object
  it belongs to (first or second) and where that object must go (left/right/top/bottom, resolved from
  the relation: in "a circle right of a square" the circle's tokens get "right", the square's "left").
  This is the structured conditioning controlled studies (MOSAIC, Okawa et al.) give their models: if
  relations are learned with it and not with text, the text side is the bottleneck.
- "side-hints": the trained CLIP encoder, plus a learned vector for each object token's side (as the
  oracle's, in a table of its own) added to its output. The table starts at zero, so it grows from a
  trained run (`train.py --grow-from RUN --text-variant side-hints`) at identity: if the trained U-Net
  then learns to place objects, the image side can do relations and what it lacked was the text telling
  it where each object goes.

All keep the tokenizer's positions (one token per scene word), so word maps read the same way; they
are for measurement only and are never shipped (they do not save as a diffusers pipeline). Training imports
this module only for a run whose text variant is not "clip" (`unet.train.build_components`): `--grow-from RUN
--text-variant side-hints` and scripts/ablation.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from ..data import COLORS, SHAPES

TEXT_VARIANTS = ("clip", "bidirectional", "oracle", "side-hints")

SIDES = {"left of": ("left", "right"), "right of": ("right", "left"), "above": ("top", "bottom"),
         "below": ("bottom", "top")}
SIDE_IDS = {None: 0, "left": 1, "right": 2, "top": 3, "bottom": 4}


class _Encoder(nn.Module):
    @property
    def device(self) -> torch.device:  # what a diffusers pipeline asks its components
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype


class BidirectionalText(_Encoder):
    """A CLIPTextModel run without the causal mask (every token sees the whole prompt)."""

    def __init__(self, clip):
        super().__init__()
        self.clip = clip
        self.config = clip.config

    def forward(self, input_ids: torch.Tensor):
        hidden = self.clip.embeddings(input_ids=input_ids)  # (B, T, D)
        hidden = self.clip.encoder(inputs_embeds=hidden, attention_mask=None, is_causal=False).last_hidden_state
        return SimpleNamespace(last_hidden_state=self.clip.final_layer_norm(hidden))


def token_roles(words: list[str]) -> list[tuple[int, int]]:
    """(object 0/1/2, side id) per word of a scene caption; 0 = not part of an object."""
    text = " ".join(words)
    relation = next((r for r in SIDES if f" {r} " in f" {text} "), None)
    single_side = next((s for s in ("left", "right", "top", "bottom") if text.endswith(f"on the {s}")), None)
    roles, obj = [], 1
    for i, w in enumerate(words):
        if w == "a" and i > 0 and obj == 1 and any(x in words[:i] for x in SHAPES):
            obj = 2  # the second "a" starts the second object
        if w in SHAPES or w in COLORS or w == "a":
            side = SIDES[relation][obj - 1] if relation else (single_side if obj == 1 else None)
            roles.append((obj, SIDE_IDS[side]))
        else:
            roles.append((0, 0))
    return roles


def caption_roles(tokenizer, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) object and side ids of every token, from the tokens (every scene word is one token)."""
    objects, sides = torch.zeros_like(input_ids), torch.zeros_like(input_ids)
    for b, ids in enumerate(input_ids.tolist()):
        tokens = tokenizer.convert_ids_to_tokens(ids)
        positions = [i for i, t in enumerate(tokens) if t.endswith("</w>")]
        words = [tokens[i][:-4] for i in positions]
        for i, (obj, side) in zip(positions, token_roles(words)):
            objects[b, i], sides[b, i] = obj, side
    return objects, sides


class OracleSlots(_Encoder):
    """Per-token embedding of (word, object index, that object's side): structured, non-contextual."""

    def __init__(self, tokenizer, width: int):
        super().__init__()
        self.tokenizer = tokenizer
        self.word = nn.Embedding(len(tokenizer), width)
        self.object = nn.Embedding(3, width)
        self.side = nn.Embedding(len(SIDE_IDS), width)
        self.position = nn.Embedding(tokenizer.model_max_length, width)
        self.norm = nn.LayerNorm(width)
        self.config = SimpleNamespace(hidden_size=width)

    def forward(self, input_ids: torch.Tensor):
        objects, sides = caption_roles(self.tokenizer, input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        hidden = self.word(input_ids) + self.object(objects) + self.side(sides) + self.position(positions)
        return SimpleNamespace(last_hidden_state=self.norm(hidden))  # (B, T, width)


class SideHints(_Encoder):
    """CLIP's causal encoder, plus a learned vector for each object token's side, added to its output.

    CLIP's parts are registered under their own names, so a trained run's text weights load as they are;
    the side embedding (`side_hint`) starts at zero, and row 0 (tokens of no object) stays zero. Adam moves
    each weight by about the learning rate per step whatever its gradient's size, so a table grown from zero
    stays near its noise for thousands of steps; `gain` multiplies its output, which is a learning rate
    `gain` times the run's for this table alone.
    """

    def __init__(self, clip, tokenizer, gain: float = 1.0):
        super().__init__()
        for name, child in clip.named_children():  # the same modules: CLIP's forward runs on these weights
            self.add_module(name, child)
        object.__setattr__(self, "_clip", clip)  # not registered again: its parameters are the ones above
        self.tokenizer, self.config, self.gain = tokenizer, clip.config, gain
        self.side_hint = nn.Embedding(len(SIDE_IDS), clip.config.hidden_size, padding_idx=0)
        nn.init.zeros_(self.side_hint.weight)

    def forward(self, input_ids: torch.Tensor):
        hidden = self._clip(input_ids=input_ids).last_hidden_state  # (B, T, D), after the final norm
        _, sides = caption_roles(self.tokenizer, input_ids)
        return SimpleNamespace(last_hidden_state=hidden + self.gain * self.side_hint(sides.to(hidden.device)))


def text_side(variant: str, tokenizer, text_encoder, side_hint_gain: float = 1.0):
    """The text side `variant` (one of `TEXT_VARIANTS`) trains: CLIP's causal encoder itself, or an ablation."""
    if variant == "bidirectional":
        return BidirectionalText(text_encoder)
    if variant == "oracle":
        return OracleSlots(tokenizer, text_encoder.config.hidden_size)
    if variant == "side-hints":
        return SideHints(text_encoder, tokenizer, side_hint_gain)
    return text_encoder
