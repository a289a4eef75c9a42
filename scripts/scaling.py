"""Quick-evaluate every snapshot of a training run and plot prompt following against training images.

See `python scripts/scaling.py --help`; the code is unet/cli/scaling.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.cli.scaling"))
