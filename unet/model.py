"""The whole image model in one file: a small pixel-space U-Net with cross-attention to text.

Read top to bottom: timestep embedding, residual block, down/up sampling, then `UNet` that wires
them into a down path, a middle and an up path with skip connections. At the resolutions the
config names, a `SpatialTransformer` (from `crossattn`) lets image features (Queries) attend to
the text encoder's hidden states (Keys/Values); every one reads the same text embeddings.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from crossattn import SpatialTransformer


def timestep_embedding(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding of diffusion timesteps (B,) -> (B, dim), as in the Transformer."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * freqs[None]  # (B, half)
    return torch.cat([args.cos(), args.sin()], dim=-1)


class ResBlock(nn.Module):
    """Two 3x3 convolutions with the timestep added in between, and a residual connection."""

    def __init__(self, in_ch: int, out_ch: int, time_dim: int, groups: int = 8):
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, in_ch)
        self.conv1 = nn.Conv2d(in_ch, out_ch, 3, padding=1)
        self.time_proj = nn.Linear(time_dim, out_ch)
        self.norm2 = nn.GroupNorm(groups, out_ch)
        self.conv2 = nn.Conv2d(out_ch, out_ch, 3, padding=1)
        self.skip = nn.Conv2d(in_ch, out_ch, 1) if in_ch != out_ch else nn.Identity()

    def forward(self, x, t_emb):
        h = self.conv1(F.silu(self.norm1(x)))
        h = h + self.time_proj(F.silu(t_emb))[:, :, None, None]  # (B, out_ch, 1, 1) broadcast over pixels
        h = self.conv2(F.silu(self.norm2(h)))
        return self.skip(x) + h


class Level(nn.Module):
    """One resolution of the U-Net: residual blocks, each optionally followed by a SpatialTransformer."""

    def __init__(self, in_ch, out_ch, time_dim, context_dim, num_blocks, cross_attention, self_attention, heads,
                 position_embedding=False):
        super().__init__()
        self.res = nn.ModuleList(ResBlock(in_ch if i == 0 else out_ch, out_ch, time_dim) for i in range(num_blocks))
        self.attn = nn.ModuleList(
            SpatialTransformer(out_ch, context_dim, heads, out_ch // heads, self_attention=self_attention,
                               position_embedding=position_embedding)
            if cross_attention else nn.Identity()
            for _ in range(num_blocks)
        )

    def forward(self, x, t_emb, context):
        for res, attn in zip(self.res, self.attn):
            x = res(x, t_emb)
            if not isinstance(attn, nn.Identity):
                x = attn(x, context)
        return x


class UNet(ModelMixin, ConfigMixin):
    """Predicts the noise in `sample` (B, C, H, W) at `timestep` given text `encoder_hidden_states` (B, T, D).

    channels[i] is the width at level i (resolution sample_size / 2**i); cross_attention[i] and
    self_attention[i] say which levels get a SpatialTransformer and whether it self-attends first.
    The middle always has both. `position_embedding` adds a 2D position embedding to the image tokens of
    every SpatialTransformer (crossattn.PositionEmbedding2D). `pooled_text` adds the prompt's summary
    vector to the timestep embedding, as SDXL and Imagen do, so that every ResBlock hears the prompt, the
    levels without cross-attention too. Configs saved before these existed lack the keys and load as
    they were made, without them.
    """

    @register_to_config
    def __init__(self, in_channels: int = 3, out_channels: int = 3, sample_size: int = 32,
                 channels: tuple = (32, 64, 128), blocks_per_level: int = 1,
                 cross_attention: tuple = (False, True, True), self_attention: tuple = (False, False, True),
                 context_dim: int = 64, heads: int = 4, time_dim: int = 128, position_embedding: bool = False,
                 pooled_text: bool = False):
        super().__init__()
        if not len(channels) == len(cross_attention) == len(self_attention):
            raise ValueError(f"channels, cross_attention and self_attention need one entry per level, got "
                             f"{len(channels)}, {len(cross_attention)}, {len(self_attention)}")
        self.time_mlp = nn.Sequential(nn.Linear(channels[0], time_dim), nn.SiLU(), nn.Linear(time_dim, time_dim))
        self.conv_in = nn.Conv2d(in_channels, channels[0], 3, padding=1)
        self.pooled_text_proj = nn.Linear(context_dim, time_dim) if pooled_text else None
        if pooled_text:  # zero: a model that gains it computes what it did before (unet.growth.grow)
            nn.init.zeros_(self.pooled_text_proj.weight)
            nn.init.zeros_(self.pooled_text_proj.bias)

        levels = list(zip(channels, cross_attention, self_attention))
        self.down = nn.ModuleList()
        self.downsample = nn.ModuleList()
        prev = channels[0]
        for i, (ch, cross, self_attn) in enumerate(levels):
            self.down.append(Level(prev, ch, time_dim, context_dim, blocks_per_level, cross, self_attn, heads,
                                   position_embedding))
            last = i == len(levels) - 1
            self.downsample.append(nn.Identity() if last else nn.Conv2d(ch, ch, 3, stride=2, padding=1))
            prev = ch

        self.mid_res1 = ResBlock(prev, prev, time_dim)
        self.mid_attn = SpatialTransformer(prev, context_dim, heads, prev // heads, self_attention=True,
                                           position_embedding=position_embedding)
        self.mid_res2 = ResBlock(prev, prev, time_dim)

        self.up = nn.ModuleList()
        self.upsample = nn.ModuleList()
        for i, (ch, cross, self_attn) in reversed(list(enumerate(levels))):
            self.up.append(Level(prev + ch, ch, time_dim, context_dim, blocks_per_level, cross, self_attn, heads,
                                 position_embedding))
            self.upsample.append(nn.Conv2d(ch, channels[i - 1], 3, padding=1) if i > 0 else nn.Identity())
            prev = channels[i - 1] if i > 0 else ch

        self.norm_out = nn.GroupNorm(8, prev)
        self.conv_out = nn.Conv2d(prev, out_channels, 3, padding=1)

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor | int, encoder_hidden_states: torch.Tensor):
        if sample.dim() != 4 or sample.shape[1] != self.config.in_channels:
            raise ValueError(f"sample must be (B, {self.config.in_channels}, H, W), got {tuple(sample.shape)}")
        factor = 2 ** (len(self.config.channels) - 1)
        if sample.shape[2] % factor or sample.shape[3] % factor:
            raise ValueError(f"height and width must be multiples of {factor}, got {tuple(sample.shape[2:])}")
        B = sample.shape[0]
        t = torch.as_tensor(timestep, device=sample.device).reshape(-1)  # a number, or 1 or B timesteps
        if t.numel() not in (1, B) or t.is_complex() or t.dtype == torch.bool:
            raise ValueError(f"timestep must be a number or a tensor of 1 or {B} (the batch) real timesteps, got "
                             f"{t.numel()} of dtype {t.dtype}")
        t = t.expand(B)
        t_emb = self.time_mlp(timestep_embedding(t, self.config.channels[0]).to(sample.dtype))  # (B, time_dim)
        context = encoder_hidden_states  # (B, T, context_dim): Keys/Values for every cross-attention
        if self.pooled_text_proj is not None:
            # The last token's hidden state summarises the prompt: in a causal encoder (CLIP) it has seen every
            # word. With padding to the maximum length it is a pad token after the end token, which CLIP's
            # pooled output takes instead; unpadded, it is the end token itself.
            t_emb = t_emb + self.pooled_text_proj(context[:, -1])  # (B, time_dim)

        h = self.conv_in(sample)
        skips = []
        for level, down in zip(self.down, self.downsample):
            h = level(h, t_emb, context)
            skips.append(h)
            h = down(h)  # (B, C, H/2, W/2) except at the last level

        h = self.mid_res2(self.mid_attn(self.mid_res1(h, t_emb), context), t_emb)

        for level, up in zip(self.up, self.upsample):
            h = level(torch.cat([h, skips.pop()], dim=1), t_emb, context)
            if not isinstance(up, nn.Identity):
                h = up(F.interpolate(h, scale_factor=2.0, mode="nearest"))  # (B, C', 2H, 2W)

        return self.conv_out(F.silu(self.norm_out(h)))
