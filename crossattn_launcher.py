"""How every command starts, `scripts/*.py` and the installed console commands alike: Ctrl-C or SIGTERM while
the command is still importing torch and diffusers (seconds) gives one line and exit code 128 + the signal,
never a traceback or exit code 0.

Only the standard library is imported here (it is a top-level module, outside the `unet` and `crossattn`
packages whose imports are the slow part), so the handlers are in place before the slow imports begin.
"""

import importlib
import os
import signal
import sys


def _report(signum: int) -> int:
    print(f"interrupted ({signal.Signals(signum).name}): while starting, nothing was written", file=sys.stderr)
    return 128 + signum


def _exit_at_once(signum, frame):
    """While importing, stop the process here rather than raise: the handler may run inside an extension
    module's initialisation (torch's pybind11 imports), where a raised KeyboardInterrupt crosses C++ and
    aborts the process ("terminate called ..."), or inside a callback that drops it. Nothing has been
    written yet, so there is nothing to clean up."""
    code = _report(signum)
    sys.stderr.flush()
    os._exit(code)


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signum)


def run(module: str, function: str = "main") -> int:
    """Import `module` and return what its `function()` returns, with interrupts reported in one line."""
    signums = [s for s in (signal.SIGINT, signal.SIGTERM)
               if signal.getsignal(s) is not signal.SIG_IGN]  # background jobs ignore Ctrl-C: keep it so
    for signum in signums:
        signal.signal(signum, _exit_at_once)
    main = getattr(importlib.import_module(module), function)
    for signum in signums:  # the command installs its own handlers once it runs
        signal.signal(signum, _interrupt)
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
