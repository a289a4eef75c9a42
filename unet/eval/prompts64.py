"""Does an image follow a scenes-64 prompt? GenEval's six tasks on the world of `unet/world.py` (single object, two
objects, counting, colours, position, colour attribution) plus size attribution, judged by `detect64`; prompts that
name a held-out combination are scored apart from the rest.

A prompt holds when every group is found (as many objects of its shape, colour and size as it counts; exactly as
many in the counting task, as GenEval counts) and, for a relation, every object of the first group stands in it to
every object of the second by GenEval's rule (`relative_position`). "and" asks for presence only, as in GenEval.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..relations import POSITION_SIDES, first_as_read, relative_position
from ..world import COLORS, HELD_OUT_COLOR_SHAPES, NUMBER_WORDS, SHAPES, Description, Group, parse_caption
from .detect64 import Detection64, detect

TASKS64 = ("single_object", "two_object", "counting", "colors", "position", "color_attr", "size_attr")
POSITION_RELATIONS = ("left of", "right of", "above", "below")
SEEN_COLOR_SHAPES = [(c, s) for c in COLORS for s in SHAPES if (c, s) not in HELD_OUT_COLOR_SHAPES]


@dataclass
class EvalPrompt64:
    task: str
    description: Description
    held_out: bool  # names a held-out colour x shape or count x shape combination

    @property
    def prompt(self) -> str:
        return self.description.text()


def _partner(start: int, avoid: tuple[str, str]) -> tuple[str, str]:
    """The first seen colour x shape from `start` (cyclically) sharing neither colour nor shape with `avoid`: a
    fixed, spread-out choice of second objects, so the prompt list is the same in every run."""
    n = len(SEEN_COLOR_SHAPES)
    return next(SEEN_COLOR_SHAPES[(start + k) % n] for k in range(n)
                if SEEN_COLOR_SHAPES[(start + k) % n][0] != avoid[0]
                and SEEN_COLOR_SHAPES[(start + k) % n][1] != avoid[1])


def _coloured_pairs(per_held_out: int) -> list[tuple[tuple[str, str], tuple[str, str], bool]]:
    """(first, second, held out) colour x shape pairs: each held-out combination `per_held_out` times, first and
    second in turn, beside a seen partner; then as many pairs of two seen combinations."""
    pairs = []
    for i, held in enumerate(HELD_OUT_COLOR_SHAPES):
        for k in range(per_held_out):
            partner = _partner(7 * i + 11 * k, held)
            pairs.append((held, partner, True) if k % 2 == 0 else (partner, held, True))
    for j in range(len(pairs)):
        first = SEEN_COLOR_SHAPES[(5 * j) % len(SEEN_COLOR_SHAPES)]
        pairs.append((first, _partner(5 * j + 17, first), False))
    return pairs


def eval_prompts64() -> list[EvalPrompt64]:
    """The evaluation's prompts, 189 of them; position, colour and size attribution have as many held-out prompts
    (a held-out colour x shape beside a seen one) as seen ones."""
    def prompt(task: str, *groups: Group, relation: str | None = None) -> EvalPrompt64:
        description = Description(tuple(groups), relation)
        return EvalPrompt64(task, description, bool(description.held_out()))

    prompts = [prompt("single_object", Group(1, s)) for s in SHAPES]
    prompts += [prompt("two_object", Group(1, a), Group(1, b), relation="and")
                for i, a in enumerate(SHAPES) for b in SHAPES[i + 1:]]
    prompts += [prompt("counting", Group(n, s, one_as="one")) for n in NUMBER_WORDS for s in SHAPES]
    prompts += [prompt("colors", Group(1, s, c)) for c in COLORS for s in SHAPES]
    position = _coloured_pairs(len(POSITION_RELATIONS))
    prompts += [prompt("position", Group(1, a[1], a[0]), Group(1, b[1], b[0]),
                       relation=POSITION_RELATIONS[k % len(POSITION_RELATIONS)])
                for k, (a, b, _) in enumerate(position)]
    prompts += [prompt("color_attr", Group(1, a[1], a[0]), Group(1, b[1], b[0]), relation="and")
                for a, b, _ in _coloured_pairs(2)]
    sizes = (("small", "big"), ("big", "small"))
    prompts += [prompt("size_attr", Group(1, a[1], a[0], sizes[k % 2][0]), Group(1, b[1], b[0], sizes[k % 2][1]),
                       relation="and") for k, (a, b, _) in enumerate(_coloured_pairs(2))]
    return prompts


def task_of(description: Description) -> str:
    """The task a prompt of the world belongs to, as `eval_prompts64` sorts them, for judging any prompt."""
    groups = description.groups
    if len(groups) == 1:
        group = groups[0]
        if group.count > 1 or group.one_as == "one":
            return "counting"
        return "colors" if group.color else "single_object"
    if description.stated_relation() != "and":
        return "position"
    if any(g.size for g in groups):
        return "size_attr"
    return "color_attr" if any(g.color for g in groups) else "two_object"


def parse_prompt64(prompt: str) -> EvalPrompt64:
    """The evaluation's reading of any prompt of the world; ValueError for one outside its grammar."""
    description = parse_caption(prompt)
    return EvalPrompt64(task_of(description), description, bool(description.held_out()))


def on_side(position: str, center: tuple[float, float], image_side: int) -> bool:
    """Whether a centre (x, y) lies on the `position` side (left, right, top, bottom) of the image's middle."""
    axis, sign = POSITION_SIDES[f"on the {position}"]
    return sign * (center[axis] - image_side / 2) > 0


def check64(p: EvalPrompt64, detections: list[Detection64], image_side: int = 64,
            exact: bool | None = None) -> tuple[bool, list[list[Detection64]]]:
    """Whether every clause of `p` holds, and the detections matched to each group (as many as it counts, or
    fewer where fewer were found), largest first. `exact`: every group must be found exactly as many times as it
    counts (None: only in the counting task, as GenEval judges)."""
    exact = p.task == "counting" if exact is None else exact
    matched, used, ok = [], set(), True
    for group in p.description.groups:
        fits = [i for i, d in enumerate(detections) if i not in used and group.matches(d.color, d.shape, d.size_word)]
        ok = ok and (len(fits) == group.count if exact else len(fits) >= group.count)
        chosen = fits[:group.count]
        used.update(chosen)
        matched.append([detections[i] for i in chosen])
    relation = p.description.stated_relation()
    if ok and relation not in (None, "and"):
        ok = all(relation in relative_position(a, b) for a in matched[0] for b in matched[1])
    if ok and p.description.position:
        ok = all(on_side(p.description.position, d.center, image_side) for d in matched[0])
    return ok, matched


def prompt_following64(records) -> dict:
    """Per task: the share of images right over all prompts, seen prompts and held-out prompts (None where a task
    has none), and how many images each share counts. `overall`: GenEval's mean over tasks, over all prompts; and
    the same means over seen and over held-out prompts, for tasks that have both. records: {"task", "ok",
    "held_out"} per image."""
    result = {"n_images": {}, "seen": {}, "held_out": {}}
    for task in TASKS64:
        for key, rows in (("all", [r for r in records if r["task"] == task]),
                          ("seen", [r for r in records if r["task"] == task and not r["held_out"]]),
                          ("held_out", [r for r in records if r["task"] == task and r["held_out"]])):
            share = sum(r["ok"] for r in rows) / len(rows) if rows else None
            if key == "all":
                result[task], result["n_images"][task] = share, len(rows)
            else:
                result[key][task] = {"score": share, "images": len(rows)}
    scored = [result[t] for t in TASKS64 if result[t] is not None]
    result["overall"] = sum(scored) / len(scored) if scored else None
    both = [t for t in TASKS64 if None not in (result["seen"][t]["score"], result["held_out"][t]["score"])]
    for key in ("seen", "held_out"):
        result[key]["overall"] = sum(result[key][t]["score"] for t in both) / len(both) if both else None
    return result


def caption_rates(scenes: list) -> dict:
    """The judge on drawn scenes (`unet.scenes64.WorldScene`), as the detector sees them: "caption", the share whose
    own caption holds with exact counts (`check64`); "reading_order", among "and" captions that hold, the share
    whose every first-group object comes first as read; "scenes" and "and_captions": how many each counts."""
    holds, reading = [], []
    for scene in scenes:
        p = parse_prompt64(scene.caption)
        ok, matched = check64(p, detect(scene.image), scene.image.shape[0], exact=True)
        holds.append(ok)
        if p.description.stated_relation() == "and" and ok:
            reading.append(all(first_as_read(a.center, b.center) for a in matched[0] for b in matched[1]))
    return {"caption": sum(holds) / len(holds) if holds else None,
            "reading_order": sum(reading) / len(reading) if reading else None,
            "scenes": len(holds), "and_captions": len(reading)}
