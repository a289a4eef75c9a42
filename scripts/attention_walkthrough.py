"""Attention in four steps, on one head: 32 token embeddings, Values four wide.

See `python scripts/attention_walkthrough.py --help`; the code is unet/cli/attention_walkthrough.py.
"""

import sys

from unet.cli.attention_walkthrough import main

if __name__ == "__main__":
    sys.exit(main())
