"""Split a training checkpoint into parts small enough to commit, and join them back for --resume.

    python scripts/checkpoint_parts.py split runs/v1/checkpoint.safetensors checkpoints/v1   # parts < 24 MB
    python scripts/checkpoint_parts.py join checkpoints/v1 runs/v1/checkpoint.safetensors    # then --resume

The parts hold exactly the checkpoint's tensors and metadata (safetensors only): joining gives a file
that resumes the run bit for bit.
"""

import argparse
import sys
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from unet.cli import usage_error

PART_BYTES = 24_000_000


def split(checkpoint: Path, folder: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    with safe_open(str(checkpoint), "pt") as f:
        metadata = f.metadata() or {}
    tensors = load_file(str(checkpoint))
    parts, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > part_bytes:
            parts.append(current)
            current, size = {}, 0
        current[name] = tensors[name].contiguous()
        size += nbytes
    parts.append(current)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for k, part in enumerate(parts):
        paths.append(folder / f"checkpoint-{k + 1:02d}-of-{len(parts):02d}.safetensors")
        save_file(part, str(paths[-1]), metadata=metadata)
    return paths


def join(folder: Path, checkpoint: Path) -> Path:
    paths = sorted(folder.glob("checkpoint-*-of-*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no checkpoint-NN-of-NN.safetensors parts in {folder}")
    expected = int(paths[0].stem.rsplit("-", 1)[1])
    if len(paths) != expected:
        raise FileNotFoundError(f"{folder} has {len(paths)} parts, their names say {expected}")
    tensors, metadata = {}, None
    for path in paths:
        with safe_open(str(path), "pt") as f:
            metadata = metadata or f.metadata()
        tensors.update(load_file(str(path)))
    checkpoint.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(checkpoint), metadata=metadata)
    return checkpoint


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
        written = split(source, target) if args.action == "split" else [join(source, target)]
    except (FileNotFoundError, OSError) as e:
        return usage_error(e)
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
