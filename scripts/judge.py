"""Does an image follow its prompt? The evaluation's judge on images you have.

See `python scripts/judge.py --help`; the code is unet/cli/judge.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.cli.judge"))
