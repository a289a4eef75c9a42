"""The live page (scripts/build_live.py, web/, docs/guides/live.md): the build command's refusals, the page's DDIM
against diffusers (in node), and the page in headless Chromium: it generates from a prompt, matches Python's image
and maps given Python's noise, and warns about unknown words as the CLI does.

Builds need the npm packages of web/package-lock.json (`npm ci` in web/, which the build runs itself when npm is
here); browser tests need Debian's chromium + chromium-driver and selenium. Without them those tests skip with the
reason and the others run.
"""

import json
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from crossattn.errors import UsageError
from unet.cli.build_live import main as build_main
from unet.cli.checks import check_prompt
from unet.cli.generate import generate_one
from unet.live import WEB, build_live, build_size, ensure_node_modules
from unet.live_browser import chromium_or_reason, close, open_live, page_generate, serve
from unet.pipeline import Settings, load_pipeline

PROMPT = "a red circle left of a blue square"


def one_line(capsys) -> str:
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


# --- the build command, without a browser

def test_build_refuses_a_folder_that_is_not_a_pipeline_in_one_line(tmp_path, capsys):
    not_a_pipeline = tmp_path / "photos"
    not_a_pipeline.mkdir()
    assert build_main(["--model", str(not_a_pipeline), "--out", str(tmp_path / "live")]) == 2
    assert "is not a pipeline folder: it has no model_index.json" in one_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["photos"]  # nothing written, no partial folder left


def test_build_never_overwrites_an_existing_folder_without_overwrite(tmp_path, capsys):
    taken = tmp_path / "live"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    assert build_main(["--out", str(taken)]) == 2
    assert f"{taken} exists; pass --overwrite to replace it" in one_line(capsys)
    # --overwrite replaces builds only: a folder that is not one stays, whatever the flag says
    assert build_main(["--out", str(taken), "--overwrite"]) == 2
    assert "is not a live-page build" in one_line(capsys)
    assert (taken / "notes.txt").read_text() == "mine"


@pytest.fixture(scope="module")
def node_modules():
    try:
        ensure_node_modules()
    except UsageError as e:
        pytest.skip(f"the page's npm packages are not available: {e}")


@pytest.fixture(scope="module")
def tiny_build(node_modules, tiny_pipeline_dir, tmp_path_factory):
    return build_live(tiny_pipeline_dir, tmp_path_factory.mktemp("live") / "tiny")


@pytest.fixture(scope="module")
def shipped_build(node_modules, tmp_path_factory):
    return build_live(None, tmp_path_factory.mktemp("live") / "shipped")


def test_build_holds_the_page_model_and_runtime_and_overwrite_replaces_it(tiny_build, tiny_pipeline_dir, capsys):
    names = sorted(p.relative_to(tiny_build).as_posix() for p in tiny_build.rglob("*") if p.is_file())
    assert names == ["ddim.js", "index.html", "live.js", "model/live.json", "model/scheduler_config.json",
                     "model/text_encoder.onnx", "model/tokenizer/tokenizer.json",
                     "model/tokenizer/tokenizer_config.json", "model/unet.onnx", "vendor/ort-wasm-simd-threaded.mjs",
                     "vendor/ort-wasm-simd-threaded.wasm", "vendor/ort.wasm.min.mjs", "vendor/tokenizers.LICENSE",
                     "vendor/tokenizers.min.mjs", "warnings.js"]
    page = (tiny_build / "index.html").read_text()
    # nothing from the network (the one address is the from-disk message's hint to serve the folder locally)
    assert re.findall(r"https?://(?!localhost:8000/)", page) == [] and "{{" not in page
    assert "window.CrossattnViewerCore" in page  # the run viewer's drawing code, inlined
    assert "#ranking li" in page  # the run viewer's look, copied in
    (tiny_build / "stale.txt").write_text("from before")
    assert build_main(["--model", str(tiny_pipeline_dir), "--out", str(tiny_build), "--overwrite"]) == 0
    assert str(tiny_build) in capsys.readouterr().out
    assert not (tiny_build / "stale.txt").exists() and (tiny_build / "model" / "unet.onnx").exists()


def test_shipped_build_downloads_at_most_30_mb(shipped_build):
    assert build_size(shipped_build) <= 30e6


# --- the page's DDIM against diffusers, in node

@pytest.mark.parametrize("overrides", [
    {},  # the shipped model's: v-prediction, zero terminal SNR, trailing spacing, clipping
    {"beta_schedule": "linear", "prediction_type": "epsilon", "timestep_spacing": "leading", "steps_offset": 1,
     "rescale_betas_zero_snr": False, "set_alpha_to_one": False, "clip_sample": False},
    {"beta_schedule": "scaled_linear", "prediction_type": "sample", "timestep_spacing": "linspace",
     "beta_start": 0.00085, "beta_end": 0.012, "rescale_betas_zero_snr": False, "clip_sample_range": 0.5},
])
def test_page_ddim_matches_diffusers(tmp_path, overrides):
    from diffusers import DDIMScheduler
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    shipped = load_pipeline(show_progress=False).scheduler
    config = {"_class_name": "DDIMScheduler", **dict(shipped.config), **overrides}
    (tmp_path / "scheduler_config.json").write_text(json.dumps(config))
    step_counts = [1, 3, 7, 25, 50, 999, 1000]
    script = f"""
import {{ makeScheduler }} from {json.dumps((WEB / "ddim.js").as_uri())};
import fs from "fs";
const s = makeScheduler(JSON.parse(fs.readFileSync({json.dumps(str(tmp_path / "scheduler_config.json"))})));
const x = Float32Array.from({{length: 64}}, (_, i) => Math.sin(i));
const pred = Float32Array.from({{length: 64}}, (_, i) => Math.cos(3 * i));
const timesteps = {json.dumps(step_counts)}.map((n) => s.timesteps(n));
const steps = s.timesteps(25).map((t) => {{
  const r = s.step(pred, t, x, 25);
  return [Array.from(r.prev), Array.from(r.x0)];
}});
console.log(JSON.stringify({{timesteps, steps}}));
"""
    (tmp_path / "check.mjs").write_text(script)
    done = subprocess.run([node, str(tmp_path / "check.mjs")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    js = json.loads(done.stdout)
    scheduler = DDIMScheduler.from_config(config)
    for n, got in zip(step_counts, js["timesteps"]):
        scheduler.set_timesteps(n)
        assert scheduler.timesteps.tolist() == got, n
    scheduler.set_timesteps(25)
    x, pred = torch.sin(torch.arange(64.0)), torch.cos(3 * torch.arange(64.0))
    for t, (prev, x0) in zip(scheduler.timesteps, js["steps"]):
        out = scheduler.step(pred, t, x)
        for expected, got in ((out.prev_sample, prev), (out.pred_original_sample, x0)):  # float32 rounding apart
            assert np.abs(expected.numpy() - got).max() <= 1e-5 * max(1, float(expected.abs().max())), int(t)


# --- the page's prompt warnings against the CLI's, in node

WARNED_PROMPTS = ["two small cyan triangles and a big orange circle", "a red dog next to a circle", "five red circles",
                  "7 stars", "three circles and two squares", "a \u00b2 circle", "A Red Circle, Please!",
                  "the circle's edge", 'a "quoted" star\'s', "back\\slash four stars", "twelve", "  spaced   out  ",
                  "a purple circle"]


@pytest.mark.parametrize("world", ["scenes-32", "scenes-64"])
def test_page_warnings_match_the_clis(tmp_path, world):
    """web/warnings.js on the words live.json carries gives, prompt by prompt, the CLI's warnings (`world_warnings`):
    for scenes-64 the world's (unknown words, counts above four, too many objects), for scenes-32 the words its
    training captions never used."""
    from types import SimpleNamespace

    from unet.cli.checks import world_warnings
    from unet.onnx_export import warning_words
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    pipe = SimpleNamespace(world=world, trained_words=None if world == "scenes-64" else
                           load_pipeline(show_progress=False).trained_words)
    live = warning_words(pipe)
    expected = [world_warnings(pipe, prompt, prompt.split()) for prompt in WARNED_PROMPTS]
    (tmp_path / "live.json").write_text(json.dumps(live))
    (tmp_path / "prompts.json").write_text(json.dumps(WARNED_PROMPTS))
    script = f"""
import {{ promptWarnings }} from {json.dumps((WEB / "warnings.js").as_uri())};
import fs from "fs";
const live = JSON.parse(fs.readFileSync({json.dumps(str(tmp_path / "live.json"))}));
const prompts = JSON.parse(fs.readFileSync({json.dumps(str(tmp_path / "prompts.json"))}));
console.log(JSON.stringify(prompts.map((p) => promptWarnings(p, p.split(/\\s+/).filter((w) => w), live))));
"""
    (tmp_path / "check.mjs").write_text(script)
    done = subprocess.run([node, str(tmp_path / "check.mjs")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    for prompt, want, have in zip(WARNED_PROMPTS, expected, got):
        assert have == want, prompt
    assert sum(map(bool, got)) >= 5  # most of these prompts warn in both worlds
    if world == "scenes-64":
        said = " ".join(w for ws in got for w in ws)  # each kind of warning is among them
        assert "unknown words" in said and "counts above four" in said and "asks for 5 objects" in said


# --- in headless Chromium

@pytest.fixture(scope="module")
def browser():
    driver, reason = chromium_or_reason()
    if driver is None:
        pytest.skip(reason)
    yield driver
    close(driver)


@pytest.fixture(scope="module")
def shipped_page(browser, shipped_build):
    with serve(shipped_build) as server:
        open_live(browser, server.url)
        yield browser, server


def python_run(pipeline, tmp_path, prompt, seed, guidance=None):
    """Python's own run (generate_one, as scripts/generate.py) and the noise it started from: (image (H, W, 3)
    uint8, {word: map (H, W)}, noise (1, C, H, W))."""
    pipe = load_pipeline(pipeline, show_progress=False)
    folder = generate_one(pipe, prompt, Settings(seed=seed, steps=25, guidance=guidance), tmp_path, "python",
                          show_progress=False)
    size, channels = pipe.unet.config.sample_size, pipe.unet.config.in_channels
    noise = torch.randn((1, channels, size, size), generator=torch.Generator("cpu").manual_seed(seed))  # as pipe()
    maps = {k: v[0].numpy() for k, v in load_file(folder / "maps.safetensors").items() if "/" not in k}
    return np.asarray(Image.open(folder / "image_0.png").convert("RGB")), maps, noise.numpy()


def assert_matches_python(result, image, maps, words):
    assert result["words"] == words
    close_pixels = (np.abs(result["image"][..., :3].astype(int) - image.astype(int)) <= 1).all(axis=-1)
    assert close_pixels.mean() >= 0.99, f"only {close_pixels.mean():.3f} of pixels within 1/255"
    assert (result["image"][..., 3] == 255).all()
    for k, word in enumerate(words):
        assert np.abs(result["maps"][k] - maps[f"{k}_{word}"]).max() <= 1e-3, word


def test_page_generates_from_a_prompt(shipped_page):
    driver, _ = shipped_page
    result = page_generate(driver, prompt=PROMPT, seed=3, steps=25)
    assert "error" not in result, result
    assert result["image"].shape == (32, 32, 4) and result["words"] == PROMPT.split() and result["warnings"] == []
    assert len(result["timesteps"]) == 25 and result["timesteps"][0] == 999 and result["timesteps"][-1] == 39
    assert result["image"][..., :3].std() > 10  # a picture, not a flat colour
    assert result["maps"].shape == (8, 32, 32) and result["maps"].min() >= 0
    assert result["maps"].sum(axis=0).max() <= 1 + 1e-4  # shares of one pixel's attention
    pipe = load_pipeline(show_progress=False)
    assert result["ids"] == pipe.tokenizer(PROMPT).input_ids  # tokenizers.js tokenises as transformers does
    again = page_generate(driver, prompt=PROMPT, seed=3, steps=25)
    assert (again["image"] == result["image"]).all()  # the page's own noise is seeded
    other = page_generate(driver, prompt=PROMPT, seed=4, steps=25)
    assert (other["image"] != result["image"]).any()


def test_page_matches_python_given_pythons_noise_shipped_model(shipped_page, tmp_path):
    driver, _ = shipped_page
    image, maps, noise = python_run(None, tmp_path, PROMPT, seed=0)
    result = page_generate(driver, prompt=PROMPT, steps=25, noise=noise)
    assert "error" not in result, result
    assert_matches_python(result, image, maps, PROMPT.split())


@pytest.fixture(scope="module")
def tiny_page(tiny_build):
    driver, reason = chromium_or_reason()  # its own browser: the shipped page stays open in the other
    if driver is None:
        pytest.skip(reason)
    with serve(tiny_build) as server:
        open_live(driver, server.url)
        yield driver
    close(driver)


@pytest.mark.parametrize("guidance", [None, 3.0])  # the model's own (no guidance) and a guided run
def test_page_matches_python_given_pythons_noise_tiny_model(tiny_page, tiny_pipeline_dir, tmp_path, guidance):
    prompt = "a blue square above a green circle"
    image, maps, noise = python_run(tiny_pipeline_dir, tmp_path, prompt, seed=5, guidance=guidance)
    given = {"guidance": guidance} if guidance else {}
    result = page_generate(tiny_page, prompt=prompt, steps=25, noise=noise, **given)
    assert "error" not in result, result
    assert result["image"].shape[:2] == image.shape[:2]
    assert_matches_python(result, image, maps, prompt.split())


def test_page_selectors_give_pythons_maps_per_layer_head_and_step(shipped_page):
    """The layer, head and step the page's selectors choose give crossattn.maps.word_maps' maps of the same run."""
    from crossattn.capture import AttentionStore
    from crossattn.maps import word_maps
    from crossattn.text import prompt_words
    driver, _ = shipped_page
    pipe = load_pipeline(show_progress=False)
    # one window per training timestep, so each sampling step can be chosen alone
    store = AttentionStore(windows=1000, num_train_timesteps=pipe.scheduler.config.num_train_timesteps)
    with store.attach(pipe.unet):
        pipe(PROMPT, num_inference_steps=25, generator=torch.Generator("cpu").manual_seed(0), show_progress=False)
    noise = torch.randn((1, 3, 32, 32), generator=torch.Generator("cpu").manual_seed(0)).numpy()
    words = prompt_words(pipe.tokenizer, PROMPT)
    layers = [name for name in store.layers if store.is_cross[name]]
    driver.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "window.crossattn.generate({prompt: arguments[0], noise: Float32Array.from(arguments[1])})"
        "  .then((r) => { window.crossattn.show(r); done(); });", PROMPT, noise.ravel().tolist())

    def page_maps(**selects) -> np.ndarray:
        for name, value in selects.items():
            driver.execute_script(
                "const [id, value] = arguments; const el = document.getElementById(id); el.value = value;"
                "el.dispatchEvent(new Event(id === 'step' ? 'input' : 'change'));", name, str(value))
        return np.array(driver.execute_script("return window.crossattn.maps().map((m) => Array.from(m))"))

    timesteps = driver.execute_script("return window.crossattn.state.run.timesteps")
    cases = [  # (the page's selectors, word_maps' selection)
        ({"layer-select": 1, "head-select": "all", "when-select": "all"}, {"layers": [layers[1]]}),
        ({"layer-select": 4, "head-select": 2}, {"layers": [layers[4]], "heads": [2]}),
        ({"layer-select": "all", "head-select": 1}, {"heads": [1]}),
        ({"head-select": "all", "when-select": "step", "step": 3}, {"timesteps": (timesteps[3], timesteps[3])}),
        ({"layer-select": 0, "head-select": 3, "step": 24}, {"layers": [layers[0]], "heads": [3],
                                                              "timesteps": (timesteps[24], timesteps[24])}),
    ]
    seen = []
    for selects, selection in cases:
        got = page_maps(**selects).reshape(len(words), 32, 32)
        expected = word_maps(store, words, (32, 32), **selection).numpy()
        assert np.abs(got - expected).max() <= 1e-3, selects
        seen.append(got)
    assert all(np.abs(a - b).max() > 1e-2 for a, b in zip(seen, seen[1:]))  # each selection shows other maps

    # the step slider shows each step's estimate of the clean image; the last step's is the image
    canvas = ("const c = document.getElementById('image');"
              "return Array.from(c.getContext('2d').getImageData(0, 0, 32, 32).data);")
    page_maps(step=24)
    last = np.array(driver.execute_script(canvas), dtype=np.uint8).reshape(32, 32, 4)
    image = page_generate(driver, prompt=PROMPT, steps=25, noise=noise)["image"]
    assert (last == image).all()
    page_maps(step=0)
    first = np.array(driver.execute_script(canvas), dtype=np.uint8).reshape(32, 32, 4)
    assert np.abs(first.astype(int) - last.astype(int)).max() > 50  # the first guess is far from the image


def test_unknown_word_shows_the_clis_warning(shipped_page):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait
    driver, _ = shipped_page
    prompt = "a purple circle"
    expected = check_prompt(load_pipeline(show_progress=False), prompt, Settings(), None)
    assert len(expected) == 1 and "purple" in expected[0]
    box = driver.find_element(By.ID, "prompt")
    box.clear()
    box.send_keys(prompt)
    driver.find_element(By.ID, "generate").click()
    WebDriverWait(driver, 120, poll_frequency=0.2).until(
        lambda d: d.find_element(By.ID, "status").text.endswith(" s") or d.find_element(By.ID, "error").text)
    warning = driver.find_element(By.ID, "warning")
    assert warning.is_displayed() and warning.text == f"warning: {expected[0]}"
    assert [b.text for b in driver.find_elements(By.CSS_SELECTOR, "#words button")] == prompt.split()
    # a known prompt clears it
    box.clear()
    box.send_keys("a red circle")
    driver.find_element(By.ID, "generate").click()
    WebDriverWait(driver, 120, poll_frequency=0.2).until(lambda d: not d.find_element(By.ID, "warning").is_displayed())
    assert [b.text for b in driver.find_elements(By.CSS_SELECTOR, "#words button")] == ["a", "red", "circle"]


def test_page_refuses_a_prompt_the_tokenizer_would_cut(shipped_page):
    from crossattn.text import dropped_words
    driver, _ = shipped_page
    prompt = " ".join(f"red circle{k}" for k in range(12))  # 'circle3' is several tokens: cut words mid-way too
    cut = dropped_words(load_pipeline(show_progress=False).tokenizer, prompt)  # what the CLI names
    assert cut
    result = page_generate(driver, prompt=prompt, seed=0, steps=2)
    assert result["error"] == (f"prompt is longer than the tokenizer's 32 tokens; these words would be dropped: "
                               f"{' '.join(cut)} (shorten it)")


def test_page_opened_from_disk_says_it_needs_a_server(tiny_build):
    driver, reason = chromium_or_reason()
    if driver is None:
        pytest.skip(reason)
    try:
        driver.get((tiny_build / "index.html").as_uri())
        error = driver.execute_script("return document.getElementById('error').textContent")
        assert "this page needs a web server" in error and "python -m http.server" in error
        assert not driver.execute_script("return !!window.crossattn")  # the module did not run: the message is right
    finally:
        close(driver)
