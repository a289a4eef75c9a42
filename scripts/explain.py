"""Explanations on the trained model, each a figure under --out (default outputs/explain):

See `python scripts/explain.py --help`; the code is unet/cli/explain.py.
"""

import sys

from unet.cli.explain import main

if __name__ == "__main__":
    sys.exit(main())
