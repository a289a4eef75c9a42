"""Build the live page, a static folder that samples in the browser: see `python scripts/build_live.py --help`.

The code is unet/cli/build_live.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.cli.build_live"))
