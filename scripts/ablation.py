"""Train a text-side ablation with the recipe of an existing run and quick-evaluate it.

See `python scripts/ablation.py --help`; the code is unet/cli/ablation.py.
"""

import sys

from unet.cli.ablation import main

if __name__ == "__main__":
    sys.exit(main())
