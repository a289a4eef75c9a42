"""The training recipe of the shipped model: v-prediction at zero terminal SNR, fresh scenes per step,
the grain measure and the scaling report."""

import json

import numpy as np
import pytest
import torch
from conftest import OLD_SCENES_32, tiny_config

from unet import make_scheduler
from unet.data import SceneSampler
from unet.eval.detect import detect
from unet.eval.prompts import background_grain
from unet.eval.scaling import best_row, wall_minutes, write_scaling
from unet.recipe import loss_weight, noise_scheduler
from unet.train import Trainer, resumed_config


@pytest.mark.parametrize("name", ["ddim", "ddpm", "dpm"])
def test_v_prediction_round_trip_recovers_x0(name):
    """Given the exact v target, the sampler's x0 estimate is the clean image -- at t = T too, where an
    epsilon model would have to divide by sqrt(alpha_bar) = 0."""
    train = noise_scheduler("v_prediction", zero_terminal_snr=True)
    assert float(train.alphas_cumprod[-1]) < 1e-6  # zero terminal SNR (float32 rounding)
    x0 = torch.rand(2, 3, 8, 8) * 2 - 1
    noise = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    sampler = make_scheduler(name, train.config)
    sampler.set_timesteps(5)
    for t in sampler.timesteps[:2]:
        if name == "dpm":  # DPM-Solver++ converts the model output to x0 before its update
            t_batch = torch.full((2,), int(t))
            v = train.get_velocity(x0, noise, t_batch)
            xt = train.add_noise(x0, noise, t_batch)
            sampler._step_index = list(sampler.timesteps).index(t)
            estimate = sampler.convert_model_output(v, sample=xt)
            tol = 1e-3 if int(t) == sampler.timesteps[0] else 1e-4
        else:
            t_batch = torch.full((2,), int(t))
            v = train.get_velocity(x0, noise, t_batch)
            xt = train.add_noise(x0, noise, t_batch)
            estimate = sampler.step(v, t, xt).pred_original_sample
            tol = 1e-4
        assert torch.allclose(estimate, x0, atol=tol), (name, int(t))


def test_epsilon_at_zero_snr_is_refused_and_weights():
    with pytest.raises(ValueError, match="zero_terminal_snr needs prediction_type 'v_prediction'"):
        tiny_config("unused", prediction_type="epsilon").validate()
    snr = torch.tensor([0.0, 1.0, 4.0, 100.0])
    v = loss_weight(snr, "v_prediction", 5.0)
    assert v[0] == 1 and v[1] == 1  # the pure-noise step keeps its full weight
    assert torch.allclose(v[3], torch.tensor(5 / 101))
    assert torch.equal(loss_weight(snr, "v_prediction", 0.0), torch.ones(4))


def test_fresh_batches_are_a_function_of_seed_and_step(tmp_path):
    a = Trainer(tiny_config(tmp_path / "a", num_samples=0))
    b = Trainer(tiny_config(tmp_path / "b", num_samples=0))
    (x1, c1, m1), (x2, c2, _) = a.batch(7), b.batch(7)
    assert torch.equal(x1, x2) and c1 == c2
    x3, c3, _ = a.batch(8)
    assert m1 is None  # masks only for a grounding loss
    assert not torch.equal(x1, x3)
    assert x1.shape == (4, 3, 16, 16) and x1.min() >= -1 and x1.max() <= 1


def test_data_workers_train_on_the_same_batches_and_a_resume_takes_its_own_count(tmp_path):
    """Batches drawn ahead in worker processes are the ones the loop draws itself (masks too), so the run is the
    same; the number of workers belongs to the call, not the run, like --max-minutes."""
    cfg = dict(steps=3, num_samples=0, grounding_weight=0.01)
    in_loop = Trainer(tiny_config(tmp_path / "a", **cfg)).train(progress=False)
    ahead = Trainer(tiny_config(tmp_path / "b", **cfg, data_workers=2))
    assert ahead.train(progress=False) == in_loop and ahead.prefetcher is None  # the workers are gone at the end
    saved = json.loads((tmp_path / "b" / "train_config.json").read_text())
    assert saved["data_workers"] == 2
    assert resumed_config(tiny_config(tmp_path / "b", steps=5, resume=True), saved).data_workers == 0
    with pytest.raises(ValueError, match="data_workers"):
        tiny_config(tmp_path / "c", data_workers=-1).validate()


def test_a_batch_the_workers_do_not_deliver_is_drawn_in_the_loop(tmp_path):
    """A worker killed with its batch (a signal to the whole process group) must not hang the run before it can
    save its checkpoint: past `wait_s` the loop draws the batch itself, the same batch."""
    from unet.train import BatchPrefetcher
    cfg = tiny_config(tmp_path / "a", steps=3, num_samples=0)
    trainer = Trainer(cfg)
    trainer.prefetcher = BatchPrefetcher(cfg, trainer.tokenizer, trainer.part, 1, wait_s=0.001)
    try:
        assert trainer.prefetcher.get(0) is None  # the worker is still starting: no wait at all
        trainer.prefetcher.started = True  # from now on a missing batch is one that never comes
        images, captions, _ = trainer.batch(1)  # not ready either: drawn here
        expected, expected_captions, _ = Trainer(tiny_config(tmp_path / "b", steps=3, num_samples=0)).batch(1)
        assert torch.equal(images, expected) and captions == expected_captions
    finally:
        trainer.prefetcher.close()


def test_fresh_scene_run_resumes_exactly(tmp_path):
    cfg = dict(steps=6, num_samples=0, checkpoint_every=3, batch_size=4)
    straight = Trainer(tiny_config(tmp_path / "a", **cfg))
    straight.train(progress=False)
    first = Trainer(tiny_config(tmp_path / "b", **{**cfg, "steps": 3}))
    first.train(progress=False)
    resumed = Trainer(tiny_config(tmp_path / "b", **cfg, resume=True))
    assert resumed.step == 3
    resumed.train(progress=False)
    for p, q in zip(straight.ema.parameters(), resumed.ema.parameters()):
        assert torch.allclose(p, q, atol=1e-5)
    words = json.loads((tmp_path / "b" / "pipeline" / "trained_words.json").read_text())
    assert {"red", "circle", "left", "above"} <= set(words)


def test_grain_zero_on_clean_scene_and_measured_on_noise():
    scene = SceneSampler(seed=2).pair()
    assert background_grain(scene.image, detect(scene.image)) == 0.0
    rng = np.random.default_rng(0)
    noisy = scene.image.astype(np.int16) + rng.integers(0, 11, scene.image.shape)  # uniform 0..10: mean 5
    noisy = noisy.clip(0, 255).astype(np.uint8)
    grain = background_grain(noisy, detect(scene.image))
    assert 4.5 < grain < 5.5
    assert background_grain(np.zeros((8, 8, 3), np.float32) + 0.5, []) == pytest.approx(127.5, abs=0.5)


def _row(step, overall, minutes=None):
    tasks = dict(single_object=0.5, two_object=0.5, colors=0.5, position=overall, color_attr=None)
    return dict(step=step, images=step * 32, minutes=minutes, **tasks, overall=overall, grain=1.5,
                shape_miou=0.4, shape_pointing=0.6)


def test_scaling_report_writer(tmp_path):
    rows = [_row(1000, 0.6, 20.0), _row(500, 0.4, 10.0), _row(1500, 0.55, 30.0)]
    assert best_row(rows)["step"] == 1000
    write_scaling(rows, tmp_path, "Scaling of test", "cpu (2 threads)")
    saved = json.loads((tmp_path / "scaling.json").read_text())
    assert [r["step"] for r in saved["rows"]] == [500, 1000, 1500] and saved["best_step"] == 1000
    table = (tmp_path / "scaling.md").read_text()
    assert "| 1000 | 32,000 | 20.0 |" in table and "**0.600**" in table and "| – |" in table
    assert (tmp_path / "scaling.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no snapshot rows"):
        write_scaling([], tmp_path, "x", "cpu")


def test_scaling_command_writes_its_report_when_every_row_is_cached(tiny_pipeline_dir, tmp_path):
    """Rerunning scaling.py over snapshots it has all evaluated rewrites the table from the cache, evaluating
    nothing (the cached row's made-up score could not come from an evaluation)."""
    import shutil

    from unet.cli import scaling
    run, out = tmp_path / "run", tmp_path / "report"
    shutil.copytree(tiny_pipeline_dir, run / "snapshots" / "step_001000")
    (run / "train_config.json").write_text(json.dumps({"batch_size": 32}))
    out.mkdir()
    (out / "scaling.json").write_text(json.dumps({"rows": [_row(1000, 0.123, 20.0)]}))
    assert scaling.main([str(run), "--out", str(out)]) == 0
    assert "**0.123**" in (out / "scaling.md").read_text()


def test_wall_minutes_adds_resumed_sessions(tmp_path):
    (tmp_path / "loss.csv").write_text("1,0.5,60.0\n2,0.4,120.0\n3,0.3,30.0\n4,0.2,90.0\n")
    assert wall_minutes(tmp_path, 2) == pytest.approx(2.0)
    assert wall_minutes(tmp_path, 4) == pytest.approx(3.5)  # 120 s in the first session + 90 s in the second
    assert wall_minutes(tmp_path, 9) is None


def test_ablation_text_sides(tmp_path):
    """The oracle resolves each object's side from the relation; the bidirectional encoder lets the first
    object's tokens see what follows, which CLIP's causal mask forbids."""
    from unet.research.text_variants import SIDE_IDS, BidirectionalText, token_roles
    from unet.train import build_components
    roles = token_roles("a red circle right of a blue square".split())
    assert roles[1] == (1, SIDE_IDS["right"]) and roles[7] == (2, SIDE_IDS["left"]) and roles[3] == (0, 0)
    assert token_roles("a green triangle on the top".split())[2] == (1, SIDE_IDS["top"])
    _, clip, _ = build_components(tiny_config(tmp_path), tmp_path)
    ids = torch.tensor([[1, 5, 6, 7, 2]])
    changed = ids.clone()
    changed[0, 3] = 9
    causal = [clip(x).last_hidden_state[0, 1] for x in (ids, changed)]
    both = [BidirectionalText(clip)(x).last_hidden_state[0, 1] for x in (ids, changed)]
    assert torch.allclose(*causal) and not torch.allclose(*both)



def test_guidance_interval(tiny_pipeline, tmp_path):
    """Guidance limited to t >= guidance_min_t: above every timestep it equals no guidance; the value travels
    with the saved pipeline."""
    def run(**kw):
        return tiny_pipeline("a red circle", num_inference_steps=3, output_type="pt", show_progress=False,
                             generator=torch.Generator().manual_seed(0), **kw).images
    assert torch.equal(run(guidance_scale=4.0, guidance_min_t=10_000), run(guidance_scale=1.0))
    assert torch.equal(run(guidance_scale=4.0, guidance_min_t=0), run(guidance_scale=4.0))
    assert not torch.equal(run(guidance_scale=4.0, guidance_min_t=500), run(guidance_scale=4.0))
    assert torch.equal(run(guidance_scale=4.0, guidance_rescale=0.0), run(guidance_scale=4.0))
    assert not torch.equal(run(guidance_scale=4.0, guidance_rescale=0.7), run(guidance_scale=4.0))
    assert torch.equal(run(guidance_scale=1.0, guidance_rescale=0.7), run(guidance_scale=1.0))  # nothing to rescale
    # guidance_max_t: below every timestep it equals no guidance, above every one it equals full guidance
    assert torch.equal(run(guidance_scale=4.0, guidance_max_t=-1), run(guidance_scale=1.0))
    assert torch.equal(run(guidance_scale=4.0, guidance_max_t=10_000), run(guidance_scale=4.0))
    assert not torch.equal(run(guidance_scale=4.0, guidance_max_t=500), run(guidance_scale=4.0))
    assert not torch.equal(run(guidance_scale=4.0, guidance_max_t=500), run(guidance_scale=1.0))
    tiny_pipeline.register_to_config(guidance_min_t=500, guidance_max_t=700)
    tiny_pipeline.save_pretrained(tmp_path)
    from unet import ScenePipeline
    loaded = ScenePipeline.from_pretrained(tmp_path)
    assert (loaded.config.guidance_min_t, loaded.config.guidance_max_t) == (500, 700)


def test_old_pipeline_folder_samples_unguided_and_unlimited(tmp_path):
    """The step-15,200 scenes-32 folder predates guidance_max_t: it loads with no upper limit and its own scale (1)."""
    from unet.pipeline import load_pipeline
    pipe = load_pipeline(OLD_SCENES_32)
    assert pipe.config.get("guidance_max_t") is None and pipe.config.guidance_scale == 1.0


def test_checkpoint_parts_round_trip(tmp_path):
    """A checkpoint split into committable parts joins back into the same tensors, and the run resumes."""

    from safetensors.torch import load_file

    from unet.cli import checkpoint_parts
    Trainer(tiny_config(tmp_path / "run", steps=2, checkpoint_every=1, num_samples=0)).train(progress=False)
    original = tmp_path / "run" / "checkpoint.safetensors"
    parts = checkpoint_parts.split(original, tmp_path / "parts", part_bytes=200_000)
    assert len(parts) > 1 and sum(p.stat().st_size for p in parts) >= original.stat().st_size * 0.9
    original.rename(tmp_path / "original.safetensors")
    assert checkpoint_parts.main(["join", str(tmp_path / "parts"), str(original)]) == 0
    a, b = load_file(str(tmp_path / "original.safetensors")), load_file(str(original))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert Trainer(tiny_config(tmp_path / "run", steps=3, num_samples=0, resume=True)).step == 2
    assert checkpoint_parts.main(["join", str(tmp_path / "parts"), str(original)]) == 2  # never overwrites


def test_saved_pipeline_keeps_vocab_and_merges(tiny_pipeline_dir):
    from transformers import CLIPTokenizer
    folder = tiny_pipeline_dir / "tokenizer"
    assert (folder / "vocab.json").exists() and (folder / "merges.txt").exists()
    slow = CLIPTokenizer(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    assert slow("a red circle").input_ids == CLIPTokenizer.from_pretrained(folder)("a red circle").input_ids


def test_single_share_sets_the_data_mix_and_old_runs_draw_the_same_batches():
    """--single-share 0 draws only pairs, 1 only single objects; the default is the mix every earlier run used."""
    from unet.data import SHAPES
    from unet.train import fresh_scenes
    from unet.train_config import DataConfig

    def objects(caption):
        return sum(w in SHAPES for w in caption.split())
    pairs = [s.caption for s in fresh_scenes(0, 7, 64, 32, single_share=0.0)]
    singles = [s.caption for s in fresh_scenes(0, 7, 64, 32, single_share=1.0)]
    assert {objects(c) for c in pairs} == {2} and {objects(c) for c in singles} == {1}
    old, new = fresh_scenes(0, 7, 16, 32), fresh_scenes(0, 7, 16, 32, single_share=DataConfig().single_share)
    assert all((a.image == b.image).all() and a.caption == b.caption for a, b in zip(old, new, strict=True))


def test_colourless_share_sets_which_pairs_name_no_colours_and_old_runs_draw_the_same_batches():
    """--colourless-share 1 captions every pair of two different shapes without colours, 0 none; pairs of one
    shape always name their colours (the words must tell the objects apart); the default is every earlier run's
    rule."""
    from unet.data import COLORS, SHAPES
    from unet.train import TrainConfig, fresh_scenes
    from unet.train_config import DataConfig

    def kinds(captions):  # (names a colour, two different shapes) per caption
        return {(any(w in COLORS for w in c.split()), len({w for w in c.split() if w in SHAPES}) == 2)
                for c in captions}
    none = [s.caption for s in fresh_scenes(0, 7, 96, 32, single_share=0.0, colourless_share=0.0)]
    every = [s.caption for s in fresh_scenes(0, 7, 96, 32, single_share=0.0, colourless_share=1.0)]
    assert kinds(none) == {(True, True), (True, False)}
    assert kinds(every) == {(False, True), (True, False)}
    old, new = fresh_scenes(0, 7, 64, 32), fresh_scenes(0, 7, 64, 32, colourless_share=DataConfig().colourless_share)
    assert all((a.image == b.image).all() and a.caption == b.caption for a, b in zip(old, new, strict=True))
    with pytest.raises(ValueError, match="colourless_share"):
        TrainConfig.from_flat(colourless_share=1.5).validate()


def test_and_order_reading_puts_the_first_named_object_first_as_read_and_changes_nothing_else():
    """--and-order reading: every "and" pair's first object is left of or above its second (under "any", some are
    right of or below it); every other scene, and every caption, is drawn exactly as before."""
    from unet.relations import first_as_read as centres_as_read
    from unet.train import TrainConfig, fresh_scenes
    from unet.train_config import DataConfig

    def first_as_read(scene):  # the first object left of the second, or above it, along their wider gap
        return centres_as_read(*(o.center for o in scene.objects))
    anyway = fresh_scenes(0, 7, 192, 32, single_share=0.0)
    reading = fresh_scenes(0, 7, 192, 32, single_share=0.0, and_order="reading")
    ands = [i for i, s in enumerate(anyway) if " and " in s.caption]
    assert len(ands) > 20
    assert all(first_as_read(reading[i]) for i in ands)
    assert not all(first_as_read(anyway[i]) for i in ands)
    assert [s.caption for s in anyway] == [s.caption for s in reading]
    assert all((anyway[i].image == reading[i].image).all() for i in range(len(anyway)) if i not in ands)
    assert DataConfig().and_order == "any"
    with pytest.raises(ValueError, match="and_order must be one of any, reading"):
        TrainConfig.from_flat(and_order="sideways").validate()


def test_levers_table_and_curves_from_evaluation_reports(tmp_path):
    from unet.research import levers

    def report(position, pointing, response=None, paired=False):
        pf = dict(single_object=1.0, two_object=0.75, colors=1.0, position=position, color_attr=0.5,
                  background_grain={"mean": 1.25})
        pf["overall"] = sum(pf[t] for t in ("single_object", "two_object", "colors", "position", "color_attr")) / 5
        if response is not None:  # a paired one wins over the unpaired, which reports before it have alone
            pf["relation_response_paired" if paired else "relation_response"] = {
                "horizontal": {"response": response, "images": 10}, "vertical": {"response": None, "images": 0}}
        return {"prompt_following": pf, "maps": {"shape_words": {"miou": 0.3, "pointing": pointing}},
                "settings": {"seeds": 8}}
    for name, r in (("a", report(0.4, 0.7)), ("b", report(0.5, 0.6, 0.25)), ("c", report(0.6, 0.65, 0.5, paired=True))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "report.json").write_text(json.dumps(r))
    out = tmp_path / "levers"
    assert levers.main([f"plain={tmp_path / 'a'}@100", f"pos={tmp_path / 'b'}@100", f"pos={tmp_path / 'c'}@200",
                        "--out", str(out)]) == 0
    table = (out / "levers.md").read_text()
    assert ("| pos | 200 | 1.000 | 0.750 | 1.000 | 0.600 | 0.500 | 0.770 | 1.25 | 0.300 / 0.650 | 0.50 / – | – |"
            in table)
    assert "| 0.25 / – u |" in table  # unpaired
    assert "| plain | 100 |" in table and "| – / – |" in table  # a report from before the relation response
    assert [r["step"] for r in json.loads((out / "levers.json").read_text())["rows"]] == [100, 100, 200]
    assert (out / "levers.png").read_bytes()[:4] == b"\x89PNG"
    assert levers.main(["plain=nowhere", "--out", str(out)]) == 2  # no @STEP
    assert levers.main([f"plain={tmp_path / 'missing'}@5", "--out", str(out)]) == 2
