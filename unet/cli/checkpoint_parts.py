"""Split a training checkpoint into parts small enough to commit, and join them back for --resume.

    # parts < 24 MB, then join them back and --resume
    python scripts/checkpoint_parts.py split runs/RUN/checkpoint.safetensors outputs/examples/training/checkpoint-RUN
    python scripts/checkpoint_parts.py join outputs/examples/training/checkpoint-RUN runs/RUN/checkpoint.safetensors

The parts hold exactly the checkpoint's tensors and metadata (safetensors only): joining gives a file
that resumes the run bit for bit. Each part records its own SHA-256 and the whole checkpoint's, checked at
join (unet/checkpoint.py); split never overwrites parts, join never overwrites a checkpoint.
"""

import argparse
import sys
from pathlib import Path

from unet.checkpoint import PART_BYTES, join, split
from unet.cli import interrupted, sigterm_as_interrupt, usage_error

__all__ = ["PART_BYTES", "join", "main", "split"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["split", "join"])
    p.add_argument("source", help="split: the checkpoint file; join: the folder of parts")
    p.add_argument("target", help="split: the folder for the parts; join: the checkpoint file to write")
    args = p.parse_args(argv)
    source, target = Path(args.source), Path(args.target)
    if not source.exists():
        return usage_error(f"{source} does not exist")
    if args.action == "join" and target.exists():
        return usage_error(f"{target} exists; a join never overwrites a checkpoint")
    try:
        with sigterm_as_interrupt():
            written = split(source, target) if args.action == "split" else [join(source, target)]
    except (OSError, ValueError) as e:  # missing or extra parts, damage, a full disk: one line, nothing half-made
        return usage_error(e)
    except KeyboardInterrupt as e:
        return interrupted(e, "nothing was written")
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
