"""Does the recipe improve with compute? The quick evaluation of every snapshot a training run kept.

A run started with `--snapshot-every N` keeps its EMA pipeline at every N steps in
`RUN/snapshots/step_XXXXXX`. Each snapshot is evaluated once (rows are cached in `scaling.json`, so
re-running, or watching a run that is still going, only evaluates the new ones), then the table and
the plot (prompt following per task and shape-word map mIoU against training images) are rewritten.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

from .prompts import TASKS


def snapshots(run: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete snapshot of `run`, by step."""
    found = []
    for folder in sorted((run / "snapshots").glob("step_*")):
        if (folder / "model_index.json").exists() and folder.name[5:].isdigit():
            found.append((int(folder.name[5:]), folder))
    return found


def wall_minutes(run: Path, step: int) -> float | None:
    """Training wall time at `step` from the run's loss.csv (step, loss, seconds since that start of the
    command; a resumed run restarts the clock, so its stretches are added up)."""
    path = run / "loss.csv"
    if not path.exists():
        return None
    total, last, offset = None, 0.0, 0.0
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            s, seconds = int(row[0]), float(row[2])
            if seconds < last:  # a new stretch of a resumed run
                offset += last
            last = seconds
            if s == step:
                total = (offset + seconds) / 60
    return total


def scaling_row(step: int, batch_size: int, minutes: float | None, report: dict) -> dict:
    """One row of the scaling table from a quick evaluation report."""
    pf = report["prompt_following"]
    return {"step": step, "images": step * batch_size, "minutes": minutes,
            **{task: pf[task] for task in TASKS}, "overall": pf["overall"],
            "grain": pf["background_grain"]["mean"],
            "shape_miou": report["maps"]["shape_words"]["miou"],
            "shape_pointing": report["maps"]["shape_words"]["pointing"]}


def best_row(rows: list[dict]) -> dict:
    """The snapshot to keep: highest prompt following (the detector's score), later step on ties."""
    return max(rows, key=lambda r: (r["overall"], r["step"]))


def fmt(x, digits=3) -> str:
    """A score for a table: `digits` decimals, or a dash for none."""
    return "–" if x is None else f"{x:.{digits}f}"


def write_scaling(rows: list[dict], out: Path, title: str, device: str) -> None:
    """scaling.json, scaling.md (the table) and scaling.png (prompt following per task and map mIoU
    against training images)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if not rows:
        raise ValueError("no snapshot rows to write")
    rows = sorted(rows, key=lambda r: r["step"])
    out.mkdir(parents=True, exist_ok=True)
    best = best_row(rows)
    (out / "scaling.json").write_text(json.dumps({"title": title, "device": device, "rows": rows,
                                                  "best_step": best["step"]}, indent=1))
    head = ["step", "images", "minutes", *TASKS, "overall", "shape mIoU", "shape pointing", "grain /255"]
    lines = [f"# {title}", "", f"Device: {device}. Quick evaluation of each snapshot; best by prompt following: "
             f"step {best['step']}.", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [str(r["step"]), f"{r['images']:,}", fmt(r["minutes"], 1), *(fmt(r[t]) for t in TASKS),
                 f"**{fmt(r['overall'])}**" if r is best else fmt(r["overall"]), fmt(r["shape_miou"]),
                 fmt(r["shape_pointing"]), fmt(r["grain"], 2)]
        lines.append("| " + " | ".join(cells) + " |")
    (out / "scaling.md").write_text("\n".join(lines) + "\n")

    fig = Figure(figsize=(9, 3.6), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax1, ax2 = fig.subplots(1, 2)
    images = [r["images"] for r in rows]
    for task in (*TASKS, "overall"):
        ax1.plot(images, [r[task] if r[task] is not None else float("nan") for r in rows], marker="o",
                 lw=2.5 if task == "overall" else 1, label=task)
    ax1.set(xlabel="training images", ylabel="prompt following", ylim=(0, 1), title="prompt following (quick eval)")
    ax1.legend(fontsize=7)
    ax2.plot(images, [r["shape_miou"] for r in rows], marker="o", label="shape-word mIoU")
    ax2.plot(images, [r["shape_pointing"] for r in rows], marker="s", label="shape-word pointing")
    ax2.set(xlabel="training images", ylim=(0, 1), title="maps on generated images")
    ax2.legend(fontsize=7)
    fig.savefig(out / "scaling.png")
