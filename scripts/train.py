"""Train the text-to-image model from scratch on synthetic scenes.

See `python scripts/train.py --help`; the code is unet/cli/train.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.cli.train"))
