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


_raised: list[int] = []  # signals whose Interrupted the handler raised and no command has reported yet


def _raise_interrupted(signum, frame):
    _raised.append(signum)
    raise Interrupted(signum)


def _handled() -> list[int]:
    """SIGTERM, and SIGINT unless it is ignored (a shell starts background jobs so: Ctrl-C is not for them)."""
    return [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not signal.SIG_IGN]


def _quiet_unraisable(unraisable) -> None:
    """`sys.unraisablehook` while a command runs: an interrupt raised where Python cannot propagate it (a weakref
    callback, a __del__) is already noted for `raise_swallowed`, so its "Exception ignored ... Traceback" block
    is not printed before the command's one line. Anything else is printed as Python would."""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        return
    sys.__unraisablehook__(unraisable)


@contextlib.contextmanager
def sigterm_as_interrupt():
    """Inside the block SIGINT and SIGTERM raise `Interrupted` (a KeyboardInterrupt) and are noted, so that
    `raise_swallowed` finds one that was lost on the way; the old handlers return after."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers live in the main thread
        yield
        return
    previous = {s: signal.signal(s, _raise_interrupted) for s in _handled()}
    hook, sys.unraisablehook = sys.unraisablehook, _quiet_unraisable
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        sys.unraisablehook = hook
        _raised.clear()  # the command is over: what it was told is settled


def raise_swallowed() -> None:
    """Raise `Interrupted` again for a signal whose exception never reached a command: Python raises it
    wherever the interpreter is, also inside a weakref callback (matplotlib's WeakKeyDictionary), where it
    is printed as "Exception ignored" and dropped -- the run would go on and exit 0. Called before a result
    is published."""
    if _raised:
        raise Interrupted(_raised[0])


def caught(e: KeyboardInterrupt) -> int:
    """The signal number of an interrupt a command caught to keep finished work (it reports it later, with what
    it kept), so that `raise_swallowed` does not raise it again before that work is published."""
    _raised.clear()
    return getattr(e, "signum", signal.SIGINT)


def interrupted(e: KeyboardInterrupt, what: str) -> int:
    """Report an interrupt in one line; the exit code the shell gives a process killed by that signal."""
    _raised.clear()
    signum = getattr(e, "signum", signal.SIGINT)
    print(f"interrupted ({signal.Signals(signum).name}): {what}", file=sys.stderr)
    return 128 + signum


class DeferredSignals:
    """Inside the block SIGINT and SIGTERM are noted, not raised, so work that must not stop half-way (a
    training step and the checkpoint after it) ends first; `raise_pending()` raises `Interrupted` for the
    first noted signal at a moment of the caller's choosing, and leaving the block raises it if nobody did.

    Training needs this: a signal raised inside a step left the noise generator past that step's draws while
    the checkpoint recorded the step before it, so `--resume` drew different noise from then on.
    """

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    def _note(self, signum, frame):
        if self.signum is None:
            self.signum = signum

    def __enter__(self) -> DeferredSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in _handled():
                self._previous[signum] = signal.signal(signum, self._note)
        return self

    def raise_pending(self) -> None:
        if self.signum is not None:
            signum, self.signum = self.signum, None
            raise Interrupted(signum)

    def __exit__(self, kind, value, traceback) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()
        if kind is None:
            self.raise_pending()
