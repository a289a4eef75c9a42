"""Pictures of word maps: a heat map over the image per word, a grid of them, per-word PNGs.

Figures are drawn with matplotlib's object API (no pyplot state), so this works headless and in
threads. Small images are shown with nearest-neighbour pixels and the maps smoothly, both enlarged,
so a 32x32 image reads clearly. All panels of one figure share one colour scale.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

CMAP = "jet"
ALPHA = 0.5


def to_uint8(images) -> np.ndarray:
    """Floats in [0, 1] (any shape, e.g. (N, H, W, 3)) as uint8 0-255, rounded; values outside are clipped."""
    return (np.clip(np.asarray(images), 0, 1) * 255).round().astype(np.uint8)


def _as_image(image) -> np.ndarray:
    array = np.asarray(image)
    if array.dtype != np.uint8:
        array = to_uint8(array)
    if array.ndim != 3 or array.shape[2] != 3:
        raise ValueError(f"image must be (H, W, 3), got {array.shape}")
    return array


def _as_maps(maps) -> np.ndarray:
    array = maps.detach().cpu().float().numpy() if isinstance(maps, torch.Tensor) else np.asarray(maps, np.float32)
    return array[None] if array.ndim == 2 else array


def _draw(ax, image, heat, vmin, vmax, title, cmap, alpha):
    H, W = image.shape[:2]
    extent = (0, W, H, 0)  # the map lies exactly over the image, whatever its aspect ratio
    ax.imshow(image, interpolation="nearest", extent=extent)
    im = None
    if heat is not None:
        im = ax.imshow(heat, cmap=cmap, alpha=alpha, vmin=vmin, vmax=vmax, interpolation="bilinear", extent=extent)
    ax.set_title(title, fontsize=11)
    ax.set_axis_off()
    return im


def overlay_grid(image, maps, words: list[str], path: str | Path, title: str | None = None,
                 vmax: float | None = None, cmap: str = CMAP, alpha: float = ALPHA, panel_inches: float = 2.0,
                 max_columns: int = 6) -> Path:
    """Save the image and one heat-map panel per word, with a shared colour bar, as a PNG."""
    image, maps = _as_image(image), _as_maps(maps)
    if len(maps) != len(words):
        raise ValueError(f"{len(maps)} maps for {len(words)} words")
    vmax = float(maps.max()) if vmax is None else vmax
    n = len(words) + 1
    cols = min(n, max_columns)
    rows = -(-n // cols)
    aspect = image.shape[0] / image.shape[1]
    fig = Figure(figsize=(panel_inches * cols + 0.8, rows * (panel_inches * aspect + 0.35) + (0.4 if title else 0)),
                 dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[n:]:
        ax.set_axis_off()
    _draw(axes[0], image, None, 0, vmax, "image", cmap, alpha)
    im = None
    for ax, heat, word in zip(axes[1:], maps, words):
        im = _draw(ax, image, heat, 0.0, vmax, word, cmap, alpha)
    if im is not None:
        fig.colorbar(im, ax=list(axes), fraction=0.03, pad=0.01, label="attention share")
    if title:
        fig.suptitle(title, fontsize=12)
    path = Path(path)
    fig.savefig(path)
    return path


def word_overlay(image, heat, word: str, path: str | Path, vmax: float | None = None, cmap: str = CMAP,
                 alpha: float = ALPHA, inches: float = 3.2) -> Path:
    """Save one word's heat map over the image, the word as title, as a PNG."""
    image, heat = _as_image(image), _as_maps(heat)[0]
    fig = Figure(figsize=(inches + 0.6, inches * image.shape[0] / image.shape[1] + 0.4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    im = _draw(ax, image, heat, 0.0, float(heat.max()) if vmax is None else vmax, word, cmap, alpha)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
    path = Path(path)
    fig.savefig(path)
    return path
