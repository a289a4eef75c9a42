"""Is one model better than another at following prompts, or could the difference be chance?

See `python scripts/compare.py --help`; the code is unet/cli/compare.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.cli.compare"))
