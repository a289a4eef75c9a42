"""Two models judged on the same images: the pairing, McNemar's exact test and `scripts/compare.py`."""

import json
from math import comb

import pytest

from unet.cli.compare import main
from unet.eval.paired import compare, judged, mcnemar_p, verdicts


def fresh_report(verdicts_by_image: dict, base_seed: int = 50000, seeds: int = 2, model: str = "m") -> dict:
    """A fresh-seeds report as evaluate.py writes it, judging `verdicts_by_image`: (prompt, sample) -> (task, ok)."""
    records = [{"task": task, "prompt": prompt, "sample": sample, "ok": ok}
               for (prompt, sample), (task, ok) in verdicts_by_image.items()]
    return {"model": model, "prompt_following": {
        "judged": judged(records, base_seed),
        "settings": {"seeds": seeds, "base_seed": base_seed, "steps": 25, "tasks": ["two_object", "position"]}}}


def images(oks: list[bool], task: str = "two_object", prompt: str = "a circle and a square") -> dict:
    return {(prompt, k): (task, ok) for k, ok in enumerate(oks)}


def test_mcnemar_p_is_the_two_sided_binomial_tail_of_the_disagreements():
    assert mcnemar_p(0, 0) == 1.0 and mcnemar_p(5, 5) == 1.0
    assert mcnemar_p(0, 10) == pytest.approx(2 / 2 ** 10)
    assert mcnemar_p(2, 10) == mcnemar_p(10, 2) == pytest.approx(2 * sum(comb(12, i) for i in range(3)) / 2 ** 12)
    assert mcnemar_p(4, 5) == 1.0  # capped: the two tails of an odd split overlap


def test_compare_counts_only_the_images_the_two_models_disagree_on():
    a = images([True, True, False, False, True]) | images([True, False], "position", "a circle left of a square")
    b = images([True, False, True, False, True]) | images([False, False], "position", "a circle left of a square")
    result = compare([("a", fresh_report(a, seeds=5))], [("b", fresh_report(b, seeds=5))])
    assert list(result) == ["position", "two_object", "all"]
    assert result["two_object"] | {"p": None} == {"images": 5, "a": 3, "b": 3, "only_a": 1, "only_b": 1, "p": None,
                                                 "prompts_disagreeing": 1}
    assert result["position"]["only_a"] == 1 and result["position"]["only_b"] == 0
    assert result["all"] == {"images": 7, "a": 4, "b": 3, "only_a": 2, "only_b": 1, "p": mcnemar_p(2, 1),
                             "prompts_disagreeing": 2}


def test_reports_of_one_side_pool_by_seed_and_a_model_against_itself_disagrees_nowhere():
    full, fresh = fresh_report(images([True, False]), base_seed=0), fresh_report(images([False, True]))
    result = compare([("full", full), ("fresh", fresh)], [("fresh b", fresh), ("full b", full)])
    assert result["all"]["images"] == 4 and result["all"]["only_a"] == result["all"]["only_b"] == 0
    assert result["all"]["p"] == 1.0


def test_images_are_paired_only_when_the_same_seed_gives_the_same_noise():
    a = fresh_report(images([True, True]))
    with pytest.raises(ValueError, match="did not judge the same images: 1 are judged by one side only"):
        compare([("a", a)], [("b", fresh_report(images([True])))])
    with pytest.raises(ValueError, match="image 1 of 'a circle and a square' from seed 50000, only by the second"):
        compare([("b", fresh_report(images([True])))], [("a", a)])
    with pytest.raises(ValueError, match="4 are judged by one side only"):  # other seeds: other noise
        compare([("a", a)], [("b", fresh_report(images([True, True]), base_seed=51000))])
    other = fresh_report(images([True, True]))
    other["prompt_following"]["settings"]["steps"] = 50
    with pytest.raises(ValueError, match="different settings \\(steps 25 against 50\\)"):
        compare([("a", a)], [("b", other)])
    with pytest.raises(ValueError, match="in another report of the same side"):
        compare([("a", a), ("a again", a)], [("b", a)])
    with pytest.raises(ValueError, match="no per-image verdicts"):
        verdicts({"prompt_following": {"overall": 0.9}}, "old/report.json")


def test_compare_script_prints_the_table_and_refuses_what_it_cannot_pair(tmp_path, capsys):
    for name, oks in (("a", [True, True, True]), ("b", [False, False, True])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(fresh_report(images(oks), seeds=3, model=name)))
    assert main(["--a", str(tmp_path / "a"), "--b", str(tmp_path / "b" / "report.json")]) == 0
    out = capsys.readouterr().out
    assert "| task | images | right: a | right: b | only a | only b |" in out
    assert f"| **all** | 3 | 3 | 1 | 2 | 0 | 1 | {mcnemar_p(2, 0):.3g} |" in out
    assert main(["--a", str(tmp_path / "a"), "--b", str(tmp_path / "b"), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["all"]["only_a"] == 2
    assert main(["--a", str(tmp_path / "a"), "--b", str(tmp_path / "missing")]) == 2
    assert "no report.json there" in capsys.readouterr().err
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "report.json").write_text(json.dumps({"prompt_following": {"overall": 0.5}}))
    assert main(["--a", str(tmp_path / "a"), "--b", str(tmp_path / "old")]) == 2
    assert "written before reports kept them" in capsys.readouterr().err
    (tmp_path / "garbage.json").write_text("{not json")
    assert main(["--a", str(tmp_path / "a"), "--b", str(tmp_path / "garbage.json")]) == 2
    assert "not a readable JSON report" in capsys.readouterr().err
