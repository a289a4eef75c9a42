"""Measure prompt following and map accuracy, with baselines, and write a report.

See `python scripts/evaluate.py --help`; the code is unet/cli/evaluate.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.cli.evaluate"))
