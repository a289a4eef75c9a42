"""Output folders: checked before any work, written whole or not at all.

A result is written into a hidden `.partial-<pid>-*` folder and renamed into place only when complete.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from pathlib import Path

from safetensors import SafetensorError

from crossattn.errors import UsageError, shorten, usage_error

from .signals import raise_swallowed

PARTIAL = ".partial-"  # prefix of the hidden folder a result is written into before it is renamed into place


def check_out_dir(out: str | Path, flag: str = "--out") -> None:
    """Raise UsageError unless `out` is a writable folder or can be created as one. Creates nothing.

    Give the user's text itself: `Path("")` is ".", and an empty `--out` must not mean the current folder."""
    if not str(out).strip():
        raise UsageError(f"{flag} is empty (''); give a folder, e.g. {flag} outputs")
    out = Path(out)
    try:
        if out.exists() and not out.is_dir():
            raise UsageError(f"{flag} {out} is a file, not a folder")
        existing = out.absolute()
        while not existing.exists():
            existing = existing.parent
    except (OSError, ValueError) as e:  # e.g. a name with a NUL byte, or a path too long
        raise UsageError(f"{flag} {shorten(str(out))} is not a usable path: {e}") from e
    if not existing.is_dir():
        raise UsageError(f"{flag} {out} cannot be created: {existing} is a file")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {out} is not writable: no permission to write in {existing}")
    try:  # permissions are not everything (/proc, a read-only mount): try it, leaving nothing
        os.rmdir(tempfile.mkdtemp(prefix=f"{PARTIAL}{os.getpid()}-probe-", dir=existing))
    except OSError as e:
        raise UsageError(f"{flag} {out} cannot be written: making a folder in {existing} failed "
                         f"({e.strerror or e})") from e


# what a full disk (ENOSPC), a file-size limit (`ulimit -f`: EFBIG) or a vanished folder raise while writing;
# safetensors wraps them in its own error
WRITE_ERRORS = (OSError, SafetensorError)


def write_failed(e: Exception, what: str) -> int:
    """Report a failed write in one line (exit code 2); the partial folder it was going into is gone already."""
    reason = getattr(e, "strerror", None) or str(e)
    return usage_error(f"could not write {what}: {reason} ({getattr(e, 'filename', None) or 'while writing'}); "
                       "nothing half-written was left")


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_partials(out: Path) -> list[Path]:
    """Delete `.partial-<pid>-*` folders whose process is gone (a run killed with SIGKILL or a power cut), in
    `out` and in the run folders just under it (where a controlled run writes its `.partial-<pid>-controlled-*`).

    Folders of runs still going are left alone; older `.partial-*` names without a pid are never read.
    """
    removed = []
    for folder in [*out.glob(f"{PARTIAL}*"), *out.glob(f"*/{PARTIAL}*")]:
        pid = folder.name[len(PARTIAL):].split("-", 1)[0]
        if folder.is_dir() and pid.isdigit() and not _process_alive(int(pid)):
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def remove_stale_temp_files(folder: Path) -> list[Path]:
    """Delete `.<name>.<pid>.tmp` files (a checkpoint being written, `checkpoint.save`) whose process is gone: a
    run killed during a save leaves one, as large as the checkpoint. Those of live processes are left alone."""
    removed = []
    for path in folder.glob(".*.tmp"):
        pid = path.name[:-len(".tmp")].rsplit(".", 1)[-1]
        if path.is_file() and pid.isdigit() and not _process_alive(int(pid)):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def _lock_path(out: Path) -> Path:
    """The file that says who writes `out`: beside it, hidden, so the run folder itself holds only the run."""
    out = Path(os.path.abspath(out))
    return out.parent / f".{out.name}.writer"


def _holder(lock: Path) -> str:
    try:
        return lock.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


@contextlib.contextmanager
def hold_folder(out: str | Path, flag: str = "--out"):
    """Claim the run folder `out` for as long as the block runs, so that one command writes it at a time: a second
    command (training, --resume, train_clip, diagnose) refuses with UsageError naming the holder's pid.

    The claim is an exclusive `flock` on `.<name>.writer` beside `out`, holding the pid: the kernel releases it
    when the process ends however it ends (SIGKILL too), so a dead run never blocks the next; a folder that
    lives longer than the claim (a result renamed into place) is still claimed, since the name is what is locked.
    Parents this made for the lock are removed again if they stayed empty."""
    lock = _lock_path(out)
    created = [p for p in [lock.parent, *lock.parent.parents] if not p.exists()]
    while True:
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:  # e.g. a run folder that is writable in a parent that is not
            raise UsageError(f"{flag} {out} cannot be claimed: making {lock.name} beside it failed "
                             f"({e.strerror or e})") from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise UsageError(f"{flag} {out} is being written by process {_holder(lock)} (another run into the same "
                             f"folder); wait for it to end, or choose another {flag}") from None
        try:  # the holder before us may have removed the file between our open and our lock: lock the new one
            same = os.fstat(fd).st_ino == os.stat(lock).st_ino
        except FileNotFoundError:
            same = False
        if same:
            break
        os.close(fd)
    try:
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        lock.unlink(missing_ok=True)  # before the lock goes, so a waiter that opened this file retries (above)
        os.close(fd)
        for folder in created:  # deepest first; stops at the first that is not empty
            try:
                folder.rmdir()
            except OSError:
                break


def claim_folder(parent: Path, name: str) -> Path:
    """Create and return `parent/name`, or the first free `name-2`, `name-3` ...: `mkdir` either makes the
    folder or fails, so two runs started together never get the same one."""
    k = 1
    while True:
        target = parent / (name if k == 1 else f"{name}-{k}")
        try:
            target.mkdir()
            return target
        except FileExistsError:
            k += 1


def _normal_permissions(folder: Path) -> None:
    """What `mkdir` and `open` would have given under the user's umask (temp folders are made private)."""
    umask = os.umask(0)
    os.umask(umask)
    for path in [folder, *folder.rglob("*")]:
        path.chmod((0o777 if path.is_dir() else 0o666) & ~umask)


@contextlib.contextmanager
def partial_folder(out: Path):
    """Yield a new hidden folder `out/.partial-<pid>-*` to write a result into; `publish` renames it into
    place. On any error or interrupt the folder goes, and so do `out` and its parents if this made them."""
    created = [p for p in [out.absolute(), *out.absolute().parents] if not p.exists()]
    out.mkdir(parents=True, exist_ok=True)
    remove_stale_partials(out)
    tmp = Path(tempfile.mkdtemp(prefix=f"{PARTIAL}{os.getpid()}-", dir=out))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for folder in created:  # deepest first; stops at the first that is not empty
            try:
                folder.rmdir()
            except OSError:
                break
        raise


def publish(tmp: Path, final: Path, replace: bool = False) -> Path:
    """Rename the finished `tmp` folder into place and return where it went: `final`, or (when `final` is
    taken, e.g. by a run started at the same time) the first free `final-2`, `final-3` ... claimed
    atomically. `replace=True` (--overwrite) replaces an existing `final` instead."""
    raise_swallowed()
    _normal_permissions(tmp)
    if not replace:
        claimed = claim_folder(final.parent, final.name)  # empty and ours: the rename below replaces it
        tmp.rename(claimed)
        return claimed
    old = None
    if final.exists():  # moved aside first, so `final` is never missing half-way
        old = Path(tempfile.mkdtemp(prefix=f"{PARTIAL}{os.getpid()}-old-", dir=final.parent))
        final.rename(old / final.name)
    tmp.rename(final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def publish_files(tmp: Path, out: Path, paths: list[Path]) -> list[Path]:
    """Move finished files from `tmp` into the existing folder `out` (each replaced whole), then drop `tmp`."""
    raise_swallowed()
    _normal_permissions(tmp)
    moved = []
    for path in paths:
        os.replace(path, out / path.name)
        moved.append(out / path.name)
    shutil.rmtree(tmp, ignore_errors=True)
    return moved
