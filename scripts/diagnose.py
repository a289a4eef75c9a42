"""Evidence for the colour collapse and for grain: what sampling settings do to colour and background.

See `python scripts/diagnose.py --help`; the code is unet/research/diagnose.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.research.diagnose"))
