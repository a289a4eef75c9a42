"""Measured control: what re-weighting, attend-and-excite and prompt-to-prompt edits buy, judged by
the detector against the prompt.

- `excite` / `reweight`: the evaluation's prompts, each sampled with and without the control from the
  same seeds; prompt following per task (GenEval rules, as `unet.eval.prompts`), background grain, and the
  seconds per image of each. Excite's subjects are the prompt's shape words; re-weighting scales every
  colour and shape word by `factor`.
- `edit`: two-object prompts; each object's shape is swapped for the third shape ("a red circle and a
  blue square" -> "a red triangle and a blue square") and sampled from the same noise with the source's
  attention replayed, and without it. A swap succeeds when the swapped object is found with its colour
  and the new shape, and the other object with its colour and shape within `place_tolerance` pixels
  of where it was. Only sources whose objects were both found count.

    python scripts/evaluate.py --control excite --quick
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..control import ControlPlan, build_controller, record_source, sample
from ..data import COLORS, SHAPES
from ..pipeline import Settings, default_guidance
from .detect import detect
from .prompts import TASKS, EvalPrompt, background_grain, check, eval_prompts
from .report import guidance_words

CONTROLS = ("excite", "reweight", "edit")


def control_prompts(quick: bool, per_task: int = 2, seed: int = 0) -> list[EvalPrompt]:
    """The evaluation's prompts; in quick mode `per_task` of each task, drawn with a fixed seed."""
    prompts = eval_prompts()
    if not quick:
        return prompts
    rng = random.Random(seed)
    return [p for task in TASKS for p in rng.sample([q for q in prompts if q.task == task], per_task)]


def plan_for(control: str, prompt: str, factor: float) -> ControlPlan:
    if control == "excite":
        return ControlPlan(excite=[])  # the prompt's object words
    words = prompt.split()
    return ControlPlan(reweight={w: factor for w in words if w in COLORS or w in SHAPES})


def _timed(fn, *args):
    """(fn(*args), seconds it took)."""
    t0 = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - t0


def evaluate_prompts(pipe, control: str, prompts: list[EvalPrompt], seeds: int, steps: int, guidance: float,
                     factor: float = 2.0, progress=None) -> tuple[dict, list[dict]]:
    """Prompt following with and without `control` ('excite' or 'reweight') on the same seeds."""
    records, seconds = [], {"plain": 0.0, "controlled": 0.0}
    for k, p in enumerate(prompts):
        settings = Settings(seed=k, steps=steps, guidance=guidance, num_images=seeds)
        plain, seconds_plain = _timed(sample, pipe, p.prompt, settings)
        controller = build_controller(pipe, plan_for(control, p.prompt, factor), p.prompt)
        controlled, seconds_controlled = _timed(sample, pipe, p.prompt, settings, controller)
        seconds["plain"] += seconds_plain
        seconds["controlled"] += seconds_controlled
        for i, (a, b) in enumerate(zip(plain, controlled)):
            da, db = detect(a), detect(b)
            records.append({"task": p.task, "prompt": p.prompt, "seed": k, "index": i, "plain": a, "controlled": b,
                            "ok_plain": check(p, da)[0], "ok_controlled": check(p, db)[0],
                            "grain_plain": background_grain(a, da), "grain_controlled": background_grain(b, db)})
        if progress:
            progress.update(1)
    report = {"tasks": {}, "settings": {"control": control, "prompts": len(prompts), "seeds": seeds, "steps": steps,
                                        "guidance": guidance}}
    if control == "reweight":
        report["settings"]["factor"] = factor
    for task in TASKS:
        rows = [r for r in records if r["task"] == task]
        if rows:
            report["tasks"][task] = {"plain": float(np.mean([r["ok_plain"] for r in rows])),
                                     "controlled": float(np.mean([r["ok_controlled"] for r in rows])),
                                     "images": len(rows)}
    for which in ("plain", "controlled"):
        report[f"overall_{which}"] = float(np.mean([t[which] for t in report["tasks"].values()]))  # mean of tasks
        report[f"grain_{which}"] = float(np.mean([r[f"grain_{which}"] for r in records]))
        report[f"seconds_per_image_{which}"] = seconds[which] / max(1, len(records))
    return report, records


def swap_edits(prompts: list[EvalPrompt]) -> list[tuple[EvalPrompt, int, str, str]]:
    """(source prompt, swapped object, new shape, edited prompt) for both objects of each two-object prompt."""
    edits = []
    for p in prompts:
        if len(p.objects) != 2 or p.objects[0][1] == p.objects[1][1]:
            continue
        for k in (0, 1):
            new = next(s for s in SHAPES if s not in (p.objects[0][1], p.objects[1][1]))
            words = p.prompt.split()
            position = [i for i, w in enumerate(words) if w in SHAPES][k]
            words[position] = new
            edits.append((p, k, new, " ".join(words)))
    return edits


def swap_succeeded(source_matched, k: int, new_shape: str, detections, place_tolerance: float) -> dict:
    """Whether the swapped object now has the new shape (same colour) and the other kept colour, shape, place."""
    swapped_source, other_source = source_matched[k], source_matched[1 - k]
    changed = any(d.color == swapped_source.color and d.shape == new_shape for d in detections)
    kept = any(d.color == other_source.color and d.shape == other_source.shape
               and np.hypot(*np.subtract(d.center, other_source.center)) <= place_tolerance for d in detections)
    return {"changed": changed, "kept": kept, "ok": changed and kept}


def evaluate_edits(pipe, prompts: list[EvalPrompt], seeds: int, steps: int, guidance: float,
                   cross_replace_steps: float = 0.8, self_replace_steps: float = 0.4, place_tolerance: float = 3.0,
                   progress=None) -> tuple[dict, list[dict]]:
    """Word swaps with the source's attention replayed (prompt-to-prompt) and without (the edited prompt alone)."""
    records, seconds = [], {"plain": 0.0, "controlled": 0.0, "source": 0.0}
    edits = swap_edits(prompts)
    for n, (p, k, new, edited) in enumerate(edits):
        settings = Settings(seed=n, steps=steps, guidance=guidance, num_images=seeds)
        (source_images, recording), seconds_source = _timed(record_source, pipe, p.prompt, settings)
        plan = ControlPlan(edit=edited, cross_replace_steps=cross_replace_steps,
                            self_replace_steps=self_replace_steps)
        controller = build_controller(pipe, plan, p.prompt, recording)
        replayed, seconds_controlled = _timed(sample, pipe, edited, settings, controller)
        alone, seconds_plain = _timed(sample, pipe, edited, settings)
        seconds["source"] += seconds_source
        seconds["controlled"] += seconds_controlled
        seconds["plain"] += seconds_plain
        for i in range(seeds):
            ok, matched = check(p, detect(source_images[i]))
            if not all(m is not None for m in matched):
                continue  # the source lacks an object: nothing to swap
            records.append({"source": p.prompt, "edited": edited, "seed": n, "index": i, "source_ok": ok,
                            "source_image": source_images[i], "plain": alone[i], "controlled": replayed[i],
                            "with_replay": swap_succeeded(matched, k, new, detect(replayed[i]), place_tolerance),
                            "without": swap_succeeded(matched, k, new, detect(alone[i]), place_tolerance)})
        if progress:
            progress.update(1)
    report = {"swaps": len(edits), "images": len(records), "settings": {
        "control": "edit", "seeds": seeds, "steps": steps, "guidance": guidance, "place_tolerance_px": place_tolerance,
        "cross_replace_steps": cross_replace_steps, "self_replace_steps": self_replace_steps}}
    for which in ("with_replay", "without"):
        report[which] = {key: float(np.mean([r[which][key] for r in records])) if records else None
                         for key in ("ok", "changed", "kept")}
    images = max(1, len(edits) * seeds)
    report["seconds_per_image"] = {"source": seconds["source"] / images, "replayed": seconds["controlled"] / images,
                                   "edited_alone": seconds["plain"] / images}
    return report, records


def run_control_evaluation(pipe, control: str, seeds: int = 4, steps: int = 25, guidance: float | None = None,
                           quick: bool = False, factor: float = 2.0, progress: bool = True):
    """(report, records) for one control; see the module docstring. guidance None: the model's own."""
    from tqdm.auto import tqdm
    guidance = default_guidance(pipe) if guidance is None else guidance
    if control not in CONTROLS:
        raise ValueError(f"unknown control {control!r}; choose one of {CONTROLS}")
    prompts = control_prompts(quick)
    if control == "edit":
        prompts = [p for p in prompts if p.task in ("two_object", "color_attr")] if not quick else \
            [p for p in eval_prompts() if p.task == "color_attr"][:3]
        bar = tqdm(total=len(swap_edits(prompts)), desc="edits", disable=not progress)
        report, records = evaluate_edits(pipe, prompts, seeds, steps, guidance, progress=bar)
    else:
        bar = tqdm(total=len(prompts), desc=control, disable=not progress)
        report, records = evaluate_prompts(pipe, control, prompts, seeds, steps, guidance, factor, progress=bar)
    bar.close()
    report["settings"]["quick"] = quick
    return report, records


def markdown(report: dict, title: str) -> str:
    s = report["settings"]
    lines = [f"# {title}", "", f"{s['steps']} DDIM steps, {guidance_words(s)}, {s['seeds']} seeds per prompt"
             f"{' (quick mode)' if s['quick'] else ''}.", ""]
    if s["control"] == "edit":
        w, wo, sec = report["with_replay"], report["without"], report["seconds_per_image"]
        lines += [f"{report['swaps']} word swaps, {report['images']} images whose source had both objects. A swap "
                  f"succeeds when the swapped object has the new shape and its colour, and the other object keeps "
                  f"colour, shape and place (within {s['place_tolerance_px']} px).", "",
                  "| | success | swapped object changed | other object kept | seconds per image |",
                  "|---|---|---|---|---|",
                  f"| edited prompt alone | {fmt(wo['ok'])} | {fmt(wo['changed'])} | {fmt(wo['kept'])} | "
                  f"{sec['edited_alone']:.2f} |",
                  f"| with the source's attention replayed (cross {s['cross_replace_steps']}, self "
                  f"{s['self_replace_steps']}) | {fmt(w['ok'])} | {fmt(w['changed'])} | {fmt(w['kept'])} | "
                  f"{sec['replayed']:.2f} (+ {sec['source']:.2f} to record the source) |", ""]
        return "\n".join(lines)
    extra = f" (factor {s['factor']} on colour and shape words)" if s["control"] == "reweight" else ""
    lines += [f"Prompt following without and with {s['control']}{extra}, same prompts and seeds.", "",
              "| task | plain | controlled | images |", "|---|---|---|---|"]
    lines += [f"| {t} | {fmt(r['plain'])} | {fmt(r['controlled'])} | {r['images']} |"
              for t, r in report["tasks"].items()]
    lines += [f"| **overall** (mean of tasks) | **{fmt(report['overall_plain'])}** | "
              f"**{fmt(report['overall_controlled'])}** | |",
              f"| background grain (0-255) | {report['grain_plain']:.2f} | {report['grain_controlled']:.2f} | |",
              f"| seconds per image | {report['seconds_per_image_plain']:.2f} | "
              f"{report['seconds_per_image_controlled']:.2f} | |", ""]
    return "\n".join(lines)


def fmt(x) -> str:
    return "–" if x is None else f"{x:.3f}"


def before_after(records: list[dict], path: Path, title: str, count: int = 8) -> Path:
    """Pairs of images, plain and controlled (for edits: source, edited alone, replayed), the verdicts as titles.
    Pairs where the verdicts differ come first: they show what the control changed."""
    edit = "source_image" in records[0] if records else False
    if edit:
        verdicts = ("with_replay", "without")
        columns = (("source_image", lambda r: f"source{'' if r['source_ok'] else ' (wrong)'}"),
                   ("plain", lambda r: f"alone: {'ok' if r['without']['ok'] else 'no'}"),
                   ("controlled", lambda r: f"replayed: {'ok' if r['with_replay']['ok'] else 'no'}"))
    else:
        verdicts = ("ok_plain", "ok_controlled")
        columns = (("plain", lambda r: f"plain: {'ok' if r['ok_plain'] else 'no'}"),
                   ("controlled", lambda r: f"controlled: {'ok' if r['ok_controlled'] else 'no'}"))
    chosen = sorted(records, key=lambda r: r[verdicts[0]] == r[verdicts[1]])[:count]  # changed verdicts first
    fig = Figure(figsize=(1.9 * len(columns) * 2, 2.3 * ((len(chosen) + 1) // 2) + 0.5), dpi=100,
                 layout="constrained")
    FigureCanvasAgg(fig)
    rows = max(1, (len(chosen) + 1) // 2)
    axes = fig.subplots(rows, 2 * len(columns), squeeze=False)
    for ax in axes.ravel():
        ax.set_axis_off()
    for n, r in enumerate(chosen):
        row, col = divmod(n, 2)
        prompt = f"-> {r['edited']}" if edit else r["prompt"]
        for c, (field, label) in enumerate(columns):
            ax = axes[row, col * len(columns) + c]
            ax.imshow(r[field], interpolation="nearest")
            ax.set_title(f"{prompt if c == 0 else ''}\n{label(r)}", fontsize=8, loc="left" if c == 0 else "center")
    fig.suptitle(title, fontsize=11)
    fig.savefig(path)
    return path


def write(report: dict, records: list[dict], folder: Path, title: str) -> Path:
    """report.json, report.md and before_after.png in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report, indent=1))
    (folder / "report.md").write_text(markdown(report, title))
    before_after(records, folder / "before_after.png", title)
    return folder / "report.md"
