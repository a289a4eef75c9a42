"""Transformer blocks as in latent diffusion, built from `CrossAttention`."""

from __future__ import annotations

import math

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


class PositionEmbedding2D(nn.Module):
    """Where each image token is, as a vector: fixed sinusoids of its (y, x), mapped by a learned linear layer.

    Attention itself is blind to position: a token's Query meets every Key the same way wherever the two
    sit, and a convolutional U-Net leaks position in only through zero padding at the borders. A prompt's
    "left of" needs to know where left is, so ViT and DiT add position embeddings to the image tokens.
    Coordinates are pixel centres in [-1, 1], so the embedding means the same at any image size; the
    frequencies double from pi/2 (one half-wave across the image: left vs right) to a few pixels.
    The linear layer starts at zero, so a block that gains the embedding computes what it did before.
    """

    def __init__(self, channels: int, frequencies: int = 5):
        super().__init__()
        self.frequencies = frequencies
        self.proj = nn.Linear(4 * frequencies, channels)  # (y, x) x (sin, cos) x frequencies -> channels
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def sinusoids(self, height: int, width: int, device=None) -> torch.Tensor:
        """(height * width, 4 * frequencies), tokens in row-major order like `flatten(2)`."""
        ys = (torch.arange(height, device=device) + 0.5) / height * 2 - 1
        xs = (torch.arange(width, device=device) + 0.5) / width * 2 - 1
        grid = torch.stack(torch.meshgrid(ys, xs, indexing="ij"), dim=-1).reshape(-1, 2)  # (HW, 2): (y, x)
        scales = math.pi / 2 * 2.0 ** torch.arange(self.frequencies, device=device)  # (F,)
        angles = (grid[:, :, None] * scales).flatten(1)  # (HW, 2F)
        return torch.cat([angles.sin(), angles.cos()], dim=-1)  # (HW, 4F)

    def forward(self, height: int, width: int) -> torch.Tensor:
        weight = self.proj.weight
        return self.proj(self.sinusoids(height, width, weight.device).to(weight.dtype))[None]  # (1, HW, channels)


class SpatialTransformer(nn.Module):
    """GroupNorm -> 1x1 conv in -> (+ position embedding) -> transformer blocks -> zero-initialised 1x1 conv
    out -> residual.

    Zero init makes a new block the identity, so adding it never disturbs the features it wraps.
    `position_embedding=True` adds `PositionEmbedding2D` to the tokens before attention: Queries then
    know where they are (for words like "left"), and self-attention's Keys where the others are.
    """

    def __init__(self, channels: int, context_dim: int, heads: int = 4, head_dim: int = 32, depth: int = 1,
                 self_attention: bool = True, groups: int = 32, position_embedding: bool = False):
        super().__init__()
        self.norm = nn.GroupNorm(min(groups, channels), channels, eps=1e-6)
        self.proj_in = nn.Conv2d(channels, channels, 1)
        self.position = PositionEmbedding2D(channels) if position_embedding else None
        self.blocks = nn.ModuleList(
            TransformerBlock(channels, context_dim, heads, head_dim, self_attention) for _ in range(depth)
        )
        self.proj_out = nn.Conv2d(channels, channels, 1)
        nn.init.zeros_(self.proj_out.weight)
        nn.init.zeros_(self.proj_out.bias)

    def forward(self, x: torch.Tensor, context: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        B, C, H, W = x.shape
        h = self.proj_in(self.norm(x)).flatten(2).transpose(1, 2)  # (B, HW, C)
        if self.position is not None:
            h = h + self.position(H, W)  # (1, HW, C), broadcast over the batch
        for block in self.blocks:
            h = block(h, context, mask)
        h = h.transpose(1, 2).reshape(B, C, H, W)
        return x + self.proj_out(h)
