"""Checks at the door: every user value is checked once, before any work, and fails with one line."""

from __future__ import annotations

import re

from crossattn.errors import UsageError, check_number, shorten
from crossattn.text import dropped_words, prompt_words

from ..pipeline import PRETRAINED, Settings, check_seed, default_size, shipped_models, size_multiple
from ..world import prompt_warnings
from .memory import available_memory, memory_estimate

# beyond this the guided noise estimate leaves the range the model was trained on and the image saturates to black
# (1e308 overflowed to inf); real Stable Diffusion uses 1 to 20
GUIDANCE_RANGE = (0.0, 100.0)


def check_guidance(guidance: float | None, flag: str = "--guidance") -> None:
    """UsageError unless the guidance scale is None (the model's own) or in `GUIDANCE_RANGE`."""
    if guidance is not None:
        check_number(flag, guidance, *GUIDANCE_RANGE, " (<= 1 turns guidance off)")


def add_model_argument(parser, what: str = "pipeline folder") -> None:
    """--model, as every command takes it: `what` (a folder), or a shipped model's name. The name is looked up where
    the model loads (`unet.pipeline.model_folder`), so a name not shipped is refused there, in one line."""
    parser.add_argument("--model", default=None, help=f"{what}, or the name of a shipped model: "
                                                      f"{', '.join(shipped_models())} (default: {PRETRAINED.name})")


def check_prompt_text(prompt: str) -> None:
    """Raise UsageError for a prompt with no words."""
    if not prompt.strip():
        raise UsageError("empty prompt: give some words, e.g. \"a red circle\"")


def unseen_words(pipe, words: list[str]) -> list[str]:
    """The words no training caption used ([] when the model does not say what it was trained on)."""
    if pipe.trained_words is None:
        return []
    return [w for w in words if re.sub(r"\W", "", w.lower()) not in pipe.trained_words]


def check_tokenizers_agree(pipe, prompt: str) -> None:
    """SDXL's context is its two text encoders' hidden states side by side, position by position, and a
    word's positions come from the first tokenizer: the second must split the prompt the same way
    (real SDXL's do: one CLIP vocabulary, only the padding token differs)."""
    second = getattr(pipe, "tokenizer_2", None)
    if second is None:
        return
    first_words, second_words = prompt_words(pipe.tokenizer, prompt), prompt_words(second, prompt)
    if [w.tokens for w in first_words] != [w.tokens for w in second_words]:
        raise UsageError(f"tokenizer and tokenizer_2 of this model split the prompt differently "
                         f"({[w.tokens for w in first_words]} vs {[w.tokens for w in second_words]} token positions "
                         "per word), so a word's map would mix tokens of different words")


def check_prompt_length(pipe, prompt: str, truncate: bool) -> None:
    """Raise UsageError for a prompt the tokenizer would cut, naming the words dropped, unless `truncate`."""
    cut = dropped_words(pipe.tokenizer, prompt)
    if cut and not truncate:
        raise UsageError(f"prompt is longer than the tokenizer's {pipe.tokenizer.model_max_length} tokens; these "
                         f"words would be dropped: {shorten(' '.join(cut), 200)} (shorten it, or pass --truncate "
                         "to accept)")


def check_prompt(pipe, prompt: str, settings: Settings, words: list[str] | None) -> list[str]:
    """Validate one prompt; returns warnings. Raises UsageError naming the problem."""
    check_prompt_text(prompt)
    check_prompt_length(pipe, prompt, settings.truncate)
    prompt_list = [w.text for w in prompt_words(pipe.tokenizer, prompt)]
    check_tokenizers_agree(pipe, prompt)
    missing = [w for w in words or [] if w not in prompt_list]
    if missing:
        raise UsageError(f"--words {shorten(repr(missing), 200)} not in the prompt; its words are: "
                         f"{shorten(repr(prompt_list), 200)}")
    return world_warnings(pipe, prompt, prompt_list)


def world_warnings(pipe, prompt: str, words: list[str]) -> list[str]:
    """Warnings for what the model's world does not hold, by the pipeline's world (`pipe.world`): for scenes-64,
    `world.prompt_warnings` (unknown words beside the words the world knows, counts above four); for scenes-32 (and
    a folder that lists its training words), the prompt's `words` no training caption used."""
    if pipe.world == "scenes-64":
        return prompt_warnings(prompt)
    unseen = unseen_words(pipe, words)
    if not unseen:
        return []
    return [f"the model never saw these words in training: {unseen}; their maps show what an untrained embedding "
            "attracts"]


def check_settings(settings: Settings) -> None:
    """The checks that need no model: raise UsageError naming the bad value and what is accepted."""
    for flag, value in (("--steps", settings.steps), ("--num-images", settings.num_images)):
        if value < 1:
            raise UsageError(f"{flag} must be a positive integer, got {value}")
    check_guidance(settings.guidance)
    check_seed(settings.seed)
    for flag, value in (("--height", settings.height), ("--width", settings.width)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be a positive number of pixels, got {value}")


def check_model_settings(pipe, settings: Settings) -> None:
    """The checks that need the model: sizes, steps within the scheduler's range, memory."""
    multiple = size_multiple(pipe)
    for flag, value in (("--height", settings.height), ("--width", settings.width)):
        if value is not None and value % multiple:
            raise UsageError(f"{flag} must be a multiple of {multiple} for this model, got {value}")
    limit = pipe.scheduler.config.num_train_timesteps
    if settings.steps > limit:
        raise UsageError(f"--steps must be at most {limit} (the scheduler's training timesteps), got {settings.steps}")
    need, free = memory_estimate(pipe, settings), available_memory(pipe.device)
    if free is not None and need > free:
        size = f"{settings.height or default_size(pipe)}x{settings.width or default_size(pipe)}"
        raise UsageError(f"this run would need about {need / 2**30:.1f} GiB ({size}, {settings.num_images} images) "
                         f"but {pipe.device} has {free / 2**30:.1f} GiB free; use a smaller size or fewer images")
