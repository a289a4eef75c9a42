"""Write DIR/index.html, a gallery of the runs under DIR: see `python scripts/gallery.py --help`."""

import sys

from crossattn_launcher import run  # interrupts during the imports: one line, exit 130/143

if __name__ == "__main__":
    sys.exit(run("crossattn.viewer", "gallery_main"))
