"""Find the objects in a scene image: colour by nearest palette entry, connected components, shape
from how the object fills its box.

Fill of the bounding box tells the shapes apart: a square fills ~1, a circle ~pi/4, a triangle ~1/2;
a triangle is also much wider at the bottom than at the top, which separates it from a small
circle when anti-aliasing blurs the fill.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from scipy import ndimage

from crossattn.overlay import to_uint8

from ..data import COLORS

PALETTE = np.array(list(COLORS.values()), np.float32)  # (colors, 3)
# Compare hue, not brightness: a dim yellow edge pixel is nearer green than yellow in plain RGB.
CHROMA = PALETTE / PALETTE.max(axis=1, keepdims=True)
NAMES = list(COLORS)


@dataclass
class Detection:
    color: str
    shape: str
    center: tuple[float, float]  # (x, y), pixels
    box: tuple[int, int, int, int]  # (x0, y0, x1, y1), x1/y1 exclusive
    mask: np.ndarray = field(repr=False)  # (H, W) bool

    @property
    def size(self) -> tuple[int, int]:
        return self.box[2] - self.box[0], self.box[3] - self.box[1]


def classify_shape(mask: np.ndarray) -> str:
    ys, xs = np.nonzero(mask)
    y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    crop = mask[y0:y1, x0:x1]
    fill = crop.mean()
    h = crop.shape[0]
    top, bottom = crop[: max(1, h // 3)].sum(), crop[h - max(1, h // 3):].sum()
    if bottom > 1.8 * max(top, 1) or fill < 0.6:
        return "triangle"
    return "square" if fill > 0.88 else "circle"


def rgb_image(image: np.ndarray) -> np.ndarray:
    """`image` as (H, W, 3) uint8, from uint8 or floats in [0, 1]; ValueError for any other shape."""
    image = np.asarray(image)
    if image.dtype != np.uint8:
        image = to_uint8(image)
    if image.ndim != 3 or image.shape[2] != 3:
        raise ValueError(f"image must be (H, W, 3), got {image.shape}")
    return image


def components(foreground: np.ndarray, nearest: np.ndarray, colors: int, min_pixels: int):
    """Each connected region of `foreground` pixels ((H, W) bool) whose nearest colour (`nearest`, (H, W) int) is
    one colour, for colours 0 .. `colors` - 1, of at least `min_pixels`: yields (colour, (H, W) bool mask, box
    (x0, y0, x1, y1), x1/y1 exclusive)."""
    for c in range(colors):
        labels, n = ndimage.label(foreground & (nearest == c))
        for k in range(1, n + 1):
            mask = labels == k
            if mask.sum() < min_pixels:
                continue
            ys, xs = np.nonzero(mask)
            yield c, mask, (int(xs.min()), int(ys.min()), int(xs.max()) + 1, int(ys.max()) + 1)


def detect(image: np.ndarray, min_pixels: int = 4, brightness: float = 60.0) -> list[Detection]:
    """Objects in an (H, W, 3) uint8 image (or float in [0, 1]), largest first."""
    pixels = rgb_image(image).astype(np.float32)
    foreground = pixels.max(axis=2) > brightness
    chroma = pixels / np.maximum(pixels.max(axis=2, keepdims=True), 1)
    nearest = np.linalg.norm(chroma[:, :, None, :] - CHROMA[None, None], axis=-1).argmin(axis=2)  # (H, W)
    found = [Detection(NAMES[c], classify_shape(mask), ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2), box, mask)
             for c, mask, box in components(foreground, nearest, len(NAMES), min_pixels)]
    return sorted(found, key=lambda d: -d.mask.sum())


def background_mask(shape: tuple[int, int], detections: list[Detection], margin: int = 1) -> np.ndarray:
    """(H, W) bool: every pixel farther than `margin` from a detected object (anti-aliased edges belong to
    objects)."""
    objects = np.zeros(shape, bool)
    for d in detections:
        objects |= d.mask
    if margin:
        objects = ndimage.binary_dilation(objects, iterations=margin)
    return ~objects
