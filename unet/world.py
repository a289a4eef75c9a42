"""The vocabulary of the scenes-64 world, and its captions as data: which groups of objects a caption names
(count, size, colour, shape), how the groups stand to each other, and which word names which objects.

A caption is one or two groups: "three green diamonds", "two red circles on the left", "a small red star above a
big blue square", "two small cyan triangles and a big orange circle". A group's objects share its shape, and its
colour and size where it names them; an unsized group's objects are each small or big, a colourless group's each
any colour. A relation holds between every object of the first group and every object of the second. "and" follows
reading order: every object of the first group is left of, or above, every object of the second.

`Description` is a caption's meaning; `Description.text()` writes it and `parse_caption` reads it back, so the
evaluation reads a prompt exactly as the generator writes it. Drawing lives in `unet/scenes64.py`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .data import COLORS as COLORS_32
from .data import POSITIONS

# Hues as far apart as eight colour names allow: red 0, orange 28.5 (midway to yellow), yellow 57, green 125, cyan 182,
# blue 231, purple 273, pink 324 degrees (red, green, blue and yellow as in scenes-32). Each is fully saturated, so an
# anti-aliased edge (the colour times its coverage, on black) keeps its hue.
COLORS = {"red": COLORS_32["red"], "orange": (245, 127, 20), "yellow": COLORS_32["yellow"],
          "green": COLORS_32["green"], "cyan": (20, 210, 215), "blue": COLORS_32["blue"],
          "purple": (150, 45, 235), "pink": (245, 70, 175)}
SHAPES = ("circle", "square", "triangle", "diamond", "star", "cross")
PLURALS = {shape: shape + ("es" if shape.endswith("s") else "s") for shape in SHAPES}  # cross -> crosses
SINGULAR = {plural: shape for shape, plural in PLURALS.items()}
# Box side of each size word as a fraction of the image side: 9.6-11.5 px (small) and 15.4-18.6 px (big) at 64 px.
# The gap between them lets the detector tell the sizes apart; the small end is the smallest at which it still
# tells a star from a cross (docs/guides/scenes-64.md has the measured rates).
SIZES = {"small": (0.15, 0.18), "big": (0.24, 0.29)}
NUMERALS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4}
NUMBER_WORDS = {1: "one", 2: "two", 3: "three", 4: "four"}
MAX_OBJECTS = 4  # in one image, all groups together
# Counts past the world's: named in warnings, never drawn
COUNTS_ABOVE = {"five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10, "eleven": 11, "twelve": 12,
                "many": None, "several": None}
# Each relation as written -> the relation it states; both phrasings of left/right are captions of the world
RELATIONS = {"left of": "left of", "to the left of": "left of", "right of": "right of",
             "to the right of": "right of", "above": "above", "below": "below"}
# "and" places the first group before the second as read: left of it or above it
READING_RELATIONS = ("left of", "above")
IMAGE_SIZE = 64
# Held out of training captions (and, for colour x shape, of training images), for the evaluation to report
# apart. Colour x shape: one colour per shape, six different colours, 6 of 48 (12.5 %); every colour keeps at least
# five shapes and every shape seven colours. Count x shape: one shape per count from two to four, 3 of 24.
HELD_OUT_COLOR_SHAPES = (("orange", "circle"), ("cyan", "square"), ("purple", "triangle"), ("red", "diamond"),
                         ("blue", "star"), ("yellow", "cross"))
HELD_OUT_COUNT_SHAPES = ((2, "star"), (3, "circle"), (4, "triangle"))
WORD_KINDS = ("count", "size", "color", "shape")  # the words that name objects, as map scoring groups them
# The longest caption the world writes: two groups of four words joined by the longest relation. Each word is one
# token of the world's vocabulary, so a tokenizer needs its words plus the start and end tokens; a shorter
# max_length would train on captions cut before their second group's shape
LONGEST_CAPTION = "two small green triangles to the right of two big orange crosses"
CAPTION_TOKENS = len(LONGEST_CAPTION.split()) + 2


@dataclass(frozen=True)
class Group:
    """Objects of one kind: `count` of `shape`, all `color` and `size` where given (None: each any)."""
    count: int
    shape: str
    color: str | None = None
    size: str | None = None
    one_as: str = "a"  # how a count of one is written: "a" ("an" before a vowel) or "one"

    def __post_init__(self):
        if self.shape not in SHAPES:
            raise ValueError(f"unknown shape {self.shape!r}; this world's shapes are {', '.join(SHAPES)}")
        if self.color is not None and self.color not in COLORS:
            raise ValueError(f"unknown colour {self.color!r}; this world's colours are {', '.join(COLORS)}")
        if self.size is not None and self.size not in SIZES:
            raise ValueError(f"unknown size {self.size!r}; this world's sizes are {', '.join(SIZES)}")
        if not 1 <= self.count <= MAX_OBJECTS:
            raise ValueError(f"a group holds 1 to {MAX_OBJECTS} objects, got {self.count}")
        if self.one_as not in ("a", "one"):
            raise ValueError(f"one_as must be 'a' or 'one', got {self.one_as!r}")
        if self.count != 1:  # only a count of one has two spellings: keep equal groups equal
            object.__setattr__(self, "one_as", "a")

    def words(self) -> list[str]:
        """The group as written: numeral, size, colour, shape ("two small cyan triangles", "an orange circle")."""
        adjectives = [w for w in (self.size, self.color) if w]
        noun = self.shape if self.count == 1 else PLURALS[self.shape]
        numeral = NUMBER_WORDS[self.count]
        if self.count == 1 and self.one_as == "a":
            numeral = "an" if (adjectives + [noun])[0][0] in "aeiou" else "a"
        return [numeral, *adjectives, noun]

    def matches(self, color: str, shape: str, size: str) -> bool:
        """Whether an object of this colour, shape and size fits the group's description."""
        return shape == self.shape and self.color in (None, color) and self.size in (None, size)

    def exclusive_with(self, other: Group) -> bool:
        """Whether no object can fit both descriptions, so each object belongs to one group and the two can be
        told apart in the image: another shape, or both coloured differently, or both sized differently."""
        return (self.shape != other.shape or (None not in (self.color, other.color) and self.color != other.color)
                or (None not in (self.size, other.size) and self.size != other.size))


@dataclass(frozen=True)
class Description:
    """What a caption says: one or two groups, and for two a relation (a key of `RELATIONS`, as written, or
    "and"); for one an optional position (left, right, top, bottom: every object in that part of the image)."""
    groups: tuple[Group, ...]
    relation: str | None = None
    position: str | None = None

    def __post_init__(self):
        if len(self.groups) not in (1, 2):
            raise ValueError(f"a caption names one or two groups, got {len(self.groups)}")
        if self.objects() > MAX_OBJECTS:
            raise ValueError(f"a scene holds at most {MAX_OBJECTS} objects, the groups name {self.objects()}")
        if len(self.groups) == 2:
            if self.relation != "and" and self.relation not in RELATIONS:
                raise ValueError(f"two groups need a relation ({', '.join(RELATIONS)}) or 'and', got {self.relation!r}")
            if not self.groups[0].exclusive_with(self.groups[1]):
                raise ValueError(f"the groups {' '.join(self.groups[0].words())!r} and "
                                 f"{' '.join(self.groups[1].words())!r} could name the same objects")
            if self.position is not None:
                raise ValueError("a position ('on the left') is for one group; two groups take a relation")
        elif self.relation is not None:
            raise ValueError(f"the relation {self.relation!r} needs two groups")
        if self.position is not None and self.position not in POSITIONS:
            raise ValueError(f"unknown position {self.position!r}; expected one of {', '.join(POSITIONS)}")

    def objects(self) -> int:
        return sum(g.count for g in self.groups)

    def stated_relation(self) -> str | None:
        """The relation every first-group object has to every second-group object ("left of" for "to the left
        of"); "and" for reading order; None for one group."""
        return RELATIONS.get(self.relation, self.relation)

    def group_words(self) -> list[list[str]]:
        """Each group's words, and between them the relation's, as `text` joins them."""
        if len(self.groups) == 1:
            tail = [f"on the {self.position}".split()] if self.position else []
            return [self.groups[0].words(), *tail]
        return [self.groups[0].words(), self.relation.split(), self.groups[1].words()]

    def text(self) -> str:
        return " ".join(w for part in self.group_words() for w in part)

    def word_objects(self) -> dict[int, tuple[int, ...]]:
        """Whitespace-word index -> the objects it names, for count, size, colour and shape words. Objects are
        numbered group by group (the first group's first), as `unet/scenes64.py` draws them."""
        parts = self.group_words()
        starts = [sum(len(part) for part in parts[:k]) for k in range(len(parts))]  # each part's first word
        links, first = {}, 0
        for group, k in zip(self.groups, (0, 2)):  # the groups are parts 0 and 2; part 1, the relation or position
            objects = tuple(range(first, first + group.count))
            links.update({starts[k] + i: objects for i, w in enumerate(parts[k]) if word_kind(w)})
            first += group.count
        return links

    def held_out(self) -> list[tuple]:
        """The held-out combinations this caption names: (colour, shape) and (count, shape) pairs."""
        found = [(g.color, g.shape) for g in self.groups if (g.color, g.shape) in HELD_OUT_COLOR_SHAPES]
        return found + [(g.count, g.shape) for g in self.groups if (g.count, g.shape) in HELD_OUT_COUNT_SHAPES]


def word_kind(word: str) -> str | None:
    """"count", "size", "color" or "shape" for a word that names objects ("two", "small", "red", "stars"); else
    None."""
    if word in NUMERALS:
        return "count"
    if word in SIZES:
        return "size"
    if word in COLORS:
        return "color"
    if word in SHAPES or word in SINGULAR:
        return "shape"
    return None


def _read_group(words: list[str], at: int, text: str) -> tuple[Group, int]:
    """The group starting at word `at`, and the index after it."""
    if at >= len(words) or words[at] not in NUMERALS:
        raise ValueError(f"expected a count ({', '.join(NUMERALS)}) at word {at + 1} of {text!r}")
    numeral, at = words[at], at + 1
    size = color = None
    if at < len(words) and words[at] in SIZES:
        size, at = words[at], at + 1
    if at < len(words) and words[at] in COLORS:
        color, at = words[at], at + 1
    noun = words[at] if at < len(words) else None
    count = NUMERALS[numeral]
    if noun not in (SHAPES if count == 1 else SINGULAR):
        wanted = "a shape" if count == 1 else "a plural shape"
        raise ValueError(f"expected {wanted} ({', '.join(SHAPES if count == 1 else SINGULAR)}) after "
                         f"{' '.join(words[:at])!r} in {text!r}, got {noun!r}")
    shape = noun if count == 1 else SINGULAR[noun]
    return Group(count, shape, color, size, "one" if numeral == "one" else "a"), at + 1


def parse_caption(text: str) -> Description:
    """Read a caption of this world back into its `Description`. ValueError naming the first word that does
    not fit the grammar: group [on the left|right|top|bottom] | group (relation | and) group."""
    words = text.lower().split()
    first, at = _read_group(words, 0, text)
    if at == len(words):
        return Description((first,))
    rest = " ".join(words[at:])
    for position in POSITIONS:
        if rest == f"on the {position}":
            return Description((first,), position=position)
    connector = next((r for r in sorted([*RELATIONS, "and"], key=len, reverse=True)
                      if words[at:at + len(r.split())] == r.split()), None)
    if connector is None:
        raise ValueError(f"expected a relation ({', '.join(RELATIONS)}), 'and' or 'on the left/right/top/bottom' "
                         f"after {' '.join(words[:at])!r} in {text!r}, got {words[at]!r}")
    second, end = _read_group(words, at + len(connector.split()), text)
    if end != len(words):
        raise ValueError(f"{text!r} goes on after its second group: {' '.join(words[end:])!r}")
    return Description((first, second), connector)


def known_words() -> list[str]:
    """Every word a caption of this world can hold (the tokenizer's vocabulary for the world)."""
    words = {*NUMERALS, *SIZES, *COLORS, *SHAPES, *SINGULAR, "and", "on", "the", *POSITIONS}
    words.update(w for r in RELATIONS for w in r.split())
    return sorted(words)


# What a warning about unknown words says the world holds (the live page shows the same: unet/onnx_export.py)
WORLD_KNOWS = (f"this world knows the colours {', '.join(COLORS)}; the shapes {', '.join(SHAPES)}; the sizes "
               f"{', '.join(SIZES)}; the counts a/an, one to four; the relations {', '.join(RELATIONS)}, 'and', and "
               "'on the left/right/top/bottom'")


def prompt_warnings(prompt: str) -> list[str]:
    """Warnings for a prompt asking for what this world does not hold: words no caption uses (named, beside the
    words the world knows) and counts above four, alone or in all. [] for a prompt the world can draw. The live
    page's copy (web/warnings.js) is tested against this one."""
    words = [re.sub(r"[^\w-]", "", w) for w in prompt.lower().split()]
    known = set(known_words())
    warnings = []
    # ASCII digits only: str.isdigit() also takes "²", which int() refuses
    too_many = [w for w in words if w in COUNTS_ABOVE or (re.fullmatch("[0-9]+", w) and int(w) > MAX_OBJECTS)]
    unknown = [w for w in words if w and w not in known and w not in too_many]
    if unknown:
        warnings.append(f"unknown words {unknown}: {WORLD_KNOWS}")
    if too_many:
        warnings.append(f"counts above {NUMBER_WORDS[MAX_OBJECTS]} {too_many}: this world draws one to "
                        f"{NUMBER_WORDS[MAX_OBJECTS]} objects of a kind and at most {MAX_OBJECTS} in an image")
    else:
        total = sum(NUMERALS[w] for w in words if w in NUMERALS)  # "a" and "an" are one each
        if total > MAX_OBJECTS:
            warnings.append(f"the prompt asks for {total} objects: this world draws at most {MAX_OBJECTS} in an "
                            "image")
    return warnings
