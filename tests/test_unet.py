import numpy as np
import pytest
import torch
from conftest import tiny_config

from unet import ScenePipeline, UNet, make_scheduler
from unet.data import COLORS, HELD_OUT_PAIRS, SHAPES, SceneDataset, SceneSampler
from unet.eval.detect import detect
from unet.relations import relative_position
from unet.train import Trainer


def test_scenes_are_deterministic_and_masks_match_captions():
    a, b = SceneSampler(seed=3), SceneSampler(seed=3)
    for _ in range(50):
        sa, sb = a(), b()
        assert sa.caption == sb.caption and np.array_equal(sa.image, sb.image)
        words = sa.caption.split()
        for i, obj in sa.word_objects.items():
            assert words[i] in (sa.objects[obj].color, sa.objects[obj].shape)
        for obj in sa.objects:
            assert obj.mask.sum() > 0
            pixels = sa.image[obj.mask].astype(float)
            assert np.abs(pixels.mean(0) - COLORS[obj.color]).max() < 40  # the mask covers that colour
        if sa.relation:
            found = detect(sa.image)
            first, second = (max(found, key=lambda d: (d.mask & o.mask).sum()) for o in sa.objects)
            assert sa.relation in relative_position(first, second)


def test_held_out_pairs_never_in_training_split():
    sampler = SceneSampler(seed=0, split="train")
    for _ in range(300):
        s = sampler.pair()
        combo = (s.objects[0].color, s.objects[0].shape, s.objects[1].color, s.objects[1].shape)
        assert combo not in HELD_OUT_PAIRS
    singles = SceneSampler(1)
    assert {singles.single().objects[0].shape for _ in range(60)} == set(SHAPES)


def test_dataset_save_load_round_trip(tmp_path):
    ds = SceneDataset.generate(10, seed=1, height=16, width=16)
    ds.save(tmp_path)
    back = SceneDataset.load(tmp_path)
    assert torch.equal(back.images, ds.images) and back.captions == ds.captions
    with pytest.raises(FileNotFoundError, match="images.safetensors"):
        SceneDataset.load(tmp_path / "missing")


def test_model_save_load_round_trip_identical(tmp_path):
    model = UNet(channels=(8, 16), cross_attention=(True, True), self_attention=(False, True), context_dim=16,
                 heads=2, sample_size=16).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    model.save_pretrained(tmp_path)
    assert (tmp_path / "diffusion_pytorch_model.safetensors").exists()
    loaded = UNet.from_pretrained(tmp_path).eval()
    x, ctx = torch.randn(2, 3, 16, 16), torch.randn(2, 5, 16)
    assert torch.equal(model(x, 10, ctx), loaded(x, 10, ctx))
    with pytest.raises(ValueError, match="multiples of 2"):
        model(torch.randn(1, 3, 15, 16), 10, ctx[:1])


def test_pipeline_deterministic_by_seed_and_round_trip(tiny_pipeline, tmp_path):
    def run(pipe, seed):
        return pipe(["a red circle", "a blue square"], num_inference_steps=3, output_type="pt", show_progress=False,
                    generator=torch.Generator().manual_seed(seed)).images
    a, b, c = run(tiny_pipeline, 0), run(tiny_pipeline, 0), run(tiny_pipeline, 1)
    assert torch.equal(a, b) and not torch.equal(a, c)
    tiny_pipeline.save_pretrained(tmp_path)
    assert torch.equal(run(ScenePipeline.from_pretrained(tmp_path), 0), a)
    images = tiny_pipeline("a red circle", num_inference_steps=2, show_progress=False).images
    assert images[0].size == (16, 16)
    with pytest.raises(ValueError, match="output_type"):
        tiny_pipeline("a red circle", output_type="jpg")


def test_schedulers_swap_and_unknown_name(tiny_pipeline):
    for name in ("ddim", "dpm", "ddpm"):
        tiny_pipeline.scheduler = make_scheduler(name, tiny_pipeline.scheduler.config)
        out = tiny_pipeline("a red circle", num_inference_steps=3, output_type="np", show_progress=False).images
        assert np.isfinite(out).all()
    with pytest.raises(ValueError, match="unknown scheduler 'euler'; choose one of"):
        make_scheduler("euler", tiny_pipeline.scheduler.config)


def test_training_lowers_loss_and_resume_continues_exactly(tmp_path):
    cfg = dict(steps=20, num_samples=64, batch_size=8, checkpoint_every=10, lr=2e-3, warmup=2)
    straight = Trainer(tiny_config(tmp_path / "a", **cfg))
    losses = straight.train(progress=False)
    assert np.mean(losses[-5:]) < np.mean(losses[:5])

    # interrupted after step 10 as by Ctrl-C: the checkpoint is saved on the way out
    first = Trainer(tiny_config(tmp_path / "b", **cfg))
    real_update = first.update_ema

    def update_then_interrupt():
        real_update()
        if first.step == 10:
            raise KeyboardInterrupt

    first.update_ema = update_then_interrupt
    with pytest.raises(KeyboardInterrupt):
        first.train(progress=False)
    resumed = Trainer(tiny_config(tmp_path / "b", **cfg, resume=True))
    assert resumed.step == 10
    rest = resumed.train(progress=False)
    assert len(rest) == 10 and resumed.step == 20
    for p, q in zip(straight.unet.parameters(), resumed.unet.parameters()):
        assert torch.allclose(p, q, atol=1e-5)  # the same run as if never interrupted
    assert (tmp_path / "b" / "pipeline" / "model_index.json").exists()
    assert (tmp_path / "b" / "loss_curve.png").stat().st_size > 0


def test_training_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError, match="data folder .* does not exist"):
        Trainer(tiny_config(tmp_path / "x", data=str(tmp_path / "nowhere")))
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        Trainer(tiny_config(tmp_path / "x", steps=-5))
    with pytest.raises(FileNotFoundError, match="--resume .*checkpoint.safetensors does not exist"):
        Trainer(tiny_config(tmp_path / "x", resume=True))
    run = tmp_path / "run"
    Trainer(tiny_config(run, steps=2, checkpoint_every=1)).train(progress=False)
    with pytest.raises(FileExistsError, match="pass --resume"):
        Trainer(tiny_config(run))
    (run / "checkpoint.safetensors").write_bytes(b"\x80\x04pickle-not-safetensors")
    with pytest.raises(ValueError, match="not a readable safetensors checkpoint"):
        Trainer(tiny_config(run, resume=True))


def test_train_script_exit_code_2(tmp_path, capsys):
    from unet.cli import train
    assert train.main(["--out", str(tmp_path / "r"), "--steps", "-1"]) == 2
    assert "steps must be a positive integer" in capsys.readouterr().err


def test_frozen_local_clip_text_encoder(tmp_path):
    """--clip PATH: a CLIP folder on disk is used as it is and stays frozen."""
    from crossattn.text import new_text_encoder, save_vocabulary
    from unet.data import SCENE_WORDS
    clip = tmp_path / "clip"
    tokenizer = save_vocabulary(SCENE_WORDS, clip, max_length=16)
    encoder = new_text_encoder(tokenizer, hidden_size=16, layers=1, heads=2, intermediate_size=32)
    encoder.save_pretrained(clip)
    before = {k: v.clone() for k, v in encoder.state_dict().items()}
    trainer = Trainer(tiny_config(tmp_path / "run", steps=3, clip=str(clip)))
    trainer.train(progress=False)
    after = trainer.accelerator.unwrap_model(trainer.text_encoder).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert trainer.unet.config.context_dim == 16
