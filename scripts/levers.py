"""Levers side by side: a table and learning curves from full evaluations of paired runs.

See `python scripts/levers.py --help`; the code is unet/research/levers.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.research.levers"))
