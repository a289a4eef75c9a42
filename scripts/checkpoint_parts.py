"""Split a training checkpoint into parts small enough to commit, and join them back for --resume.

See `python scripts/checkpoint_parts.py --help`; the code is unet/cli/checkpoint_parts.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.cli.checkpoint_parts"))
