"""Quick-evaluate every snapshot of a training run and plot prompt following against training images.

See `python scripts/scaling.py --help`; the code is unet/cli/scaling.py.
"""

import sys

from unet.cli.scaling import main

if __name__ == "__main__":
    sys.exit(main())
