"""Write the evaluation: report.json, report.md (the table the model card shows) and figures."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from crossattn.overlay import ALPHA, CMAP

from ..world import WORD_KINDS
from .map_scoring import BASELINES, READOUTS, method_maps
from .prompts import TASKS
from .scaling import fmt

READOUT_LABELS = {"refined": "refined", "top_heads": "top heads"}
# The contenders of "where each wins": our plain aggregation, the read-outs beyond it, DAAM's recipe.
CONTENDERS = ("ours", *READOUTS, "daam")


def _block(report: dict, name: str, dataset: bool) -> dict | None:
    """The scores of method `name` on generated (or dataset) images; None in reports from before it."""
    suffix = "_dataset" if dataset else ""
    if name == "ours":
        return report["maps" + suffix]
    if name in READOUTS:
        return report.get("readouts" + suffix, {}).get(name)
    return report["baselines" + suffix][name]


def map_rows(report: dict, dataset: bool) -> list[str]:
    """The map-accuracy table (markdown lines) for generated or dataset images: ours, the read-outs, baselines."""
    lines = ["| method | shape mIoU | shape pointing | shape mass | colour mIoU | colour pointing | colour mass "
             "| threshold | words (shape/colour) |", "|---|---|---|---|---|---|---|---|---|"]
    rows = [("ours (plain): " + report["maps"]["aggregation"], _block(report, "ours", dataset))]
    rows += [(f"{READOUT_LABELS[r]}: {b['params']}", b) for r in READOUTS if (b := _block(report, r, dataset))]
    rows += [(b, _block(report, b, dataset)) for b in BASELINES]
    for name, r in rows:
        sh, co = r["shape_words"], r["color_words"]
        lines.append(f"| {name} | {fmt(sh['miou'])} | {fmt(sh['pointing'])} | {fmt(sh['mass'])} | "
                     f"{fmt(co['miou'])} | {fmt(co['pointing'])} | {fmt(co['mass'])} | {r['threshold']}"
                     f"{' (min-max)' if r.get('threshold_rule') == 'minmax' else ''} | "
                     f"{sh['n']}/{co['n']} |")
    return lines


def winners(report: dict) -> list[str]:
    """'Where each wins' (markdown lines): per images, words and measure, the best of `CONTENDERS`."""
    lines = ["| images | words | mIoU | pointing | mass |", "|---|---|---|---|---|"]
    for dataset, images in ((False, "generated"), (True, "dataset")):
        blocks = {n: b for n in CONTENDERS if (b := _block(report, n, dataset))}
        for kind, words in (("shape_words", "shape"), ("color_words", "colour")):
            cells = []
            for measure in ("miou", "pointing", "mass"):
                scored = {n: b[kind][measure] for n, b in blocks.items() if b[kind][measure] is not None}
                if not scored:
                    cells.append("–")
                    continue
                best = max(scored, key=scored.get)
                plain = f" (plain {scored['ours']:.3f})" if best != "ours" else ""
                cells.append(f"{best} {scored[best]:.3f}{plain}")
            lines.append(f"| {images} | {words} | " + " | ".join(cells) + " |")
    return lines


def maps_markdown(report: dict) -> str:
    """What the model card's maps section shows, straight from the report: both map tables, where each read-out
    wins, the self-attention's row entropy and the dataset read-out against the timestep."""
    lines = ["### Map accuracy on generated images (masks from the detector)", "", *map_rows(report, False), "",
             f"### Map accuracy on dataset images denoised one step from t={report['maps_dataset']['timestep']} "
             "(exact masks)", "", *map_rows(report, True), ""]
    if "readouts" in report:
        lines += ["### Where each read-out wins (ours = plain, refined, top_heads, daam)", "", *winners(report), ""]
    if report.get("self_attention_entropy"):
        entropy = report["self_attention_entropy"]
        lines += ["Self-attention row entropy, as a fraction of the maximum (1 = uniform rows): "
                  + ", ".join(f"{name} {value:.2f}" for name, value in entropy.items()) + ".", ""]
    if report.get("dataset_timestep_sweep"):
        sweep = report["dataset_timestep_sweep"]
        lines += ["### Dataset read-out against the timestep (plain / refined)", "",
                  "| t | shape mIoU | shape pointing | colour mIoU | colour pointing |", "|---|---|---|---|---|"]
        for t, v in sweep.items():
            cells = [f"{fmt(v['ours'][k][m])} / {fmt(v['refined'][k][m])}"
                     for k in ("shape_words", "color_words") for m in ("miou", "pointing")]
            lines.append(f"| {t} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def guided_at(pipe) -> dict:
    """The timesteps the pipeline guides at (as `evaluate.py --guidance-max-t` set them): a report's settings."""
    return {"guidance_min_t": pipe.config.get("guidance_min_t", 0), "guidance_max_t": pipe.config.get("guidance_max_t")}


def guidance_words(settings: dict) -> str:
    """A report's guidance: "guidance 2.0", or "guidance 2.0 at t <= 550" where it guided only some timesteps
    (reports written before the window was saved have none)."""
    scale, lo, hi = settings["guidance"], settings.get("guidance_min_t") or 0, settings.get("guidance_max_t")
    if scale == 1 or (not lo and hi is None):
        return f"guidance {scale}"
    if lo and hi is not None:
        return f"guidance {scale} at {lo} <= t <= {hi}"
    return f"guidance {scale} at t >= {lo}" if lo else f"guidance {scale} at t <= {hi}"


def markdown(report: dict, title: str) -> str:
    pf, s = report["prompt_following"], report["settings"]
    lines = [f"# {title}", "",
             f"{s['prompts']} prompts × {s['seeds']} seeds, {s['steps']} {s.get('scheduler', 'ddim').upper()} steps, "
             f"{guidance_words(s)}"
             f"{' (quick mode)' if s['quick'] else ''}. Maps chosen on a separate split of "
             f"{s['selection_seeds']} other seeds per prompt.", "",
             "## Prompt following (GenEval rules, our detector)", "",
             "| task | accuracy | images |", "|---|---|---|"]
    lines += [f"| {t} | {fmt(pf[t])} | {pf['n_images'][t]} |" for t in TASKS]
    lines += [f"| **overall** (mean of tasks) | **{fmt(pf['overall'])}** | {sum(pf['n_images'].values())} |", ""]
    if "background_grain" in pf:  # reports written before the grain measure have none
        g = pf["background_grain"]
        lines += [f"Background grain (mean |pixel| off the detected objects, 0-255; the data's is 0): "
                  f"mean {g['mean']:.2f}, 90th percentile {g['p90']:.2f}.", ""]
    if "relation_response" in pf:  # reports written before it have none
        cells = [f"{axis} {fmt(v['response'])} ({v['images']} images)" for axis, v in pf["relation_response"].items()]
        lines += ["Relation response (P(first object on the named side | the word) - P(same side | the opposite "
                  "word), position images with both objects found; 0 = the word is ignored, 1 = obeyed): "
                  + ", ".join(cells) + ".", ""]
    lines += and_order_markdown(pf)
    lines += relations_markdown(pf)
    lines += layout_markdown(report)
    lines += [maps_markdown(report).replace("### ", "## ")]
    sweep = report["maps"]["shape_words"]["sweep"]
    lines += ["## Threshold sweep (ours, shape words, generated images; fraction of each map's maximum)", "",
              "| " + " | ".join(sweep) + " |", "|" + "---|" * len(sweep),
              "| " + " | ".join(fmt(v) for v in sweep.values()) + " |", ""]
    return "\n".join(lines)


def and_order_markdown(pf: dict) -> list[str]:
    """Where the "and" prompts put their first-named object, where the report has it (reports before it: none)."""
    if "and_order" not in pf or pf["and_order"]["first_as_read"] is None:
        return []
    v = pf["and_order"]
    return [f"Word order of the \"and\" prompts (share of their images, both objects found, whose first-named object "
            f"comes first as read, left to right or top to bottom; about 0.5 = the order is left to the noise): "
            f"{fmt(v['first_as_read'])} ({v['images']} images).", ""]


def relations_markdown(pf: dict) -> list[str]:
    """The paired relation response and the relation words' similarity, from a report's prompt following (or a
    `--relations-only` report), where it has them."""
    lines = []
    if "relation_response_paired" in pf:
        lines += ["## Position words, paired (opposite words sampled from the same noise, on seeds of their own; "
                  "exact: a word the model ignores gives 0 and images that differ by 0)", "",
                  "| axis | response | order moved | pairs | images differ (/255) |", "|---|---|---|---|---|"]
        lines += [f"| {axis} | {fmt(v['response'])} | {fmt(v['moved'])} | {v['pairs']} | {fmt(v['pixel_difference'])} |"
                  for axis, v in pf["relation_response_paired"].items()]
        lines += [""]
    if "relation_word_similarity" in pf:
        cells = [f"{pair} {v:.3f}" for pair, v in pf["relation_word_similarity"].items()]
        lines += ["Relation words as the U-Net receives them (cosine similarity of the text encoder's hidden states "
                  "at the word, 'a circle left of a square' against 'right of'; 1 = the same vector): "
                  + ", ".join(cells) + ".", ""]
    return lines


def layout_markdown(report: dict) -> list[str]:
    """The layout response and key separation (unet/eval/layout.py), where the report has them."""
    lines = []
    layout = report.get("prompt_following", report).get("layout_response")
    if layout:
        steps = ", ".join(f"t = {t}" for t in layout["timesteps"])
        lines += ["## Layout response (the model's shift of the first object between opposite words, at the first "
                  f"sampling steps, ÷ the data's; mean x0 of {layout['draws']} noise draws)", "",
                  f"| pair | response | per step ({steps}) | model shift (px) | data shift (px) |",
                  "|---|---|---|---|---|"]
        lines += [f"| {name} | {fmt(v['response'], 2)} | {' / '.join(fmt(r, 2) for r in v['response_per_step'])} | "
                  f"{fmt(v['model_shift'][0], 1)} | {fmt(v['data_shift'], 1)} |" for name, v in layout["pairs"].items()]
        lines += [""]
    keys = report.get("key_separation")
    if keys:
        lines += ["## Key separation (cosine between the Keys of a prompt's two different colour words, and shape "
                  "words, per cross-attention layer; 1 = the softmax cannot tell them apart)", "",
                  "| layer | colour words, mean / max | shape words, mean / max |", "|---|---|---|"]
        lines += [f"| {name} | {fmt(v['color']['mean'], 2)} / {fmt(v['color']['max'], 2)} | "
                  f"{fmt(v['shape']['mean'], 2)} / {fmt(v['shape']['max'], 2)} |" for name, v in keys["layers"].items()]
        if keys.get("text_output"):  # what every layer projects: words merged here cannot be told apart anywhere
            v = keys["text_output"]
            lines += [f"| text encoder output (before the Keys) | {fmt(v['color']['mean'], 2)} / "
                      f"{fmt(v['color']['max'], 2)} | {fmt(v['shape']['mean'], 2)} / {fmt(v['shape']['max'], 2)} |"]
        if keys.get("largest_activation") is not None:
            lines += ["", f"The text encoder's largest |activation| before its final LayerNorm: "
                          f"{keys['largest_activation']:.1f}."]
        lines += [""]
    return lines


MAPS_BEGIN, MAPS_END = "<!-- maps: begin -->", "<!-- maps: end -->"


def check_readme(readme: Path) -> str:
    """`readme`'s text; ValueError unless it is a readable file with one `MAPS_BEGIN` ... `MAPS_END` block."""
    try:
        text = Path(readme).read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"readme {readme} is not a readable text file: {e}") from e
    if text.count(MAPS_BEGIN) != 1 or text.count(MAPS_END) != 1 or text.index(MAPS_BEGIN) > text.index(MAPS_END):
        raise ValueError(f"readme {readme} must hold one '{MAPS_BEGIN}' ... '{MAPS_END}' block for the maps tables")
    return text


def refresh_readme(readme: Path, report: dict, source: str) -> None:
    """Replace the block between `MAPS_BEGIN` and `MAPS_END` in `readme` with `maps_markdown(report)`, so the
    model card's maps tables are the report's. `source` names the report (shown under the tables)."""
    text = check_readme(readme)
    head, rest = text.split(MAPS_BEGIN)
    _, tail = rest.split(MAPS_END)
    block = f"{MAPS_BEGIN}\n{maps_markdown(report)}\n(from `{source}`)\n{MAPS_END}"
    Path(readme).write_text(head + block + tail)


def bar_chart(report: dict, path: Path) -> None:
    pf = report["prompt_following"]
    fig = Figure(figsize=(9, 3.4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    names = list(TASKS) + ["overall"]
    ax1.bar(names, [pf[t] or 0 for t in names], color=["C0"] * len(TASKS) + ["C3"])
    ax1.set_ylim(0, 1)
    ax1.set_title("prompt following")
    ax1.tick_params(axis="x", rotation=30)
    methods = ["ours"] + list(BASELINES)
    values = [report["maps"]["shape_words"]] + [report["baselines"][b]["shape_words"] for b in BASELINES]
    x = np.arange(len(methods))
    ax2.bar(x - 0.2, [v["miou"] or 0 for v in values], 0.4, label="mIoU")
    ax2.bar(x + 0.2, [v["pointing"] or 0 for v in values], 0.4, label="pointing")
    ax2.set_xticks(x, methods)
    ax2.set_ylim(0, 1)
    ax2.set_title("shape-word maps (generated images)")
    ax2.legend()
    fig.savefig(path)


def examples(records, batches, selection, path: Path, per_kind: int = 4) -> None:
    """Hits and misses: each image with the map of its first object word, under our aggregation."""
    hits = [r for r in records if r["ok"] and r.get("words")][:per_kind]
    misses = [r for r in records if not r["ok"]][:per_kind]
    rows = hits + misses
    if not rows:
        return
    fig = Figure(figsize=(2.0 * len(rows), 4.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(rows), squeeze=False)
    cache = {}
    for col, r in enumerate(rows):
        image = r["image"]
        axes[0, col].imshow(image, interpolation="nearest")
        axes[0, col].set_title(("✓ " if r["ok"] else "✗ ") + r["prompt"], fontsize=7, wrap=True)
        axes[0, col].set_axis_off()
        axes[1, col].imshow(image, interpolation="nearest")
        axes[1, col].set_axis_off()
        if r.get("words"):
            if r["batch"] not in cache:
                cache[r["batch"]] = method_maps("ours", batches[r["batch"]].store, image.shape[:2], selection)
            word, tokens, _ = r["words"][-1]
            heat = cache[r["batch"]][r["index"], tokens].sum(0).numpy()
            axes[1, col].imshow(heat, cmap=CMAP, alpha=ALPHA, interpolation="bilinear")
            axes[1, col].set_title(f"map of '{word}'", fontsize=8)
        else:
            axes[1, col].set_title("(no object found)", fontsize=8)
    fig.savefig(path)


def write(report: dict, records, batches, selection, folder: Path, title: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report, indent=1))
    (folder / "report.md").write_text(markdown(report, title) + "\n![tasks and maps](tasks.png)\n\n"
                                      "![hits and misses](examples.png)\n")
    (folder / "maps.md").write_text(maps_markdown(report) + "\n")  # the model card's maps tables, as they are
    bar_chart(report, folder / "tasks.png")
    examples(records, batches, selection, folder / "examples.png")
    return folder


def markdown64(report: dict, title: str) -> str:
    """The report of a scenes-64 model (`run_evaluation64`): each task over all, seen and held-out prompts, where the
    "and" prompts put their first object, each word kind's map accuracy, and how numerals' maps spread; a
    `prompt_following64_on_fresh_seeds` report has no maps."""
    pf, s = report["prompt_following"], report["settings"]
    seeds = (f"{s['seeds']} seeds from seed {s['base_seed']} (fresh seeds: prompt following only, no maps)"
             if "base_seed" in s else f"{s['seeds']} seeds")
    threshold = ("" if "maps" not in report else
                 f" The maps' threshold is chosen on {s['selection_seeds']} other seeds per prompt.")
    lines = [f"# {title}", "",
             f"{s['prompts']} prompts × {seeds}, {s['steps']} {s.get('scheduler', 'ddim').upper()} steps, "
             f"{guidance_words(s)}.{threshold}",
             "", "## Prompt following (GenEval rules, the scenes-64 detector)", "",
             "| task | all prompts | seen | held out | images |", "|---|---|---|---|---|"]
    lines += [f"| {t} | {fmt(pf[t])} | {fmt(pf['seen'][t]['score'])} | {fmt(pf['held_out'][t]['score'])} | "
              f"{pf['n_images'][t]} |" for t in s["tasks"]]
    lines += [f"| **overall** (mean of tasks) | **{fmt(pf['overall'])}** | {fmt(pf['seen']['overall'])} | "
              f"{fmt(pf['held_out']['overall'])} | {sum(pf['n_images'].values())} |", "", *and_order_markdown(pf)]
    if "maps" not in report:  # a --fresh-seeds report
        return "\n".join(lines)
    dataset = f"dataset images denoised one step from t={report['maps_dataset']['timestep']} (exact masks)"
    for key, images in (("maps", "generated images (masks from the detector)"), ("maps_dataset", dataset)):
        maps = report[key]
        lines += [f"## Map accuracy on {images}", "",
                  f"Threshold {maps['threshold']} of each map's maximum (chosen by shape words), and each kind's own "
                  "(chosen by its words on the selection seeds). Recall: the share of the objects' masks the region "
                  "marks; precision: the share of the region on them.", "",
                  "| words | mIoU | recall | precision | pointing | mass | own threshold: mIoU | maps |",
                  "|---|---|---|---|---|---|---|---|"]
        lines += [f"| {kind} | {fmt(m['miou'])} | {fmt(m.get('recall'))} | {fmt(m.get('precision'))} | "
                  f"{fmt(m['pointing'])} | {fmt(m['mass'])} | {own_miou(m)} | {m['n']} |"
                  for kind in WORD_KINDS for m in [maps[f"{kind}_words"]]]
        lines += ["", "Numerals' maps over their objects (target: mass >= 0.8 and every object >= 1/(2N)):", "",
                  "| count | maps | mass | smallest share | evenness | meets target |", "|---|---|---|---|---|---|"]
        lines += [f"| {count} | {v['n']} | {fmt(v['mass'])} | {fmt(v['min_share'])} | {fmt(v['evenness'])} | "
                  f"{fmt(v['meets_target'])} |" for count, v in maps["numerals"].items()]
        lines.append("")
    return "\n".join(lines)


def own_miou(scores: dict) -> str:
    """A word kind's mIoU at its own threshold, "0.704 (0.1)", or "–" in reports from before it was measured."""
    return (f"{fmt(scores['own_miou'])} ({scores['own_threshold']:g})" if scores.get("own_miou") is not None
            else "–")


def write64(report: dict, folder: Path, title: str) -> Path:
    """A scenes-64 evaluation's report.json and report.md in `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "report.json").write_text(json.dumps(report, indent=1))
    (folder / "report.md").write_text(markdown64(report, title))
    return folder
