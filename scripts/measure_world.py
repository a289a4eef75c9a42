"""Measure the scenes-64 world's generator (drawing speed) and detector (rates against the drawn truth).

See `python scripts/measure_world.py --help`; the code is unet/cli/measure_world.py.
"""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("unet.cli.measure_world"))
