"""Is one model better than another at following prompts, or could the difference be chance?

    python scripts/compare.py --a runs/evals/A runs/evals/A-f50000 --b runs/evals/B runs/evals/B-f50000

Each --a / --b is one or more report folders (or report.json files) of `evaluate.py`, the full evaluation or
`--fresh-seeds`, of the two models evaluated with the same settings: the same seed then starts the same image from
the same noise, so the images pair up. Prints, per task and in all, how many images each model got right, how many
only one of them did, and McNemar's exact p: the chance that the images they disagree on would split at least
that unevenly if each were a coin toss. Only those images tell the models apart; a p below 0.05 is a difference
these seeds show, not a proof, and the disagreements' prompts count says whether a few prompts carry it.
Reports written before evaluate.py kept each image's verdict cannot be compared: evaluate the model again.
"""

import argparse
import json
import sys
from pathlib import Path

from unet.cli import UsageError, usage_error
from unet.eval.paired import compare, markdown


def read_report(path: str) -> tuple[str, dict]:
    """(the name errors give it, the report) of a report folder or its report.json."""
    file = Path(path) / "report.json" if Path(path).is_dir() else Path(path)
    try:
        report = json.loads(file.read_text())
    except FileNotFoundError:
        raise UsageError(f"{path}: no report.json there; give an evaluate.py report folder or its "
                         "report.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{file}: not a readable JSON report ({type(e).__name__}: {e})") from e
    if not isinstance(report, dict):
        raise UsageError(f"{file}: not an evaluate.py report (a JSON object)")
    return str(file), report


def side_name(reports: list[tuple[str, dict]], fallback: str) -> str:
    """The model the reports of one side name (`model` in each), or `fallback` if they name none or several."""
    models = {report.get("model") for _, report in reports}
    return models.pop() if len(models) == 1 and None not in models else fallback


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--a", nargs="+", required=True, metavar="REPORT", help="the first model's report folders")
    p.add_argument("--b", nargs="+", required=True, metavar="REPORT",
                   help="the second model's report folders: the same evaluations, in any order")
    p.add_argument("--names", nargs=2, metavar=("A", "B"), default=None,
                   help="what the table calls the two models (default: the model each side's reports name)")
    p.add_argument("--json", action="store_true", help="print the counts as JSON instead of a table")
    args = p.parse_args(argv)
    try:
        a = [read_report(path) for path in args.a]
        b = [read_report(path) for path in args.b]
        result = compare(a, b)
    except UsageError as e:
        return usage_error(e)
    except (ValueError, KeyError, TypeError) as e:  # KeyError, TypeError: a report.json of another shape
        return usage_error(e if isinstance(e, ValueError) else f"not an evaluate.py report ({type(e).__name__}: {e})")
    names = args.names or [side_name(a, "A"), side_name(b, "B")]
    if names[0] == names[1]:
        names = [f"A ({names[0]})", f"B ({names[1]})"]
    print(json.dumps(result, indent=1) if args.json else markdown(result, *names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
