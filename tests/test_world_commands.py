"""The commands that take `--model` with a scenes-64 model: control and explain read its world's shape words (the
plurals its counts use: "three green diamonds"), and the research tool built on scenes-32's prompts refuses it in one
line. The scenes-32 model keeps its words."""

import json
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
import torch
from test_bad_input import one_line_error

from unet.cli import explain as explain_script
from unet.cli import generate as generate_script
from unet.control import object_words
from unet.pipeline import SHAPE_WORDS, ScenePipeline, load_pipeline, shape_words
from unet.research import diagnose as diagnose_script
from unet.research.diagnose import noise_summaries


@pytest.fixture
def tiny64_pipeline_dir(tiny64_run) -> Path:
    return tiny64_run / "pipeline"


def test_each_world_has_its_shape_words(tiny64_pipeline_dir, tiny_pipeline):
    assert shape_words(load_pipeline(tiny64_pipeline_dir, show_progress=False)) == SHAPE_WORDS["scenes-64"]
    assert shape_words(tiny_pipeline) == SHAPE_WORDS["scenes-32"] == ("circle", "square", "triangle")
    assert {"diamonds", "crosses", "star"} <= set(SHAPE_WORDS["scenes-64"])
    words = "two small cyan triangles and a big orange circle".split()
    assert object_words(words, SHAPE_WORDS["scenes-64"]) == ["triangles", "circle"]
    assert object_words(words) == ["circle"]  # scenes-32's words know no plural


def test_excite_takes_the_plural_shape_words_of_a_64_model(tiny64_pipeline_dir, tmp_path, capsys):
    out = tmp_path / "out"
    rc = generate_script.main(["two purple circles right of a yellow star", "--excite", "--model",
                               str(tiny64_pipeline_dir), "--out", str(out), "--steps", "2", "--quiet"])
    assert rc == 0, capsys.readouterr().err
    (folder,) = out.iterdir()
    assert json.loads((folder / "meta.json").read_text())["control"]["excite"] == ["circles", "star"]
    line = one_line_error(capsys, generate_script.main(["four pink", "--excite", "--model", str(tiny64_pipeline_dir),
                                                        "--out", str(tmp_path / "o2"), "--quiet"]),
                          "has no object word (circle, square, triangle, diamond, star, cross, circles")
    assert not (tmp_path / "o2").exists(), line


def test_explain_follows_the_first_shape_word_of_the_models_world(tiny64_pipeline_dir, tiny_pipeline_dir, tmp_path):
    def followed(model, prompt):
        args = Namespace(prompt=prompt, seed=0, out=str(tmp_path / "out"), model=str(model), truncate=False,
                         word=None, what="heads", x=None, y=None)
        return explain_script.check_inputs(args)[1]

    assert followed(tiny64_pipeline_dir, "three green diamonds") == "diamonds"
    assert followed(tiny64_pipeline_dir, "a small red star above a big blue square") == "star"
    assert followed(tiny_pipeline_dir, "a red circle left of a blue square") == "circle"


def test_diagnose_refuses_a_64_model(tiny64_pipeline_dir, tmp_path, capsys):
    rc = diagnose_script.main(["words", "--model", str(tiny64_pipeline_dir), "--out", str(tmp_path / "d")])
    err = capsys.readouterr().err  # after the loading bars, one error line
    assert rc == 2 and "error: diagnose words measures a model of world scenes-32" in err
    assert "model of world scenes-64" in err
    assert "Traceback" not in err and not list((tmp_path / "d").glob("*.json"))


def test_diagnose_counts_tells_each_asked_count_what_was_drawn(tiny64_pipeline_dir, tiny_pipeline_dir, tmp_path,
                                                               capsys):
    """Every counting prompt's images are counted once, under the count it asked for; a scenes-32 model is refused."""
    assert diagnose_script.main(["counts", "--model", str(tiny64_pipeline_dir), "--out", str(tmp_path / "d"),
                                 "--seeds", "2"]) == 0
    counts = json.loads((tmp_path / "d" / "counts.json").read_text())["counts"]
    assert sorted(counts["drawn"]) == ["1", "2", "3", "4"] and counts["seeds"] == 2
    for asked, row in counts["drawn"].items():
        assert sum(row.values()) == 6 * 2  # six shapes, two seeds each
        assert counts["exact"][asked] == row.get(asked, 0) / 12
    capsys.readouterr()
    rc = diagnose_script.main(["counts", "--model", str(tiny_pipeline_dir), "--out", str(tmp_path / "e")])
    err = capsys.readouterr().err
    assert rc == 2 and "diagnose counts measures a model of world scenes-64" in err and "Traceback" not in err
    assert not (tmp_path / "e" / "counts.json").exists()


def test_diagnose_count_noise_samples_every_count_of_a_shape_from_one_noise(tiny64_pipeline_dir, tmp_path,
                                                                          monkeypatch):
    """count-noise: each shape's four counting prompts are one batch whose rows share one noise, another noise per
    seed, at the guidance asked; its summaries are read off what was drawn: the exact shares, the misses per noise
    and an error correlation per pair of counts, and the same with the noises shuffled (every count keeps its
    misses)."""
    batches, call = [], ScenePipeline.__call__

    def spy(self, prompt, *args, latents=None, **kwargs):
        batches.append((list(prompt), latents.clone(), kwargs["guidance_scale"]))
        return call(self, prompt, *args, latents=latents, **kwargs)

    monkeypatch.setattr(ScenePipeline, "__call__", spy)
    assert diagnose_script.main(["count-noise", "--model", str(tiny64_pipeline_dir), "--out", str(tmp_path / "d"),
                                 "--seeds", "2", "--guidance", "2.5", "--guidance-min-t", "400"]) == 0
    assert len(batches) == 6 * 2  # six shapes, two noises each
    for prompts, latents, guidance in batches:
        assert [p.split()[0] for p in prompts] == ["one", "two", "three", "four"] and guidance == 2.5
        assert all(torch.equal(row, latents[0]) for row in latents)
    assert not torch.equal(batches[0][1][0], batches[1][1][0])  # the next seed, another noise
    result = json.loads((tmp_path / "d" / "count-noise.json").read_text())["count_noise"]
    assert result["guidance"] == 2.5 and result["guided_t"] == [400, None]
    rows = [row for shape_rows in result["drawn"].values() for row in shape_rows]
    assert result["noises"] == len(rows) == 12 and all(len(row) == 4 for row in rows)
    for k, asked in enumerate(("1", "2", "3", "4")):
        assert result["exact"][asked] == sum(row[k] == int(asked) for row in rows) / 12
    misses = [sum(found != asked for found, asked in zip(row, (1, 2, 3, 4))) for row in rows]
    assert result["misses_per_noise"] == [misses.count(m) for m in range(5)]
    assert sorted(result["error_correlation"]) == ["1/2", "1/3", "1/4", "2/3", "2/4", "3/4"]
    # shuffling noises within a shape, count by count, keeps every count's misses: the same misses in all
    shuffled = result["shuffled"]["misses_per_noise"]
    assert abs(sum(shuffled) - 12) < 1e-9 and abs(sum(m * k for k, m in enumerate(shuffled)) - sum(misses)) < 1e-9


def test_diagnose_counts_samples_at_the_guidance_asked_and_refuses_flags_it_would_ignore(tiny64_pipeline_dir,
                                                                                        tmp_path, capsys):
    """counts takes a guidance scale and the guided timesteps, and records them; a guidance flag another diagnosis
    would ignore, a bound outside the scheduler's timesteps and an empty range are refused before anything is
    written."""
    assert diagnose_script.main(["counts", "--model", str(tiny64_pipeline_dir), "--out", str(tmp_path / "d"),
                                 "--seeds", "1", "--guidance", "2", "--guidance-min-t", "500"]) == 0
    counts = json.loads((tmp_path / "d" / "counts.json").read_text())["counts"]
    assert counts["guidance"] == 2.0 and counts["guided_t"] == [500, None]
    assert sum(sum(row.values()) for row in counts["drawn"].values()) == 24  # every counting prompt, once
    for argv, says in ((["words", "--guidance-max-t", "500"],
                        "--guidance-max-t applies to diagnose counts and count-noise, not words"),
                       (["grain", "--guidance", "2"],
                        "--guidance applies to diagnose first-step, counts and count-noise"),
                       (["counts", "--guidance-min-t", "1000"], "--guidance-min-t must be a timestep from 0 to 999"),
                       (["counts", "--guidance-min-t", "600", "--guidance-max-t", "500"],
                        "no timestep would be guided")):
        capsys.readouterr()
        rc = diagnose_script.main([*argv, "--model", str(tiny64_pipeline_dir), "--out", str(tmp_path / "e")])
        err = capsys.readouterr().err
        assert rc == 2 and says in err and "Traceback" not in err, argv
        assert not list((tmp_path / "e").glob("*.json"))


def test_sample_grid_draws_the_prompts_each_model_was_watched_learning(tiny64_pipeline_dir, tmp_path):
    """The grid's default prompts are the model's own run's sample prompts; a folder without a run config (as the
    shipped scenes-32) takes its world's recipe's, so a scenes-64 model is never shown scenes-32's four colours."""
    import shutil

    from unet.cli.sample_grid import training_sample_prompts
    from unet.recipe_file import read_recipe
    from unet.train_config import RunConfig

    assert training_sample_prompts(load_pipeline(tiny64_pipeline_dir, show_progress=False)) == [
        "three green diamonds"]  # tests/data/tiny-recipe-64.toml's
    bare = tmp_path / "bare64"
    shutil.copytree(tiny64_pipeline_dir, bare)
    saved = json.loads((bare / "train_config.json").read_text())
    saved.pop("sample_prompts")  # still names its world
    (bare / "train_config.json").write_text(json.dumps(saved))
    prompts = training_sample_prompts(load_pipeline(bare, show_progress=False))
    assert prompts == read_recipe("scenes-64")[1]["sample_prompts"] and "three green diamonds" in prompts
    assert training_sample_prompts(load_pipeline("scenes-32", show_progress=False)) == RunConfig().sample_prompts


def test_noise_summaries_tell_a_noise_that_decides_the_count_from_one_that_does_not():
    """Errors that go with the noise (a row all one too many, or all right) are all in the same direction and
    correlate fully; errors that alternate between counts correlate negatively and never agree in direction."""
    noisy = noise_summaries(np.array([[1, 1, 1, 1], [0, 0, 0, 0]] * 3), [1, 2, 3, 4])
    assert noisy["misses_per_noise"] == [3, 0, 0, 0, 3] and noisy["same_direction"] == "3 of 3"
    assert noisy["mean_error_correlation"] == pytest.approx(1.0)
    alternating = noise_summaries(np.array([[1, -1, 1, -1], [-1, 1, -1, 1]] * 3), [1, 2, 3, 4])
    assert alternating["same_direction_share"] == 0 and alternating["error_correlation"]["1/2"] == pytest.approx(-1)
    assert noise_summaries(np.zeros((4, 4), int), [1, 2, 3, 4])["mean_error_correlation"] is None
