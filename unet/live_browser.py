"""Drive a live-page build (unet/live.py) in headless Chromium: for the benchmark (scripts/benchmark_live.py),
the tests (tests/test_live_page.py) and any script that wants the page's images and maps.

Needs Debian's chromium + chromium-driver (/usr/bin/chromium, /usr/bin/chromedriver) and selenium (the dev
extra). The build is served by Python's own http.server on 127.0.0.1, which also counts the bytes it sends:
the page's download size.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import os
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np

CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"


class CountingServer(http.server.ThreadingHTTPServer):
    """Serves one folder; `sent` counts the bytes of every file body sent, `files` their paths."""
    daemon_threads = True

    def __init__(self, folder: Path):
        self.sent, self.files = 0, []
        self.lock = threading.Lock()
        handler = functools.partial(_CountingHandler, directory=str(folder))
        super().__init__(("127.0.0.1", 0), handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/"


class _CountingHandler(http.server.SimpleHTTPRequestHandler):
    # the page's module scripts and WebAssembly need their real types, whatever /etc/mime.types holds
    extensions_map = {**http.server.SimpleHTTPRequestHandler.extensions_map, ".js": "text/javascript",
                      ".mjs": "text/javascript", ".wasm": "application/wasm", ".json": "application/json"}

    def copyfile(self, source, outputfile):
        start = source.tell()
        super().copyfile(source, outputfile)
        with self.server.lock:
            self.server.sent += source.tell() - start
            self.server.files.append(self.path)

    def log_message(self, *args):  # quiet: tests and the benchmark print what matters
        pass


@contextlib.contextmanager
def serve(folder: Path):
    """A CountingServer for `folder` on a free local port, running until the block ends."""
    server = CountingServer(Path(folder))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def chromium_or_reason():
    """(selenium driver for headless Chromium, None), or (None, why not) when it cannot start here."""
    try:
        from selenium import webdriver
        from selenium.common.exceptions import WebDriverException
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        return None, "selenium is not installed (pip install -e '.[dev]')"
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.path.exists(path):
            return None, f"{path} not found (apt-get install -y chromium chromium-driver)"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    for arg in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--disable-extensions", "--window-size=1400,1000", f"--user-data-dir={profile}"):
        options.add_argument(arg)
    try:
        driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    except WebDriverException as e:
        shutil.rmtree(profile, ignore_errors=True)
        return None, f"Chromium did not start: {str(e.msg or e).splitlines()[0]}"
    driver.profile_dir = profile
    driver.set_script_timeout(600)
    return driver, None


def close(driver) -> None:
    driver.quit()
    shutil.rmtree(driver.profile_dir, ignore_errors=True)


def open_live(driver, url: str, timeout: float = 120) -> float:
    """Open the page at `url` and wait until its model is loaded; returns the seconds that took (from navigation).
    AssertionError with the page's own error line when it does not load."""
    driver.get(url)
    state = driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "const wait = () => window.crossattn ? window.crossattn.ready.then(() => done('ok'), (e) => done('' + e))"
        "  : (document.getElementById('error').textContent ? done(document.getElementById('error').textContent)"
        "     : setTimeout(wait, 50));"
        "wait();")
    assert state == "ok", f"the live page did not load: {state}"
    return driver.execute_script("return performance.now()") / 1000


# What generate() returns, made JSON-able: bytes and Float32Arrays as plain lists.
_GENERATE = """
const [options, done] = [arguments[0], arguments[arguments.length - 1]];
if (options.noise) options.noise = Float32Array.from(options.noise);
window.crossattn.generate(options).then(
  (r) => done({image: Array.from(r.image), words: r.words, maps: r.maps.map((m) => Array.from(m)),
               warnings: r.warnings, tokens: r.tokens, ids: r.ids, timesteps: r.timesteps, ms: r.ms}),
  (e) => done({error: e.message}));
"""


def page_generate(driver, **options) -> dict:
    """window.crossattn.generate(options) on the open page: {image (H, W, 4) uint8, words, maps (words, H, W),
    warnings, tokens, ids, timesteps, ms}, or {error: message}."""
    if isinstance(options.get("noise"), np.ndarray):
        options["noise"] = options["noise"].astype(np.float32).ravel().tolist()
    result = driver.execute_async_script(_GENERATE, options)
    if "error" in result:
        return result
    side = int(round((len(result["image"]) // 4) ** 0.5))
    result["image"] = np.array(result["image"], dtype=np.uint8).reshape(side, side, 4)
    result["maps"] = np.array(result["maps"], dtype=np.float32).reshape(len(result["words"]), side, side)
    return result
