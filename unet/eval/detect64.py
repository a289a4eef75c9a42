"""Find the objects in a scenes-64 image (`unet/world.py`): colour by nearest hue, connected components, shape by
the best-fitting drawn template, size word from the fitted side.

Eight colours are too close in RGB for scenes-32's chroma rule (orange lies between red and yellow), but their hues
are at least 28 degrees apart and an anti-aliased edge on black keeps its object's hue. Six shapes at ~10 pixels are
too small for hand-made fill rules (a small star and a small cross fill their boxes alike), so each component is
compared with every shape drawn by the generator itself (`unet.scenes64.coverage`) in the component's box, and the
shape whose drawing overlaps it most wins. scenes-32's detector (`detect.py`) is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from scipy import ndimage

from ..scenes64 import coverage
from ..world import COLORS, SHAPES, SIZES
from .detect import Detection, components, rgb_image

# The palette's RGB: (colors, 3)
PALETTE_RGB = np.array(list(COLORS.values()), np.float32)


def hue(pixels: np.ndarray) -> np.ndarray:
    """HSV hue in degrees [0, 360) of (..., 3) RGB pixels: (...)."""
    pixels = pixels.astype(np.float32)
    r, g, b = pixels[..., 0], pixels[..., 1], pixels[..., 2]
    top, bottom = pixels.max(axis=-1), pixels.min(axis=-1)
    delta = np.maximum(top - bottom, 1e-6)
    h = np.where(top == r, (g - b) / delta % 6, np.where(top == g, (b - r) / delta + 2, (r - g) / delta + 4))
    return h * 60 % 360


PALETTE_HUES = hue(PALETTE_RGB)  # (colors,)
NAMES = list(COLORS)
# The side (pixels, as a share of the image) that splits small from big: midway between the two sizes' ranges
SIZE_SPLIT = (SIZES["small"][1] + SIZES["big"][0]) / 2
# How much the fitted side may differ from the component's box: the detector's mask takes pixels covered about a
# quarter (brightness 60 of a channel near 240), so its box is up to a pixel wider than the drawn side
SIDE_TRIES = (-1.5, -1.0, -0.5, 0.0)


@dataclass
class Detection64(Detection):
    """A scenes-64 object: `Detection` (colour, shape, centre, box, mask) plus its size word and fitted side."""
    size_word: str = "small"
    side: float = 0.0  # pixels: the side of the best-fitting template


def fit_shape(mask: np.ndarray, cover: np.ndarray) -> tuple[str, float, float]:
    """The shape whose drawing best matches one object: (shape, side in pixels, overlap). `mask` ((H, W) bool) is
    the object's component; `cover` ((H, W) float in [0, 1]) how much of each pixel it seems to cover (zero away
    from it). Each template is drawn centred in the mask's box at the box's larger extent and slightly less, and
    compared by soft IoU, sum(min) / sum(max): anti-aliased edges carry the shape of a 10-pixel star, which a
    binary mask loses (a small star's mask fits a diamond or a circle a quarter of the time; its coverage 0.99 of
    the time right, docs/guides/scenes-64.md)."""
    ys, xs = np.nonzero(mask)
    y0, y1, x0, x1 = ys.min(), ys.max() + 1, xs.min(), xs.max() + 1
    cx, cy, extent = (x0 + x1) / 2, (y0 + y1) / 2, max(x1 - x0, y1 - y0)
    best = ("circle", float(extent), -1.0)
    for shape in SHAPES:
        for change in SIDE_TRIES:
            side = max(1.0, extent + change)
            drawn, (a, b, c, d) = coverage(shape, cx, cy, side, *mask.shape)
            template = np.zeros(mask.shape, np.float32)
            template[a:b, c:d] = drawn
            union = np.maximum(template, cover).sum()
            overlap = float(np.minimum(template, cover).sum() / union) if union else 0.0
            if overlap > best[2]:
                best = (shape, side, overlap)
    return best


def detect(image: np.ndarray, min_pixels: int = 4, brightness: float = 60.0,
           saturation: float = 0.4) -> list[Detection64]:
    """Objects in an (H, W, 3) uint8 image (or float in [0, 1]) of the scenes-64 world, largest first. A pixel is
    an object's when its brightest channel passes `brightness` and its saturation `saturation` (the world's
    colours are all near 0.9; grey and white artefacts are not objects)."""
    image = rgb_image(image)
    pixels = image.astype(np.float32)
    top = pixels.max(axis=2)
    foreground = (top > brightness) & ((top - pixels.min(axis=2)) / np.maximum(top, 1) > saturation)
    gap = np.abs(hue(pixels)[:, :, None] - PALETTE_HUES[None, None])  # (H, W, colors)
    nearest = np.minimum(gap, 360 - gap).argmin(axis=2)  # (H, W): the nearest hue around the circle
    found = []
    for c, mask, box in components(foreground, nearest, len(NAMES), min_pixels):
        near = ndimage.binary_dilation(mask)  # with the faint edge pixels below `brightness`
        cover = np.where(near, np.clip(top / PALETTE_RGB[c].max(), 0, 1), 0)
        shape, side, _ = fit_shape(mask, cover)
        size_word = "small" if side < SIZE_SPLIT * image.shape[0] else "big"
        found.append(Detection64(NAMES[c], shape, ((box[0] + box[2]) / 2, (box[1] + box[3]) / 2), box, mask,
                                 size_word, side))
    return sorted(found, key=lambda d: -d.mask.sum())


def detector_rates(scenes: list) -> dict:
    """The detector against drawn scenes' truth (`unet.scenes64.WorldScene`): for each object, the detection
    overlapping it most must cover more than half its mask. Returns the share of objects it gets right per
    "shape/size" (its shape), and overall for "color", "shape", "size" and "all" three together; "count": the
    share of scenes with exactly one detection per object; "objects" and "scenes": how many were judged."""
    tallies: dict[str, list[int]] = {}

    def tally(key: str, right: bool):
        hits, total = tallies.setdefault(key, [0, 0])
        tallies[key] = [hits + bool(right), total + 1]

    for scene in scenes:
        found = detect(scene.image)
        tally("count", len(found) == len(scene.objects))
        for obj in scene.objects:
            d = max(found, key=lambda d: (d.mask & obj.mask).sum(), default=None)
            if d is None or (d.mask & obj.mask).sum() <= obj.mask.sum() / 2:
                d = None
            truth = (obj.color, obj.shape, obj.size)
            seen = (d.color, d.shape, d.size_word) if d else (None, None, None)
            tally(f"{obj.shape}/{obj.size}", seen[1] == obj.shape)
            for key, a, b in zip(("color", "shape", "size"), seen, truth):
                tally(key, a == b)
            tally("all", seen == truth)
    rates = {key: hits / total for key, (hits, total) in tallies.items()}
    rates["objects"] = tallies.get("all", [0, 0])[1]
    rates["scenes"] = len(scenes)
    return rates
