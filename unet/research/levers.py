"""Levers side by side: a table and learning curves from full evaluations of paired runs.

    python scripts/levers.py --out outputs/examples/levers \
        "start=outputs/examples/eval@15200" "plain=runs/evals/v1-16800@16800" "pos=runs/evals/arm-pos-16800@16800"

Each arm is LABEL=REPORT_FOLDER@STEP (a folder `evaluate.py` wrote); give an arm several times, at
several steps, for its curve. Writes levers.md, levers.json and levers.png into --out.

Paired runs (`train.py --grow-from`) are compared at the same steps, on the skills the levers are meant to
move. An arm is a label and its evaluation reports by step; arms grown from one checkpoint see the same batches,
so at a given step they differ only by the lever.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from unet.cli import (
    UsageError,
    check_out_dir,
    interrupted,
    partial_folder,
    publish_files,
    sigterm_as_interrupt,
    usage_error,
)
from unet.eval.prompts import TASKS
from unet.eval.scaling import fmt
from unet.folders import WRITE_ERRORS, write_failed

CURVES = (("position", "position"), ("color_attr", "colour attribution"), ("shape_pointing", "shape-word pointing"),
          ("overall", "overall"))


LEVER_FILES = ("levers.json", "levers.md", "levers.png")
# what a row reads from a full evaluation report (older reports lack the relation measures: those are optional)
REQUIRED = [("prompt_following", t) for t in (*TASKS, "overall")] + [
    ("prompt_following", "background_grain", "mean"), ("maps", "shape_words", "miou"),
    ("maps", "shape_words", "pointing"), ("settings", "seeds")]


def missing_key(report: dict) -> str | None:
    """The first of `REQUIRED` that `report` lacks, as "a.b.c", or None."""
    for path in REQUIRED:
        node = report
        for key in path:
            if not isinstance(node, dict) or key not in node:
                return ".".join(path)
            node = node[key]
    return None


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
        except UnicodeDecodeError as e:
            raise ValueError(f"{spec!r}: {path} is not UTF-8 text (byte {e.start}): not an evaluation report") from e
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{spec!r}: {path} is not a readable evaluation report ({e})") from e
        if not isinstance(report, dict) or "prompt_following" not in report:
            raise ValueError(f"{spec!r}: {path} is not a full evaluation report (a --relations-only one?)")
        lacking = missing_key(report)
        if lacking is not None:
            raise ValueError(f"{spec!r}: {path} lacks {lacking}: not a full report of scripts/evaluate.py")
        rows.append(lever_row(label, int(step), report))
    return rows


def write_levers(rows: list[dict], out: Path, title: str) -> None:
    """levers.json, levers.md (one row per arm and step) and levers.png (a curve per arm for each skill), written
    into the folder `out`."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    (out / "levers.json").write_text(json.dumps({"title": title, "rows": rows}, indent=1))
    head = ["arm", "step", *TASKS, "overall", "grain /255", "shape mIoU / pointing",
            "relation response (h / v; u: unpaired)", "left/right similarity"]
    lines = [f"# {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["arm"], f"{r['step']:,}", *(fmt(r[t]) for t in TASKS), fmt(r["overall"]), fmt(r["grain"], 2),
                 f"{fmt(r['shape_miou'])} / {fmt(r['shape_pointing'])}",
                 f"{fmt(r['horizontal'], 2)} / {fmt(r['vertical'], 2)}"
                 f"{' u' if not r.get('response_paired') and r['horizontal'] is not None else ''}",
                 fmt(r["left_right_similarity"], 4)]
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("arms", nargs="+", metavar="LABEL=REPORT_FOLDER@STEP")
    p.add_argument("--out", required=True, help="folder for levers.md, levers.json and levers.png")
    p.add_argument("--title", default="Levers, full evaluations of paired runs")
    p.add_argument("--overwrite", action="store_true", help="replace a table already in --out")
    args = p.parse_args(argv)
    out = Path(args.out)
    with sigterm_as_interrupt():
        try:
            check_out_dir(args.out)
            taken = [name for name in LEVER_FILES if (out / name).exists()]
            if taken and not args.overwrite:
                raise UsageError(f"--out {out} already holds {', '.join(taken)}; pass --overwrite to replace them, "
                                 "or choose another --out")
            rows = read_rows(args.arms)
        except (ValueError, UsageError) as e:
            return usage_error(e)
        except KeyboardInterrupt as e:
            return interrupted(e, "nothing was written")
        try:
            with partial_folder(out) as tmp:  # the three files appear together or not at all
                write_levers(rows, tmp, args.title)
                publish_files(tmp, out, [tmp / name for name in LEVER_FILES])
        except KeyboardInterrupt as e:
            return interrupted(e, "no table written (its files appear only when all three are complete)")
        except WRITE_ERRORS as e:
            return write_failed(e, "the levers table")
    print(f"wrote {out / 'levers.md'}, levers.json and levers.png ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
