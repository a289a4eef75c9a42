"""Attention in four steps, on one head: 32 token embeddings, Values four wide.

See `python scripts/attention_walkthrough.py --help`; the code is unet/cli/attention_walkthrough.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.cli.attention_walkthrough"))
