"""A grid of samples: one row per seed, one column per prompt (the training samples' prompts by default).

See `python scripts/sample_grid.py --help`; the code is unet/cli/sample_grid.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.cli.sample_grid"))
