"""Does the image follow the prompt? GenEval's tasks on our world (single object, two objects, colours,
position, colour attribution): the evaluation's prompts, and a prompt counts only if every clause holds,
judged by the detector; plus the background grain the model leaves around the objects."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from crossattn.overlay import to_uint8

from ..data import COLORS, HELD_OUT_PAIRS, RELATIONS, SHAPES
from ..relations import RELATION_SIDES, WORD_SIDES, first_as_read, relative_position
from .detect import Detection, background_mask

TASKS = ("single_object", "two_object", "colors", "position", "color_attr")


@dataclass
class EvalPrompt:
    task: str
    prompt: str
    objects: list[tuple[str | None, str]]  # (colour or None, shape) per object, in prompt order
    relation: str | None = None


def eval_prompts() -> list[EvalPrompt]:
    """GenEval-style prompts. Pairs with colours come from the held-out combinations only."""
    prompts = [EvalPrompt("single_object", f"a {s}", [(None, s)]) for s in SHAPES]
    prompts += [EvalPrompt("colors", f"a {c} {s}", [(c, s)]) for c in COLORS for s in SHAPES]
    shape_pairs = [(a, b) for a in SHAPES for b in SHAPES if a != b]
    prompts += [EvalPrompt("two_object", f"a {a} and a {b}", [(None, a), (None, b)]) for a, b in shape_pairs]
    prompts += [EvalPrompt("position", f"a {a} {r} a {b}", [(None, a), (None, b)], r)
                for a, b in shape_pairs for r in RELATIONS]
    prompts += [EvalPrompt("color_attr", f"a {c1} {s1} and a {c2} {s2}", [(c1, s1), (c2, s2)])
                for c1, s1, c2, s2 in HELD_OUT_PAIRS if c1 != c2 and s1 != s2]
    return prompts


def word_objects(prompt: str) -> dict[int, int]:
    """Word index -> object index for colour and shape words ("a red circle and a square": 1,2 -> 0; 5 -> 1)."""
    mapping, obj = {}, 0
    for i, w in enumerate(prompt.split()):
        if w in COLORS or w in SHAPES:
            mapping[i] = obj
        if w in SHAPES:
            obj += 1
    return mapping


def check(p: EvalPrompt, detections: list[Detection]) -> tuple[bool, list[Detection | None]]:
    """Whether every clause of `p` holds, and the detection matched to each of its objects."""
    matched, used = [], set()
    for color, shape in p.objects:
        hit = next((i for i, d in enumerate(detections) if i not in used and d.shape == shape
                    and (color is None or d.color == color)), None)
        matched.append(None if hit is None else detections[hit])
        if hit is not None:
            used.add(hit)
    ok = all(m is not None for m in matched)
    if ok and p.relation is not None:
        ok = p.relation in relative_position(matched[0], matched[1])
    return ok, matched


def background_grain(image: np.ndarray, detections: list[Detection], margin: int = 1) -> float:
    """Mean |pixel| (0-255 scale, all channels) of the background: every pixel farther than `margin` from a
    detected object. The data's background is exactly 0, so anything above it is grain the model left."""
    image = np.asarray(image)
    if image.dtype != np.uint8:
        image = to_uint8(image)
    background = image[background_mask(image.shape[:2], detections, margin)].astype(np.float64)  # (pixels, 3)
    return float(background.mean()) if background.size else 0.0


OPPOSITE_RELATIONS = {"horizontal": ("left of", "right of"), "vertical": ("above", "below")}
# the paired test's axes: (the word, its opposite, which prompts). "shapes": the evaluation's colourless relation
# prompts (the first two axes, as reports have always had them); "colours": relations between coloured objects;
# "one object": a coloured object's absolute position
PAIRED_AXES = {"horizontal": ("left of", "right of", "shapes"), "vertical": ("above", "below", "shapes"),
               "horizontal, coloured": ("left of", "right of", "colours"),
               "vertical, coloured": ("above", "below", "colours"),
               "on the left/right": ("on the left", "on the right", "one object"),
               "on the top/bottom": ("on the top", "on the bottom", "one object")}


def relation_response(records) -> dict:
    """Does the relation word move the objects at all? Per axis, over position images where both objects were
    found: P(first object on the side "left of" names | "left of") - P(same side | "right of"), and likewise
    "above" against "below". 0: the word is ignored (a model that places objects at random, or by the noise
    alone, whatever the word); 1: always obeyed. Position accuracy alone cannot tell a model that ignores the
    word from one that follows it half the time; this can. None on an axis without images of both words."""
    result = {}
    for axis, (first, second) in OPPOSITE_RELATIONS.items():
        index, sign = RELATION_SIDES[first]  # the side `first` names; `second` names the other
        shares, images = [], 0
        for relation in (first, second):
            offsets = [r["centers"][0][index] - r["centers"][1][index] for r in records
                       if r.get("relation") == relation and r.get("centers") and None not in r["centers"]]
            images += len(offsets)
            shares.append(np.mean([np.sign(o) == sign for o in offsets]) if offsets else None)
        response = None if None in shares else float(shares[0] - shares[1])
        result[axis] = {"response": response, "images": images}
    return result


def and_order(records) -> dict:
    """Where "and" prompts ("a circle and a square", "a blue triangle and a red circle") put the first-named
    object: the share of their images with both objects found whose first object comes first as read. A model
    that leaves the order to the noise gives about 0.5; one trained with `--and-order reading` about 1, which
    means that each "and" prompt is drawn in half the layouts it could be."""
    found = [r for r in records if r["task"] in ("two_object", "color_attr") and r.get("centers")
             and None not in r["centers"]]
    first = [first_as_read(*r["centers"]) for r in found]
    return {"first_as_read": float(np.mean(first)) if first else None, "images": len(first)}


def paired_relation_response(pairs: list[tuple], axis: str) -> dict:
    """`relation_response` from images paired by their noise: `pairs` holds, for one axis, (offset under the
    axis's first word, offset under the opposite word, mean |pixel difference| of the two images), an offset
    being the first object's centre minus the second's along the axis, None where an object was not found.

    Both images of a pair start from the same noise, so a word the model ignores gives the same image twice and
    a response of exactly 0, whatever the noise favours; unpaired, the noise's own bias shows up as response.
    `moved` is the share of pairs (both objects found in both) whose order along the axis the word changed.
    For a one-object axis (`PAIRED_AXES`), the offset is the object's centre minus the image's."""
    first = PAIRED_AXES[axis][0]
    _, sign = WORD_SIDES[first]
    found = [(a, b) for a, b, _ in pairs if a is not None and b is not None]
    first = [np.sign(a) == sign for a, _ in found]
    second = [np.sign(b) == sign for _, b in found]
    return {"response": float(np.mean(first) - np.mean(second)) if found else None,
            "moved": float(np.mean([x != y for x, y in zip(first, second)])) if found else None,
            "pixel_difference": float(np.mean([d for _, _, d in pairs])) if pairs else None,
            "pairs": len(found), "images": 2 * len(pairs)}


# --- map methods: each returns (B, T, H, W) token maps from the same recorded attention


def prompt_following(records) -> dict:
    result = {"n_images": {}}
    for task in TASKS:
        rows = [r for r in records if r["task"] == task]
        result[task] = sum(r["ok"] for r in rows) / len(rows) if rows else None
        result["n_images"][task] = len(rows)
    scored = [result[t] for t in TASKS if result[t] is not None]
    result["overall"] = sum(scored) / len(scored)  # GenEval: mean over tasks
    grain = [r["grain"] for r in records]
    result["background_grain"] = {"mean": float(np.mean(grain)), "p90": float(np.percentile(grain, 90)),
                                  "unit": "mean |pixel| of background pixels, 0-255"}
    return result


def parse_prompt(prompt: str) -> EvalPrompt:
    """The evaluation's reading of a scene prompt: its objects in order and its relation, so any prompt of the
    evaluation's kinds ("a red circle left of a blue square", "a triangle and a square") can be judged.

    Raises ValueError when the prompt names no shape, more than two, or a relation without two objects."""
    words = prompt.lower().split()
    objects, colour = [], None
    for w in words:
        if w in COLORS:
            colour = w
        elif w in SHAPES:
            objects.append((colour, w))
            colour = None
    text = f" {' '.join(words)} "
    relation = next((r for r in RELATIONS if f" {r} " in text), None)
    if not 1 <= len(objects) <= 2:
        raise ValueError(f"a judged prompt names one or two of the shapes {list(SHAPES)}, got {len(objects)} in "
                         f"{prompt!r}")
    if relation is not None and len(objects) != 2:
        raise ValueError(f"the relation {relation!r} needs two objects, {prompt!r} names {len(objects)}")
    if len(objects) == 1:
        task = "colors" if objects[0][0] else "single_object"
    else:
        task = "position" if relation else ("color_attr" if any(c for c, _ in objects) else "two_object")
    return EvalPrompt(task, prompt, objects, relation)
