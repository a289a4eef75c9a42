"""Write DIR/index.html, a gallery of the runs under DIR: see `python scripts/gallery.py --help`."""

import sys

from crossattn.viewer import gallery_main

if __name__ == "__main__":
    sys.exit(gallery_main())
