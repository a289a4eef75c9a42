"""A controlled run beside the plain one: `generate.py --reweight red=2 --excite --edit "..."`.

"Control" is the project's one word for steering sampling through attention (`crossattn.control`); the
command line's group, the `steered/` folder and the `control` entry of meta.json keep their names.

Builds a `crossattn.control.Controller` from words (checked before any work), samples the steered
images with the same seed, and writes them into the plain run's folder: `steered/` (images,
overlay, word maps), `compare.png` (plain and steered overlays side by side, one colour scale) and a
`control` entry in `meta.json` saying what was applied and what it cost.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from crossattn.capture import AttentionStore
from crossattn.control import (
    MAX_FACTOR,
    Controller,
    Edit,
    Excite,
    Reweight,
    align_prompts,
    parse_weights,
    word_positions,
)
from crossattn.errors import UsageError
from crossattn.maps import word_maps
from crossattn.overlay import overlay_grid, to_uint8
from crossattn.text import prompt_words

from .data import SHAPES
from .folders import PARTIAL
from .pipeline import ScenePipeline
from .signals import raise_swallowed


@dataclass
class ControlPlan:
    """What the controlled run applies; every word already checked against the prompts it applies to."""
    reweight: dict[str, float] = field(default_factory=dict)
    reweight_steps: tuple[float, float] = (0.0, 1.0)
    excite: list[str] | None = None  # subject words; [] = the prompt's object words; None = no excite
    edit: str | None = None  # the edited prompt, sampled with the plain prompt's attention replayed
    cross_replace_steps: float = 0.8
    self_replace_steps: float = 0.4
    local_blend: bool = False

    def controlled_prompt(self, prompt: str) -> str:
        return self.edit if self.edit is not None else prompt

    def subjects(self, words: list[str]) -> list[str]:
        return self.excite or object_words(words)


def add_control_args(parser) -> None:
    g = parser.add_argument_group("steering", "a second, steered run with the same seed, written beside the plain "
                                              "one (steered/, compare.png, meta.json 'control')")
    g.add_argument("--reweight", nargs="+", action="extend", metavar="WORD=FACTOR", default=None,
                   help=f"scale these words' attention, e.g. red=2 (prompt-to-prompt's re-weighting; factors within "
                        f"+-{MAX_FACTOR:g}); repeated flags add up")
    g.add_argument("--reweight-steps", nargs=2, type=float, metavar=("START", "END"), default=None,
                   help="share of the run to re-weight in, START < END (default 0 1: all of it)")
    g.add_argument("--excite", nargs="*", action="extend", metavar="WORD", default=None,
                   help="attend-and-excite these subject words (bare flag: the prompt's object words); repeated "
                        "flags add up")
    g.add_argument("--edit", default=None, metavar="PROMPT",
                   help="prompt-to-prompt: sample this edited prompt with the plain prompt's attention replayed "
                        "(same number of words: word swap; words only added: refinement)")
    g.add_argument("--cross-replace-steps", type=float, default=None, help="with --edit: share of the run whose "
                   "cross-attention is replayed (default 0.8)")
    g.add_argument("--self-replace-steps", type=float, default=None, help="with --edit: share of the run whose "
                   "self-attention is replayed (default 0.4)")
    g.add_argument("--local-blend", action="store_true", help="keep the plain image outside the edited words' maps")


def object_words(prompt_word_texts: list[str]) -> list[str]:
    """The prompt's object words: the shapes of this project's scenes, in order, once each."""
    return list(dict.fromkeys(w for w in prompt_word_texts if w in SHAPES))


def plan_control(pipe, args) -> ControlPlan | None:
    """The control the command line asks for, or None; raises UsageError naming any bad value."""
    shaping = [("--reweight-steps", args.reweight_steps, args.reweight, "--reweight"),
               ("--cross-replace-steps", args.cross_replace_steps, args.edit, "--edit"),
               ("--self-replace-steps", args.self_replace_steps, args.edit, "--edit"),
               ("--local-blend", args.local_blend or None, args.edit, "--edit")]
    for flag, value, control, control_flag in shaping:
        if value is not None and control is None:
            raise UsageError(f"{flag} needs {control_flag}, which is not given: add {control_flag} or drop {flag}")
    if args.reweight is None and args.excite is None and args.edit is None:
        return None
    if not isinstance(pipe, ScenePipeline):
        raise UsageError("--reweight/--excite/--edit need this project's pipeline (its sampling loop calls the "
                         "controller); for diffusers models use crossattn.control.Controller in Python")
    if args.edit is not None and len(args.prompts) != 1:
        raise UsageError(f"--edit takes exactly one prompt to edit, got {len(args.prompts)}")
    defaults = ControlPlan()
    start, end = args.reweight_steps or defaults.reweight_steps
    cross = defaults.cross_replace_steps if args.cross_replace_steps is None else args.cross_replace_steps
    self_steps = defaults.self_replace_steps if args.self_replace_steps is None else args.self_replace_steps
    for name, value in (("--reweight-steps START", start), ("--reweight-steps END", end),
                        ("--cross-replace-steps", cross), ("--self-replace-steps", self_steps)):
        if not 0.0 <= value <= 1.0:  # also refuses nan
            raise UsageError(f"{name} must be a share of the run between 0 and 1, got {value}")
    if start >= end:
        raise UsageError(f"--reweight-steps {start:g} {end:g} is {'empty' if start == end else 'reversed'}: START "
                         "must be below END (shares of the run, e.g. 0 0.5)")
    excite = None if args.excite is None else list(dict.fromkeys(args.excite))
    plan = ControlPlan(reweight_steps=(start, end), excite=excite, edit=args.edit,
                       cross_replace_steps=cross, self_replace_steps=self_steps, local_blend=args.local_blend)
    try:
        if args.reweight is not None:
            plan.reweight = parse_weights(args.reweight)
        for prompt in args.prompts:
            target = prompt_words(pipe.tokenizer, plan.controlled_prompt(prompt))
            texts = [w.text for w in target]
            word_positions(target, list(plan.reweight), "--reweight")
            if plan.excite is not None and not plan.subjects(texts):
                raise ValueError(f"--excite: {plan.controlled_prompt(prompt)!r} has no object word "
                                 f"({', '.join(SHAPES)}); name the subjects, e.g. --excite {texts[-1]}")
            word_positions(target, plan.excite or [], "--excite")
            if plan.edit is not None:
                alignment = align_prompts(pipe.tokenizer, prompt, plan.edit)
                if plan.local_blend and not alignment.target_tokens:
                    raise ValueError("--local-blend: the edit changes no word, so there is nothing to blend")
    except ValueError as e:
        raise UsageError(str(e)) from e
    return plan


def build_controller(pipe, plan: ControlPlan, prompt: str, recording=None) -> Controller:
    """The controller for the controlled run of the plain prompt `prompt` (words looked up in the controlled one)."""
    words = prompt_words(pipe.tokenizer, plan.controlled_prompt(prompt))
    reweight = excite = edit = None
    if plan.reweight:
        found = word_positions(words, list(plan.reweight), "--reweight")
        reweight = Reweight({p: plan.reweight[w] for w, ps in found.items() for p in ps}, steps=plan.reweight_steps)
    if plan.excite is not None:
        subjects = plan.subjects([w.text for w in words])
        found = word_positions(words, subjects, "--excite")
        excite = Excite([found[w] for w in subjects], text_end=words[-1].tokens[-1] + 1)
    if plan.edit is not None:
        edit = Edit(recording, align_prompts(pipe.tokenizer, prompt, plan.edit), plan.cross_replace_steps,
                    plan.self_replace_steps, plan.local_blend)
    return Controller.for_pipeline(pipe, reweight=reweight, edit=edit, excite=excite)


def sample(pipe, prompt: str, settings, controller: Controller | None = None, store: AttentionStore | None = None,
           show_progress: bool = False) -> np.ndarray:
    """(N, H, W, 3) uint8 images of `prompt` with the run settings' seed, controlled by `controller` if given."""
    generator = torch.Generator(device="cpu").manual_seed(settings.seed)
    attached = [a for a in (store, controller) if a is not None]
    for a in attached:
        a.attach(pipe.unet)
    try:
        images = pipe(prompt, num_inference_steps=settings.steps, guidance_scale=settings.guidance,
                      generator=generator, num_images_per_prompt=settings.num_images, height=settings.height,
                      width=settings.width, output_type="np", controller=controller,
                      show_progress=show_progress).images
    finally:
        for a in reversed(attached):
            a.detach()
    return to_uint8(images)


def record_source(pipe, prompt: str, settings, show_progress: bool = False):
    """(images, recording): the plain prompt sampled with a recorder; an edit replays the recording (same
    seed, same images as the plain run)."""
    recorder = Controller.for_pipeline(pipe, record=True)
    images = sample(pipe, prompt, settings, recorder, show_progress=show_progress)
    return images, recorder.recording


def describe(plan: ControlPlan, prompt: str, controlled_words) -> str:
    """One line for figure titles: what the controlled run of `prompt` applied."""
    parts = []
    if plan.edit is not None:
        parts.append(f"edit of {prompt!r}" + (" + local blend" if plan.local_blend else ""))
    if plan.reweight:
        parts.append("reweight " + " ".join(f"{w}={f:g}" for w, f in plan.reweight.items()))
    if plan.excite is not None:
        parts.append("excite " + ", ".join(plan.subjects([w.text for w in controlled_words])))
    return "; ".join(parts)


def control_one(pipe, plan: ControlPlan, prompt: str, settings, folder: Path, show_progress: bool = True) -> Path:
    """Run the controlled generation of `prompt` (plain run in `folder`) and add it there; returns `folder`."""
    timings = {}
    recording = None
    t0 = time.perf_counter()
    if plan.edit is not None:
        recording = record_source(pipe, prompt, settings, show_progress)[1]
        timings["record_source_s"] = time.perf_counter() - t0
    controller = build_controller(pipe, plan, prompt, recording)
    steered = plan.controlled_prompt(prompt)
    store = AttentionStore.for_pipeline(pipe)
    t0 = time.perf_counter()
    images = sample(pipe, steered, settings, controller, store, show_progress)
    timings["sampling_s"] = time.perf_counter() - t0

    size = images.shape[1:3]
    words = prompt_words(pipe.tokenizer, steered)
    maps = word_maps(store, words, size, index=None, normalize=settings.normalize)  # (N, words, H, W)
    plain_meta = json.loads((folder / "meta.json").read_text())
    plain_words = [w["text"] for w in plain_meta["words"]]
    plain_maps = load_file(str(folder / "maps.safetensors"))
    plain = torch.stack([plain_maps[f"{i}_{w}"][0] for i, w in enumerate(plain_words)])  # (words, H, W), image 0
    vmax = float(max(plain.max(), maps[0].max()))  # one colour scale for both rows of the comparison

    # named like every partial folder (with this process's id), so a later run removes it if this one is killed
    tmp = Path(tempfile.mkdtemp(prefix=f"{PARTIAL}{os.getpid()}-steered-", dir=folder))
    try:
        (tmp / "steered").mkdir()
        names = []
        for k, image in enumerate(images):
            names.append(f"steered/image_{k}.png")
            Image.fromarray(image).save(tmp / names[-1])
        title = f"steered: {steered} ({describe(plan, prompt, words)})"
        overlay_grid(images[0], maps[0], [w.text for w in words], tmp / "steered" / "overlay.png", title=title,
                     vmax=vmax)
        save_file({f"{w.index}_{w.text}": maps[:, w.index].contiguous() for w in words},
                  str(tmp / "steered" / "maps.safetensors"), metadata={"prompt": steered})
        overlay_grid(np.asarray(Image.open(folder / "image_0.png").convert("RGB")), plain, plain_words,
                     tmp / "plain.png", title=f"plain: {prompt}", vmax=vmax)
        paste_row([tmp / "plain.png", tmp / "steered" / "overlay.png"], tmp / "compare.png")
        (tmp / "plain.png").unlink()
        control = {**asdict(plan), "prompt": steered, "images": names, "overlay": "steered/overlay.png",
                   "compare": "compare.png",
                   "timings": {k: round(v, 3) for k, v in timings.items()},
                   "plain_sampling_s": plain_meta.get("timings", {}).get("sampling_s")}
        if plan.excite is not None:
            control["excite"] = plan.subjects([w.text for w in words])
            control["excite_log"] = controller.excite_log
        plain_meta["control"] = control
        (tmp / "meta.json").write_text(json.dumps(plain_meta, indent=1))
        raise_swallowed()  # an interrupt lost inside matplotlib while writing: nothing of this run is moved in
        if (folder / "steered").exists():  # --overwrite of a folder that had a steered run
            shutil.rmtree(folder / "steered")
        (tmp / "steered").rename(folder / "steered")
        os.replace(tmp / "compare.png", folder / "compare.png")
        os.replace(tmp / "meta.json", folder / "meta.json")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def paste_row(paths: list[Path], out: Path, gap: int = 16) -> Path:
    """Paste PNGs left to right on white, tops aligned."""
    panels = [Image.open(p).convert("RGB") for p in paths]
    canvas = Image.new("RGB", (sum(p.width for p in panels) + gap * (len(panels) - 1), max(p.height for p in panels)),
                       "white")
    x = 0
    for p in panels:
        canvas.paste(p, (x, 0))
        x += p.width + gap
    canvas.save(out)
    return out
