"""crossattn: attention you can see -- the four steps, the blocks, the text side, capture and overlays."""

from .attention import CrossAttention, attention
from .blocks import GEGLU, PositionEmbedding2D, SpatialTransformer, TransformerBlock

__all__ = ["GEGLU", "CrossAttention", "PositionEmbedding2D", "SpatialTransformer", "TransformerBlock", "attention"]
