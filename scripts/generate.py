"""Generate images from prompts and save, for every word, where the image attended to it.

See `python scripts/generate.py --help`; the code is unet/cli/generate.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.cli.generate"))
