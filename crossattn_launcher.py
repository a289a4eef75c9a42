"""How every command starts, `scripts/*.py` and the installed console commands alike: Ctrl-C or SIGTERM while
the command is still importing torch and diffusers (seconds) gives one line and exit code 128 + the signal,
never a traceback or exit code 0.

Only the standard library is imported here (it is a top-level module, outside the `unet` and `crossattn`
packages whose imports are the slow part), so the handlers are in place before the slow imports begin.
"""

import importlib
import signal
import sys

_noted: list[int] = []  # signals received while importing


def _interrupt(signum, frame):
    _noted.append(signum)
    raise KeyboardInterrupt(signum)


def _quiet_unraisable(unraisable) -> None:
    """An interrupt raised where Python cannot propagate it (importlib's module-lock weakref callback) is
    already noted in `_noted`: print no "Exception ignored ... Traceback" block before the one line. (The same
    as `unet.signals`' hook, repeated here because importing `unet` is the slow import this guards.)"""
    if isinstance(unraisable.exc_value, KeyboardInterrupt):
        return
    sys.__unraisablehook__(unraisable)


def _report(signum: int) -> int:
    print(f"interrupted ({signal.Signals(signum).name}): while starting, nothing was written", file=sys.stderr)
    return 128 + signum


def run(module: str, function: str = "main") -> int:
    """Import `module` and return what its `function()` returns, with interrupts reported in one line."""
    for signum in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(signum) is not signal.SIG_IGN:  # background jobs ignore Ctrl-C: keep it so
            signal.signal(signum, _interrupt)  # the command installs its own handlers once it runs
    hook, sys.unraisablehook = sys.unraisablehook, _quiet_unraisable
    try:
        main = getattr(importlib.import_module(module), function)
    except BaseException as e:
        # a library may catch the interrupt half-way through an import and fail later with another error
        if _noted or isinstance(e, KeyboardInterrupt):
            return _report(_noted[0] if _noted else signal.SIGINT)
        raise
    finally:
        sys.unraisablehook = hook
    if _noted:  # caught and dropped inside an import that still finished
        return _report(_noted[0])
    try:
        return main()
    except KeyboardInterrupt as e:  # the commands report their own; this is what came before they ran
        return _report(getattr(e, "signum", None) or next((a for a in e.args if isinstance(a, int)), signal.SIGINT))


# the console commands of pyproject.toml's [project.scripts]
def generate() -> int:
    return run("unet.cli.generate")


def attend() -> int:
    return run("unet.cli.attend")


def gallery() -> int:
    return run("crossattn.viewer", "gallery_main")
