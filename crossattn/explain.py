"""Figures that explain attention in a trained model: the text encoder's self-attention, the
positional embeddings, cross-attention per head and layer, and one pixel's self-attention.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from .capture import AttentionStore
from .maps import DEFAULT_REFINEMENT, MAP_KINDS, Refinement, propagate, self_affinity, sharpen_affinity
from .overlay import ALPHA, CMAP
from .text import prompt_words


def _figure(width, height):
    fig = Figure(figsize=(width, height), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


# --- text self-attention
@torch.no_grad()
def text_attention(tokenizer, text_encoder, sentence: str) -> tuple[list[str], torch.Tensor]:
    """Token strings and the encoder's self-attention weights (layers, heads, T, T), T without padding.

    Needs the eager attention implementation to return weights; CLIP's is causal, so each token
    attends only to itself and earlier tokens.
    """
    ids = tokenizer(sentence, truncation=True, max_length=tokenizer.model_max_length, return_tensors="pt").input_ids
    previous = text_encoder.config._attn_implementation
    text_encoder.config._attn_implementation = "eager"
    try:
        out = text_encoder(ids.to(text_encoder.device), output_attentions=True)
    finally:
        text_encoder.config._attn_implementation = previous
    weights = torch.stack([a[0] for a in out.attentions]).cpu()  # (layers, heads, T, T)
    tokens = [t.replace("</w>", "") for t in tokenizer.convert_ids_to_tokens(ids[0])]
    return tokens, weights


def look_back(tokenizer, weights: torch.Tensor, sentence: str, word: str) -> torch.Tensor:
    """(layers, T): where `word` (its last token, which has seen the whole word) looks, heads averaged."""
    words = prompt_words(tokenizer, sentence)
    match = [w for w in words if w.text == word]
    if not match or not match[0].tokens:
        raise ValueError(f"word {word!r} not in the sentence; its words are {[w.text for w in words]}")
    return weights[:, :, match[0].tokens[-1]].mean(dim=1)


def text_figure(tokens, weights, sentence, word, row, unseen: list[str], path) -> None:
    L, Hh, T, _ = weights.shape
    fig = _figure(2.6 * Hh + 0.5, 2.6 * L + 3.2)
    grid = fig.add_gridspec(L + 1, Hh)
    for layer in range(L):
        for head in range(Hh):
            ax = fig.add_subplot(grid[layer, head])
            ax.imshow(weights[layer, head].numpy(), cmap="viridis", vmin=0, vmax=1)
            ax.set_xticks(range(T), tokens, rotation=90, fontsize=6)
            ax.set_yticks(range(T), tokens, fontsize=6)
            ax.set_title(f"layer {layer} head {head}", fontsize=8)
    ax = fig.add_subplot(grid[L, :])
    for layer in range(L):
        ax.plot(range(T), row[layer].numpy(), marker="o", label=f"layer {layer}")
    ax.set_xticks(range(T), tokens, rotation=45, fontsize=8)
    ax.set_ylabel("weight")
    ax.legend(fontsize=8)
    ax.set_title(f"where '{word}' looks back to (heads averaged; causal: never forward)", fontsize=9)
    note = f"never seen in training: {', '.join(unseen)}" if unseen else "all words seen in training"
    fig.suptitle(f"text encoder self-attention: \"{sentence}\"\n({note})", fontsize=10)
    fig.savefig(path)


def positions_figure(text_encoder, path, n: int | None = None) -> torch.Tensor:
    """Cosine similarity of the learned position embeddings: attention alone does not see order."""
    pos = text_encoder.embeddings.position_embedding.weight.detach().cpu()[:n]
    unit = F.normalize(pos, dim=-1)
    sim = unit @ unit.T  # (P, P)
    fig = _figure(5, 4.4)
    ax = fig.add_subplot()
    im = ax.imshow(sim.numpy(), cmap="coolwarm", vmin=-1, vmax=1)
    ax.set_xlabel("position")
    ax.set_ylabel("position")
    ax.set_title("cosine similarity of position embeddings")
    fig.colorbar(im, ax=ax)
    fig.savefig(path)
    return sim


# --- cross-attention per head and layer, one word
def head_layer_maps(store: AttentionStore, tokens: list[int], size, kind: str = "plain",
                    refinement: Refinement = DEFAULT_REFINEMENT) -> tuple[list[str], torch.Tensor]:
    """Layers (names) and maps (layers, heads + 1, H, W) for the given token positions of image 0;
    the last column is the heads' mean. `kind` (crossattn.maps.MAP_KINDS) says how each cell is read:
    plain (bilinear), refined (propagated through the recorded self-attention first, as `refined_token_maps`)
    or daam (DAAM's per-head step: bicubic, clamped at 0)."""
    if kind not in MAP_KINDS:
        raise ValueError(f"kind must be one of {MAP_KINDS}, got {kind!r}")
    names = [n for n in store.layers if store.is_cross[n]]
    if kind == "refined":
        affinity, affinity_hw = self_affinity(store, refinement.self_resolution, refinement.self_timesteps)
        affinity = sharpen_affinity(affinity, refinement.sharpen)[:1]  # image 0
    rows = []
    for name in names:
        h, w = store.layer_shapes[name]
        per_head = torch.stack([store.mean(name, heads=[k])[0] for k in range(store.heads(name))])  # (heads, N, T)
        per_head = torch.cat([per_head, per_head.mean(0, keepdim=True)])
        grid = per_head[:, :, tokens].sum(-1).reshape(-1, 1, h, w)  # (heads + 1, 1, h, w)
        if kind == "refined":
            grid = propagate(grid.transpose(0, 1), affinity, affinity_hw, refinement.iterations,
                             refinement.renorm).transpose(0, 1)
        mode = "bicubic" if kind == "daam" else "bilinear"
        rows.append(F.interpolate(grid, size=size, mode=mode, align_corners=False)[:, 0].clamp(min=0))
    width = max(r.shape[0] for r in rows)
    rows = [torch.cat([r, r.new_full((width - r.shape[0], *size), float("nan"))]) for r in rows]
    return names, torch.stack(rows)


def _shape_label(store, name):
    h, w = store.layer_shapes[name]
    return f"{name}\n({h}×{w})"


def heads_figure(image: np.ndarray, names, maps: torch.Tensor, store, word: str, prompt: str, path,
                 kind: str = "plain") -> None:
    L, K = maps.shape[:2]
    fig = _figure(1.7 * K + 1.5, 1.7 * L + 0.8)
    axes = fig.subplots(L, K, squeeze=False)
    for i in range(L):
        for k in range(K):
            ax = axes[i, k]
            ax.set_xticks([])
            ax.set_yticks([])
            if torch.isnan(maps[i, k]).all():
                ax.set_axis_off()
                continue
            ax.imshow(image, interpolation="nearest")
            ax.imshow(maps[i, k].numpy(), cmap=CMAP, alpha=ALPHA, interpolation="bilinear")
            if i == 0:
                ax.set_title("mean" if k == K - 1 else f"head {k}", fontsize=9)
            if k == 0:
                ax.set_ylabel(_shape_label(store, names[i]), fontsize=6)
    how = "" if kind == "plain" else f" ({kind} maps)"
    fig.suptitle(f"cross-attention to '{word}'{how} per head (columns) and layer (rows): \"{prompt}\"", fontsize=10)
    fig.savefig(path)


# --- self-attention of one pixel
def pixel_maps(store: AttentionStore, pixel: tuple[int, int], size) -> dict[str, torch.Tensor]:
    """For each self-attention layer: where pixel (x, y) of the image looks, (H, W) upsampled, image 0."""
    H, W = size
    x, y = pixel
    if not (0 <= x < W and 0 <= y < H):
        raise ValueError(f"pixel (x={x}, y={y}) lies outside the {W}x{H} image")
    out = {}
    for name in store.layers:
        if store.is_cross[name]:
            continue
        h, w = store.layer_shapes[name]
        row = store.mean(name)[0, (y * h // H) * w + x * w // W]  # (N,) the query at that pixel
        out[name] = F.interpolate(row.reshape(1, 1, h, w), size=size, mode="bilinear", align_corners=False)[0, 0]
    if not out:
        raise ValueError("no self-attention was recorded: attach AttentionStore(self_attention=True)")
    return out


def pixel_figure(image: np.ndarray, maps: dict, pixel, store, path) -> None:
    fig = _figure(2.6 * (len(maps) + 1), 3.0)
    axes = fig.subplots(1, len(maps) + 1, squeeze=False)[0]
    axes[0].imshow(image, interpolation="nearest")
    axes[0].plot([pixel[0]], [pixel[1]], marker="+", color="white", markersize=14, mew=2)
    axes[0].set_title(f"pixel (x={pixel[0]}, y={pixel[1]})", fontsize=9)
    for ax, (name, heat) in zip(axes[1:], maps.items()):
        ax.imshow(image, interpolation="nearest")
        ax.imshow(heat.numpy(), cmap=CMAP, alpha=ALPHA, interpolation="bilinear")
        ax.plot([pixel[0]], [pixel[1]], marker="+", color="white", markersize=14, mew=2)
        ax.set_title(_shape_label(store, name), fontsize=7)
    for ax in axes:
        ax.set_axis_off()
    fig.suptitle("self-attention: where one pixel looks", fontsize=10)
    fig.savefig(path)
