"""Two models judged on the same images: which images one got right and the other did not, and whether that
difference could be chance.

Every evaluation samples its prompts from fixed seeds (the report's from 0, `--fresh-seeds BASE` from BASE), so
two models evaluated with the same settings start image k of a prompt from the same noise. Each report keeps its
verdicts (`judged`: one [task, prompt, sample, right] row per image), and `compare` pairs them. Only the images
the two models disagree on say anything about which is better; McNemar's exact test asks how likely a split at
least that uneven would be if each disagreement were a coin toss. It treats the images as independent, which the
seeds of one prompt are not quite (a prompt one model cannot draw costs it every seed), so a small p is weaker
evidence than it looks when the disagreements crowd on a few prompts; `compare` reports how many prompts they
fall on.
"""

from __future__ import annotations

from collections import Counter
from math import comb

# the settings that decide which noise a (seed, prompt, sample) gets and how many steps draw it: the batches are
# drawn whole (every sample of 8 prompts from one generator), so the seeds per prompt and the prompt list count too
PAIRING_SETTINGS = ("seeds", "steps", "scheduler", "quick", "tasks")


def judged(records: list[dict], base_seed: int) -> dict:
    """The verdicts of an evaluation's `records` (each with its "task", "prompt", "sample" and "ok"), as a report
    keeps them: the images were sampled from seeds `base_seed` ..."""
    return {"base_seed": base_seed,
            "images": [[r["task"], r["prompt"], r["sample"], bool(r["ok"])] for r in records]}


def verdicts(report: dict, source: str) -> dict[tuple[int, str, int], tuple[str, bool]]:
    """(base seed, prompt, sample) -> (task, right) for every image a report judged; `source` names it in errors."""
    pf = report.get("prompt_following") if isinstance(report, dict) else None
    if not isinstance(pf, dict) or "judged" not in pf:
        raise ValueError(f"{source} keeps no per-image verdicts ('judged'): it is not an evaluate.py report, or "
                         "it was written before reports kept them; evaluate the model again to compare it")
    base = pf["judged"]["base_seed"]
    result = {}
    for task, prompt, sample, ok in pf["judged"]["images"]:
        key = (base, prompt, sample)
        if key in result:
            raise ValueError(f"{source}: image {sample} of {prompt!r} from seed {base} is judged twice")
        result[key] = (task, ok)
    return result


def pairing_settings(report: dict) -> dict:
    """The report's `PAIRING_SETTINGS` (a fresh-seeds report keeps its settings with its scores; reports that name
    no scheduler used DDIM, and only fresh-seeds reports choose tasks)."""
    settings = report.get("settings") or report["prompt_following"].get("settings", {})
    defaults = {"scheduler": "ddim", "quick": False, "tasks": None}
    return {k: settings.get(k, defaults.get(k)) for k in PAIRING_SETTINGS}


def mcnemar_p(only_a: int, only_b: int) -> float:
    """McNemar's exact two-sided p: the chance that `only_a + only_b` fair coin tosses split at least as unevenly.
    1.0 when they split evenly or there are none."""
    n, k = only_a + only_b, min(only_a, only_b)
    if n == 0:
        return 1.0
    return min(1.0, 2 * sum(comb(n, i) for i in range(k + 1)) / 2 ** n)


def compare(a: list[tuple[str, dict]], b: list[tuple[str, dict]]) -> dict:
    """Pair the images of reports `a` and `b` (each a list of (source, report)) and count, per task and in all:
    images, right for each side, right for one side only, McNemar's p, and on how many prompts the disagreements
    fall. Both sides must have judged the same images with the same pairing settings."""
    sides = []
    for reports in (a, b):
        pooled = {}
        for source, report in reports:
            settings = pairing_settings(report)
            for key, (task, ok) in verdicts(report, source).items():
                if key in pooled:
                    raise ValueError(f"{source}: image {key[2]} of {key[1]!r} from seed {key[0]} is in another "
                                     "report of the same side too; give each evaluation once")
                pooled[key] = (task, ok, settings, source)
        sides.append(pooled)
    only = set(sides[0]) ^ set(sides[1])
    if only:
        base, prompt, sample = min(only, key=str)
        side = "first" if (base, prompt, sample) in sides[0] else "second"
        raise ValueError(f"the two sides did not judge the same images: {len(only)} are judged by one side only "
                         f"(e.g. image {sample} of {prompt!r} from seed {base}, only by the {side}); give each side "
                         "the same evaluations (the full report, the same --fresh-seeds, --seeds and --tasks)")
    for key, (_, _, settings, source) in sides[0].items():
        other, other_source = sides[1][key][2], sides[1][key][3]
        if settings != other:
            differ = ", ".join(f"{k} {settings[k]} against {other[k]}" for k in PAIRING_SETTINGS
                               if settings[k] != other[k])
            raise ValueError(f"{source} and {other_source} were sampled with different settings ({differ}), so "
                             "the same seed is not the same image; evaluate both models with the same settings")
    rows: dict[str, Counter] = {}
    prompts: dict[str, set] = {}
    for key, (task, ok_a, _, _) in sides[0].items():
        ok_b = sides[1][key][1]
        for group in (task, "all"):
            row = rows.setdefault(group, Counter())
            row.update(images=1, a=ok_a, b=ok_b, only_a=ok_a and not ok_b, only_b=ok_b and not ok_a)
            if ok_a != ok_b:
                prompts.setdefault(group, set()).add(key[1])
    order = sorted(rows, key=lambda g: (g == "all", g))
    return {group: {"images": rows[group]["images"], "a": rows[group]["a"], "b": rows[group]["b"],
                    "only_a": rows[group]["only_a"], "only_b": rows[group]["only_b"],
                    "p": mcnemar_p(rows[group]["only_a"], rows[group]["only_b"]),
                    "prompts_disagreeing": len(prompts.get(group, ()))} for group in order}


def markdown(result: dict, name_a: str, name_b: str) -> str:
    """The comparison as a table: one row per task, then all images."""
    lines = [f"| task | images | right: {name_a} | right: {name_b} | only {name_a} | only {name_b} | "
             "prompts they fall on | McNemar p |", "|---|---|---|---|---|---|---|---|"]
    for group, r in result.items():
        label = "**all**" if group == "all" else group
        lines.append(f"| {label} | {r['images']} | {r['a']} | {r['b']} | {r['only_a']} | {r['only_b']} | "
                     f"{r['prompts_disagreeing']} | {r['p']:.3g} |")
    return "\n".join(lines)
