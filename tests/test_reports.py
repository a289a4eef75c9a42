"""The evaluation and benchmark scripts end to end on a tiny model: well-formed outputs, not timings."""

import json
import math

import numpy as np
import pytest
from PIL import Image

from unet.cli import benchmark, evaluate
from unet.data import SHAPES, SceneSampler
from unet.eval.evaluate import paired_prompts, run_evaluation
from unet.eval.map_scoring import BASELINES
from unet.eval.prompts import PAIRED_AXES, TASKS, prompt_following
from unet.pipeline import load_pipeline


def test_quick_evaluation_writes_well_formed_report(tiny_pipeline_dir, tmp_path):
    out = tmp_path / "eval"
    rc = evaluate.main(["--model", str(tiny_pipeline_dir), "--quick", "--out", str(out), "--steps", "3",
                        "--seeds", "1", "--dataset-images", "4", "--quiet"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    pf = report["prompt_following"]
    assert pf["n_images"] == {t: 3 for t in TASKS}  # 3 prompts per task x 1 seed
    assert pf["overall"] == pytest.approx(sum(pf[t] for t in TASKS) / len(TASKS))  # GenEval: mean of tasks
    scenes = [SceneSampler(123, 16, 16, split="eval")() for _ in range(4)]  # dataset_batch's scenes
    for kind, in_kind in (("shape_words", lambda w: w in SHAPES), ("color_words", lambda w: w not in SHAPES)):
        # every method scores the same (map, mask) pairs: one per word whose object was found
        blocks = [report["maps"]] + [report["baselines"][b] for b in BASELINES]
        assert len({block[kind]["n"] for block in blocks}) == 1
        expected = sum(in_kind(s.caption.split()[i]) for s in scenes for i in s.word_objects)
        assert report["maps_dataset"][kind]["n"] == expected > 0  # dataset masks are exact: every word scored
    assert set(pf["relation_response"]) == {"horizontal", "vertical"}
    assert {axis: v["images"] for axis, v in pf["relation_response_paired"].items()} == \
        {axis: 2 * len(paired_prompts(axis)) for axis in PAIRED_AXES}  # each prompt and its opposite, 1 seed
    assert {axis: len(paired_prompts(axis)) for axis in PAIRED_AXES}["horizontal"] == 6  # as reports always had
    layout = pf["layout_response"]["pairs"]
    assert set(layout) == {"left of/right of", "above/below", "on the left/on the right", "on the top/on the bottom"}
    assert all(v["data_shift"] > 3 and len(v["response_per_step"]) == 3 for v in layout.values())
    keys = report["key_separation"]["layers"]
    assert keys and all(-1 <= v["color"]["max"] <= 1 and v["color"]["pairs"] > 0 for v in keys.values())
    assert set(pf["relation_word_similarity"]) == {"left/right", "above/below"}
    assert all(-1 <= v <= 1 for v in pf["relation_word_similarity"].values())
    assert pf["relation_word_similarity"]["left/right"] < 0.999  # a barely trained encoder still tells them apart
    md = (out / "report.md").read_text()
    assert report["model"] == str(tiny_pipeline_dir) and md.startswith(f"# Evaluation of {tiny_pipeline_dir} (")
    assert "| overall" in md.replace("**", "") and "daam" in md and "Relation response" in md and "paired" in md
    assert "## Layout response" in md and "| on the top/on the bottom |" in md and "## Key separation" in md
    assert "| text encoder output (before the Keys) |" in md
    assert Image.open(out / "tasks.png").width > 300


def test_a_report_of_the_shipped_model_says_where_it_lives():
    from unet.pipeline import PRETRAINED, model_label
    label = model_label(None)
    where = label[label.index("(") + 1:-1]
    assert label.startswith("shipped scenes-32") and (PRETRAINED.parents[2] / where) == PRETRAINED
    assert (PRETRAINED / "model_index.json").is_file() and model_label("runs/v3") == "runs/v3"


def test_prompt_following_on_constructed_records():
    records = [{"task": "single_object", "ok": ok, "grain": g} for ok, g in ((True, 0.0), (False, 2.0))]
    records += [{"task": "two_object", "ok": ok, "grain": 1.0} for ok in (True, True, True, False)]
    pf = prompt_following(records)
    assert pf["single_object"] == 0.5 and pf["two_object"] == 0.75 and pf["colors"] is None
    assert pf["overall"] == 0.625  # the mean over the tasks that have images, not over images (4 / 6)
    assert pf["n_images"] == {"single_object": 2, "two_object": 4, "colors": 0, "position": 0, "color_attr": 0}
    assert pf["background_grain"]["mean"] == pytest.approx(np.mean([0.0, 2.0, 1.0, 1.0, 1.0, 1.0]))


def test_quick_evaluation_of_the_shipped_model_detects_objects():
    """A tiny test model draws nothing yet; the shipped one must, or every prompt-following score is 0."""
    report, records, _, _ = run_evaluation(load_pipeline(show_progress=False), seeds=1, steps=10, dataset_images=4,
                                           quick=True, progress=False)
    assert sum(r["ok"] for r in records) >= 1 and report["prompt_following"]["overall"] > 0
    found = [r for r in records if r["task"] == "position" and None not in r["centers"]]
    assert report["prompt_following"]["relation_response"]["horizontal"]["images"] + \
        report["prompt_following"]["relation_response"]["vertical"]["images"] == len(found)
    assert report["maps"]["shape_words"]["n"] >= 1  # at least one detected object had its word's map scored


def test_quick_benchmark_writes_positive_finite_ratios(tiny_pipeline_dir, tmp_path):
    out = tmp_path / "bench"
    assert benchmark.main(["--model", str(tiny_pipeline_dir), "--quick", "--out", str(out)]) == 0
    r = json.loads((out / "bench.json").read_text())
    ratios = list(r["block_vs_diffusers_fused"].values()) + list(r["block_vs_diffusers_weights"].values())
    ratios += [r["capture_overhead"], r["training_images_per_s"], r["fraction_of_matmul_peak"]]
    ratios += list(r["sampling_images_per_s"].values())
    assert all(math.isfinite(x) and x > 0 for x in ratios)
    sizes = {v["store_bytes"] for v in r["capture_bytes_by_steps"].values()}
    assert len(r["capture_bytes_by_steps"]) == 3 and all(s > 0 for s in sizes)
    every = [v["every_step_bytes"] for v in r["capture_bytes_by_steps"].values()]
    assert every == sorted(every) and every[0] < every[-1]  # storing every step would grow


def test_a_report_names_the_timesteps_it_guided_at():
    from unet.eval.report import guidance_words
    assert guidance_words({"guidance": 1.0, "guidance_max_t": 550}) == "guidance 1.0"  # unguided: no window
    assert guidance_words({"guidance": 2.0}) == "guidance 2.0"  # a report from before the window was saved
    assert guidance_words({"guidance": 2.0, "guidance_min_t": 0, "guidance_max_t": None}) == "guidance 2.0"
    assert guidance_words({"guidance": 2.0, "guidance_max_t": 550}) == "guidance 2.0 at t <= 550"
    assert guidance_words({"guidance": 3.0, "guidance_min_t": 880}) == "guidance 3.0 at t >= 880"
    assert guidance_words({"guidance": 2.0, "guidance_min_t": 100, "guidance_max_t": 550}) == \
        "guidance 2.0 at 100 <= t <= 550"
