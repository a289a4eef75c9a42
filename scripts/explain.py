"""Explanations on the trained model, each a figure under --out (default outputs/explain):

See `python scripts/explain.py --help`; the code is unet/cli/explain.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.cli.explain"))
