"""Transformer blocks as in latent diffusion, built from `CrossAttention`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .attention import CrossAttention


class GEGLU(nn.Module):
    """Gated GELU feed-forward (Shazeer 2020): half the projection gates the other half."""

    def __init__(self, dim: int, mult: int = 4):
        super().__init__()
        self.proj_in = nn.Linear(dim, dim * mult * 2)
        self.proj_out = nn.Linear(dim * mult, dim)

    def forward(self, x):
        hidden, gate = self.proj_in(x).chunk(2, dim=-1)
        return self.proj_out(hidden * F.gelu(gate))


class TransformerBlock(nn.Module):
    """Pre-norm self-attention -> cross-attention -> GEGLU feed-forward, each with a residual.

    `self_attention=False` drops the first step: at high resolutions self-attention is the
    expensive part and cross-attention alone carries the words.
    """

    def __init__(self, dim: int, context_dim: int, heads: int = 4, head_dim: int = 32, self_attention: bool = True):
        super().__init__()
        self.attn1 = CrossAttention(dim, None, heads, head_dim) if self_attention else None
        self.norm1 = nn.LayerNorm(dim) if self_attention else None
        self.attn2 = CrossAttention(dim, context_dim, heads, head_dim)
        self.norm2 = nn.LayerNorm(dim)
        self.ff = GEGLU(dim)
        self.norm3 = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        # x: (B, HW, dim) image features; context: (B, T, context_dim) text embeddings
        if self.attn1 is not None:
            x = x + self.attn1(self.norm1(x))
        x = x + self.attn2(self.norm2(x), context, mask)  # image Queries, text Keys/Values
        return x + self.ff(self.norm3(x))


class SpatialTransformer(nn.Module):
    """GroupNorm -> 1x1 conv in -> transformer blocks -> zero-initialised 1x1 conv out -> residual.

    Zero init makes a new block the identity, so adding it never disturbs the features it wraps.
    """

    def __init__(self, channels: int, context_dim: int, heads: int = 4, head_dim: int = 32, depth: int = 1,
                 self_attention: bool = True, groups: int = 32):
        super().__init__()
        self.norm = nn.GroupNorm(min(groups, channels), channels, eps=1e-6)
        self.proj_in = nn.Conv2d(channels, channels, 1)
        self.blocks = nn.ModuleList(
            TransformerBlock(channels, context_dim, heads, head_dim, self_attention) for _ in range(depth)
        )
        self.proj_out = nn.Conv2d(channels, channels, 1)
        nn.init.zeros_(self.proj_out.weight)
        nn.init.zeros_(self.proj_out.bias)

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, C, H, W = x.shape
        h = self.proj_in(self.norm(x)).flatten(2).transpose(1, 2)  # (B, HW, C)
        for block in self.blocks:
            h = block(h, context, mask)
        h = h.transpose(1, 2).reshape(B, C, H, W)
        return x + self.proj_out(h)
