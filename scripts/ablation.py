"""Train a text-side ablation with the recipe of an existing run and quick-evaluate it.

See `python scripts/ablation.py --help`; the code is unet/research/ablation.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.research.ablation"))
