"""Time the live page in headless Chromium and count its download: see `python scripts/benchmark_live.py --help`.

The code is unet/cli/benchmark_live.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.cli.benchmark_live"))
