"""Does an image follow its prompt? The evaluation's judge on images you have.

See `python scripts/judge.py --help`; the code is unet/cli/judge.py.
"""

import sys

from unet.cli.judge import main

if __name__ == "__main__":
    sys.exit(main())
