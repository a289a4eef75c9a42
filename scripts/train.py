"""Train the text-to-image model from scratch on synthetic scenes.

See `python scripts/train.py --help`; the code is unet/cli/train.py.
"""

import sys

from unet.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
