"""Levers side by side: a table and learning curves from full evaluations of paired runs.

    python scripts/levers.py --out outputs/examples/levers \
        "start=outputs/examples/eval@15200" "plain=runs/evals/v1-16800@16800" "pos=runs/evals/arm-pos-16800@16800"

Each arm is LABEL=REPORT_FOLDER@STEP (a folder `evaluate.py` wrote); give an arm several times, at
several steps, for its curve. Writes levers.md, levers.json and levers.png into --out.
"""

import argparse
import sys
from pathlib import Path

from unet.cli import UsageError, check_out_dir, usage_error
from unet.eval.levers import read_rows, write_levers


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("arms", nargs="+", metavar="LABEL=REPORT_FOLDER@STEP")
    p.add_argument("--out", required=True, help="folder for levers.md, levers.json and levers.png")
    p.add_argument("--title", default="Levers, full evaluations of paired runs")
    args = p.parse_args(argv)
    try:
        check_out_dir(args.out)
        rows = read_rows(args.arms)
    except (ValueError, UsageError) as e:
        return usage_error(e)
    write_levers(rows, Path(args.out), args.title)
    print(f"wrote {Path(args.out) / 'levers.md'} and levers.png ({len(rows)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
