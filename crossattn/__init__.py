"""crossattn: attention you can see -- the four steps, the blocks, the text side, capture, maps and control.

The everyday API is one import:

    from crossattn import AttentionStore, word_maps, maps_of, prompt_words, Controller
"""

from .attention import CrossAttention, attention
from .blocks import GEGLU, PositionEmbedding2D, SpatialTransformer, TransformerBlock
from .capture import AttentionStore
from .control import Controller
from .maps import maps_of, word_maps
from .text import prompt_words

__all__ = ["GEGLU", "AttentionStore", "Controller", "CrossAttention", "PositionEmbedding2D", "SpatialTransformer",
           "TransformerBlock", "attention", "maps_of", "prompt_words", "word_maps"]
