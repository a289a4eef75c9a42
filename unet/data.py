"""Captioned synthetic scenes with ground truth: 1-2 coloured shapes on black, per-object masks,
and which caption word names which object.

Everything is drawn from a seed, so the same seed gives the same images, captions and masks.
Two-object colour/shape combinations in `HELD_OUT_PAIRS` never appear in training captions;
evaluation prompts come from them.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

COLORS = {"red": (230, 25, 25), "green": (25, 200, 40), "blue": (40, 70, 245), "yellow": (240, 230, 30)}
SHAPES = ("circle", "square", "triangle")
RELATIONS = ("left of", "right of", "above", "below")
POSITIONS = ("left", "right", "top", "bottom")  # absolute positions for single objects
# Where an "and" caption ("a circle and a square") puts its first object. "any": on any side of the second, so
# nothing but the two shape words tells the objects apart, and the model must settle which is which between
# them. "reading": left of or above the second, as the objects are read, so the word order places them as a
# relation word would (docs/experiments/why-the-second-object-goes-missing.md).
AND_ORDERS = ("any", "reading")
READING_ORDER = {"right of": "left of", "below": "above"}


def check_and_order(order: str) -> None:
    """ValueError unless `order` is one of `AND_ORDERS`."""
    if order not in AND_ORDERS:
        raise ValueError(f"and_order must be one of {', '.join(AND_ORDERS)}, got {order!r}")
SCENE_WORDS = sorted(set(
    list(COLORS) + list(SHAPES) + list(POSITIONS)
    + "a an the and of to on in with above below image picture shape shapes object big small".split()
))


def _pair_held_out(c1: str, s1: str, c2: str, s2: str) -> bool:
    digest = hashlib.sha256(f"{c1} {s1}|{c2} {s2}".encode()).digest()
    return digest[0] % 7 == 0


ALL_PAIRS = [(c1, s1, c2, s2) for c1 in COLORS for s1 in SHAPES for c2 in COLORS for s2 in SHAPES
             if (c1, s1) != (c2, s2)]
HELD_OUT_PAIRS = [p for p in ALL_PAIRS if _pair_held_out(*p)]


@dataclass
class SceneObject:
    color: str
    shape: str
    center: tuple[float, float]  # (x, y) in pixels
    size: float  # side of the bounding box, pixels
    mask: np.ndarray = field(repr=False)  # (H, W) bool, visible pixels


@dataclass
class Scene:
    image: np.ndarray  # (H, W, 3) uint8
    caption: str
    objects: list[SceneObject]
    word_objects: dict[int, int]  # whitespace-word index -> object index, for colour and shape words
    relation: str | None = None  # "left of" etc. for relation captions: objects[0] <relation> objects[1]

    def word_mask(self, index: int) -> np.ndarray:
        """(H, W) bool: the visible pixels of the object whitespace word `index` names (a grounding loss's target)."""
        return self.objects[self.word_objects[index]].mask


def _coverage(shape: str, cx: float, cy: float, size: float, height: int, width: int, ss: int = 4) -> np.ndarray:
    """Fraction of each pixel the shape covers, by 4x4 supersampling: (H, W) float in [0, 1]."""
    ys = (np.arange(height * ss) + 0.5) / ss
    xs = (np.arange(width * ss) + 0.5) / ss
    X, Y = np.meshgrid(xs, ys)
    r = size / 2
    if shape == "circle":
        inside = (X - cx) ** 2 + (Y - cy) ** 2 <= r * r
    elif shape == "square":
        inside = (np.abs(X - cx) <= r) & (np.abs(Y - cy) <= r)
    elif shape == "triangle":  # apex up, base at the bottom of the box
        top, bottom = cy - r, cy + r
        t = np.clip((Y - top) / (2 * r), 0, 1)
        inside = (Y >= top) & (Y <= bottom) & (np.abs(X - cx) <= t * r)
    else:
        raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")
    return inside.reshape(height, ss, width, ss).mean(axis=(1, 3))


def scenes_to_tensor(scenes: list) -> torch.Tensor:
    """(B, 3, H, W) uint8 images of drawn scenes (each `.image` is (H, W, 3) uint8)."""
    return torch.from_numpy(np.stack([s.image for s in scenes])).permute(0, 3, 1, 2).contiguous()


def to_model_range(images: torch.Tensor) -> torch.Tensor:
    """uint8 pixels (any shape) as the model's floats in [-1, 1]."""
    return images.float() / 127.5 - 1


def render(objects: list[tuple[str, str, float, float, float]], height: int = 32, width: int = 32):
    """Draw (color, shape, cx, cy, size) objects on black; later objects cover earlier ones.

    Returns the (H, W, 3) uint8 image and one visible-pixel mask per object.
    """
    image = np.zeros((height, width, 3), np.float32)
    masks = []
    for color, shape, cx, cy, size in objects:
        cover = _coverage(shape, cx, cy, size, height, width)
        image = image * (1 - cover[..., None]) + cover[..., None] * np.array(COLORS[color], np.float32)
        masks = [m & (cover <= 0.5) for m in masks] + [cover > 0.5]
    return image.round().clip(0, 255).astype(np.uint8), masks


def _place_pair(rng: np.random.Generator, relation: str, size1: float, size2: float, height: int, width: int):
    """Centres for two objects so that `object 1 <relation> object 2` holds clearly."""
    horizontal = relation in ("left of", "right of")
    span, across = (width, height) if horizontal else (height, width)
    m1, m2 = size1 / 2 + 1, size2 / 2 + 1
    # first object's coordinate along the relation's axis, then the second beyond it without overlap
    # (on images too small for that, as close as fits)
    a = rng.uniform(m1, max(m1, span - m2 - (m1 + m2)))
    b = rng.uniform(min(a + m1 + m2, span - m2), span - m2)
    if relation in ("right of", "below"):
        a, b = span - a, span - b  # mirror: first object in the far half
    jitter = across * 0.12
    c1 = across / 2 + rng.uniform(-jitter, jitter)
    c2 = across / 2 + rng.uniform(-jitter, jitter)
    return ((a, c1), (b, c2)) if horizontal else ((c1, a), (c2, b))


class SceneSampler:
    """Draws scenes from a seed. `split="train"` avoids held-out pair combinations; "eval" uses only them."""

    def __init__(self, seed: int = 0, height: int = 32, width: int = 32, split: str = "train",
                 p_single: float = 0.4, p_colourless: float = 0.2, and_order: str = "any"):
        if split not in ("train", "eval", "all"):
            raise ValueError(f"split must be 'train', 'eval' or 'all', got {split!r}")
        check_and_order(and_order)
        self.rng = np.random.default_rng(seed)
        self.height, self.width, self.split, self.p_single = height, width, split, p_single
        self.p_colourless = p_colourless  # pairs of two different shapes captioned without colours
        self.and_order = and_order  # where "a circle and a square" puts the circle: see AND_ORDERS
        pairs = {"train": [p for p in ALL_PAIRS if p not in HELD_OUT_PAIRS], "eval": HELD_OUT_PAIRS,
                 "all": ALL_PAIRS}[split]
        self.pairs = pairs

    def _size(self) -> float:
        return self.rng.uniform(0.25, 0.4) * min(self.height, self.width)

    def single(self, color: str | None = None, shape: str | None = None, where: str | None = None) -> Scene:
        """One object; `where` (one of `POSITIONS`) forces an absolute-position caption ("on the left")."""
        rng, H, W = self.rng, self.height, self.width
        color = color or rng.choice(list(COLORS))
        shape = shape or rng.choice(SHAPES)
        size = self._size()
        r = size / 2 + 1
        cx, cy = rng.uniform(r, W - r), rng.uniform(r, H - r)
        style = rng.integers(4)  # drawn even when `where` forces the style, so the random stream is the same
        if where is not None:
            style = 0
        if style == 0:  # absolute position teaches position words without binding two objects
            where = where or rng.choice(POSITIONS)
            if where in ("left", "right"):
                cx = rng.uniform(r, W * 0.35) if where == "left" else rng.uniform(W * 0.65, W - r)
            else:
                cy = rng.uniform(r, H * 0.35) if where == "top" else rng.uniform(H * 0.65, H - r)
            caption = f"a {color} {shape} on the {where}"
        elif style == 1:
            caption = f"a {shape}"
        else:
            caption = f"a {color} {shape}"
        image, masks = render([(color, shape, cx, cy, size)], H, W)
        words = caption.split()
        word_objects = {i: 0 for i, w in enumerate(words) if w in (color, shape)}
        return Scene(image, caption, [SceneObject(color, shape, (cx, cy), size, masks[0])], word_objects)

    def pair(self, combo: tuple[str, str, str, str] | None = None, relation: str | None = None,
             with_colors: bool | None = None) -> Scene:
        rng, H, W = self.rng, self.height, self.width
        c1, s1, c2, s2 = combo or self.pairs[rng.integers(len(self.pairs))]
        if relation is None:
            relation = rng.choice(RELATIONS + ("and",))
        if with_colors is None:
            # the same draw and comparison as before this share was a parameter: 1 - 0.2 == 0.8 exactly
            with_colors = rng.random() < 1 - self.p_colourless or s1 == s2
        size1, size2 = self._size(), self._size()
        placed = relation
        if relation == "and":
            placed = rng.choice(RELATIONS)  # drawn under either order, so the random stream is the same
            if self.and_order == "reading":
                placed = READING_ORDER.get(placed, placed)
        (x1, y1), (x2, y2) = _place_pair(rng, placed, size1, size2, H, W)
        image, masks = render([(c1, s1, x1, y1, size1), (c2, s2, x2, y2, size2)], H, W)
        first = f"a {c1} {s1}" if with_colors else f"a {s1}"
        second = f"a {c2} {s2}" if with_colors else f"a {s2}"
        caption = f"{first} {relation} {second}"
        words = caption.split()
        split_at = len(first.split()) + len(relation.split())
        word_objects = {}
        for i, w in enumerate(words):
            obj = 0 if i < split_at else 1
            if w in ((c1, s1) if obj == 0 else (c2, s2)):
                word_objects[i] = obj
        objects = [SceneObject(c1, s1, (x1, y1), size1, masks[0]), SceneObject(c2, s2, (x2, y2), size2, masks[1])]
        return Scene(image, caption, objects, word_objects, relation if relation != "and" else None)

    def __call__(self) -> Scene:
        return self.single() if self.rng.random() < self.p_single else self.pair()


class SceneDataset(torch.utils.data.Dataset):
    """Images (N, 3, H, W) uint8 and their captions, held in memory."""

    def __init__(self, images: torch.Tensor, captions: list[str]):
        if images.dim() != 4 or images.shape[1] != 3 or len(images) != len(captions):
            raise ValueError(f"need images (N, 3, H, W) and N captions, got {tuple(images.shape)} and {len(captions)}")
        self.images, self.captions = images, captions

    def __len__(self):
        return len(self.captions)

    def __getitem__(self, i):
        return to_model_range(self.images[i]), self.captions[i]

    @classmethod
    def generate(cls, n: int, seed: int = 0, height: int = 32, width: int = 32, split: str = "train"):
        sampler = SceneSampler(seed, height, width, split)
        scenes = [sampler() for _ in range(n)]
        return cls(scenes_to_tensor(scenes), [s.caption for s in scenes])

    def save(self, folder: str | Path) -> None:
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({"images": self.images}, str(folder / "images.safetensors"))
        (folder / "captions.json").write_text(json.dumps(self.captions))

    @classmethod
    def load(cls, folder: str | Path):
        folder = Path(folder)
        if not (folder / "images.safetensors").exists() or not (folder / "captions.json").exists():
            raise FileNotFoundError(
                f"data folder {folder} must hold images.safetensors and captions.json "
                "(write one with `python scripts/train.py --make-data DIR`)")
        return cls(load_file(str(folder / "images.safetensors"))["images"],
                   json.loads((folder / "captions.json").read_text()))
