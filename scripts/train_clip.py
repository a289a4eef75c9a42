"""Train a CLIP of our own on the scenes, to freeze as the U-Net's text side.

See `python scripts/train_clip.py --help`; the code is unet/cli/train_clip.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.cli.train_clip"))
