"""Generate images and per-word attention maps: see `python scripts/generate.py --help`."""

import sys

from unet.generate import main

if __name__ == "__main__":
    sys.exit(main())
