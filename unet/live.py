"""Build the live page (docs/guides/live.md): a static folder that samples a pipeline in the browser.

    python scripts/build_live.py --out live            # the shipped model; then: python -m http.server -d live

`build_live(model, out)` writes `out/` whole (into a hidden partial folder, renamed into place at the end):
- index.html, live.js, ddim.js, warnings.js: the page (sources in web/); one viewer with the run pages: the run
  viewer's <style> and its drawing code (crossattn/templates/viewer_core.js) are copied into index.html;
- model/: what `unet.onnx_export.export_onnx` writes (ONNX text encoder and U-Net, configs, tokenizer);
- vendor/: the browser files of the npm packages pinned in web/package-lock.json (onnxruntime-web's
  WebAssembly build, tokenizers.js), copied from web/node_modules, which `npm ci` fills when it is missing
  or holds other versions. Nothing is fetched when the page runs.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

from crossattn.errors import UsageError
from crossattn.viewer import TEMPLATES, VIEWER_CORE

from .folders import partial_folder, publish
from .onnx_export import export_onnx, load_exportable

WEB = Path(__file__).resolve().parents[1] / "web"  # page sources and package.json (a repository checkout)
# copied as they are; index.html gets the viewer's style and code inlined
PAGE_FILES = ("live.js", "ddim.js", "warnings.js")
# (npm package, file in the package, name in vendor/): only what the page loads, so the download stays small
VENDOR = (
    ("onnxruntime-web", "dist/ort.wasm.min.mjs", "ort.wasm.min.mjs"),  # the WebAssembly backend alone
    ("onnxruntime-web", "dist/ort-wasm-simd-threaded.mjs", "ort-wasm-simd-threaded.mjs"),  # imported by it
    ("onnxruntime-web", "dist/ort-wasm-simd-threaded.wasm", "ort-wasm-simd-threaded.wasm"),
    ("@huggingface/tokenizers", "dist/tokenizers.min.mjs", "tokenizers.min.mjs"),
    ("@huggingface/tokenizers", "LICENSE", "tokenizers.LICENSE"),
)


def pinned_versions(web: Path = WEB) -> dict[str, str]:
    """{package: version} as web/package.json pins them (exact versions only)."""
    return json.loads((web / "package.json").read_text())["dependencies"]


def installed_version(package: str, web: Path = WEB) -> str | None:
    path = web / "node_modules" / package / "package.json"
    return json.loads(path.read_text())["version"] if path.is_file() else None


def ensure_node_modules(web: Path = WEB) -> None:
    """Make web/node_modules hold exactly the pinned packages, running `npm ci` (the lock file's versions)
    when it does not; UsageError (one line) when npm is missing or fails."""
    wanted = pinned_versions(web)
    if all(installed_version(p, web) == v for p, v in wanted.items()):
        return
    npm = shutil.which("npm")
    if npm is None:
        raise UsageError(f"the page needs the npm packages {sorted(wanted)} in {web / 'node_modules'} and npm is "
                         "not installed: install node 20 + npm (or run `npm ci` in web/ elsewhere and copy it)")
    done = subprocess.run([npm, "ci", "--no-audit", "--no-fund", "--ignore-scripts"], cwd=web,
                          capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise UsageError(f"`npm ci` in {web} failed (exit {done.returncode}): {last}")
    missing = [p for p, v in wanted.items() if installed_version(p, web) != v]
    if missing:
        raise UsageError(f"`npm ci` in {web} did not install {missing} at the pinned versions")


def viewer_style() -> str:
    """The run viewer's CSS (crossattn/templates/run.html), so the live page looks like it: one look."""
    match = re.search(r"<style>(.*?)</style>", (TEMPLATES / "run.html").read_text(), re.S)
    if match is None:
        raise RuntimeError("crossattn/templates/run.html has no <style> block to share")
    return match.group(1)


def check_build_target(out: Path, overwrite: bool) -> None:
    """UsageError unless `out` is free, or `overwrite` and it is a build this command wrote (never any folder)."""
    if not out.exists():
        return
    if not overwrite:
        raise UsageError(f"{out} exists; pass --overwrite to replace it")
    if not (out / "live.js").is_file() or not (out / "model" / "live.json").is_file():
        raise UsageError(f"{out} exists and is not a live-page build (no live.js and model/live.json); "
                         "refusing to replace it even with --overwrite")


def build_live(model: str | Path | None, out: Path, overwrite: bool = False) -> Path:
    """Write the live page for pipeline folder `model` (None: the shipped model) as folder `out`; returns it.
    UsageError (one line) for a folder that is not a pipeline, an existing `out` without `overwrite`, or npm
    packages that cannot be had. Nothing is left behind on any error."""
    out = Path(out)
    check_build_target(out, overwrite)
    pipe = load_exportable(model)  # refuses a folder that is not one of our pipelines, before any other work
    ensure_node_modules()
    with partial_folder(out.parent) as tmp:
        export_onnx(model, tmp / "model", pipe)
        (tmp / "vendor").mkdir()
        for package, source, name in VENDOR:
            shutil.copyfile(WEB / "node_modules" / package / source, tmp / "vendor" / name)
        page = (WEB / "index.html").read_text().replace("/*{{viewer_style}}*/", viewer_style())
        page = page.replace("/*{{viewer_core}}*/", (TEMPLATES / VIEWER_CORE).read_text())
        (tmp / "index.html").write_text(page)
        for name in PAGE_FILES:
            shutil.copyfile(WEB / name, tmp / name)
        return publish(tmp, out, replace=overwrite)


def build_size(out: Path) -> int:
    """Bytes of every file in a build: what a browser downloads to run the page (it loads them all)."""
    return sum(p.stat().st_size for p in Path(out).rglob("*") if p.is_file() and not p.name.endswith("LICENSE"))
