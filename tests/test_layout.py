"""Layout response and key separation (unet/eval/layout.py): exact on models whose answer is known."""

import numpy as np
import pytest
import torch

from unet.eval.layout import COMBOS, POSITION_PAIRS, data_mean, key_separation, layout_prompt, layout_response
from unet.pipeline import make_scheduler
from unet.recipe import noise_scheduler

SIZE, SCENES = 16, 40


class Config(dict):
    __getattr__ = dict.__getitem__


class MeanImageUNet(torch.nn.Module):
    """Predicts v so that the x0 estimate is a fixed image per prompt: the data's own mean for that prompt's
    caption (`obey`), or for the pair's first word whatever the word (`ignore`)."""

    def __init__(self, scheduler, targets: torch.Tensor):
        super().__init__()
        self.config = Config(sample_size=SIZE, in_channels=3)
        self.alphas = scheduler.alphas_cumprod
        self.targets = targets  # (prompts, 3, H, W)

    def forward(self, x, t, encoder_hidden_states):
        x0 = self.targets[encoder_hidden_states[:, 0, 0].long()]  # the prompt index the fake encoder wrote
        a = self.alphas[int(t)]
        return (a.sqrt() * x - x0) / (1 - a).sqrt()  # x0 = sqrt(a) x - sqrt(1 - a) v


class FakePipe:
    def __init__(self, obey: bool):
        self.scheduler = make_scheduler("ddim", noise_scheduler().config)
        self.device = torch.device("cpu")
        self.prompts, targets = [], []
        for first, second, _, template in POSITION_PAIRS:
            for combo in COMBOS:
                for word in (first, second):
                    self.prompts.append(layout_prompt(template, combo, word))
                    targets.append(data_mean(template, combo, word if obey else first, SIZE, SIZE, SCENES))
        self.unet = MeanImageUNet(self.scheduler, torch.stack(targets))

    def encode_prompt(self, prompts):
        return torch.tensor([self.prompts.index(p) for p in prompts], dtype=torch.float32).view(-1, 1, 1)


@pytest.mark.parametrize("obey, expected", [(True, 1.0), (False, 0.0)])
def test_a_model_that_obeys_the_word_scores_1_and_one_that_ignores_it_0(obey, expected):
    result = layout_response(FakePipe(obey), draws=2, data_scenes=SCENES)
    assert result["timesteps"][0] == 999  # trailing spacing starts from pure noise
    for name, pair in result["pairs"].items():
        assert pair["data_shift"] > 3, name  # the data moves the first object a few pixels
        assert pair["response_per_step"] == pytest.approx([expected] * 3, abs=1e-4), name


def test_identical_keys_give_a_cosine_of_1(tiny_pipeline):
    result = key_separation(tiny_pipeline)
    layers = result["layers"]
    assert layers and all(v["color"]["pairs"] > 0 and v["shape"]["pairs"] > 0 for v in layers.values())
    assert all(v["color"]["max"] < 1 - 1e-4 for v in layers.values())  # a trained encoder's words differ
    assert result["largest_activation"] > 0

    encoder, forward = tiny_pipeline.text_encoder, tiny_pipeline.text_encoder.forward

    def same_everywhere(ids, **kwargs):  # every token gets one vector: the Keys cannot differ
        out = forward(ids, **kwargs)
        out.last_hidden_state = out.last_hidden_state[:, :1].expand_as(out.last_hidden_state)
        return out

    encoder.forward = same_everywhere
    result = key_separation(tiny_pipeline)
    same = result["layers"]
    assert result["text_output"]["color"]["mean"] == pytest.approx(1.0)  # merged before any Key is made
    for v in same.values():
        assert v["color"]["max"] == pytest.approx(1.0) and v["color"]["mean"] == pytest.approx(1.0)
        assert v["shape"]["mean"] == pytest.approx(1.0)


def test_training_logs_layout_without_touching_its_random_streams(tmp_path):
    import json

    from conftest import tiny_config

    from unet.eval.layout_log import LayoutLog
    from unet.eval.prompts import PAIRED_AXES
    from unet.train import Trainer

    plain = Trainer(tiny_config(tmp_path / "plain", steps=4))
    plain.train(progress=False)
    cfg = tiny_config(tmp_path / "logged", steps=4, layout_every=2, checkpoint_every=2)
    logged = Trainer(cfg, callbacks=[LayoutLog()])
    logged.train(progress=False)
    rows = [json.loads(line) for line in (tmp_path / "logged" / "layout.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2, 4]
    assert all(len(r["layout_response"]) == 4 and set(r["paired"]) == set(PAIRED_AXES) for r in rows)
    for p, q in zip(plain.ema.parameters(), logged.ema.parameters()):
        assert torch.equal(p, q)  # the measurements drew none of the training's random numbers
    # a resume from step 2 drops the rows logged after its checkpoint (and a line cut short by a crash)
    (tmp_path / "logged" / "layout.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 9')
    from unet.train import trim_log
    trim_log(tmp_path / "logged" / "layout.jsonl", 2)
    kept = [json.loads(line)["step"] for line in (tmp_path / "logged" / "layout.jsonl").read_text().splitlines()]
    assert kept == [2]


def test_word_merging_traces_two_words_through_the_encoder_to_its_output(tiny_pipeline):
    """scripts/diagnose.py words: one cosine per hidden state (embeddings, then each layer), and with nothing zeroed
    the output's cosine is the encoder's own output at the two words."""
    from crossattn.text import prompt_words
    from unet.research.diagnose import WORD_PROMPTS, word_merging
    result = word_merging(tiny_pipeline)
    assert len(result) == len(WORD_PROMPTS)
    layers = tiny_pipeline.text_encoder.config.num_hidden_layers
    prompt, first, second = WORD_PROMPTS[0]
    entry = result[f"{prompt}: {first}/{second}"]
    assert len(entry["cosine_per_layer"]) == layers + 1
    words = prompt_words(tiny_pipeline.tokenizer, prompt)
    i, j = (next(w.tokens[0] for w in words if w.text == name) for name in (first, second))
    ids = tiny_pipeline.tokenizer([prompt], padding="max_length", max_length=tiny_pipeline.tokenizer.model_max_length,
                                  return_tensors="pt").input_ids
    with torch.no_grad():
        out = tiny_pipeline.text_encoder(ids).last_hidden_state[0]
    assert entry["cosine_at_output"]["largest 0 dims zeroed"] == pytest.approx(
        float(torch.cosine_similarity(out[i], out[j], dim=0)), abs=1e-5)
    assert entry["cosine_at_output"]["largest 3 dims zeroed"] != entry["cosine_at_output"]["largest 0 dims zeroed"]
    assert set(entry["largest_activation_per_token"]) >= {"red@1", "blue@6"}


def test_two_object_diagnosis_samples_what_fresh_seeds_scores_and_sorts_its_misses(tiny_pipeline):
    """scripts/diagnose.py two-objects: image for image what `evaluate.py --fresh-seeds` samples (13 prompts: two
    batches, each with its own noise), one x0 estimate per step; misses sorted by what was drawn and whether
    both objects were ever shown."""
    from unet.eval.detect import detect
    from unet.eval.evaluate import generate_batches
    from unet.eval.prompts import check, eval_prompts
    from unet.research.diagnose import miss_kinds, objects_along_sampling
    tasks = ("two_object", "color_attr")
    records = objects_along_sampling(tiny_pipeline, tasks=tasks, seeds=2, base_seed=7, steps=3)
    prompts = [p for p in eval_prompts() if p.task in tasks]
    assert len(prompts) > 8  # more than one batch
    fresh, _ = generate_batches(tiny_pipeline, prompts, 2, 7, 3, 1.0)  # what --fresh-seeds samples
    assert [r["prompt"] for r in records] == [r["prompt"] for r in fresh]
    for mine, theirs in zip(records, fresh):
        assert np.array_equal(mine["image"], theirs["image"]) and mine["ok"] == theirs["ok"]
    last = records[-1]
    shown_at_end = sum(m is not None for m in check(prompts[-1], detect(last["image"]))[1])
    assert last["objects_shown"][-1] == shown_at_end  # the last x0 estimate is the image
    assert all(len(r["objects_shown"]) == len(r["objects_found"]) == 3 for r in records)
    assert all(0 <= s <= 2 and s <= f for r in records for s, f in zip(r["objects_shown"], r["objects_found"]))
    assert records[0]["asked"] == sorted(records[0]["prompt"].split()[1::3])  # "a circle and a square"

    def row(ok, shown, found, drawn):
        return {"task": "two_object", "ok": ok, "objects_shown": shown, "objects_found": found,
                "asked": ["circle", "square"], "drawn": drawn}
    summary = miss_kinds([row(True, [0, 2, 2], [1, 2, 2], ["circle", "square"]),
                          row(False, [0, 1, 1], [1, 1, 1], ["circle"]),
                          row(False, [1, 2, 1], [1, 2, 1], ["square"]),
                          row(False, [2, 1, 1], [2, 2, 2], ["square", "square"])])["two_object"]
    assert summary["right"] == 1 and summary["images"] == 4
    assert summary["misses"] == {"one or none drawn; never both shown": 1,
                                 "one or none drawn; both shown right at some step": 1,
                                 "two or more drawn, a shape or colour wrong; both shown right at some step": 1}
    assert summary["first step showing both (from 1), right images"] == {2: 1}
    assert summary["misses drawing two or more objects of one shape"] == 1
    assert summary["misses by what was drawn"] == {"asked circle + square, drawn circle": 1,
                                                   "asked circle + square, drawn square": 1,
                                                   "asked circle + square, drawn square + square": 1}


def test_the_overlap_pass_samples_the_same_images_and_reads_one_overlap_per_step(tiny_pipeline):
    """diagnose.py two-objects' second pass: the same images right or wrong as the first, one overlap in [0, 1] per
    step, summarised per band of steps for right images, wrong ones and those that draw one shape twice."""
    from unet.eval.evaluate import generate_batches
    from unet.eval.prompts import eval_prompts
    from unet.research.diagnose import object_map_overlap, overlap_summary
    tasks = ("two_object", "color_attr")
    second = object_map_overlap(tiny_pipeline, tasks=tasks, seeds=2, base_seed=7, steps=3)
    fresh, _ = generate_batches(tiny_pipeline, [p for p in eval_prompts() if p.task in tasks], 2, 7, 3, 1.0)
    assert [(r["prompt"], r["ok"]) for r in second] == [(r["prompt"], r["ok"]) for r in fresh]
    assert all(len(r["overlap"]) == 3 and all(0 <= v <= 1 + 1e-4 for v in r["overlap"]) for r in second)

    def summary_of(overlaps, ok):
        rows = [{"task": "two_object", "ok": k, "drawn": ["circle", "circle"] if not k else ["circle", "square"],
                 "overlap": o} for o, k in zip(overlaps, ok)]
        return overlap_summary(rows)["two_object"]
    summary = summary_of([[0.5] * 5 + [0.2] * 20, [0.9] * 25], [True, False])
    assert summary["right"] == {"steps 1-5": 0.5, "steps 6-12": 0.2, "steps 13-25": 0.2, "images": 1}
    assert summary["one shape drawn twice"]["steps 1-5"] == 0.9 == summary["wrong"]["steps 13-25"]


def test_text_routes_replace_the_padding_or_the_pooled_text_with_the_empty_prompts_and_put_them_back(tiny_pipeline):
    import pytest
    import torch

    from unet.cli import UsageError
    from unet.research.diagnose import text_route_replaced
    pipe, prompt = tiny_pipeline, "a red circle"
    real, empty = pipe.encode_prompt([prompt]), pipe.encode_prompt([""])
    end = len(pipe.tokenizer(prompt).input_ids) - 1  # start, words, end
    with text_route_replaced(pipe, "padding of the empty prompt"):
        replaced = pipe.encode_prompt([prompt])
    assert torch.equal(replaced[0, :end + 1], real[0, :end + 1])  # the words and the end token as they were
    assert torch.equal(replaced[0, end + 1:], empty[0, end + 1:]) and not torch.equal(replaced, real)
    assert "encode_prompt" not in pipe.__dict__ and torch.equal(pipe.encode_prompt([prompt]), real)
    if pipe.unet.pooled_text_proj is None:
        with pytest.raises(UsageError, match="no pooled text"):
            with text_route_replaced(pipe, "pooled text of the empty prompt"):
                pass
        pipe.unet.pooled_text_proj = torch.nn.Linear(real.shape[-1], 8)  # as a model trained with --pooled-text
    proj = pipe.unet.pooled_text_proj
    with text_route_replaced(pipe, "pooled text of the empty prompt"):
        a, b = pipe.unet.pooled_text_proj(real[:, -1]), pipe.unet.pooled_text_proj(torch.randn_like(real[:, -1]))
    assert torch.equal(a, b) and torch.equal(a, proj(empty[:, -1]))  # the empty prompt's, whatever the prompt
    assert pipe.unet.pooled_text_proj is proj


def test_the_second_object_blind_route_changes_only_what_reads_the_second_object(tiny_pipeline):
    import torch

    from crossattn.text import prompt_words
    from unet.research.diagnose import second_object_blind_mask, text_route_replaced
    pipe, prompts = tiny_pipeline, ["a circle and a square", "a red circle"]
    words = {w.text + str(w.index): w.tokens[0] for w in prompt_words(pipe.tokenizer, prompts[0])}
    mask = second_object_blind_mask(pipe.tokenizer, prompts)[:, 0]  # (B, T, T)
    blocked = (mask < 0) & torch.ones_like(mask).tril().bool()  # what the causal mask alone would allow
    assert blocked[1].sum() == 0  # one shape: the causal mask alone
    rows, cols = blocked[0].nonzero().T
    assert set(rows.tolist()) == {words["a3"], words["square4"]}
    assert set(cols.tolist()) == {words["a0"], words["circle1"]}
    real = pipe.encode_prompt(prompts)
    with text_route_replaced(pipe, "second object blind to the first"):
        blind = pipe.encode_prompt(prompts)
    assert torch.equal(blind[1], real[1])  # one object: nothing to hide
    assert torch.equal(blind[0, :words["a3"]], real[0, :words["a3"]])  # up to "and", as trained
    assert not torch.allclose(blind[0, words["square4"]], real[0, words["square4"]])
    assert torch.equal(pipe.encode_prompt(prompts), real)  # put back


def test_object_regions_label_the_two_largest_objects_and_the_wall_cuts_only_between_them():
    import numpy as np
    import torch

    from unet.data import COLORS
    from unet.eval.detect import detect
    from unet.research.diagnose import SelfAttentionBetweenObjects, object_regions
    image = np.zeros((16, 16, 3), dtype=np.uint8)
    image[1:7, 1:7] = COLORS["red"]  # 36 pixels: the larger object, label 1
    image[10:14, 10:14] = COLORS["blue"]  # 16 pixels, label 2
    assert object_regions(image[:8, :8]).max() == 0  # one object: no wall
    labels = object_regions(image, grow=1)
    assert (labels == 1).sum() == 8 * 8 and labels[0, 0] == 1 and labels[3, 3] == 1
    assert (labels == 2).sum() == 6 * 6 and labels[12, 12] == 2 and labels[8, 8] == 0
    found = detect(image)
    assert np.array_equal(object_regions(image, grow=1, found=found), labels)  # the detector's objects reused
    assert object_regions(image, found=found[:1]).max() == 0  # what is passed is what counts
    regions = torch.zeros(1, 4, 4, dtype=torch.long)  # a 2x2 token grid after pooling: token 0 object 1, 3 object 2
    regions[0, :2, :2], regions[0, 2:, 2:] = 1, 2
    weights = torch.full((1, 2, 4, 4), 0.25)  # (B, heads, N, N)
    wall = SelfAttentionBetweenObjects(regions)
    walled = wall.weights(None, "mid", False, 0.0, weights, weights)
    assert torch.allclose(walled.sum(-1), torch.ones(1, 2, 4))
    assert walled[0, :, 0, 3].eq(0).all() and walled[0, :, 3, 0].eq(0).all()
    assert torch.allclose(walled[0, :, 0, :3], torch.full((2, 3), 1 / 3))  # the rest of the row, renormalised
    assert torch.equal(walled[0, :, 1], weights[0, :, 1])  # background reads everything, as the model computed
    boosted = SelfAttentionBetweenObjects(regions, factor=3.0).weights(None, "mid", False, 0.0, weights, weights)
    assert torch.allclose(boosted[0, :, 0], torch.tensor([0.5, 0.5, 0.5, 1.5]).expand(2, 4) / 3.0)
    cross = torch.rand(1, 2, 4, 7)
    assert wall.weights(None, "mid", True, 0.0, cross, cross) is cross
    late = SelfAttentionBetweenObjects(regions, begin=0.3)
    late.start()  # the hook every recipe gets when a run begins
    assert late.weights(None, "mid", False, 0.1, weights, weights) is weights
    assert SelfAttentionBetweenObjects(regions, end=0.3).weights(None, "mid", False, 0.3, weights, weights) is weights


def test_diagnose_keeps_an_earlier_result_unless_told_to_overwrite_it(tmp_path, capsys):
    from unet.research import diagnose
    (tmp_path / "two-objects.json").write_text("an earlier diagnosis")
    assert diagnose.main(["two-objects", "--out", str(tmp_path), "--model", str(tmp_path / "none")]) == 2
    assert "already holds two-objects.json; pass --overwrite" in capsys.readouterr().err
    assert (tmp_path / "two-objects.json").read_text() == "an earlier diagnosis"


def test_diagnose_refuses_a_seed_count_below_one_before_loading_a_model(tmp_path, capsys):
    from unet.research import diagnose
    assert diagnose.main(["two-objects", "--out", str(tmp_path / "d"), "--seeds", "0"]) == 2
    assert "--seeds must be a positive integer, got 0" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
