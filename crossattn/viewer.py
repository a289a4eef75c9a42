"""Pages to inspect runs in a browser, offline: one `index.html` per run and a gallery of runs.

A run page (`write_run_page`) shows the image large, one button per word, the word's map over the
image (opacity slider, colour bar), the words ranked at the hovered pixel, and selectors for layer,
head, timestep window and normalisation. It works opened from disk (file://): browsers do not let a
file:// page fetch() files next to it, so the data sits in `viewer_data.js`, loaded by a <script> tag.

What the page needs is saved per cross-attention layer and timestep window, heads kept apart, at the
layer's own resolution: each word's share of every pixel's attention (its tokens summed), the mean
over the forward passes in that window, as uint16 fixed point (value * 65535, so 1.5e-5 steps; shares
are in [0, 1]). The page redoes what `crossattn.maps` does -- weight windows by their pass counts,
average heads, upsample bilinearly (torch's align_corners=False), average layers, normalise -- so its
maps equal those in maps.safetensors up to that rounding. Size: 2 bytes x images x heads x words x
pixels x windows, summed over layers (docs/guides/viewer.md).

`write_gallery(root)` writes root/index.html linking every run page found under root.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import os
import sys
import time
from pathlib import Path
from urllib.parse import quote

import numpy as np

from .capture import AttentionStore
from .errors import UsageError, usage_error
from .text import Word

TEMPLATES = Path(__file__).parent / "templates"
RUN_PAGE, RUN_DATA, GALLERY_PAGE = "index.html", "viewer_data.js", "index.html"
VIEWER_CORE = "viewer_core.js"  # the drawing and read-outs the run page shares with the live page (unet/live.py)
QUANT = 65535  # uint16 fixed point for shares in [0, 1]


def _window_mean(store: AttentionStore, layer: str, window: int) -> tuple[np.ndarray, int]:
    """`layer`'s weights in one timestep window, heads apart, averaged over its passes: (B, heads, N, keys),
    and the number of passes.

    Reads `store.sums`/`store.counts`: the store's read methods average heads (`mean`) or count passes
    over all windows (`passes`), and the page needs both per window.
    """
    key = (layer, window)
    return (store.sums[key] / store.counts[key]).cpu().numpy(), store.counts[key]


def word_shares(weights: np.ndarray, words: list[Word]) -> np.ndarray:
    """Attention weights (B, heads, N, keys) -> each word's share (B, heads, words, N), its tokens summed.

    A word with no tokens (cut by --truncate) gets zeros."""
    B, heads, N, _ = weights.shape
    out = np.zeros((B, heads, len(words), N), dtype=np.float32)
    for i, w in enumerate(words):
        if w.tokens:
            out[:, :, i] = weights[..., w.tokens].sum(axis=-1)
    return out


def kind_blocks(kinds: dict) -> dict:
    """The run page's other map kinds: {kind: (images, words, H, W) raw maps} -> {kind: base64 float32 data}.

    Plain maps are rebuilt on the page from the per-layer blocks (so its selectors work); refined and DAAM's
    come whole, at image size, and the page normalises them as it does the plain ones."""
    out = {}
    for kind, maps in kinds.items():
        if kind == "plain":
            continue
        array = np.ascontiguousarray(maps.detach().cpu().numpy(), dtype="<f4")  # (images, words, H, W)
        out[kind] = {"data": base64.b64encode(array.tobytes()).decode()}
    return out


def run_page_data(store: AttentionStore, words: list[Word], meta: dict, kinds: dict | None = None) -> dict:
    """Everything the run page shows, as JSON-ready values: meta, words, windows, per-layer blocks and
    the other map kinds (`kinds`: {kind: (images, words, H, W) raw maps}, see `kind_blocks`)."""
    layers = []
    for name in store.layers:
        if not store.is_cross[name]:
            continue
        h, w = store.layer_shapes[name]
        blocks = []
        for window in store.recorded_windows(name):
            mean, passes = _window_mean(store, name, window)
            shares = word_shares(mean, words)  # (B, heads, words, h*w)
            fixed = np.round(np.clip(shares, 0, 1) * QUANT).astype("<u2")
            blocks.append({"window": window, "passes": passes, "data": base64.b64encode(fixed.tobytes()).decode()})
        layers.append({"name": name, "h": h, "w": w, "heads": store.heads(name), "blocks": blocks})
    windows = sorted({b["window"] for layer in layers for b in layer["blocks"]}, reverse=True)  # sampling order
    other_kinds = kind_blocks(kinds or {})
    return {
        "format": 1, "quant": QUANT, "meta": meta, "words": [w.text for w in words],
        "height": meta["height"], "width": meta["width"], "num_images": meta["num_images"],
        "normalize": meta["normalize"], "layers": layers, "kind": meta.get("maps", "plain"),
        "kinds": ["plain", *other_kinds], "kind_maps": other_kinds,
        "windows": [{"index": k, "lo": round(store.window_range(k)[0]), "hi": round(store.window_range(k)[1]) - 1}
                    for k in windows],
    }


def write_run_page(folder: Path, store: AttentionStore, words: list[Word], meta: dict,
                   kinds: dict | None = None) -> Path:
    """Write folder/index.html and folder/viewer_data.js for a run folder; returns the page's path.
    `kinds`: other map kinds the page can switch to, {kind: (images, words, H, W) raw maps}."""
    folder = Path(folder)
    data = run_page_data(store, words, meta, kinds)
    (folder / RUN_DATA).write_text("window.CROSSATTN_RUN = " + json.dumps(data, separators=(",", ":")) + ";\n")
    page = (TEMPLATES / "run.html").read_text()
    page = page.replace("/*{{viewer_core}}*/", (TEMPLATES / VIEWER_CORE).read_text())  # shared with the live page
    page = page.replace("{{title}}", html.escape(meta["prompt"]))
    (folder / RUN_PAGE).write_text(page)
    return folder / RUN_PAGE


# --- gallery

def find_runs(root: Path) -> list[Path]:
    """Run folders (holding meta.json) under `root`, newest first; half-written `.partial-*` folders skipped."""
    runs = [p.parent for p in Path(root).rglob("meta.json")
            if not any(part.startswith(".partial-") for part in p.relative_to(root).parts)]
    return sorted(runs, key=lambda p: (-(p / "meta.json").stat().st_mtime, str(p)))


def read_run_meta(run: Path) -> dict:
    """A run's meta.json as the gallery needs it; ValueError saying what is wrong with it (unreadable, not
    UTF-8 or JSON, not an object, a prompt that is not text, images that are not a list of file names)."""
    path = run / "meta.json"
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"its meta.json is not a readable UTF-8 JSON file ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:80]})") from e
    if not isinstance(meta, dict):
        raise ValueError(f"its meta.json holds a JSON {type(meta).__name__}, not an object")
    if not isinstance(meta.get("prompt", ""), str):
        raise ValueError(f"its meta.json's prompt is not text: {meta['prompt']!r:.40}")
    images = meta.get("images", [])
    if not isinstance(images, list) or not all(isinstance(i, str) for i in images):
        raise ValueError("its meta.json's images is not a list of file names")
    return meta


def _href(rel: str, name: str = "") -> str:
    """A link to `rel/name` relative to the gallery: './' first and every part URL-quoted, so no folder name
    (e.g. 'javascript:alert(1)') can turn into a scheme or break out of the attribute."""
    return "./" + "/".join(quote(part, safe="") for part in [*rel.split("/"), *([name] if name else [""])])


def _card(root: Path, run: Path, meta: dict) -> str:
    rel = run.relative_to(root).as_posix()
    esc = html.escape
    has_page = (run / RUN_PAGE).exists()
    link = _href(rel, RUN_PAGE if has_page else "")
    thumb = _href(rel, meta["images"][0]) if meta.get("images") else ""
    written = time.strftime("%Y-%m-%d %H:%M", time.localtime((run / "meta.json").stat().st_mtime))
    note = "" if has_page else '<p class="note">no page (older run): links to the folder</p>'
    return (f'<a class="card" href="{esc(link)}" data-prompt="{esc(meta.get("prompt", ""))}">'
            f'<img src="{esc(thumb)}" alt="{esc(meta.get("prompt", ""))}">'
            f'<p class="prompt">{esc(meta.get("prompt", "?"))}</p>'
            f'<p>seed {esc(str(meta.get("seed", "?")))} · {esc(str(meta.get("steps", "?")))} steps · '
            f'guidance {esc(str(meta.get("guidance", "?")))} · {esc(str(meta.get("num_images", 1)))} image(s)</p>'
            f'<p class="model">{esc(str(meta.get("model", "?")))}</p><p class="date">{written} · {esc(rel)}</p>'
            f"{note}</a>")


def write_gallery(root: Path, warn=None) -> Path:
    """Write root/index.html with a card per run under root; replaces the previous gallery. A run whose
    meta.json cannot be read is skipped, and `warn` (default: a line on stderr) is told which and why."""
    warn = warn or (lambda line: print(f"warning: {line}", file=sys.stderr))
    root = Path(root)
    if not root.is_dir():
        raise UsageError(f"{root} is not a folder")
    if (root / "meta.json").exists():
        raise UsageError(f"{root} is a run folder (its index.html is the run page); give the folder above it")
    runs = find_runs(root)
    if not runs:
        raise UsageError(f"no runs under {root}: no folder there holds a meta.json (written by scripts/generate.py)")
    cards = []
    for run in runs:
        try:
            cards.append(_card(root, run, read_run_meta(run)))
        except ValueError as e:
            warn(f"skipped {run}: {e}")
    page = (TEMPLATES / "gallery.html").read_text()
    page = page.replace("{{title}}", html.escape(root.resolve().name)).replace("{{count}}", str(len(cards)))
    page = page.replace("{{cards}}", "\n".join(cards))
    target, tmp = root / GALLERY_PAGE, root / f".{GALLERY_PAGE}.{os.getpid()}.tmp"
    try:
        tmp.write_text(page)
        os.replace(tmp, target)  # a browser reloading mid-write sees the old or the new page, never half of one
    finally:
        tmp.unlink(missing_ok=True)
    return target


def gallery_main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="gallery.py", description="Write DIR/index.html: a gallery of the runs "
                                "(folders written by scripts/generate.py) under DIR, linking each run's page.")
    p.add_argument("dir", help="folder holding run folders, e.g. outputs/")
    args = p.parse_args(argv)
    if not args.dir.strip():
        return usage_error("the folder is empty (''); give the folder holding the runs, e.g. outputs")
    try:
        page = write_gallery(Path(args.dir))
    except UsageError as e:
        return usage_error(e)
    except OSError as e:  # a full disk, a file-size limit, a folder that is not writable
        return usage_error(f"could not write the gallery in {args.dir}: {e.strerror or e}; the old page is unchanged")
    except KeyboardInterrupt:
        print("interrupted (SIGINT): the gallery page is unchanged", file=sys.stderr)
        return 128 + 2
    print(page)
    return 0
