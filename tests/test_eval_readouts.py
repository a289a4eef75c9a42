"""The evaluation's read-outs beyond the plain aggregation (refined, top heads), where each wins, and the
README's maps tables written straight from the report."""

import json

import pytest

from unet.cli import evaluate
from unet.eval.map_scoring import READOUTS, TOP_HEAD_FRACTIONS, candidate_top_heads
from unet.eval.report import CONTENDERS, MAPS_BEGIN, MAPS_END, maps_markdown, winners


def test_quick_evaluation_reports_readouts_and_rewrites_the_readme_tables(tiny_pipeline_dir, tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# title\n\nbefore\n{MAPS_BEGIN}\nold tables\n{MAPS_END}\nafter\n")
    out = tmp_path / "eval"
    rc = evaluate.main(["--model", str(tiny_pipeline_dir), "--quick", "--out", str(out), "--steps", "3", "--seeds",
                        "1", "--dataset-images", "4", "--quiet", "--readme", str(readme),
                        "--guidance", "2", "--guidance-max-t", "500"])
    assert rc == 0
    report = json.loads((out / "report.json").read_text())
    assert (report["settings"]["guidance"], report["settings"]["guidance_max_t"]) == (2.0, 500)
    for images in ("", "_dataset"):
        for name in READOUTS:
            block = report["readouts" + images][name]
            assert block["params"] and block["shape_words"]["n"] == report["maps" + images]["shape_words"]["n"]
    assert report["readouts"]["refined"]["params"].startswith("k=")
    assert report["readouts"]["top_heads"]["params"].startswith("top ")
    assert set(report["dataset_timestep_sweep"]) == {"100", "200", "300", "500"}
    assert all(0 < v <= 1 for v in report["self_attention_entropy"].values())
    tables = (out / "maps.md").read_text()
    assert tables.strip() == maps_markdown(report).strip()
    text = readme.read_text()
    assert "old tables" not in text and text.startswith("# title\n\nbefore\n") and text.endswith("after\n")
    assert maps_markdown(report) in text and str(out / "report.json") in text


def test_bad_readme_is_refused_before_any_work(tiny_pipeline_dir, tmp_path, capsys):
    (tmp_path / "README.md").write_text("no block here\n")
    rc = evaluate.main(["--model", str(tiny_pipeline_dir), "--quick", "--out", str(tmp_path / "eval"), "--quiet",
                        "--readme", str(tmp_path / "README.md")])
    err = capsys.readouterr().err
    assert rc == 2 and "--readme" in err and MAPS_BEGIN in err and err.count("\n") == 1
    assert not (tmp_path / "eval").exists()


def test_winners_name_the_best_contender_per_measure():
    def block(shape, colour):
        return {"shape_words": {"miou": shape, "pointing": shape, "mass": shape},
                "color_words": {"miou": colour, "pointing": colour, "mass": None}}
    report = {"maps": block(0.5, 0.1), "readouts": {"refined": block(0.2, 0.3), "top_heads": block(0.6, 0.2)},
              "baselines": {"daam": block(0.1, 0.4)}, "maps_dataset": block(0.3, 0.3),
              "readouts_dataset": {"refined": block(0.1, 0.1), "top_heads": block(0.1, 0.1)},
              "baselines_dataset": {"daam": block(0.2, 0.2)}}
    assert CONTENDERS == ("ours", "refined", "top_heads", "daam")
    rows = winners(report)[2:]
    assert rows[0] == "| generated | shape | top_heads 0.600 (plain 0.500) | top_heads 0.600 (plain 0.500) | " \
                      "top_heads 0.600 (plain 0.500) |"
    assert rows[1] == "| generated | colour | daam 0.400 (plain 0.100) | daam 0.400 (plain 0.100) | – |"
    assert rows[2].startswith("| dataset | shape | ours 0.300 |") and "daam 0.200 (plain 0.300)" not in rows[2]


def test_top_heads_are_the_most_relevant_heads():
    relevance = {("a", 0): 0.9, ("a", 1): 0.1, ("b", 0): 0.5, ("b", 1): 0.8, ("c", 0): 0.2}
    candidates = candidate_top_heads(relevance, timesteps=(0, 499))
    assert len(candidates) == len(TOP_HEAD_FRACTIONS)
    chosen = {name.split(" (")[0]: c["heads"] for name, c in candidates.items()}
    assert chosen["top 20%"] == {"a": [0]} and chosen["top 50%"] == {"a": [0], "b": [1]}
    assert all(c["timesteps"] == (0, 499) for c in candidates.values())
    with pytest.raises(KeyError):
        chosen["top 90%"]
