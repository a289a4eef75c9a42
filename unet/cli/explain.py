"""Explanations on the trained model, each a figure under --out (default outputs/explain):

    python scripts/explain.py text  ["a red circle left of a blue square"] [--word circle]
    python scripts/explain.py heads ["a red circle left of a blue square"] [--word circle]
    python scripts/explain.py pixel ["a red circle left of a blue square"] [--x 8 --y 16]

text:  the shared text encoder's self-attention per layer and head, where a word looks back to,
       and the similarity of the position embeddings (attention alone does not see order).
heads: cross-attention maps for one word per head and per U-Net layer.
pixel: for one pixel, its self-attention map over the image in each self-attention layer.
"""

import argparse
import sys
from pathlib import Path

import torch

from crossattn import explain
from crossattn.capture import AttentionStore
from crossattn.maps import DEFAULT_MAP_KIND, DEFAULT_REFINEMENT, MAP_KINDS, refined_store
from crossattn.overlay import to_uint8
from crossattn.text import prompt_words
from unet.cli import (
    UsageError,
    add_model_argument,
    check_out_dir,
    check_seed,
    interrupted,
    partial_folder,
    publish_files,
    shorten,
    sigterm_as_interrupt,
    usage_error,
)
from unet.cli.checks import check_prompt_length, check_prompt_text, unseen_words
from unet.folders import WRITE_ERRORS, write_failed
from unet.pipeline import default_size, load_pipeline, shape_words

DEFAULT_PROMPT = "a red circle left of a blue square"


def check_inputs(args):
    """Every check before any model work (one line, exit 2): returns the pipeline and the word to follow.
    Fills in the default pixel for 'pixel'."""
    check_prompt_text(args.prompt)
    check_seed(args.seed)
    check_out_dir(args.out)
    pipe = load_pipeline(args.model, show_progress=False)
    check_prompt_length(pipe, args.prompt, args.truncate)
    words = [w.text for w in prompt_words(pipe.tokenizer, args.prompt)]
    word = args.word or next((w for w in words if w in shape_words(pipe)), words[-1])
    if word not in words:
        raise UsageError(f"--word {shorten(repr(word))} is not in the prompt; its words are "
                         f"{shorten(repr(words), 200)}")
    if args.what == "pixel":
        size = default_size(pipe)  # the pipeline's default: explain does not change the size
        args.x = size // 4 if args.x is None else args.x
        args.y = size // 2 if args.y is None else args.y
        if not (0 <= args.x < size and 0 <= args.y < size):
            raise UsageError(f"pixel (x={args.x}, y={args.y}) lies outside the {size}x{size} image")
    return pipe, word


def run(args, pipe, word: str, out: Path) -> list[Path]:
    """Make the figure(s) for `args.what` in `out`; returns their paths."""
    prompt = args.prompt
    words = [w.text for w in prompt_words(pipe.tokenizer, prompt)]
    if args.what == "text":
        tokens, weights = explain.text_attention(pipe.tokenizer, pipe.text_encoder, prompt)
        row = explain.look_back(pipe.tokenizer, weights, prompt, word)
        explain.text_figure(tokens, weights, prompt, word, row, unseen_words(pipe, words),
                            out / "text_attention.png")
        explain.positions_figure(pipe.text_encoder, out / "positions.png")
        top = [(tokens[i], round(v, 3)) for i, v in sorted(enumerate(row[-1].tolist()), key=lambda t: -t[1])[:3]]
        print(f"'{word}' looks back most to (last layer): {top}")
        return [out / "text_attention.png", out / "positions.png"]
    if args.what == "heads" and args.maps == "refined":
        store = refined_store(pipe, DEFAULT_REFINEMENT)  # the self-attention the refined cells go through
    else:
        store = AttentionStore.for_pipeline(pipe, self_attention=args.what == "pixel")
    pipe.set_progress_bar_config(disable=True)  # the same call for ours and diffusers' SD/SDXL pipelines
    with store.attach(pipe.unet):  # under guidance the store keeps the prompt half by itself
        image = pipe(prompt, generator=torch.Generator().manual_seed(args.seed), output_type="np").images[0]
    image = to_uint8(image)
    size = image.shape[:2]
    if args.what == "heads":
        tokens = next(w.tokens for w in prompt_words(pipe.tokenizer, prompt) if w.text == word)
        names, maps = explain.head_layer_maps(store, tokens, size, kind=args.maps)
        explain.heads_figure(image, names, maps, store, word, prompt, out / "heads_layers.png", kind=args.maps)
        return [out / "heads_layers.png"]
    x = size[1] // 4 if args.x is None else args.x
    y = size[0] // 2 if args.y is None else args.y
    try:
        maps = explain.pixel_maps(store, (x, y), size)
    except ValueError as e:
        raise UsageError(str(e)) from e
    explain.pixel_figure(image, maps, (x, y), store, out / "pixel_self_attention.png")
    return [out / "pixel_self_attention.png"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=["text", "heads", "pixel"])
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    p.add_argument("--word", default=None, help="the word to follow (default: the prompt's first shape word in the "
                   "model's world: \"diamonds\" in \"three green diamonds\")")
    p.add_argument("--x", type=int, default=None, help="pixel column for 'pixel' (default: a quarter across)")
    p.add_argument("--y", type=int, default=None, help="pixel row for 'pixel' (default: half way down)")
    p.add_argument("--maps", default=DEFAULT_MAP_KIND, choices=MAP_KINDS,
                   help=f"heads: how each (layer, head) map is read (default {DEFAULT_MAP_KIND}): plain, refined "
                        "through self-attention, or DAAM's per-head bicubic step")
    p.add_argument("--seed", type=int, default=0)
    add_model_argument(p)
    p.add_argument("--out", default="outputs/explain")
    p.add_argument("--truncate", action="store_true", help="accept a prompt longer than the tokenizer allows")
    args = p.parse_args(argv)
    out = Path(args.out)
    with sigterm_as_interrupt():
        try:
            pipe, word = check_inputs(args)
            with partial_folder(out) as tmp:  # figures appear in --out only when all are made
                paths = publish_files(tmp, out, run(args, pipe, word, tmp))
        except UsageError as e:
            return usage_error(e)
        except KeyboardInterrupt as e:
            return interrupted(e, f"no figure half-written in {out}")
        except WRITE_ERRORS as e:  # a full disk or a file-size limit: the partial folder is gone already
            return write_failed(e, "the figures")
    for path in paths:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
