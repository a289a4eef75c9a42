"""Attention in four visible steps, and the block that uses them.

`attention` is the whole idea: project to Queries/Keys/Values, scaled dot products, softmax,
weighted sum of Values. `CrossAttention` wraps it as an `nn.Module` whose parameter names match
diffusers' `Attention` (`to_q`, `to_k`, `to_v`, `to_out.0`), so state dicts move between the two.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def _check_mask(mask: torch.Tensor | None, batch: int, keys: int) -> torch.Tensor | None:
    """The key padding mask as bool (B, keys), True = keep. Accepts bool or integer 0/1 (what tokenizers
    return as `attention_mask`). Float masks are refused: the fused kernel would add them to the scores."""
    if mask is None:
        return None
    if mask.dim() != 2 or tuple(mask.shape) != (batch, keys):
        raise ValueError(
            f"key padding mask must have shape (B, keys) = ({batch}, {keys}) with True for real keys, "
            f"got {tuple(mask.shape)}"
        )
    if mask.is_floating_point() or mask.is_complex():
        raise ValueError(f"key padding mask must be bool or integer 0/1 (1 = keep), got {mask.dtype}; "
                         "an additive float mask is not supported")
    if mask.dtype != torch.bool:
        if ((mask != 0) & (mask != 1)).any():
            raise ValueError("an integer key padding mask must hold only 0 (drop) and 1 (keep)")
        mask = mask.bool()
    if not mask.any(dim=1).all():
        raise ValueError("key padding mask drops every key of some sample: each needs at least one key kept")
    return mask


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, N, heads * head_dim) -> (B, heads, N, head_dim)."""
    B, N, _ = x.shape
    return x.view(B, N, heads, -1).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(B, heads, N, head_dim) -> (B, N, heads * head_dim)."""
    B, H, N, D = x.shape
    return x.transpose(1, 2).reshape(B, N, H * D)


def attention(
    x: torch.Tensor,
    context: torch.Tensor,
    to_q: nn.Module,
    to_k: nn.Module,
    to_v: nn.Module,
    heads: int,
    mask: torch.Tensor | None = None,
    return_weights: bool = False,
    edit=None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Multi-head attention of queries `x` (B, N, C) over keys/values `context` (B, T, D).

    `mask` (B, T) is True (or 1) for real keys; padded keys (False, 0) get exactly zero weight, on the
    fused and the explicit path alike. Float masks raise. Non-finite inputs are not checked: a NaN
    query gives NaN on the explicit path but may give finite values on the fused kernel.
    Returns the per-head values `(B, N, heads * head_dim)` (before the output projection) and,
    if `return_weights`, the softmax weights `(B, heads, N, T)`; otherwise the fused kernel runs
    and the weights are None. `edit`, if given, takes the softmax weights and returns the weights
    that weigh the Values instead (control, `crossattn.control`); it forces the explicit path.
    """
    mask = _check_mask(mask, x.shape[0], context.shape[1])
    q, k, v = to_q(x), to_k(context), to_v(context)  # (B, N, inner), (B, T, inner), (B, T, inner)
    if not isinstance(heads, int) or heads < 1 or q.shape[-1] % heads or k.shape[-1] % heads:
        raise ValueError(f"heads={heads} does not divide the projection width {q.shape[-1]}: give a positive "
                         f"divisor of it")
    q, k, v = split_heads(q, heads), split_heads(k, heads), split_heads(v, heads)
    # (B, heads, N, head_dim), (B, heads, T, head_dim), (B, heads, T, head_dim)
    key_mask = None if mask is None else mask[:, None, None, :]  # (B, 1, 1, T), broadcast over heads, queries
    if not return_weights and edit is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask)  # same maths, fused kernel
        return merge_heads(out), None

    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, heads, N, T): scaled dot products
    if key_mask is not None:
        scores = scores.masked_fill(~key_mask, float("-inf"))
    weights = scores.softmax(dim=-1)  # (B, heads, N, T): each query's weights over keys sum to 1
    if edit is not None:
        weights = edit(weights)  # (B, heads, N, T), e.g. re-weighted or replayed words
    out = weights @ v  # (B, heads, N, head_dim): weighted sum of Values
    return merge_heads(out), weights


class CrossAttention(nn.Module):
    """Image features attend to text (or, with no context, to themselves).

    query_dim: channels of the image features (Queries).
    context_dim: width of the text embeddings (Keys/Values); None means self-attention.
    Inputs: `x` as (B, C, H, W) or (B, N, C); `context` as (B, T, context_dim).
    Output has the shape of `x`.

    The fused kernel runs unless someone needs the weights: `need_weights=True` in the call, or an
    observer (an `AttentionStore`) attached via `self.observer`, which receives
    `(self, weights)` with weights (B, heads, N, T).
    """

    def __init__(self, query_dim: int, context_dim: int | None = None, heads: int = 4, head_dim: int = 32,
                 dropout: float = 0.0):
        super().__init__()
        for name, value in (("query_dim", query_dim), ("heads", heads), ("head_dim", head_dim)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if context_dim is not None and (not isinstance(context_dim, int) or context_dim < 1):
            raise ValueError(f"context_dim must be a positive integer or None (self-attention), got {context_dim!r}")
        inner = heads * head_dim
        self.query_dim, self.heads, self.head_dim = query_dim, heads, head_dim
        self.is_cross_attention = context_dim is not None
        self.context_dim = context_dim if context_dim is not None else query_dim
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(self.context_dim, inner, bias=False)
        self.to_v = nn.Linear(self.context_dim, inner, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(inner, query_dim), nn.Dropout(dropout)])
        self.observer = None  # set by AttentionStore.attach; called with the weights of every forward
        self.controller = None  # set by crossattn.control.Controller.attach; may change the weights

    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, mask: torch.Tensor | None = None,
                need_weights: bool = False):
        image_shape = None
        if x.dim() == 4:
            B, C, H, W = x.shape
            image_shape = (H, W)
            x = x.flatten(2).transpose(1, 2)  # (B, HW, C)
        elif x.dim() != 3:
            raise ValueError(f"x must be (B, C, H, W) or (B, N, C), got shape {tuple(x.shape)}")
        if x.shape[-1] != self.query_dim:
            raise ValueError(f"x has {x.shape[-1]} channels; this block expects query_dim={self.query_dim}")
        if x.shape[0] == 0:
            raise ValueError(f"x holds a batch of 0 images (shape {tuple(x.shape)}); give at least one")
        if context is None:
            if self.is_cross_attention:
                raise ValueError(f"cross-attention needs context of shape (B, T, {self.context_dim})")
            context = x
        elif context.dim() != 3 or context.shape[-1] != self.context_dim or context.shape[0] != x.shape[0]:
            raise ValueError(
                f"context must be (B, T, context_dim) = ({x.shape[0]}, T, {self.context_dim}), "
                f"got {tuple(context.shape)}"
            )
        elif context.shape[1] == 0:
            raise ValueError(f"context has 0 keys (shape {tuple(context.shape)}): attention needs at least one "
                             "token to attend to")

        want_weights = need_weights or self.observer is not None
        edit = None if self.controller is None else (lambda w: self.controller(self, w))
        out, weights = attention(x, context, self.to_q, self.to_k, self.to_v, self.heads, mask, want_weights, edit)
        if self.observer is not None:
            self.observer(self, weights)
        out = self.to_out[1](self.to_out[0](out))  # (B, N, query_dim)
        if image_shape is not None:
            out = out.transpose(1, 2).reshape(B, C, *image_shape)
        return (out, weights) if need_weights else out
