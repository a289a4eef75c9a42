"""Measure the live page in headless Chromium: its download, its load time, and the time of one image with all
its maps; optionally its parity with Python, the judge's verdicts on seeds 0-7, and a screenshot.

    python scripts/benchmark_live.py                       # builds the shipped model's page in a temporary folder
    python scripts/benchmark_live.py --build live --parity --judge --screenshot live.png

Targets (docs/guides/live.md): one 25-step image with all maps in <= 2 s; a download of <= 30 MB.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..live import build_live
from ..live_browser import chromium_or_reason, close, open_live, page_generate, serve
from . import UsageError, add_model_argument, usage_error

FIRST_EXAMPLE = "a red circle left of a blue square"  # the README's first example
TARGET_SECONDS, TARGET_BYTES = 2.0, 30e6


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="benchmark_live.py", description="Time the live page in headless Chromium "
                                "and count its download.")
    p.add_argument("--build", default=None, help="a build of scripts/build_live.py (default: build --model into a "
                                                 "temporary folder)")
    add_model_argument(p, "pipeline folder to build when no --build")
    p.add_argument("--prompt", default=FIRST_EXAMPLE)
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--runs", type=int, default=5, help="timed generations after one warm-up (default 5)")
    p.add_argument("--parity", action="store_true", help="also run Python on its own noise and compare")
    p.add_argument("--judge", action="store_true", help="also judge --prompt on seeds 0-7 (the page's own noise)")
    p.add_argument("--screenshot", default=None, help="save a PNG of the page after a generation here")
    return p.parse_args(argv)


def machine() -> str:
    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
               platform.processor() or "?")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{cpu}, {len(os.sched_getaffinity(0))} cores, load average {load:.1f}"


def parity(driver, model, prompt: str, steps: int) -> str:
    """Python's run (scripts/generate.py's code) against the page given Python's noise: pixels and maps."""
    import torch
    from safetensors.torch import load_file

    from ..cli.generate import generate_one
    from ..pipeline import Settings, load_pipeline
    pipe = load_pipeline(model, show_progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        folder = generate_one(pipe, prompt, Settings(seed=0, steps=steps), Path(tmp), "python", show_progress=False)
        from PIL import Image
        image = np.asarray(Image.open(folder / "image_0.png").convert("RGB")).astype(int)
        maps = load_file(folder / "maps.safetensors")
    size, channels = pipe.unet.config.sample_size, pipe.unet.config.in_channels
    noise = torch.randn((1, channels, size, size), generator=torch.Generator("cpu").manual_seed(0)).numpy()
    result = page_generate(driver, prompt=prompt, steps=steps, noise=noise)
    if "error" in result:
        raise UsageError(f"the page refused the prompt: {result['error']}")
    diff = np.abs(result["image"][..., :3].astype(int) - image)
    within = (diff <= 1).all(axis=-1).mean()
    map_diff = max(float(np.abs(result["maps"][k] - maps[f"{k}_{w}"][0].numpy()).max())
                   for k, w in enumerate(result["words"]))
    return (f"parity with Python (seed 0's noise): {100 * within:.1f} % of pixels within 1/255 (largest difference "
            f"{diff.max()}/255); maps: largest difference {map_diff:.1e}")


def judged(driver, prompt: str, steps: int) -> str:
    from .judge import judge
    right = []
    for seed in range(8):
        result = page_generate(driver, prompt=prompt, seed=seed, steps=steps)
        ok, found = judge(prompt, np.ascontiguousarray(result["image"][..., :3]))
        right.append(ok)
        print(f"  seed {seed}: {'right' if ok else 'wrong'} ({found})")
    return f"judge.py on the page's seeds 0-7 (its own noise): {sum(right)} of 8 right (target >= 7)"


def main(argv=None) -> int:
    args = parse_args(argv)
    driver = None
    try:
        if args.steps < 1 or args.runs < 1:
            raise UsageError(f"--steps and --runs must be positive, got {args.steps} and {args.runs}")
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(args.build) if args.build else build_live(args.model, Path(tmp) / "live")
            if not (folder / "live.js").is_file():
                raise UsageError(f"{folder} is not a build of scripts/build_live.py (no live.js)")
            driver, reason = chromium_or_reason()
            if driver is None:
                raise UsageError(f"cannot run Chromium here: {reason}")
            with serve(folder) as server:
                open_live(driver, server.url)
                timings = driver.execute_async_script(  # the page warms its runtime up after loading (live.js)
                    "const done = arguments[arguments.length - 1];"
                    "window.crossattn.warm.then(() => done(window.crossattn.timings));")
                loaded, warm_s = timings["ready_ms"] / 1000, (timings["warm_ms"] - timings["ready_ms"]) / 1000
                print(f"machine: {machine()}; headless Chromium, ONNX Runtime Web (WebAssembly, 1 thread)")
                print(f"download: {server.sent / 1e6:.2f} MB in {len(server.files)} files "
                      f"(target <= {TARGET_BYTES / 1e6:.0f} MB); page ready (model loaded) in {loaded:.2f} s, "
                      f"runtime warmed up {warm_s:.2f} s later")
                warm = page_generate(driver, prompt=args.prompt, seed=0, steps=args.steps)
                if "error" in warm:
                    raise UsageError(f"the page refused the prompt: {warm['error']}")
                times = [page_generate(driver, prompt=args.prompt, seed=1 + k, steps=args.steps)["ms"] / 1000
                         for k in range(args.runs)]
                print(f"one image, {args.steps} steps, with all maps: median {statistics.median(times):.2f} s "
                      f"(first after warm-up: {warm['ms'] / 1000:.2f} s; then: {', '.join(f'{t:.2f}' for t in times)}; "
                      f"target <= {TARGET_SECONDS:.0f} s)")
                if args.parity:
                    print(parity(driver, args.model, args.prompt, args.steps))
                if args.judge:
                    print(judged(driver, args.prompt, args.steps))
                if args.screenshot:
                    screenshot(driver, Path(args.screenshot), args.prompt)
                    print(f"screenshot: {args.screenshot}")
    except UsageError as e:
        return usage_error(e)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        if driver is not None:
            close(driver)
    return 0


def screenshot(driver, path: Path, prompt: str) -> None:
    """The page as a person sees it: the prompt generated through the form, a word chosen, a pixel hovered."""
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    driver.set_window_size(1300, 860)
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(prompt)
    driver.find_element(By.ID, "generate").click()
    WebDriverWait(driver, 120, poll_frequency=0.2).until(lambda d: d.find_element(By.ID, "status").text.endswith(" s"))
    buttons = driver.find_elements(By.CSS_SELECTOR, "#words button")
    if len(buttons) > 2:
        buttons[2].click()  # "circle" in the first example
    driver.execute_script("const o = document.getElementById('opacity'); o.value = 55;"  # the image shows through
                          "o.dispatchEvent(new Event('input'));")
    stage = driver.find_element(By.ID, "stage")
    ActionChains(driver).move_to_element_with_offset(stage, -stage.size["width"] // 4, 0).perform()
    path.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(path))


if __name__ == "__main__":
    sys.exit(main())
