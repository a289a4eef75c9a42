"""What every front end here shares: Ctrl-C or SIGTERM while the command is still importing torch and
diffusers (seconds) gives one line and exit code 128 + the signal, never a traceback or exit code 0.

Only the standard library is imported here, so the handlers are in place before the slow imports begin.
"""

import importlib
import signal
import sys


def _interrupt(signum, frame):
    raise KeyboardInterrupt(signum)


def run(module: str, function: str = "main") -> int:
    """Import `module` and return what its `function()` returns, with interrupts reported in one line."""
    signal.signal(signal.SIGTERM, _interrupt)  # the command installs its own handlers once it runs
    try:
        return getattr(importlib.import_module(module), function)()
    except KeyboardInterrupt as e:  # the commands report their own; this is what came before they ran
        signum = getattr(e, "signum", None) or next((a for a in e.args if isinstance(a, int)), signal.SIGINT)
        print(f"interrupted ({signal.Signals(signum).name}): while starting, nothing was written", file=sys.stderr)
        return 128 + signum
