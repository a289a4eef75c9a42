"""Captioned scenes of the scenes-64 world (`unet/world.py`): one to four coloured shapes on black at 64x64, in one
or two groups, with an exact mask per object and the objects each count, size, colour and shape word names.

Everything is drawn from a seed, so the same seed gives the same images, captions and masks. The training split
never names a held-out colour x shape or count x shape combination, and never draws a held-out colour x shape
object, even under a colourless caption; the "eval" split names at least one held-out combination in every caption.
scenes-32's data (`unet/data.py`) is untouched by this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

from .data import POSITIONS, SceneDataset, check_and_order, scenes_to_tensor
from .relations import POSITION_SIDES, first_as_read, relative_position
from .world import (
    COLORS,
    HELD_OUT_COLOR_SHAPES,
    IMAGE_SIZE,
    MAX_OBJECTS,
    READING_RELATIONS,
    RELATIONS,
    SHAPES,
    SIZES,
    Description,
    Group,
)

SUPERSAMPLE = 4  # each pixel's coverage from 4x4 sub-pixel samples
GAP = 2.0  # pixels kept empty between any two objects' boxes, so each object is its own connected component
# Where "on the left" etc. puts every object's centre: within this share of the image from that side
POSITION_SHARE = 0.4
# A relation is drawn so that it holds by the evaluation's rule (GenEval's, `relative_position`) at twice its
# threshold: a margin for the detector's boxes, which differ from the drawn ones by a pixel
RELATION_MARGIN = 0.2
# Reading order is decided by whichever offset is larger, with no threshold: drawn centres keep it when the
# detector's (box centres, up to half a pixel off each) shift the offset by a pixel either way
READING_MARGIN = 1.0
PLACEMENT_TRIES = 100  # layouts tried before a caption is judged not to fit (the sampler then draws another)
OBJECT_TRIES = 20  # positions tried for one object before its layout is given up
# The star's outer radius against its box side, so that its box is as wide as the side: 2 cos(18 deg) R = side
STAR_RADIUS = 1 / (2 * math.cos(math.radians(18)))
STAR_INNER = 0.45  # inner vertices' radius against the outer: pointed enough to tell from a circle when small
# The star's outer vertices reach R up and R sin(54 deg) down: its centre sits below its box's centre by this share
STAR_DROP = (1 - math.sin(math.radians(54))) / 2 * STAR_RADIUS
CROSS_ARM = 1 / 3  # the cross's arm width against its side
STATED = ("left of", "right of", "above", "below", "and")  # what two groups' captions state, drawn alike


def inside(shape: str, dx: np.ndarray, dy: np.ndarray, side: float) -> np.ndarray:
    """Whether points at offsets (dx, dy) pixels from a shape's box centre (y down) are inside the shape drawn in
    a box `side` pixels wide. Every shape's box is centred on its centre and `side` wide."""
    r = side / 2
    if shape == "circle":
        return dx * dx + dy * dy <= r * r
    if shape == "square":
        return (np.abs(dx) <= r) & (np.abs(dy) <= r)
    if shape == "triangle":  # apex up, base at the bottom of the box
        t = np.clip((dy + r) / (2 * r), 0, 1)
        return (dy >= -r) & (dy <= r) & (np.abs(dx) <= t * r)
    if shape == "diamond":
        return np.abs(dx) + np.abs(dy) <= r
    if shape == "cross":  # a plus sign
        arm = r * CROSS_ARM
        return ((np.abs(dx) <= arm) & (np.abs(dy) <= r)) | ((np.abs(dy) <= arm) & (np.abs(dx) <= r))
    if shape == "star":  # five points, one up
        outer = side * STAR_RADIUS
        x, y = dx, -(dy - side * STAR_DROP)  # about the star's own centre, y up
        radius = np.hypot(x, y)
        # fold the angle from the nearest outer vertex into [0, 36] degrees: the star is symmetric about each
        # vertex's axis and repeats every 72
        angle = np.abs((np.arctan2(x, y) + math.pi / 5) % (2 * math.pi / 5) - math.pi / 5)
        px, py = radius * np.cos(angle), radius * np.sin(angle)  # along and across the vertex's axis
        ax, bx, by = outer, outer * STAR_INNER * math.cos(math.pi / 5), outer * STAR_INNER * math.sin(math.pi / 5)
        # inside when on the centre's side of the edge from the outer vertex (ax, 0) to the inner one (bx, by)
        return (bx - ax) * py - by * (px - ax) >= 0
    raise ValueError(f"unknown shape {shape!r}; expected one of {SHAPES}")


def coverage(shape: str, cx: float, cy: float, side: float, height: int, width: int) -> tuple[np.ndarray, tuple]:
    """The share of each pixel the shape covers, on the crop of the image around its box: ((h, w) float in
    [0, 1], (y0, y1, x0, x1) the crop's place in the (height, width) image)."""
    half = side / 2 + 1
    y0, y1 = max(0, math.floor(cy - half)), min(height, math.ceil(cy + half))
    x0, x1 = max(0, math.floor(cx - half)), min(width, math.ceil(cx + half))
    ss = SUPERSAMPLE
    ys = y0 + (np.arange((y1 - y0) * ss) + 0.5) / ss - cy
    xs = x0 + (np.arange((x1 - x0) * ss) + 0.5) / ss - cx
    points = inside(shape, xs[None, :], ys[:, None], side)  # (h * ss, w * ss)
    return points.reshape(y1 - y0, ss, x1 - x0, ss).mean(axis=(1, 3)), (y0, y1, x0, x1)


@dataclass
class WorldObject:
    color: str
    shape: str
    size: str  # "small" or "big"
    center: tuple[float, float]  # (x, y), pixels
    side: float  # the box's side, pixels
    mask: np.ndarray = field(repr=False)  # (H, W) bool: pixels covered more than half


@dataclass
class WorldScene:
    image: np.ndarray  # (H, W, 3) uint8
    caption: str
    description: Description
    objects: list[WorldObject]  # group by group, as `Description.word_objects` numbers them
    word_objects: dict[int, tuple[int, ...]]  # whitespace-word index -> the objects that word names

    def word_mask(self, index: int) -> np.ndarray:
        """(H, W) bool: the pixels of every object whitespace word `index` names (a grounding loss's target)."""
        return np.any([self.objects[k].mask for k in self.word_objects[index]], axis=0)

    def groups(self) -> list[list[WorldObject]]:
        """The objects of each group, in caption order."""
        out, first = [], 0
        for group in self.description.groups:
            out.append(self.objects[first:first + group.count])
            first += group.count
        return out


def render(objects: list[tuple[str, str, float, float, float]], height: int, width: int):
    """Draw (color, shape, cx, cy, side) objects on black. Objects must not overlap (the sampler keeps them
    apart), so each mask is the whole object. Returns the (H, W, 3) uint8 image and one (H, W) bool mask each."""
    image = np.zeros((height, width, 3), np.float32)
    masks = []
    for color, shape, cx, cy, side in objects:
        cover, (y0, y1, x0, x1) = coverage(shape, cx, cy, side, height, width)
        image[y0:y1, x0:x1] += cover[..., None] * np.array(COLORS[color], np.float32)
        mask = np.zeros((height, width), bool)
        mask[y0:y1, x0:x1] = cover > 0.5
        masks.append(mask)
    return image.round().clip(0, 255).astype(np.uint8), masks


def apart(a: tuple[float, float, float], b: tuple[float, float, float]) -> bool:
    """Whether two (cx, cy, side) boxes are at least `GAP` pixels apart along one axis."""
    reach = (a[2] + b[2]) / 2 + GAP
    return abs(a[0] - b[0]) >= reach or abs(a[1] - b[1]) >= reach


def holds(relation: str, a: tuple[float, float, float], b: tuple[float, float, float], reading: bool) -> bool:
    """Whether box `a` stands in `relation` to box `b` by the evaluation's rule with a margin; `reading`: and
    comes first as read (the "and" convention) with every centre offset changed by up to `READING_MARGIN`."""
    boxes = [SimpleNamespace(center=(x, y), size=(side, side)) for x, y, side in (a, b)]
    if relation not in relative_position(*boxes, threshold=RELATION_MARGIN):
        return False
    m = READING_MARGIN
    return not reading or all(first_as_read(a[:2], (b[0] + ex, b[1] + ey)) for ex in (-m, m) for ey in (-m, m))


class Scenes64Sampler:
    """Draws scenes of the world from a seed. `split`: "train" (no held-out combination), "eval" (at least one
    in every caption) or "all". Shares: `p_one_group` of captions name one group; `p_position` of those say where
    it is; `p_colourless` and `p_unsized` of groups leave out their colour or size word. `and_order` "reading":
    "A and B" draws every A before every B as read; "any": on any side. `seed` may be a tuple, e.g. (seed, step)
    for a training batch of its own."""

    def __init__(self, seed: int | tuple[int, ...] = 0, split: str = "train", size: int = IMAGE_SIZE,
                 p_one_group: float = 0.4, p_position: float = 0.25, p_colourless: float = 0.2, p_unsized: float = 0.5,
                 and_order: str = "reading"):
        if split not in ("train", "eval", "all"):
            raise ValueError(f"split must be 'train', 'eval' or 'all', got {split!r}")
        check_and_order(and_order)
        shares = {"p_one_group": p_one_group, "p_position": p_position, "p_colourless": p_colourless,
                  "p_unsized": p_unsized}
        for name, share in shares.items():
            if not 0 <= share <= 1:
                raise ValueError(f"{name} must be a share in [0, 1], got {share}")
        if size < 16:  # four big objects fit down to here; the detector needs 64 px (docs/guides/scenes-64.md)
            raise ValueError(f"size must be at least 16 pixels, got {size}")
        self.rng = np.random.default_rng(seed)
        self.split, self.size, self.and_order = split, size, and_order
        self.p_one_group, self.p_position, self.p_colourless, self.p_unsized = shares.values()
        self.unfit = 0  # captions drawn again because their objects did not fit (a share the guide reports)

    def _colors_for(self, shape: str) -> list[str]:
        """The colours an object of `shape` may be drawn in: in training, none held out with it."""
        return [c for c in COLORS if self.split != "train" or (c, shape) not in HELD_OUT_COLOR_SHAPES]

    def _group(self, count: int) -> Group:
        rng = self.rng
        shape = SHAPES[rng.integers(len(SHAPES))]
        colors = self._colors_for(shape)
        color = None if rng.random() < self.p_colourless else colors[rng.integers(len(colors))]
        size = None if rng.random() < self.p_unsized else list(SIZES)[rng.integers(len(SIZES))]
        return Group(count, shape, color, size, "one" if rng.random() < 0.25 else "a")  # "one" for a quarter

    def _in_split(self, description: Description) -> bool:
        held_out = bool(description.held_out())
        return {"train": not held_out, "eval": held_out, "all": True}[self.split]

    def description(self) -> Description:
        """A random caption's meaning, in this sampler's split."""
        rng = self.rng
        while True:
            if rng.random() < self.p_one_group:
                group = self._group(int(rng.integers(1, MAX_OBJECTS + 1)))
                position = None
                if rng.random() < self.p_position:
                    position = POSITIONS[rng.integers(len(POSITIONS))]
                description = Description((group,), position=position)
            else:
                first = int(rng.integers(1, MAX_OBJECTS))
                groups = (self._group(first), self._group(int(rng.integers(1, MAX_OBJECTS - first + 1))))
                # each stated relation and "and" alike, then either phrasing of left and right
                connector = STATED[rng.integers(len(STATED))]
                phrasings = [words for words, stated in RELATIONS.items() if stated == connector] or ["and"]
                connector = phrasings[rng.integers(len(phrasings))]
                if not groups[0].exclusive_with(groups[1]):
                    continue
                description = Description(groups, connector)
            if self._in_split(description):
                return description

    def _objects(self, description: Description) -> list[tuple[str, str, str, float]]:
        """(colour, shape, size word, side in pixels) for every object, group by group."""
        rng, out = self.rng, []
        for group in description.groups:
            colors = self._colors_for(group.shape)
            for _ in range(group.count):
                color = group.color or colors[rng.integers(len(colors))]
                size = group.size or list(SIZES)[rng.integers(len(SIZES))]
                low, high = SIZES[size]
                out.append((color, group.shape, size, rng.uniform(low, high) * self.size))
        return out

    def _region(self, description: Description, group: int, cut: float, axis: int) -> list[tuple[float, float]]:
        """The (low, high) bounds of a centre of `group` on x and y, before each object's own margin: the whole
        image, the part a position names, or the group's side of `cut` on a relation's `axis`."""
        S = self.size
        bounds = [(0.0, S), (0.0, S)]
        if description.position:
            axis_of, sign = POSITION_SIDES[f"on the {description.position}"]
            bounds[axis_of] = (0.0, POSITION_SHARE * S) if sign < 0 else ((1 - POSITION_SHARE) * S, S)
        elif len(description.groups) == 2:
            before = group == 0 if cut >= 0 else group == 1  # which group lies on the low side of the cut
            bounds[axis] = (0.0, abs(cut)) if before else (abs(cut), S)
        return bounds

    def _scatter(self, description: Description, sides: list[float], cut: float, axis: int) -> list | None:
        """(cx, cy, side) boxes, each in its group's region and `GAP` apart from those before it (`OBJECT_TRIES`
        positions each), or None when one found no room."""
        boxes, first_group = [], description.groups[0].count
        for i, side in enumerate(sides):
            bounds = self._region(description, 0 if i < first_group else 1, cut, axis)
            margin = side / 2 + 1
            low = [max(lo, margin) for lo, _ in bounds]
            high = [min(hi, self.size - margin) for _, hi in bounds]
            if low[0] > high[0] or low[1] > high[1]:
                return None
            for _ in range(OBJECT_TRIES):
                box = (self.rng.uniform(low[0], high[0]), self.rng.uniform(low[1], high[1]), side)
                if all(apart(box, other) for other in boxes):
                    boxes.append(box)
                    break
            else:
                return None
        return boxes

    def _place(self, description: Description, sides: list[float]) -> list[tuple[float, float]] | None:
        """Centres for objects of these sides so that the caption holds, or None if `PLACEMENT_TRIES` layouts
        all failed. Two groups are split by a random cut across the relation's axis, then every pair checked."""
        rng, S = self.rng, self.size
        relation = description.stated_relation()
        reading = relation == "and" and self.and_order == "reading"
        if relation == "and":
            relation = READING_RELATIONS[rng.integers(2)] if reading else ("left of", "right of", "above",
                                                                            "below")[rng.integers(4)]
        axis = 0 if relation in ("left of", "right of") else 1
        first_group = description.groups[0].count
        for _ in range(PLACEMENT_TRIES):
            cut = rng.uniform(0.3, 0.7) * S
            if relation in ("right of", "below"):
                cut = -cut  # the first group on the high side
            boxes = self._scatter(description, sides, cut, axis)
            if boxes is not None and (relation is None or all(
                    holds(relation, a, b, reading) for a in boxes[:first_group] for b in boxes[first_group:])):
                return [(x, y) for x, y, _ in boxes]
        return None

    def draw(self, description: Description) -> WorldScene | None:
        """A scene of `description`, or None when its objects do not fit (e.g. four big objects on the left)."""
        objects = self._objects(description)
        centres = self._place(description, [side for *_, side in objects])
        if centres is None:
            return None
        image, masks = render([(c, s, x, y, side) for (c, s, _, side), (x, y) in zip(objects, centres)],
                              self.size, self.size)
        drawn = [WorldObject(c, s, size, xy, side, m) for (c, s, size, side), xy, m in zip(objects, centres, masks)]
        return WorldScene(image, description.text(), description, drawn, description.word_objects())

    def __call__(self) -> WorldScene:
        while True:  # a caption whose objects do not fit is drawn again
            scene = self.draw(self.description())
            if scene is not None:
                return scene
            self.unfit += 1


def scenes64_dataset(n: int, seed: int = 0, split: str = "train", size: int = IMAGE_SIZE) -> SceneDataset:
    """`n` scenes of the world as scenes-32's in-memory dataset: images (n, 3, size, size) uint8 and captions."""
    sampler = Scenes64Sampler(seed, split, size)
    scenes = [sampler() for _ in range(n)]
    return SceneDataset(scenes_to_tensor(scenes), [s.caption for s in scenes])
