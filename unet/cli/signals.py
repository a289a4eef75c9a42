"""Interrupts: Ctrl-C and SIGTERM take the same path, and every command prints one line for them."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading


class Interrupted(KeyboardInterrupt):
    """SIGTERM (kill, timeout, job schedulers) raised as Ctrl-C's exception, so the same cleanup runs."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_interrupted(signum, frame):
    raise Interrupted(signum)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Inside the block SIGTERM raises `Interrupted` (a KeyboardInterrupt); the old handler returns after."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_interrupted)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def interrupted(e: KeyboardInterrupt, what: str) -> int:
    """Report an interrupt in one line; the exit code the shell gives a process killed by that signal."""
    signum = getattr(e, "signum", signal.SIGINT)
    print(f"interrupted ({signal.Signals(signum).name}): {what}", file=sys.stderr)
    return 128 + signum
