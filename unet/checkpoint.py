"""Training checkpoints on disk: safetensors only, written whole, checked whenever they are read.

Every checkpoint, and every part `split` cuts it into, records a SHA-256 of its own tensors in its
metadata (`sha256`); a part also records the whole checkpoint's (`checkpoint_sha256`), so `join` can
check the file it rebuilds. Reading checks the hash and refuses non-finite weights, naming the tensor.
A file without a hash is of the older format (e.g. the parts of runs/v1 at step 3,590, committed before
2026-12-01) and is read as before.

    tensors, metadata = load(path)          # ValueError, one line, for any damage
    save(tensors, path, {"step": "250"})    # a temp file renamed into place; the hash added
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .signals import raise_swallowed

HASH = "sha256"  # metadata key: SHA-256 of the file's own tensors
WHOLE_HASH = "checkpoint_sha256"  # metadata key of a part: SHA-256 of the whole checkpoint's tensors
PART_BYTES = 24_000_000
PART_PATTERN = "checkpoint-*-of-*.safetensors"


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 over every tensor's name, dtype, shape and bytes, in name order (independent of file layout)."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def check_finite(tensors: dict[str, torch.Tensor], source: str) -> None:
    """ValueError naming the first tensor holding NaN or inf."""
    for name in sorted(tensors):
        t = tensors[name]
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            raise ValueError(f"{source} holds non-finite values (NaN or inf) in tensor {name!r} ({bad} of "
                             f"{t.numel()} values): it is damaged or the run diverged")


def read_metadata(path: Path) -> tuple[dict[str, str], list[str]]:
    """(metadata, tensor names) from the header alone; ValueError for a file that is not safetensors."""
    try:
        with safe_open(str(path), "pt") as f:
            return dict(f.metadata() or {}), list(f.keys())
    except Exception as e:  # safetensors raises its own SafetensorError, OSError and others
        raise_swallowed()  # an interrupt turned into another error (see `load`) is a Ctrl-C, not a damaged file
        raise ValueError(f"{path} is not a readable safetensors checkpoint: {_reason(e)}") from e


def load(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(tensors, metadata) of a checkpoint or part, its hash (if it records one) and finiteness checked."""
    metadata, _ = read_metadata(path)
    try:
        tensors = load_file(str(path))
    except Exception as e:  # a truncated file or a garbled header
        # or an interrupt: one landing inside torch's tensor construction comes out as ValueError("could not
        # determine the shape of object type 'torch.storage.UntypedStorage'"), so a Ctrl-C while a run resumed
        # read as a damaged checkpoint
        raise_swallowed()
        raise ValueError(f"{path} is not a readable safetensors checkpoint: {_reason(e)}") from e
    if HASH in metadata and tensors_sha256(tensors) != metadata[HASH]:
        raise ValueError(f"{path} is damaged: its tensors do not match the SHA-256 it records (metadata "
                         f"'{HASH}'); copy or join it again")
    check_finite(tensors, str(path))
    return tensors, metadata


def save(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> Path:
    """Write `tensors` with `metadata` and their hash to a temp file beside `path`, then rename it into place:
    a crash, an interrupt or a full disk never leaves a half-written `path`. Raises OSError naming `path`."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={**metadata, HASH: tensors_sha256(tensors)})
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, Exception) and not isinstance(e, OSError):  # safetensors wraps write errors in its own
            raise OSError(f"could not write {path}: {_reason(e)}") from e
        raise
    return path


def _reason(e: Exception) -> str:
    return " ".join(str(e).split())[:200] or type(e).__name__


def split(checkpoint: Path, folder: Path, part_bytes: int = PART_BYTES) -> list[Path]:
    """Cut `checkpoint` into `folder/checkpoint-NN-of-NN.safetensors` parts of at most about `part_bytes`.

    Refuses (FileExistsError) a folder that already holds parts; the parts appear only when all are written."""
    tensors, metadata = load(checkpoint)
    folder = Path(folder)
    existing = sorted(folder.glob(PART_PATTERN)) if folder.is_dir() else []
    if existing:
        raise FileExistsError(f"{folder} already holds checkpoint parts ({existing[0].name}, ...); a split never "
                              "overwrites parts: choose an empty folder")
    parts, current, size = [], {}, 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if current and size + nbytes > part_bytes:
            parts.append(current)
            current, size = {}, 0
        current[name] = tensors[name].contiguous()
        size += nbytes
    parts.append(current)
    common = {k: v for k, v in metadata.items() if k not in (HASH, WHOLE_HASH)}
    common[WHOLE_HASH] = tensors_sha256(tensors)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".partial-{os.getpid()}-parts-", dir=folder))
    try:
        names = [f"checkpoint-{k + 1:02d}-of-{len(parts):02d}.safetensors" for k in range(len(parts))]
        for name, part in zip(names, parts):
            save(part, tmp / name, common)
        paths = []
        for name in names:
            os.replace(tmp / name, folder / name)
            paths.append(folder / name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if created:
            shutil.rmtree(folder, ignore_errors=True)
        raise
    tmp.rmdir()
    return paths


def join(folder: Path, checkpoint: Path) -> Path:
    """Rebuild the checkpoint from `folder`'s parts (each part's hash, then the whole's, checked)."""
    paths = sorted(Path(folder).glob(PART_PATTERN))
    if not paths:
        raise FileNotFoundError(f"no checkpoint-NN-of-NN.safetensors parts in {folder}")
    expected = int(paths[0].stem.rsplit("-", 1)[1])
    if len(paths) != expected:
        raise FileNotFoundError(f"{folder} has {len(paths)} parts, their names say {expected}")
    tensors, metadata, wholes = {}, None, set()
    for path in paths:
        part, part_metadata = load(path)
        metadata = metadata or part_metadata
        wholes.add(part_metadata.get(WHOLE_HASH))
        tensors.update(part)
    metadata = {k: v for k, v in metadata.items() if k not in (HASH, WHOLE_HASH)}
    whole = wholes.pop() if len(wholes) == 1 else "parts disagree"
    if whole is not None and tensors_sha256(tensors) != whole:
        raise ValueError(f"the parts in {folder} do not make the checkpoint they were cut from (its SHA-256 "
                         "differs): a part is missing, extra or from another checkpoint")
    Path(checkpoint).parent.mkdir(parents=True, exist_ok=True)
    return save(tensors, Path(checkpoint), metadata)
