"""Levers side by side: full evaluations of paired runs (`train.py --grow-from`) at the same steps, as one
table and learning curves of the skills the levers are meant to move.

An arm is a label and its evaluation reports by step; arms grown from one checkpoint see the same batches,
so at a given step they differ only by the lever.
"""

from __future__ import annotations

import json
from pathlib import Path

from .prompts import TASKS
from .scaling import _fmt

CURVES = (("position", "position"), ("color_attr", "colour attribution"), ("shape_pointing", "shape-word pointing"),
          ("overall", "overall"))


def lever_row(label: str, step: int, report: dict) -> dict:
    pf = report["prompt_following"]
    # the paired response is exact; reports written before it have only the unpaired one (marked "u")
    paired = "relation_response_paired" in pf
    response = pf["relation_response_paired"] if paired else pf.get("relation_response", {})
    return {"arm": label, "step": step, **{t: pf[t] for t in TASKS}, "overall": pf["overall"],
            "grain": pf["background_grain"]["mean"], "shape_miou": report["maps"]["shape_words"]["miou"],
            "shape_pointing": report["maps"]["shape_words"]["pointing"],
            "horizontal": response.get("horizontal", {}).get("response"),
            "vertical": response.get("vertical", {}).get("response"), "response_paired": paired,
            "seeds": report["settings"]["seeds"],
            "left_right_similarity": pf.get("relation_word_similarity", {}).get("left/right")}


def read_rows(specs: list[str]) -> list[dict]:
    """Rows from "LABEL=REPORT_FOLDER@STEP" specs; ValueError naming a bad one."""
    rows = []
    for spec in specs:
        label, sep, rest = spec.partition("=")
        folder, at, step = rest.rpartition("@")
        if not (sep and at and label and step.isdigit()):
            raise ValueError(f"{spec!r}: give LABEL=REPORT_FOLDER@STEP, e.g. plain=runs/evals/v1-16800@16800")
        path = Path(folder) / "report.json"
        try:
            report = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{spec!r}: {path} is not a readable evaluation report ({e})") from e
        if "prompt_following" not in report:
            raise ValueError(f"{spec!r}: {path} is not a full evaluation report (a --relations-only one?)")
        rows.append(lever_row(label, int(step), report))
    return rows


def write_levers(rows: list[dict], out: Path, title: str) -> None:
    """levers.json, levers.md (one row per arm and step) and levers.png (a curve per arm for each skill)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out.mkdir(parents=True, exist_ok=True)
    (out / "levers.json").write_text(json.dumps({"title": title, "rows": rows}, indent=1))
    head = ["arm", "step", *TASKS, "overall", "grain /255", "shape mIoU / pointing",
            "relation response (h / v; u: unpaired)", "left/right similarity"]
    lines = [f"# {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["arm"], f"{r['step']:,}", *(_fmt(r[t]) for t in TASKS), _fmt(r["overall"]), _fmt(r["grain"], 2),
                 f"{_fmt(r['shape_miou'])} / {_fmt(r['shape_pointing'])}",
                 f"{_fmt(r['horizontal'], 2)} / {_fmt(r['vertical'], 2)}"
                 f"{' u' if not r.get('response_paired') and r['horizontal'] is not None else ''}",
                 _fmt(r["left_right_similarity"], 4)]
        lines.append("| " + " | ".join(cells) + " |")
    (out / "levers.md").write_text("\n".join(lines) + "\n")

    fig = Figure(figsize=(12, 3.4), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    arms = list(dict.fromkeys(r["arm"] for r in rows))
    for ax, (key, name) in zip(fig.subplots(1, len(CURVES)), CURVES):
        for arm in arms:
            points = sorted((r["step"], r[key]) for r in rows if r["arm"] == arm and r[key] is not None)
            ax.plot([s for s, _ in points], [v for _, v in points], marker="o", label=arm)
        ax.set(xlabel="step", title=name, ylim=(0, 1))
    ax.legend(fontsize=7)
    fig.savefig(out / "levers.png")
