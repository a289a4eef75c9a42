"""Measure prompt following and map accuracy, with baselines, and write a report.

See `python scripts/evaluate.py --help`; the code is unet/cli/evaluate.py.
"""

import sys

from unet.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
