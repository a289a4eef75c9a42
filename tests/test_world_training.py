"""Training in the scenes-64 world through the one-command path: `train.py --recipe` with `world = "scenes-64"` draws
the world's scenes, builds its vocabulary and grounds every word on the objects it names; its pipeline knows its
world, so evaluate.py runs the world's own evaluation and generate/attend warn with the world's words. Models are
found by name (`--model scenes-32`) or by folder."""

import json
from pathlib import Path

import pytest
import torch
from test_bad_input import one_line_error

from crossattn.text import prompt_words
from unet import checkpoint
from unet.cli import attend as attend_script
from unet.cli import evaluate as evaluate_script
from unet.cli import generate as generate_script
from unet.cli import train as train_script
from unet.data import scenes_to_tensor, to_model_range
from unet.eval.paired import judged
from unet.pipeline import PRETRAINED, load_pipeline, model_folder, model_label
from unet.recipe_file import read_recipe, read_rounds, round_configs
from unet.train import TrainConfig, build_components, fresh_scenes, training_batch
from unet.world import CAPTION_TOKENS, LONGEST_CAPTION, NUMERALS, known_words, parse_caption

TINY_64 = Path(__file__).resolve().parent / "data" / "tiny-recipe-64.toml"


@pytest.fixture
def tiny64_config(tmp_path) -> TrainConfig:
    _, values = read_recipe(TINY_64)
    return TrainConfig.from_flat(**values, out=str(tmp_path / "run"))


def test_a_tiny_64_recipe_trains_from_nothing_and_its_pipeline_samples(tiny64_run):
    saved = json.loads((tiny64_run / "train_config.json").read_text())
    assert saved["world"] == "scenes-64" and saved["size"] == 16 and saved["steps"] == 4
    _, resolved = read_recipe(tiny64_run / "pipeline" / "recipe.resolved.toml")
    assert resolved["world"] == "scenes-64"
    assert json.loads(json.dumps(TrainConfig.from_flat(**{**resolved, "out": saved["out"]}).flat())) == saved
    # the words of its captions, the world's (scenes-32 has no "diamonds" or "orange")
    trained = set(json.loads((tiny64_run / "pipeline" / "trained_words.json").read_text()))
    assert {"diamonds", "orange", "small", "four"} <= trained <= set(known_words())
    pipe = load_pipeline(tiny64_run / "pipeline", show_progress=False)
    assert pipe.world == "scenes-64"
    words = prompt_words(pipe.tokenizer, LONGEST_CAPTION)
    assert [w.text for w in words] == LONGEST_CAPTION.split() and all(len(w.tokens) == 1 for w in words)
    images = pipe(["three green diamonds", LONGEST_CAPTION], num_inference_steps=2, output_type="np",
                  generator=torch.Generator().manual_seed(0), show_progress=False).images
    assert images.shape == (2, 16, 16, 3) and (images >= 0).all() and (images <= 1).all()


def test_a_resumed_64_run_ends_on_the_same_weights(tiny64_run, tmp_path):
    """Stopped half-way and resumed, a scenes-64 run draws the same batches and ends bit for bit where the straight
    run did."""
    again = tmp_path / "again"
    assert train_script.main(["--recipe", str(TINY_64), "--out", str(again), "--steps", "2", "--quiet"]) == 0
    assert train_script.main(["--out", str(again), "--resume", "--steps", "4", "--quiet"]) == 0
    a, _ = checkpoint.load(tiny64_run / "checkpoint.safetensors")
    b, _ = checkpoint.load(again / "checkpoint.safetensors")
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]


def test_grounding_masks_cover_exactly_the_objects_each_word_names(tiny64_config, tmp_path):
    """Every token of a count, size, colour or shape word gets the union of the masks of the objects it names (a
    numeral: all of its group's), every other token zeros; the batch's images are the drawn scenes'."""
    cfg = tiny64_config.replace(batch_size=24, caption_dropout=0.0)
    tokenizer, _, _ = build_components(cfg, tmp_path)
    step = 3
    images, captions, masks = training_batch(cfg, tokenizer, step)
    data = cfg.data
    scenes = fresh_scenes(cfg.run.seed, step, cfg.optimizer.batch_size, cfg.model.size, data.single_share,
                          data.colourless_share, data.and_order, data.world)
    assert torch.equal(images, to_model_range(scenes_to_tensor(scenes))) and captions == [s.caption for s in scenes]
    assert masks.shape == (24, cfg.text.max_length, 16, 16)
    numerals = 0
    for b, scene in enumerate(scenes):
        named = torch.zeros(cfg.text.max_length, dtype=torch.bool)
        for word in prompt_words(tokenizer, scene.caption):
            objects = scene.word_objects.get(word.index, ())
            union = torch.zeros(16, 16, dtype=torch.bool)
            for k in objects:
                union |= torch.from_numpy(scene.objects[k].mask)
            for position in word.tokens:
                assert torch.equal(masks[b, position], union.float()), (scene.caption, word.text)
                named[position] = bool(objects)
            if word.text in NUMERALS:  # as many objects as it says, all of them covered
                assert len(objects) == NUMERALS[word.text] and union.sum() == sum(
                    scene.objects[k].mask.sum() for k in objects), scene.caption
                numerals += len(objects) > 1
        assert not masks[b, ~named].any()  # relation and position words, start, end and padding: nothing
    assert numerals > 0  # the batch had numerals of several objects to check


def test_the_same_step_draws_the_same_batch(tiny64_config, tmp_path):
    tokenizer, _, _ = build_components(tiny64_config, tmp_path)
    first, again, other = (training_batch(tiny64_config, tokenizer, step) for step in (5, 5, 6))
    assert first[1] == again[1] and torch.equal(first[0], again[0]) and torch.equal(first[2], again[2])
    assert first[1] != other[1]
    assert all(parse_caption(c) for c in first[1] if c)  # the world's captions, not scenes-32's


def test_the_scenes_64_recipe_has_every_lesson_of_scenes_32():
    """The recipe differs from scenes-32's only in its world, its size and U-Net, its captions' length, its run's
    length and its sample prompts."""
    cfg = TrainConfig.from_flat(**read_recipe("scenes-64")[1])
    cfg.validate()
    base = TrainConfig.from_flat(**read_recipe("scenes-32")[1])
    changed = {name for name, value in cfg.flat().items() if value != base.flat()[name]}
    assert changed <= {"world", "size", "channels", "cross_attention", "self_attention", "max_length", "steps",
                       "decay_start", "decay_steps", "sample_prompts"}
    assert cfg.data.world == "scenes-64" and cfg.model.size == 64 and len(cfg.model.channels) == 4
    schedule = cfg.schedule
    assert schedule.decay_start + schedule.decay_steps == schedule.steps  # the cooldown ends the run, as scenes-32's
    assert all(parse_caption(p) for p in cfg.run.sample_prompts)


def test_the_scenes_64_recipe_rebuilds_the_shipped_model_round_by_round():
    """One command, `--recipe scenes-64`, trains every round the shipped model was made by: round 1 has the first
    run's settings and the last round the shipped pipeline's, each round from the one before (the shipped one went
    on from round 6's run, whose folder was runs/g9-18k at the time). Only the folders differ."""
    path, values = read_recipe("scenes-64")
    first = TrainConfig.from_flat(**values)
    rounds = round_configs(first, read_rounds(path), "runs/scenes-64")
    assert rounds and all(r.schedule.decay_start + r.schedule.decay_steps == r.schedule.steps for r in rounds)
    fresh = [first, *(r for r in rounds if r.grown_from is None)]
    assert len({r.run.seed for r in fresh}) == len(fresh)  # every round that starts afresh draws other batches
    examples = Path(__file__).resolve().parents[1] / "outputs" / "examples" / "scenes-64"
    for cfg, made in ((first, examples / "first-run"), (rounds[-1], model_folder("scenes-64"))):
        saved = json.loads((made / "train_config.json").read_text())
        ours = json.loads(json.dumps(cfg.flat()))
        assert {k for k in saved if k in ours and saved[k] != ours[k]} <= {"out", "started_from", "grown_from"}
    assert rounds[-1].grown_from == f"{rounds[-2].out}@{rounds[-2].schedule.steps}"  # round 6's run, going on
    # the shipped resolved recipe is the last round's settings, and its header names the command that makes it
    shipped = model_folder("scenes-64") / "recipe.resolved.toml"
    _, resolved = read_recipe(shipped)
    last = rounds[-1].replace(out=TrainConfig().out, started_from=None, grown_from=None)
    assert TrainConfig.from_flat(**resolved).flat() == last.flat()
    assert read_rounds(shipped) == []
    assert f"round {len(rounds) + 1}, the last, of recipes/scenes-64.toml" in shipped.read_text()


@pytest.mark.parametrize("args, message", [
    (["--world", "scenes-99"], "world must be one of 'scenes-32', 'scenes-64', got 'scenes-99'"),
    (["--max-length", str(CAPTION_TOKENS - 1)], f"give at least {CAPTION_TOKENS}"),
    (["--num-samples", "64"], "--num-samples is for world scenes-32 only"),
    (["--layout-every", "10"], "--layout-every is for world scenes-32 only"),
])
def test_a_bad_world_setting_is_one_line_at_the_door(tmp_path, capsys, args, message):
    run = tmp_path / "run"
    one_line_error(capsys, train_script.main(["--recipe", str(TINY_64), "--out", str(run), *args]), message)
    assert not run.exists()


def test_a_bad_world_in_a_recipe_and_make_data_are_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.toml"
    bad.write_text('[data]\nworld = "scenes-128"\n')
    one_line_error(capsys, train_script.main(["--recipe", str(bad), "--out", str(tmp_path / "run")]),
                   "world must be one of 'scenes-32', 'scenes-64', got 'scenes-128'")
    one_line_error(capsys, train_script.main(["--make-data", str(tmp_path / "data"), "--num-samples", "8",
                                              "--world", "scenes-64"]), "--make-data writes scenes-32's scenes only")
    assert not (tmp_path / "run").exists() and not (tmp_path / "data").exists()


def test_models_by_name_and_by_folder(tiny64_run, tmp_path, capsys):
    """`--model scenes-32` is the shipped folder, and `--model scenes-64` the shipped model of the 64-px world; a
    folder path works as before; a name not shipped is one line naming the shipped ones."""
    assert model_folder("scenes-32") == PRETRAINED and model_folder(None) == PRETRAINED
    assert model_label("scenes-32") == model_label(None)
    assert model_folder(str(tiny64_run / "pipeline")) == tiny64_run / "pipeline"
    out = tmp_path / "out"
    assert generate_script.main(["a red circle", "--model", "scenes-32", "--steps", "1", "--out", str(out),
                                 "--quiet"]) == 0
    (folder,) = out.iterdir()
    assert json.loads((folder / "meta.json").read_text())["model"] == "scenes-32"
    assert load_pipeline("scenes-64").world == "scenes-64"
    capsys.readouterr()
    line = one_line_error(capsys, evaluate_script.main(["--model", "scenes-99", "--out", str(tmp_path / "o3")]),
                          "model folder scenes-99 does not exist; the shipped models are scenes-32, ")
    assert "scenes-64" in line and "path of a pipeline folder" in line
    assert not (tmp_path / "o3").exists()


def test_generate_and_attend_warn_with_the_world_of_the_model(tiny64_run, tiny_pipeline_dir, tmp_path, capsys):
    pipeline = str(tiny64_run / "pipeline")
    out = tmp_path / "out"
    assert generate_script.main(["a red dog", "five circles", "--model", pipeline, "--steps", "1", "--out", str(out),
                                 "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "warning: unknown words ['dog']: this world knows the colours red, orange" in err
    assert "warning: counts above four ['five']" in err
    image = next(out.glob("a-red-dog*")) / "image_0.png"
    assert attend_script.main([str(image), "a small red dog", "--model", pipeline, "--out", str(tmp_path / "attend"),
                               "--quiet"]) == 0
    assert "note: unknown words ['dog']" in capsys.readouterr().err
    # a scenes-32 model still warns with the words its captions used
    assert generate_script.main(["a red dog", "--model", str(tiny_pipeline_dir), "--steps", "1", "--out",
                                 str(tmp_path / "out32"), "--quiet"]) == 0
    err = capsys.readouterr().err
    assert "never saw these words in training: ['dog']" in err and "this world knows" not in err


def test_evaluate_runs_the_world_evaluation_on_a_64_model(tiny64_run, tmp_path, capsys):
    out = tmp_path / "eval"
    assert evaluate_script.main(["--model", str(tiny64_run / "pipeline"), "--seeds", "1", "--steps", "1",
                                 "--dataset-images", "2", "--out", str(out), "--quiet"]) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["world"] == "scenes-64" and report["settings"]["prompts"] == 189
    pf = report["prompt_following"]
    assert set(pf["held_out"]) >= {"counting", "size_attr", "overall"} and 0 <= pf["overall"] <= 1
    assert report["maps_dataset"]["images"] == 2 and "numerals" in report["maps"]
    markdown = (out / "report.md").read_text()
    assert "| counting |" in markdown and "| size |" in markdown and "held out" in markdown
    assert "report: " in capsys.readouterr().out
    one_line_error(capsys, evaluate_script.main(["--model", str(tiny64_run / "pipeline"), "--relations-only",
                                                 "--out", str(tmp_path / "rel"), "--quiet"]),
                   "--relations-only measures scenes-32's prompts")
    assert not (tmp_path / "rel").exists()


def test_fresh_seeds_measure_a_64_model_on_other_noise(tiny64_run, tmp_path, capsys):
    """--fresh-seeds BASE on a scenes-64 model: its seven tasks, held-out prompts apart, sampled from BASE (the
    judged images record it), no maps; the same BASE gives the same report, --tasks (scenes-32's) is refused."""
    pipe = str(tiny64_run / "pipeline")
    reports = []
    for out in (tmp_path / "a", tmp_path / "b"):
        assert evaluate_script.main(["--model", pipe, "--fresh-seeds", "500", "--seeds", "1", "--steps", "1",
                                     "--out", str(out), "--quiet"]) == 0
        reports.append(json.loads((out / "report.json").read_text()))
    report = reports[0]
    assert report["world"] == "scenes-64" and report["settings"]["base_seed"] == 500
    assert "maps" not in report and report["settings"]["prompts"] == 189
    pf = report["prompt_following"]
    assert pf["judged"]["base_seed"] == 500 and sum(pf["n_images"].values()) == 189
    assert set(pf["held_out"]) >= {"counting", "size_attr", "overall"}
    assert reports[1]["prompt_following"]["judged"] == pf["judged"]
    markdown = (tmp_path / "a" / "report.md").read_text()
    assert "from seed 500" in markdown and "| counting |" in markdown and "Map accuracy" not in markdown
    assert "report: " in capsys.readouterr().out
    one_line_error(capsys, evaluate_script.main(["--model", pipe, "--fresh-seeds", "500", "--tasks", "colors",
                                                 "--out", str(tmp_path / "c"), "--quiet"]),
                   "--tasks measures scenes-32's prompts")
    one_line_error(capsys, evaluate_script.main(["--model", pipe, "--fresh-seeds", str(2**64 - 101), "--out",
                                                 str(tmp_path / "d"), "--quiet"]), "--fresh-seeds must be a seed")
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def test_fresh_seeds_judge_the_images_a_mapped_evaluation_samples_without_recording_maps(tiny64_run, monkeypatch):
    """Fresh seeds keep no maps, so they record none: the same images are judged the same as with the attention store
    attached (recording does not change sampling), and no store is built."""
    from crossattn.capture import AttentionStore
    from unet.eval import evaluate64
    pipe = load_pipeline(str(tiny64_run / "pipeline"))
    prompts = evaluate64.eval_prompts64()[:3]
    mapped, pairs = evaluate64.sample_and_judge(pipe, prompts, 1, 500, 2, 2.0)
    assert any(pairs.values())

    def no_store(*args, **kwargs):
        raise AssertionError("fresh seeds built an attention store")
    monkeypatch.setattr(AttentionStore, "for_pipeline", no_store)
    monkeypatch.setattr(evaluate64, "eval_prompts64", lambda: prompts)
    fresh = evaluate64.prompt_following64_on_fresh_seeds(pipe, 1, 500, 2, 2.0)
    assert fresh["prompt_following"]["judged"] == judged(mapped, 500)


def test_the_benchmark_compares_only_a_scenes_32_model_with_the_previous_architecture(tiny64_run, tiny_pipeline_dir):
    """The previous architecture is a 32-px model of scenes-32: side by side with a scenes-64 model its rows would
    compare two worlds. The other rows (fewer sampling steps, the model's own guidance) hold for any model."""
    from unet.cli.benchmark import table
    from unet.eval.benchmark import recipe_speed
    for folder, world in ((tiny64_run / "pipeline", "scenes-64"), (tiny_pipeline_dir, "scenes-32")):
        pipe = load_pipeline(folder, show_progress=False)
        speed = recipe_speed(pipe, steps=1, repeats=1, batch_size=2)
        assert ("training" in speed) == (world == "scenes-32"), world
        assert speed["dpm10_vs_ddim"]["seconds_dpm10"] > 0 and speed["own_guidance_vs_4"]["seconds_own"] > 0
        rows = table({"recipe": speed, "settings": {"sampling_steps": 1}, "block_vs_diffusers_fused": {},
                      "block_vs_diffusers_weights": {}, "capture_overhead": 1.0, "capture_bytes_by_steps": {},
                      "sampling_images_per_s": {}, "sampling": {"8": {"seconds": 1.0}}, "training_images_per_s": 1.0,
                      "unet_gflop_per_image_forward": 1.0, "sampling_gflops": 1.0, "matmul_peak_gflops": 1.0,
                      "fraction_of_matmul_peak": 1.0})
        assert ("previous architecture" in rows) == (world == "scenes-32") and "DPM-Solver++ 10 steps" in rows
