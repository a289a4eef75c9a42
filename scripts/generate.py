"""Generate images from prompts and save, for every word, where the image attended to it.

See `python scripts/generate.py --help`; the code is unet/cli/generate.py.
"""

import sys

from unet.cli.generate import main

if __name__ == "__main__":
    sys.exit(main())
