"""Speed and memory side by side: our attention block vs diffusers', capture overhead and memory,

See `python scripts/benchmark.py --help`; the code is unet/cli/benchmark.py.
"""

import sys

from unet.cli.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
