"""Generate images from prompts and save, for every word, where the image attended to it.

    python scripts/generate.py "a red circle left of a blue square" --seed 0

Writes one new folder per prompt under --out: image PNGs (prompt and seed in text chunks),
overlay.png, words/<i>_<word>.png, maps.safetensors and meta.json. Works with the shipped model
(default), any folder this project's training wrote, or a Stable Diffusion folder on disk.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import platform
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image, PngImagePlugin
from safetensors.torch import save_file

from crossattn.capture import AttentionStore
from crossattn.maps import NORMALIZATIONS, merge_words, token_maps
from crossattn.overlay import overlay_grid, word_overlay
from crossattn.text import dropped_words, prompt_words
from crossattn.viewer import write_run_page

from .pipeline import (  # noqa: F401 -- UsageError, load_pipeline, TRAINED_WORDS re-exported for old imports
    PRETRAINED,
    TRAINED_WORDS,
    ScenePipeline,
    UsageError,
    check_device,
    default_guidance,
    load_pipeline,
    make_scheduler,
    shorten,
)
from .steer import add_steering_args, plan_steering, steer_one

PARTIAL = ".partial-"  # prefix of the hidden folder a result is written into before it is renamed into place


# --- interrupts: Ctrl-C and SIGTERM take the same path, and every command prints one line for them
class Interrupted(KeyboardInterrupt):
    """SIGTERM (kill, timeout, job schedulers) raised as Ctrl-C's exception, so the same cleanup runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Inside the block SIGTERM raises `Interrupted` (a KeyboardInterrupt); the old handler returns after."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupted(e: KeyboardInterrupt, what: str) -> int:
    """Report an interrupt in one line; the exit code the shell gives a process killed by that signal."""
    signum = getattr(e, "signum", signal.SIGINT)
    print(f"interrupted ({signal.Signals(signum).name}): {what}", file=sys.stderr)
    return 128 + signum


def usage_error(e: Exception) -> int:
    """Report bad input as one line on stderr; exit code 2."""
    print(f"error: {shorten(' '.join(str(e).split()), 500)}", file=sys.stderr)
    return 2


# --- output folders: checked before any work, written whole or not at all
def check_out_dir(out: Path, flag: str = "--out") -> None:
    """Raise UsageError unless `out` is a writable folder or can be created as one. Creates nothing."""
    try:
        if out.exists() and not out.is_dir():
            raise UsageError(f"{flag} {out} is a file, not a folder")
        existing = out.absolute()
        while not existing.exists():
            existing = existing.parent
    except (OSError, ValueError) as e:  # e.g. a name with a NUL byte, or a path too long
        raise UsageError(f"{flag} {shorten(str(out))} is not a usable path: {e}") from e
    if not existing.is_dir():
        raise UsageError(f"{flag} {out} cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {out} is not writable: no permission to write in {existing}")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_partials(out: Path) -> list[Path]:
    """Delete `.partial-<pid>-*` folders whose process is gone (a run killed with SIGKILL or a power cut).

    Folders of runs still going are left alone; older `.partial-*` names without a pid are never read.
    """
    removed = []
    for folder in out.glob(f"{PARTIAL}*"):
        pid = folder.name[len(PARTIAL):].split("-", 1)[0]
        if folder.is_dir() and pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def _normal_permissions(folder: Path) -> None:
    """What `mkdir` and `open` would have given under the user's umask (temp folders are made private)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def partial_folder(out: Path):
    """Yield a new hidden folder `out/.partial-<pid>-*` to write a result into; `publish` renames it into
    place. On any error or interrupt the folder goes, and so do `out` and its parents if this made them."""
    created = [p for p in [out.absolute(), *out.absolute().parents] if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    tmp = Path(tempfile.mkdtemp(prefix=f"{PARTIAL}{os.getpid()}-", dir=out))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in created:  # deepest first; stops at the first that is not empty
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def publish(tmp: Path, final: Path) -> Path:
    """Rename the finished `tmp` folder to `final` (replacing an existing `final`, for --overwrite)."""
    _normal_permissions(tmp)
    old = None
    if final.exists():  # moved aside first, so `final` is never missing half-way
        old = Path(tempfile.mkdtemp(prefix=f"{PARTIAL}{os.getpid()}-old-", dir=final.parent))
        final.rename(old / final.name)
    tmp.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def publish_files(tmp: Path, out: Path, paths: list[Path]) -> list[Path]:
    """Move finished files from `tmp` into the existing folder `out` (each replaced whole), then drop `tmp`."""
    _normal_permissions(tmp)
    moved = []
    for path in paths:
        os.replace(path, out / path.name)
        moved.append(out / path.name)
    shutil.rmtree(tmp, ignore_errors=True)
    return moved


@dataclass
class Settings:
    seed: int = 0
    steps: int = 25
    guidance: float | None = None  # None: the model's own default (model_index.json)
    num_images: int = 1
    height: int | None = None
    width: int | None = None
    normalize: str = "raw"
    scheduler: str = "ddim"
    self_attention: bool = False
    truncate: bool = False


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


def check_prompt(pipe, prompt: str, settings: Settings, words: list[str] | None) -> list[str]:
    """Validate one prompt; returns warnings. Raises UsageError naming the problem."""
    if not prompt.strip():
        raise UsageError("empty prompt: give some words, e.g. \"a red circle\"")
    cut = dropped_words(pipe.tokenizer, prompt)
    if cut and not settings.truncate:
        raise UsageError(f"prompt is longer than the tokenizer's {pipe.tokenizer.model_max_length} tokens; these "
                         f"words would be dropped: {shorten(' '.join(cut), 200)} (shorten it, or pass --truncate "
                         "to accept)")
    prompt_list = [w.text for w in prompt_words(pipe.tokenizer, prompt)]
    check_tokenizers_agree(pipe, prompt)
    missing = [w for w in words or [] if w not in prompt_list]
    if missing:
        raise UsageError(f"--words {shorten(repr(missing), 200)} not in the prompt; its words are: "
                         f"{shorten(repr(prompt_list), 200)}")
    notes = []
    unseen = unseen_words(pipe, prompt_list)
    if unseen:
        notes.append(f"the model never saw these words in training: {unseen}; their maps show what an "
                     "untrained embedding attracts")
    return notes


MAX_SEED = 2 ** 64 - 1  # torch.Generator.manual_seed takes 64 bits


def check_settings(settings: Settings) -> None:
    """The checks that need no model: raise UsageError naming the bad value and what is accepted."""
    for flag, value in (("--steps", settings.steps), ("--num-images", settings.num_images)):
        if value < 1:
            raise UsageError(f"{flag} must be a positive integer, got {value}")
    if settings.guidance is not None and not math.isfinite(settings.guidance):
        raise UsageError(f"--guidance must be a finite number (<= 1 turns guidance off), got {settings.guidance}")
    if not 0 <= settings.seed <= MAX_SEED:
        raise UsageError(f"--seed must be an integer from 0 to 2**64 - 1, got {shorten(str(settings.seed))}")
    for flag, value in (("--height", settings.height), ("--width", settings.width)):
        if value is not None and value < 1:
            raise UsageError(f"{flag} must be a positive number of pixels, got {value}")


def size_multiple(pipe) -> int:
    """Height and width must be multiples of this: our U-Net halves the image at every level but the
    last; a Stable Diffusion pipeline works on latents `vae_scale_factor` times smaller."""
    if not isinstance(pipe, ScenePipeline):
        return int(getattr(pipe, "vae_scale_factor", 8))
    config = pipe.unet.config
    return 2 ** (len(getattr(config, "channels", None) or config.block_out_channels) - 1)


def default_size(pipe) -> int:
    """The image side the model was made for, in pixels."""
    return pipe.unet.config.sample_size * (1 if isinstance(pipe, ScenePipeline) else size_multiple(pipe))


def available_memory(device: torch.device) -> int | None:
    """Bytes free for a run on `device`: free GPU memory, or the machine's available RAM; None if unknown."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type != "cpu":
        return None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _level(name: str, levels: int) -> int:
    """How many times the U-Net halved the input before the module `name` (ours: down.i / mid_attn / up.j;
    diffusers: down_blocks.i / mid_block / up_blocks.j); 0, the largest, when the name says nothing."""
    found = re.match(r"(down|up)[a-z_]*\.(\d+)\.", name)
    if found:
        index = int(found.group(2))
        return index if found.group(1) == "down" else levels - 1 - index
    return levels - 1 if name.startswith("mid") else 0


def memory_estimate(pipe, settings: Settings) -> int:
    """Rough bytes a run needs beyond the weights, to refuse sizes that cannot fit: the attention weights
    capture makes explicit (scores and softmax of the largest layer at once, 2 images per prompt under
    guidance), the store's running sums (per layer and timestep window), and full-size activations."""
    factor = 1 if isinstance(pipe, ScenePipeline) else size_multiple(pipe)
    height = (settings.height or default_size(pipe)) // factor
    width = (settings.width or default_size(pipe)) // factor
    guidance = default_guidance(pipe) if settings.guidance is None else settings.guidance
    per_pass = settings.num_images * (2 if guidance > 1 else 1)
    windows = min(settings.steps, new_store(pipe, settings).windows)
    config = pipe.unet.config
    levels = len(getattr(config, "channels", None) or config.block_out_channels)
    biggest = sums = 0
    for name, module in pipe.unet.named_modules():
        heads, cross = vars(module).get("heads"), vars(module).get("is_cross_attention")  # ours and diffusers
        if not isinstance(heads, int) or cross is None or not (cross or settings.self_attention):
            continue  # not attention, or self-attention left to the fused kernel (no weights kept)
        k = _level(name, levels)
        queries = math.ceil(height / 2 ** k) * math.ceil(width / 2 ** k)
        keys = pipe.tokenizer.model_max_length if cross else queries
        one_image = heads * queries * keys * 4  # float32 (heads, N, keys)
        biggest = max(biggest, 2 * per_pass * one_image)
        sums += windows * settings.num_images * one_image
    first = (getattr(config, "channels", None) or config.block_out_channels)[0]
    activations = 8 * per_pass * first * height * width * 4  # a few full-size feature maps alive at once
    return biggest + sums + activations


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


def new_store(pipe, settings: Settings) -> AttentionStore:
    """The store a run records into; its timestep windows span the scheduler's training timesteps."""
    return AttentionStore(self_attention=settings.self_attention,
                          num_train_timesteps=pipe.scheduler.config.num_train_timesteps)


def _slug(prompt: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:60] or "prompt"


def _new_folder(out: Path, name: str, overwrite: bool) -> Path:
    target = out / name
    if overwrite or not target.exists():
        return target
    k = 2
    while (out / f"{name}-{k}").exists():
        k += 1
    return out / f"{name}-{k}"


def _versions() -> dict:
    from importlib.metadata import version
    return {"python": platform.python_version(), "torch": torch.__version__, "diffusers": version("diffusers"),
            "transformers": version("transformers"), "crossattn": version("crossattn"), "machine": platform.machine()}


def generate_one(pipe, prompt: str, settings: Settings, out_dir: Path, model_name: str,
                 words_filter: list[str] | None = None, overwrite: bool = False, show_progress: bool = True) -> Path:
    """Generate `settings.num_images` images for `prompt` and write its folder; returns the folder."""
    check_settings(settings)
    if settings.guidance is None:
        settings = dataclasses.replace(settings, guidance=default_guidance(pipe))
    check_model_settings(pipe, settings)
    timings = {}
    words = prompt_words(pipe.tokenizer, prompt)
    generator = torch.Generator(device="cpu").manual_seed(settings.seed)
    store = new_store(pipe, settings)
    t0 = time.perf_counter()
    with store.attach(pipe.unet):  # the store tells the guided halves apart by itself
        kwargs = dict(num_inference_steps=settings.steps, guidance_scale=settings.guidance, generator=generator,
                      num_images_per_prompt=settings.num_images, height=settings.height, width=settings.width,
                      output_type="np")
        if isinstance(pipe, ScenePipeline):
            images = pipe(prompt, attention_store=store, show_progress=show_progress, **kwargs).images
        else:
            pipe.set_progress_bar_config(disable=not show_progress)
            images = pipe(prompt, **kwargs).images
    timings["sampling_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    images = (np.asarray(images) * 255).round().astype(np.uint8)  # (N, H, W, 3)
    size = images.shape[1:3]
    tokens = token_maps(store, size)  # (N, T, H, W)
    maps = torch.stack([merge_words(t, words, settings.normalize) for t in tokens])  # (N, words, H, W)
    tensors = {f"{w.index}_{w.text}": maps[:, w.index].contiguous() for w in words}
    for layer in sorted(store.layers):
        if not store.is_cross[layer]:
            continue
        per_layer = token_maps(store, size, layers=[layer])
        for w in words:
            tensors[f"layer/{layer}/{w.index}_{w.text}"] = torch.stack(
                [merge_words(t, [w], settings.normalize)[0] for t in per_layer]).contiguous()
    timings["maps_s"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    with partial_folder(out_dir) as tmp:  # renamed into place only when complete; removed on any error
        final = _new_folder(out_dir, f"{_slug(prompt)}-s{settings.seed}", overwrite)
        names = []
        for k, image in enumerate(images):
            info = PngImagePlugin.PngInfo()
            info.add_text("prompt", prompt)
            info.add_text("seed", str(settings.seed))
            info.add_text("index", str(k))
            names.append(f"image_{k}.png")
            Image.fromarray(image).save(tmp / names[-1], pnginfo=info)
        shown = [w for w in words if words_filter is None or w.text in words_filter]
        vmax = float(maps[0, [w.index for w in shown]].max()) if shown else None
        for k, image in enumerate(images):
            overlay_grid(image, maps[k, [w.index for w in shown]], [w.text for w in shown],
                         tmp / ("overlay.png" if k == 0 else f"overlay_{k}.png"), title=prompt, vmax=vmax)
        (tmp / "words").mkdir()
        for w in shown:
            word_overlay(images[0], maps[0, w.index], w.text, tmp / "words" / f"{w.index}_{_slug(w.text)}.png",
                         vmax=vmax)
        save_file(tensors, str(tmp / "maps.safetensors"), metadata={"prompt": prompt, "normalize": settings.normalize})
        timings["write_s"] = time.perf_counter() - t0
        meta = {
            "prompt": prompt, "words": [asdict(w) for w in words], "shown_words": [w.text for w in shown],
            "seed": settings.seed, "steps": settings.steps, "guidance": settings.guidance,
            "scheduler": type(pipe.scheduler).__name__, "num_images": len(images), "height": int(size[0]),
            "width": int(size[1]), "normalize": settings.normalize, "model": model_name, "images": names,
            "layers": {name: list(store.layer_shapes[name]) for name in store.layers},
            "timings": {k: round(v, 3) for k, v in timings.items()}, "versions": _versions(),
        }
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        write_run_page(tmp, store, words, meta)  # index.html + viewer_data.js: the run in a browser
        return publish(tmp, final)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        prog="generate.py",
        description="Generate images from prompts and save each word's cross-attention map over the image.",
        epilog="Each prompt gets a new folder under --out with image_*.png, overlay.png, words/, "
               "maps.safetensors and meta.json. Existing folders are never overwritten unless --overwrite.")
    p.add_argument("prompts", nargs="+", help="one or more prompts, each in quotes")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed, prompt, device: same image and maps)")
    p.add_argument("--steps", type=int, default=25, help="denoising steps (default 25)")
    p.add_argument("--guidance", type=float, default=None,
                   help="classifier-free guidance scale; <=1 turns it off (default: the model's own: 1 for the "
                        "shipped model, which samples best unguided; 7.5 for Stable Diffusion folders)")
    p.add_argument("--num-images", type=int, default=1, help="images per prompt (default 1)")
    p.add_argument("--height", type=int, default=None, help="image height (default: the model's size)")
    p.add_argument("--width", type=int, default=None, help="image width (default: the model's size)")
    p.add_argument("--words", nargs="+", default=None, help="only these words in the overlays (default: all)")
    p.add_argument("--model", default=None, help="pipeline folder: ours or a Stable Diffusion folder "
                                                 "(default: the shipped model)")
    p.add_argument("--scheduler", default="ddim", choices=["ddim", "dpm", "ddpm"], help="sampler (default ddim)")
    p.add_argument("--normalize", default="raw", choices=NORMALIZATIONS, help="map normalisation (default raw: "
                   "each pixel's share of attention on the word)")
    p.add_argument("--out", default="outputs", help="parent folder for the results (default outputs/)")
    p.add_argument("--device", default=None, help="torch device, e.g. cuda (default: cpu)")
    p.add_argument("--self-attention", action="store_true", help="also record self-attention (more memory)")
    p.add_argument("--truncate", action="store_true", help="accept prompts longer than the tokenizer allows")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output folder of the same name")
    p.add_argument("--quiet", action="store_true", help="no progress or loading bars")
    add_steering_args(p)  # --reweight, --excite, --edit: a steered run beside the plain one
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    settings = Settings(args.seed, args.steps, args.guidance, args.num_images, args.height, args.width,
                        args.normalize, args.scheduler, args.self_attention, args.truncate)
    with sigterm_as_interrupt():
        try:
            # every check before any model work: a bad value costs nothing and leaves nothing behind
            check_settings(settings)
            check_out_dir(Path(args.out))
            pipe = load_pipeline(args.model, args.scheduler, args.device, show_progress=not args.quiet)
            if settings.guidance is None:
                settings = dataclasses.replace(settings, guidance=default_guidance(pipe))
            check_model_settings(pipe, settings)
            notes = [n for prompt in args.prompts for n in check_prompt(pipe, prompt, settings, args.words)]
            notes += check_prompt(pipe, args.edit, settings, None) if args.edit is not None else []
            plan = plan_steering(pipe, args)
        except UsageError as e:
            return usage_error(e)
        except KeyboardInterrupt as e:
            return interrupted(e, "nothing was written")
        for note in notes:
            print(f"warning: {note}", file=sys.stderr)
        model_name = str(args.model or "shipped:" + PRETRAINED.name)
        try:
            for prompt in args.prompts:
                folder = generate_one(pipe, prompt, settings, Path(args.out), model_name, args.words, args.overwrite,
                                      show_progress=not args.quiet)
                print(folder)
                if plan is not None:
                    print(steer_one(pipe, plan, prompt, settings, folder, show_progress=not args.quiet) / "compare.png")
        except KeyboardInterrupt as e:
            return interrupted(e, "no half-written folder left; the folders printed above are complete")
    return 0


if __name__ == "__main__":
    sys.exit(main())
