"""Where a training step's time goes, by phase and by operator (torch.profiler).

See `python scripts/profile_training.py --help`; the code is unet/research/profile_training.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.research.profile_training"))
