"""Split a training checkpoint into parts small enough to commit, and join them back for --resume.

See `python scripts/checkpoint_parts.py --help`; the code is unet/cli/checkpoint_parts.py.
"""

import sys

from unet.cli.checkpoint_parts import main

if __name__ == "__main__":
    sys.exit(main())
