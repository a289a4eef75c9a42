"""Evidence for the colour collapse and for grain: what sampling settings do to colour and background.

See `python scripts/diagnose.py --help`; the code is unet/cli/diagnose.py.
"""

import sys

from unet.cli.diagnose import main

if __name__ == "__main__":
    sys.exit(main())
