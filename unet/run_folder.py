"""The run folder, the project's central artefact: one prompt's images, its word maps and how they were made.

    image_<k>.png        the images (prompt, seed and index in PNG text chunks)
    overlay.png          every shown word's map over image 0 (overlay_<k>.png for the others)
    words/<i>_<word>.png one word's map over image 0
    maps.safetensors     "<i>_<word>": (N, H, W) maps of the run's kind; "layer/<name>/<i>_<word>": each layer's
    meta.json            prompt, settings, words, layers, timings, versions (and "control", if controlled)
    index.html           the run in a browser (viewer_data.js beside it)

`generate` and `attend` write it (`write_run_files`, named by `run_name`/`attend_name`); the control run reads
it back (`read_run`) and adds `controlled/` and compare.png.
"""

from __future__ import annotations

import json
import platform
import re
import time
from dataclasses import asdict
from pathlib import Path

import torch
from PIL import Image, PngImagePlugin
from safetensors.torch import load_file, save_file

from crossattn.capture import AttentionStore
from crossattn.maps import DEFAULT_REFINEMENT, MAP_KINDS, Refinement, daam_grid, maps_of, refined_store, word_maps
from crossattn.overlay import overlay_grid, word_overlay
from crossattn.viewer import write_run_page


def slug(prompt: str) -> str:
    """The part of a run folder's name that comes from its prompt: lower case, runs of other characters as "-"."""
    return re.sub(r"[^a-z0-9]+", "-", prompt.lower()).strip("-")[:60] or "prompt"


def run_name(prompt: str, seed: int) -> str:
    """The folder `generate` writes for `prompt` at `seed` (a run started beside it gets "-2")."""
    return f"{slug(prompt)}-s{seed}"


def attend_name(prompt: str, timestep: int, seed: int) -> str:
    """The folder `attend` writes for `prompt` on an image noised to `timestep` with `seed`."""
    return f"{slug(prompt)}-t{timestep}-s{seed}"


def versions() -> dict:
    """What made the run: the versions meta.json records."""
    from importlib.metadata import version
    return {"python": platform.python_version(), "torch": torch.__version__, "diffusers": version("diffusers"),
            "transformers": version("transformers"), "crossattn": version("crossattn"), "machine": platform.machine()}


def map_store(pipe, kind: str, self_attention: bool = False,
              refinement: Refinement = DEFAULT_REFINEMENT) -> AttentionStore:
    """The store a run of map kind `kind` records into: everything with `--self-attention`; else the
    cross-attention, plus for `--maps refined` the bounded self-attention record refined maps need (heads
    averaged). Other runs leave self-attention to the fused kernel, as before (their images are unchanged)."""
    if self_attention:
        return AttentionStore.for_pipeline(pipe, self_attention=True)
    if kind == "refined":
        return refined_store(pipe, refinement)
    return AttentionStore.for_pipeline(pipe)


def run_maps(pipe, store: AttentionStore, words, size, kind: str, normalize: str,
             refinement: Refinement = DEFAULT_REFINEMENT):
    """The run's maps: (N, words, H, W) of `kind`, the tensors of maps.safetensors (`kind`'s maps per word,
    and the plain maps of each cross-attention layer) and, for the run page, every kind the store can give
    (raw: the page normalises)."""
    grid = daam_grid(pipe, *size)
    maps = maps_of(kind, store, words, size, index=None, normalize=normalize, refinement=refinement,
                   grid=grid)  # (N, words, H, W)
    tensors = {f"{w.index}_{w.text}": maps[:, w.index].contiguous() for w in words}
    for layer in sorted(store.layers):
        if not store.is_cross[layer]:
            continue
        for w in words:
            tensors[f"layer/{layer}/{w.index}_{w.text}"] = word_maps(
                store, [w], size, index=None, normalize=normalize, layers=[layer])[:, 0].contiguous()
    kinds = {}
    for other in MAP_KINDS:
        try:
            kinds[other] = maps_of(other, store, words, size, index=None, refinement=refinement, grid=grid)
        except ValueError:  # refined without self-attention recorded; DAAM without up/down layers
            continue
    return maps, tensors, kinds


def write_run_files(tmp: Path, images, maps, tensors: dict, words, words_filter, meta: dict, store,
                    kinds: dict) -> dict:
    """Write a run folder's files into `tmp`: image_<k>.png (prompt, seed, index in text chunks), overlays,
    words/, maps.safetensors, meta.json (`meta` plus the image names, shown words and write time) and the
    run page. `generate` and `attend` write the same folder with it; returns the meta written."""
    t0 = time.perf_counter()
    prompt = meta["prompt"]
    names = []
    for k, image in enumerate(images):
        info = PngImagePlugin.PngInfo()
        info.add_text("prompt", prompt)
        info.add_text("seed", str(meta["seed"]))
        info.add_text("index", str(k))
        names.append(f"image_{k}.png")
        Image.fromarray(image).save(tmp / names[-1], pnginfo=info)
    shown = [w for w in words if words_filter is None or w.text in words_filter]
    vmax = float(maps[0, [w.index for w in shown]].max()) if shown else None
    for k, image in enumerate(images):
        overlay_grid(image, maps[k, [w.index for w in shown]], [w.text for w in shown],
                     tmp / ("overlay.png" if k == 0 else f"overlay_{k}.png"), title=prompt, vmax=vmax)
    (tmp / "words").mkdir()
    for w in shown:
        word_overlay(images[0], maps[0, w.index], w.text, tmp / "words" / f"{w.index}_{slug(w.text)}.png",
                     vmax=vmax)
    save_file(tensors, str(tmp / "maps.safetensors"),
              metadata={"prompt": prompt, "normalize": meta["normalize"], "maps": meta["maps"]})
    meta = {**meta, "words": [asdict(w) for w in words], "shown_words": [w.text for w in shown], "images": names,
            "num_images": len(images), "height": int(images.shape[1]), "width": int(images.shape[2]),
            "layers": {name: list(store.layer_shapes[name]) for name in store.layers}}
    meta["timings"] = {**meta.get("timings", {}), "write_s": time.perf_counter() - t0}
    meta["timings"] = {k: round(v, 3) for k, v in meta["timings"].items()}
    meta["versions"] = versions()
    (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
    write_run_page(tmp, store, words, meta, kinds)  # index.html + viewer_data.js: the run in a browser
    return meta


def read_run(folder: Path, image: int | str = 0) -> tuple[dict, list[str], torch.Tensor]:
    """A run folder's meta.json, its words, and the map of each word (words, H, W) for one image, as written:
    `image` is its index, or its file name as meta.json lists it (ValueError if it does not)."""
    meta = json.loads((folder / "meta.json").read_text())
    if isinstance(image, str):
        if image not in meta["images"]:
            raise ValueError(f"{image} is not one of the run's images ({', '.join(meta['images'])})")
        image = meta["images"].index(image)
    words = [w["text"] for w in meta["words"]]
    maps = load_file(str(folder / "maps.safetensors"))
    return meta, words, torch.stack([maps[f"{i}_{w}"][image] for i, w in enumerate(words)])
