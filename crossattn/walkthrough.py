"""The four steps of attention on one head, with every intermediate kept, for teaching.

Uses the very `CrossAttention` block the model uses: its learned projections make Q, K and V, and
the result is checked against what the block itself returns.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .attention import CrossAttention, attention


@dataclass
class Walkthrough:
    x: torch.Tensor  # (T, dim) token embeddings
    q: torch.Tensor  # (T, 4)
    k: torch.Tensor  # (T, 4)
    v: torch.Tensor  # (T, 4)
    scores: torch.Tensor  # (T, T) scaled dot products
    weights: torch.Tensor  # (T, T) softmax rows
    context: torch.Tensor  # (T, 4) weighted sums of Values
    block_context: torch.Tensor  # (T, 4) the same, computed by crossattn.attention inside the block
    block_output: torch.Tensor  # (T, dim) what CrossAttention returns
    projected: torch.Tensor  # (T, dim) our context vectors through the block's output layer


def walk(tokens: int = 32, dim: int = 16, value_width: int = 4, seed: int = 0) -> Walkthrough:
    """Self-attention of one head over `tokens` random embeddings of width `dim`."""
    if tokens < 2 or dim < 1 or value_width < 1:
        raise ValueError(f"need tokens >= 2, dim >= 1, value_width >= 1; got {tokens}, {dim}, {value_width}")
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    block = CrossAttention(dim, heads=1, head_dim=value_width).eval()
    x = torch.randn(tokens, dim, generator=gen)
    with torch.no_grad():
        q, k, v = block.to_q(x), block.to_k(x), block.to_v(x)  # step 1: three learned projections, (T, 4) each
        scores = q @ k.T / math.sqrt(value_width)  # step 2: scaled dot products, (T, T)
        weights = scores.softmax(dim=-1)  # step 3: softmax, each row sums to 1
        context = weights @ v  # step 4: weighted sum of Values, (T, 4)
        block_context, _ = attention(x[None], x[None], block.to_q, block.to_k, block.to_v, heads=1)
        block_output = block(x[None])[0]
        projected = block.to_out[0](context)
    return Walkthrough(x, q, k, v, scores, weights, context, block_context[0], block_output, projected)


def describe(w: Walkthrough, token: int = 0) -> list[str]:
    """The printed story of the walkthrough for one query token."""
    T = w.x.shape[0]
    row = w.weights[token]
    top = int(row.argmax())
    lines = [
        f"token embeddings x: {tuple(w.x.shape)}",
        f"1. project: Q = x Wq {tuple(w.q.shape)}, K = x Wk {tuple(w.k.shape)}, V = x Wv {tuple(w.v.shape)}",
        f"2. scaled dot products: Q K^T / sqrt({w.q.shape[1]}) -> {tuple(w.scores.shape)}",
        f"3. softmax over each row -> weights {tuple(w.weights.shape)}; row {token} sums to {row.sum().item():.6f}",
        f"4. weighted sum of Values: weights V -> {tuple(w.context.shape)}",
        "",
        f"token {token}'s weights on every token:",
        "  " + " ".join(f"{i}:{p:.3f}" for i, p in enumerate(row.tolist())),
        f"largest: token {top} ({row[top].item():.4f}); on token 0: {row[0].item():.4f}; "
        f"on token {T - 1}: {row[T - 1].item():.4f}",
        f"context vector of token {token}: [{', '.join(f'{c:.4f}' for c in w.context[token].tolist())}]",
        f"same as crossattn.CrossAttention's attention: {torch.allclose(w.context, w.block_context, atol=1e-6)}",
        f"CrossAttention's output = its output layer applied to these context vectors: "
        f"{torch.allclose(w.block_output, w.projected, atol=1e-5)}",
    ]
    return lines


def figure(w: Walkthrough, path, token: int = 0) -> None:
    """Bars of token `token`'s weights, and each Value's contribution to its context vector."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    T, width = w.v.shape
    row = w.weights[token]
    contributions = (row[:, None] * w.v).numpy()  # (T, 4): weight_j * v_j
    fig = Figure(figsize=(10, 6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(2, 1)
    ax1.bar(range(T), row.numpy(), color="C0")
    ax1.set_title(f"softmax weights of token {token} over all {T} tokens (sum = 1)")
    ax1.set_xlabel("key token")
    for c in range(width):  # grouped bars: one per Value component
        ax2.bar([i + (c - width / 2 + 0.5) * 0.2 for i in range(T)], contributions[:, c], 0.2, label=f"component {c}")
    ax2.axhline(0, color="k", lw=0.5)
    ctx = ", ".join(f"{c:.3f}" for c in w.context[token].tolist())
    ax2.set_title(f"each Value's contribution (weight × value); they sum to the context vector [{ctx}]")
    ax2.set_xlabel("key token")
    ax2.legend(fontsize=8, ncol=width)
    fig.savefig(path)
