"""The evaluation and benchmark scripts end to end on a tiny model: well-formed outputs, not timings."""

import json
import math

from PIL import Image

from unet.cli import benchmark, evaluate
from unet.eval.evaluate import BASELINES, TASKS


def test_quick_evaluation_writes_well_formed_report(tiny_pipeline_dir, tmp_path):
    out = tmp_path / "eval"
    rc = evaluate.main(["--model", str(tiny_pipeline_dir), "--quick", "--out", str(out), "--steps", "3",
                        "--seeds", "1", "--dataset-images", "4", "--quiet"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    pf = report["prompt_following"]
    assert 0 <= pf["overall"] <= 1 and all(t in pf for t in TASKS)
    assert sum(pf["n_images"].values()) == 15  # 3 prompts per task x 1 seed
    for kind in ("shape_words", "color_words"):
        for block in [report["maps"]] + [report["baselines"][b] for b in BASELINES]:
            s = block[kind]
            assert s["n"] == 0 or (0 <= s["miou"] <= 1 and 0 <= s["pointing"] <= 1)
        s = report["maps_dataset"][kind]
        assert s["n"] > 0 and 0 <= s["miou"] <= 1  # dataset masks are exact: always scored
    md = (out / "report.md").read_text()
    assert "| overall" in md.replace("**", "") and "daam" in md
    assert Image.open(out / "tasks.png").width > 300


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
