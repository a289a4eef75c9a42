"""Speed and memory side by side: our attention block vs diffusers', capture overhead and memory,

See `python scripts/benchmark.py --help`; the code is unet/cli/benchmark.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.cli.benchmark"))
