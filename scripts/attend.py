"""The attention maps of an image you already have, in the same run folder as generate.py writes.

See `python scripts/attend.py --help`; the code is unet/cli/attend.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.cli.attend"))
