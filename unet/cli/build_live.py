"""Build the live page: a static folder that samples a pipeline in the browser, with every word's map.

    python scripts/build_live.py --out live                 # the shipped model
    python -m http.server -d live 8000                      # then open http://localhost:8000/

docs/guides/live.md says what the page does; unet/live.py what the folder holds.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..live import build_live, build_size
from . import UsageError, add_model_argument, check_out_dir, interrupted, sigterm_as_interrupt, usage_error


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="build_live.py", description="Build the live page (a static folder) for a "
                                "pipeline folder: ONNX models, the page, and its npm packages' browser files.")
    add_model_argument(p)
    p.add_argument("--out", required=True, help="the folder to write (refused if it exists, unless --overwrite)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing build")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    with sigterm_as_interrupt():
        try:
            check_out_dir(args.out)
            out = build_live(args.model, Path(args.out), args.overwrite)
        except UsageError as e:
            return usage_error(e)
        except KeyboardInterrupt as e:
            return interrupted(e, "no half-written build was left")
    print(f"{out} ({build_size(out) / 1e6:.1f} MB); serve it with: python -m http.server -d {out} 8000")
    return 0


if __name__ == "__main__":
    sys.exit(main())
