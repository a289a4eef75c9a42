"""The run page (index.html per run folder) and the gallery: data written, and behaviour in headless Chromium.

Browser tests need Debian's chromium + chromium-driver (/usr/bin/chromium, /usr/bin/chromedriver) and
selenium (the dev extra); without them they skip with the reason and the other tests run.
"""

import base64
import json
from importlib.metadata import entry_points
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from crossattn.capture import AttentionStore
from crossattn.maps import DEFAULT_REFINEMENT, Refinement, maps_of, refined_store, word_maps
from crossattn.text import prompt_words
from crossattn.viewer import QUANT, RUN_DATA, gallery_main, word_shares, write_gallery
from unet.cli.generate import generate_one
from unet.pipeline import Settings

PROMPT = "a red circle left of a blue square"


def make_run(pipe, out, prompt=PROMPT, seed=0, maps="plain", **settings):
    return generate_one(pipe, prompt, Settings(seed=seed, steps=3, **settings), Path(out), "tiny-test-model",
                        show_progress=False, maps=maps)


def run_data(folder: Path) -> dict:
    text = (folder / RUN_DATA).read_text()
    prefix = "window.CROSSATTN_RUN = "
    assert text.startswith(prefix) and text.rstrip().endswith(";")
    return json.loads(text[len(prefix):].rstrip().rstrip(";"))


def decode(block: dict, shape) -> np.ndarray:
    return np.frombuffer(base64.b64decode(block["data"]), dtype="<u2").reshape(shape).astype(np.float64) / QUANT


def rerun_store(pipe, prompt=PROMPT, seed=0, steps=3, guidance=None, num_images=2):
    """The same sampling as run_dir's (same seed, the model's own guidance), with the store kept for reference maps."""
    store = AttentionStore.for_pipeline(pipe)
    with store.attach(pipe.unet):
        pipe(prompt, num_inference_steps=steps, guidance_scale=guidance,
             generator=torch.Generator().manual_seed(seed), output_type="np", show_progress=False,
             num_images_per_prompt=num_images)
    return store


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory, tiny_pipeline_dir):
    from unet.cli.generate import load_pipeline
    return make_run(load_pipeline(tiny_pipeline_dir), tmp_path_factory.mktemp("runs"), num_images=2)


# --- without a browser

def test_run_folder_gets_offline_page_and_data_equal_to_the_store(run_dir, tiny_pipeline):
    page = (run_dir / "index.html").read_text()
    assert '<script src="viewer_data.js"></script>' in page and PROMPT in page
    assert "http://" not in page and "https://" not in page  # nothing from the network, no CDN
    data = run_data(run_dir)
    meta = json.loads((run_dir / "meta.json").read_text())
    assert data["meta"] == meta and data["words"] == PROMPT.split() and data["normalize"] == "raw"
    store = rerun_store(tiny_pipeline)
    words = prompt_words(tiny_pipeline.tokenizer, PROMPT)
    cross = [name for name in store.layers if store.is_cross[name]]
    assert [layer["name"] for layer in data["layers"]] == cross and len(cross) >= 2
    windows = {w for (_, w) in store.sums}
    assert sorted(w["index"] for w in data["windows"]) == sorted(windows) and len(windows) == 3  # 3 steps
    for layer in data["layers"]:
        assert [layer["h"], layer["w"]] == meta["layers"][layer["name"]]
        for block in layer["blocks"]:
            key = (layer["name"], block["window"])
            assert block["passes"] == store.counts[key]
            expected = word_shares((store.sums[key] / store.counts[key]).numpy(), words)  # (B, heads, words, N)
            got = decode(block, expected.shape)
            assert np.abs(got - expected).max() <= 1 / QUANT
            assert got.sum(axis=2).max() <= 1 + 1e-3  # the words' shares of one pixel's attention


def test_word_shares_sums_a_words_tokens_and_zeros_a_cut_word():
    from crossattn.text import Word
    weights = np.random.default_rng(0).random((1, 2, 4, 6)).astype(np.float32)  # (B, heads, N, keys)
    shares = word_shares(weights, [Word(0, "two", [1, 2]), Word(1, "cut", []), Word(2, "one", [5])])
    assert shares.shape == (1, 2, 3, 4)
    np.testing.assert_allclose(shares[:, :, 0], weights[..., 1] + weights[..., 2])
    assert (shares[:, :, 1] == 0).all()
    np.testing.assert_allclose(shares[:, :, 2], weights[..., 5])


def test_gallery_lists_every_run_and_rerun_updates_it(tiny_pipeline, tmp_path, capsys):
    first = make_run(tiny_pipeline, tmp_path / "a", prompt="a red circle", seed=1)
    half = tmp_path / "a" / ".partial-x"  # an interrupted run: never listed
    half.mkdir()
    (half / "meta.json").write_text("{}")
    assert gallery_main([str(tmp_path)]) == 0
    page = (tmp_path / "index.html").read_text()
    assert capsys.readouterr().out.strip() == str(tmp_path / "index.html")
    assert f'href="./a/{first.name}/index.html"' in page and f'src="./a/{first.name}/image_0.png"' in page
    assert "a red circle" in page and "seed 1" in page and "tiny-test-model" in page and ".partial-" not in page
    assert "1 run(s)" in page
    second = make_run(tiny_pipeline, tmp_path / "b", prompt="a blue square", seed=2)
    write_gallery(tmp_path)
    page = (tmp_path / "index.html").read_text()
    assert f'href="./b/{second.name}/index.html"' in page and "a blue square" in page and "2 run(s)" in page


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing", "is not a folder"),
    (lambda p: p, "no runs under"),
])
def test_gallery_bad_folder_is_one_line_exit_2(tmp_path, capsys, make, message):
    assert gallery_main([str(make(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_gallery_refuses_a_run_folder(run_dir, capsys):
    before = (run_dir / "index.html").read_text()
    assert gallery_main([str(run_dir)]) == 2
    assert "is a run folder" in capsys.readouterr().err
    assert (run_dir / "index.html").read_text() == before  # the run page is left alone


def test_gallery_console_command_installed():
    (entry,) = [e for e in entry_points(group="console_scripts") if e.name == "crossattn-gallery"]
    assert entry.value == "crossattn_launcher:gallery"  # through the launcher, as scripts/gallery.py


# --- in headless Chromium

@pytest.fixture(scope="module")
def browser():
    from unet.live_browser import chromium_or_reason, close  # one way to start Chromium, for both pages' tests
    driver, reason = chromium_or_reason()
    if driver is None:
        pytest.skip(reason)
    yield driver
    close(driver)


def open_page(browser, path: Path):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait
    browser.get(path.resolve().as_uri())
    try:  # on a loaded machine the page's script may still be decoding its data when get() returns
        WebDriverWait(browser, 30, poll_frequency=0.2).until(
            lambda b: b.execute_script("return !!window.crossattnViewer"))
    except TimeoutException:
        pass
    errors = browser.execute_script("return window.crossattnViewer ? null : document.body.innerText")
    assert errors is None, f"the page did not start: {errors}"


def page_maps(browser) -> np.ndarray:
    """The maps the page computed for its selection: (words, H, W)."""
    maps = np.array(browser.execute_script("return window.crossattnViewer.maps().map((m) => Array.from(m))"))
    H, W = browser.execute_script("return [window.CROSSATTN_RUN.height, window.CROSSATTN_RUN.width]")
    return maps.reshape(len(maps), H, W)


def canvas_pixels(browser) -> np.ndarray:
    return np.array(browser.execute_script(
        "const c = document.getElementById('map');"
        "return Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data);"))


def hover(browser, x: int, y: int, size: int):
    """Move the mouse over image pixel (x, y) of the stage (offsets count from the element's centre)."""
    from selenium.webdriver.common.action_chains import ActionChains
    stage = browser.find_element("id", "stage")
    s = stage.size["width"] / size
    ActionChains(browser).move_to_element_with_offset(
        stage, int((x + 0.5) * s - stage.size["width"] / 2), int((y + 0.5) * s - stage.size["height"] / 2)).perform()


def choose(browser, select_id: str, value: str):
    from selenium.webdriver.support.ui import Select
    Select(browser.find_element("id", select_id)).select_by_value(value)


def test_hover_ranks_words_as_the_saved_maps(browser, run_dir, tmp_path):
    open_page(browser, run_dir / "index.html")
    assert browser.find_element("id", "prompt").text == PROMPT
    assert [b.text for b in browser.find_elements("css selector", "#words button")] == PROMPT.split()
    saved = load_file(str(run_dir / "maps.safetensors"))
    words = PROMPT.split()
    size = saved["0_a"].shape[-1]
    for x, y in [(3, 5), (12, 9)]:
        hover(browser, x, y, size)
        assert browser.find_element("id", "pixel").text == f"(x {x}, y {y})"
        rows = browser.find_elements("css selector", "#ranking li")
        shown = [(int(r.get_attribute("data-index")), float(r.get_attribute("data-value"))) for r in rows]
        expected = {i: float(saved[f"{i}_{w}"][0, y, x]) for i, w in enumerate(words)}
        assert sorted(i for i, _ in shown) == list(range(len(words)))
        for i, value in shown:
            assert value == pytest.approx(expected[i], abs=5e-5)
        for (a, _), (b, _) in zip(shown, shown[1:]):  # ranked by the saved values (ties within rounding)
            assert expected[a] >= expected[b] - 5e-5
        assert rows[0].find_element("css selector", ".word").text == f"{shown[0][0]}: {words[shown[0][0]]}"
    browser.save_screenshot(str(tmp_path / "run_hover.png"))
    assert (tmp_path / "run_hover.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_selectors_change_the_map_as_crossattn_maps_does(browser, run_dir, tiny_pipeline, tmp_path):
    open_page(browser, run_dir / "index.html")
    saved = load_file(str(run_dir / "maps.safetensors"))
    words = prompt_words(tiny_pipeline.tokenizer, PROMPT)
    store = rerun_store(tiny_pipeline)
    size = tuple(saved["0_a"].shape[-2:])
    np.testing.assert_allclose(page_maps(browser), torch.stack([saved[f"{w.index}_{w.text}"][0] for w in words]),
                               atol=5e-5)
    before = canvas_pixels(browser)
    layers = [o.get_attribute("value") for o in browser.find_elements("css selector", "#layer-select option")][1:]
    layer = layers[-1]
    choose(browser, "layer-select", layer)
    after = canvas_pixels(browser)
    assert after.shape == before.shape and np.abs(after - before).sum() > 0  # the drawn map changed
    np.testing.assert_allclose(page_maps(browser), torch.stack(
        [saved[f"layer/{layer}/{w.index}_{w.text}"][0] for w in words]), atol=5e-5)
    browser.save_screenshot(str(tmp_path / "run_layer.png"))

    # one head, one timestep window, softmax: as word_maps computes them from the store
    window = browser.find_elements("css selector", "#window-select option")[1].get_attribute("value")
    lo, hi = [(w["lo"], w["hi"]) for w in run_data(run_dir)["windows"] if w["index"] == int(window)][0]
    choose(browser, "head-select", "1")
    choose(browser, "window-select", window)
    choose(browser, "norm-select", "softmax")
    expected = word_maps(store, words, size, layers=[layer], heads=[1], timesteps=(lo, hi), normalize="softmax")
    got = page_maps(browser)
    np.testing.assert_allclose(got, expected, atol=2e-4)
    choose(browser, "image-select", "1")  # the second image of the run: its own maps and its own PNG
    assert browser.find_element("id", "image").get_attribute("src").endswith("/image_1.png")
    np.testing.assert_allclose(page_maps(browser), word_maps(store, words, size, index=1, layers=[layer], heads=[1],
                                                             timesteps=(lo, hi), normalize="softmax"), atol=2e-4)
    assert not np.allclose(page_maps(browser), got, atol=1e-3)
    np.testing.assert_allclose(got.sum(axis=0), 1, atol=1e-6)
    assert np.abs(canvas_pixels(browser) - after).sum() > 0
    choose(browser, "norm-select", "minmax")
    got = page_maps(browser)
    assert np.allclose(got.max(axis=(1, 2)), 1) and np.allclose(got.min(axis=(1, 2)), 0)
    assert browser.find_elements("css selector", "#ticks span")[-1].text == "1.000"

    # a word button selects the word the map shows; the opacity slider sets the map's opacity
    browser.find_elements("css selector", "#words button")[2].click()
    assert browser.execute_script("return window.crossattnViewer.state.word") == 2
    browser.execute_script("const s = document.getElementById('opacity'); s.value = 25;"
                           "s.dispatchEvent(new Event('input'));")
    assert browser.find_element("id", "map").value_of_css_property("opacity") == "0.25"
    browser.save_screenshot(str(tmp_path / "run_selected.png"))
    assert all((tmp_path / n).stat().st_size > 1000 for n in ("run_layer.png", "run_selected.png"))


@pytest.fixture(scope="module")
def refined_run(tmp_path_factory, tiny_pipeline_dir):
    from unet.cli.generate import load_pipeline
    return make_run(load_pipeline(tiny_pipeline_dir), tmp_path_factory.mktemp("refined"), num_images=2,
                    maps="refined")


def test_run_data_holds_every_kind_and_meta_names_the_saved_one(refined_run, tiny_pipeline):
    data, meta = run_data(refined_run), json.loads((refined_run / "meta.json").read_text())
    assert meta["maps"] == data["kind"] == "refined" and data["kinds"] == ["plain", "refined", "daam"]
    assert meta["refinement"]["iterations"] == DEFAULT_REFINEMENT.iterations
    # 3 steps (t = 999, 666, 333) miss the default's low-noise self-attention: the run read every step's
    assert meta["refinement"]["self_timesteps"] is None
    refinement = Refinement(**meta["refinement"])
    saved = load_file(str(refined_run / "maps.safetensors"))
    store = sample_store(tiny_pipeline, refined_store(tiny_pipeline))
    words = prompt_words(tiny_pipeline.tokenizer, PROMPT)
    for kind in ("refined", "daam"):
        got = np.frombuffer(base64.b64decode(data["kind_maps"][kind]["data"]), dtype="<f4")
        got = got.reshape(2, len(words), 16, 16)
        np.testing.assert_allclose(got, maps_of(kind, store, words, (16, 16), index=None, refinement=refinement),
                                   atol=1e-5)
    refined = maps_of("refined", store, words, (16, 16), index=None, refinement=refinement)
    for w in words:  # maps.safetensors holds the run's kind; per-layer maps stay plain
        np.testing.assert_allclose(saved[f"{w.index}_{w.text}"], refined[:, w.index], atol=1e-5)
    assert not np.allclose(saved["1_red"], word_maps(store, words, (16, 16), index=None)[:, 1], atol=1e-4)


def sample_store(pipe, store, seed=0, steps=3, num_images=2):
    """make_run's sampling again (same seed, default guidance) into `store`."""
    with store.attach(pipe.unet):
        pipe(PROMPT, num_inference_steps=steps, generator=torch.Generator().manual_seed(seed), output_type="np",
             show_progress=False, num_images_per_prompt=num_images)
    return store


def test_page_switches_between_map_kinds(browser, refined_run, tiny_pipeline, tmp_path):
    open_page(browser, refined_run / "index.html")
    words = prompt_words(tiny_pipeline.tokenizer, PROMPT)
    store = sample_store(tiny_pipeline, refined_store(tiny_pipeline))
    saved = load_file(str(refined_run / "maps.safetensors"))
    assert [o.get_attribute("value") for o in browser.find_elements("css selector", "#kind-select option")] == [
        "plain", "refined", "daam"]
    assert browser.execute_script("return window.crossattnViewer.state.kind") == "refined"
    np.testing.assert_allclose(page_maps(browser), torch.stack([saved[f"{w.index}_{w.text}"][0] for w in words]),
                               atol=5e-5)  # the run's own kind, as saved
    assert browser.find_element("id", "layer-select").get_attribute("disabled") is not None
    drawn = {"refined": canvas_pixels(browser)}
    refinement = Refinement(**json.loads((refined_run / "meta.json").read_text())["refinement"])
    for kind in ("plain", "daam", "refined"):
        choose(browser, "kind-select", kind)
        np.testing.assert_allclose(page_maps(browser), maps_of(kind, store, words, (16, 16), index=0,
                                                               refinement=refinement), atol=5e-5)
        drawn[kind] = canvas_pixels(browser)
        assert (browser.find_element("id", "layer-select").get_attribute("disabled") is None) == (kind == "plain")
    assert np.abs(drawn["plain"] - drawn["daam"]).sum() > 0 and np.array_equal(drawn["refined"], canvas_pixels(browser))
    choose(browser, "kind-select", "daam")  # the page normalises every kind alike; second image, its own maps
    choose(browser, "norm-select", "softmax")
    choose(browser, "image-select", "1")
    np.testing.assert_allclose(page_maps(browser), maps_of("daam", store, words, (16, 16), index=1,
                                                           normalize="softmax"), atol=5e-5)
    assert "DAAM" in browser.find_element("id", "explain").text
    browser.save_screenshot(str(tmp_path / "run_daam.png"))
    assert (tmp_path / "run_daam.png").stat().st_size > 1000


def test_raw_colour_bar_ends_at_the_words_peak(browser, run_dir):
    open_page(browser, run_dir / "index.html")
    saved = load_file(str(run_dir / "maps.safetensors"))
    word = browser.execute_script("return window.crossattnViewer.state.word")
    peak = float(saved[f"{word}_{PROMPT.split()[word]}"][0].max())
    assert float(browser.find_elements("css selector", "#ticks span")[-1].text) == pytest.approx(peak, abs=1e-3)


def test_gallery_links_open_each_run_page(browser, tiny_pipeline, tmp_path):
    runs = [make_run(tiny_pipeline, tmp_path / "out", prompt=p, seed=s)
            for p, s in [("a red circle", 0), ("a blue square", 5)]]
    gallery = write_gallery(tmp_path / "out")
    browser.get(gallery.resolve().as_uri())
    cards = browser.find_elements("css selector", "a.card")
    targets = {Path(browser.execute_script("return decodeURI(new URL(arguments[0].href).pathname)", c))
               for c in cards}
    assert targets == {(r / "index.html").resolve() for r in runs}
    assert all(browser.execute_script("return arguments[0].naturalWidth", img) == 16
               for img in browser.find_elements("css selector", "a.card img"))  # thumbnails loaded from disk
    browser.save_screenshot(str(tmp_path / "gallery.png"))
    card = [c for c in cards if "a blue square" in c.text][0]
    assert "seed 5" in card.text and "tiny-test-model" in card.text
    card.click()
    assert browser.find_element("id", "prompt").text == "a blue square"
    urls = browser.execute_script("return [...document.querySelectorAll('[src], [href]')].map((e) => e.src || e.href)")
    assert len(urls) == 2 and all(u.startswith("file://") for u in urls)  # the image and the data, from disk
    browser.save_screenshot(str(tmp_path / "gallery_to_run.png"))
    assert (tmp_path / "gallery.png").stat().st_size > 1000
