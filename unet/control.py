"""A controlled run beside the plain one: `generate.py --reweight red=2 --excite --edit "..."`.

"Control" is the project's one word for changing sampling through attention (`crossattn.control`): the
command line's group, the `controlled/` folder and the `control` entry of meta.json.

Builds a `crossattn.control.Controller` from a `ControlPlan` (its words checked at the door by
unet/cli/control.py), samples the controlled images with the same seed, and writes them into the plain
run's folder: `controlled/` (images,
overlay, word maps), `compare.png` (plain and controlled overlays side by side, one colour scale) and a
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
from safetensors.torch import save_file

from crossattn.capture import AttentionStore
from crossattn.control import (
    Controller,
    Edit,
    Excite,
    Reweight,
    align_prompts,
    word_positions,
)
from crossattn.maps import word_maps
from crossattn.overlay import overlay_grid, to_uint8
from crossattn.text import prompt_words

from .data import SHAPES
from .folders import PARTIAL
from .run_folder import read_run
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
    shape_words: tuple[str, ...] = SHAPES  # the model's world's (`pipeline.shape_words`): what --excite takes

    def controlled_prompt(self, prompt: str) -> str:
        return self.edit if self.edit is not None else prompt

    def subjects(self, words: list[str]) -> list[str]:
        return self.excite or object_words(words, self.shape_words)


def object_words(prompt_word_texts: list[str], shapes: tuple[str, ...] = SHAPES) -> list[str]:
    """The prompt's object words: its words among `shapes` (a world's shape words), in order, once each."""
    return list(dict.fromkeys(w for w in prompt_word_texts if w in shapes))


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
    controlled = plan.controlled_prompt(prompt)
    store = AttentionStore.for_pipeline(pipe)
    t0 = time.perf_counter()
    images = sample(pipe, controlled, settings, controller, store, show_progress)
    timings["sampling_s"] = time.perf_counter() - t0

    size = images.shape[1:3]
    words = prompt_words(pipe.tokenizer, controlled)
    maps = word_maps(store, words, size, index=None, normalize=settings.normalize)  # (N, words, H, W)
    plain_meta, plain_words, plain = read_run(folder)  # plain: (words, H, W), image 0
    vmax = float(max(plain.max(), maps[0].max()))  # one colour scale for both rows of the comparison

    # named like every partial folder (with this process's id), so a later run removes it if this one is killed
    tmp = Path(tempfile.mkdtemp(prefix=f"{PARTIAL}{os.getpid()}-controlled-", dir=folder))
    try:
        (tmp / "controlled").mkdir()
        names = []
        for k, image in enumerate(images):
            names.append(f"controlled/image_{k}.png")
            Image.fromarray(image).save(tmp / names[-1])
        title = f"controlled: {controlled} ({describe(plan, prompt, words)})"
        overlay_grid(images[0], maps[0], [w.text for w in words], tmp / "controlled" / "overlay.png", title=title,
                     vmax=vmax)
        save_file({f"{w.index}_{w.text}": maps[:, w.index].contiguous() for w in words},
                  str(tmp / "controlled" / "maps.safetensors"), metadata={"prompt": controlled})
        overlay_grid(np.asarray(Image.open(folder / "image_0.png").convert("RGB")), plain, plain_words,
                     tmp / "plain.png", title=f"plain: {prompt}", vmax=vmax)
        paste_row([tmp / "plain.png", tmp / "controlled" / "overlay.png"], tmp / "compare.png")
        (tmp / "plain.png").unlink()
        control = {**asdict(plan), "prompt": controlled, "images": names, "overlay": "controlled/overlay.png",
                   "compare": "compare.png",
                   "timings": {k: round(v, 3) for k, v in timings.items()},
                   "plain_sampling_s": plain_meta.get("timings", {}).get("sampling_s")}
        if plan.excite is not None:
            control["excite"] = plan.subjects([w.text for w in words])
            control["excite_log"] = controller.excite_log
        plain_meta["control"] = control
        (tmp / "meta.json").write_text(json.dumps(plain_meta, indent=1))
        raise_swallowed()  # an interrupt lost inside matplotlib while writing: nothing of this run is moved in
        if (folder / "controlled").exists():  # --overwrite of a folder that had a controlled run
            shutil.rmtree(folder / "controlled")
        (tmp / "controlled").rename(folder / "controlled")
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
