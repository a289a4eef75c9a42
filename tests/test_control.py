"""Steering: re-weighting, prompt-to-prompt replay, attend-and-excite, on tiny models."""

import pytest
import torch
from diffusers import UNet2DConditionModel

from crossattn.capture import AttentionStore
from crossattn.control import (
    Controller,
    Edit,
    Excite,
    Reweight,
    align_prompts,
    gaussian_smooth,
    parse_weights,
    word_positions,
)
from crossattn.text import prompt_words

PROMPT = "a red circle left of a blue square"


def run(pipe, prompt=PROMPT, controller=None, store=None, steps=4, seed=0, images=1):
    return pipe(prompt, num_inference_steps=steps, guidance_scale=3.0, generator=torch.Generator().manual_seed(seed),
                num_images_per_prompt=images, output_type="pt", controller=controller,
                show_progress=False).images


def positions(pipe, prompt, *names):
    found = word_positions(prompt_words(pipe.tokenizer, prompt), list(names), "test")
    return [found[n] for n in names]


def test_reweight_by_one_changes_nothing_and_other_factors_do(tiny_pipeline):
    (red,) = positions(tiny_pipeline, PROMPT, "red")
    default = run(tiny_pipeline)  # fused kernel: no store, no controller
    results = {}
    for factor in (None, 1.0, 4.0):
        store = AttentionStore()
        controller = None if factor is None else Controller(Reweight({p: factor for p in red}))
        with store.attach(tiny_pipeline.unet):
            if controller is None:
                images = run(tiny_pipeline, store=store)
            else:
                with controller.attach(tiny_pipeline.unet):
                    images = run(tiny_pipeline, controller=controller, store=store)
        results[factor] = images, store
    (plain, plain_store), (same, same_store), (up, up_store) = results[None], results[1.0], results[4.0]
    assert torch.equal(plain, same)  # bit-identical images
    assert plain_store.sums.keys() == same_store.sums.keys()
    assert all(torch.equal(plain_store.sums[k], same_store.sums[k]) for k in plain_store.sums)  # and maps
    assert not torch.equal(plain, up)
    key = next(iter(plain_store.sums))
    assert up_store.sums[key][..., red].mean() > plain_store.sums[key][..., red].mean()
    assert torch.equal(run(tiny_pipeline), default)  # detached: the fused default path again
    assert torch.allclose(default, plain, atol=1e-5)


def test_reweight_respects_layers_and_steps(tiny_pipeline):
    (red,) = positions(tiny_pipeline, PROMPT, "red")
    plain = run(tiny_pipeline)
    never = Controller(Reweight({p: 5.0 for p in red}, steps=(1.0, 1.0)))
    with never.attach(tiny_pipeline.unet):
        assert torch.allclose(run(tiny_pipeline, controller=never), plain, atol=1e-5)
    with pytest.raises(ValueError, match="no cross-attention layer named"):
        Controller(Reweight({1: 2.0}, layers=["nope"])).attach(tiny_pipeline.unet)
    assert torch.equal(run(tiny_pipeline), plain)  # the failed attach left nothing behind
    with pytest.raises(ValueError, match="finite"):
        Reweight({1: float("nan")})


def test_replaying_own_attention_reproduces_images(tiny_pipeline):
    recorder = Controller(record=True)
    with recorder.attach(tiny_pipeline.unet):
        source = run(tiny_pipeline, controller=recorder, images=2)
    assert recorder.recording.weights and len(recorder.recording.latents) == 4
    assert torch.allclose(source, run(tiny_pipeline, images=2), atol=1e-5)  # recording does not change the images
    own = align_prompts(tiny_pipeline.tokenizer, PROMPT, PROMPT)
    replay = Controller(edit=Edit(recorder.recording, own, cross_replace_steps=1.0, self_replace_steps=1.0,
                                  local_blend=False))
    with replay.attach(tiny_pipeline.unet):
        again = run(tiny_pipeline, controller=replay, images=2)
    assert torch.equal(again, source)


def test_word_swap_replays_the_source_layout(tiny_pipeline):
    edited = PROMPT.replace("circle", "triangle")
    recorder = Controller(record=True)
    with recorder.attach(tiny_pipeline.unet):
        source = run(tiny_pipeline, controller=recorder)
    alignment = align_prompts(tiny_pipeline.tokenizer, PROMPT, edited)
    store = AttentionStore()
    controller = Controller(edit=Edit(recorder.recording, alignment, cross_replace_steps=1.0, self_replace_steps=0.0))
    with store.attach(tiny_pipeline.unet), controller.attach(tiny_pipeline.unet):
        swapped = run(tiny_pipeline, edited, controller=controller, store=store)
    assert not torch.equal(swapped, source)  # the new word's Values change the image
    # the maps the edited prompt used are the source's: "triangle" attends where "circle" did
    (circle,), (triangle,) = positions(tiny_pipeline, PROMPT, "circle"), positions(tiny_pipeline, edited, "triangle")
    layer, window = next(iter(store.sums))
    recorded = sum(w for (name, _), w in recorder.recording.weights.items() if name == layer)
    used = store.sums[(layer, window)]
    assert used.shape == recorded.shape
    assert torch.allclose(used[..., triangle].sum() / store.counts[(layer, window)],
                          recorded[..., circle].sum() / 4, rtol=0.5)  # same order: one window vs all steps

    blend = Controller(edit=Edit(recorder.recording, alignment, local_blend=True, blend_threshold=0.0))
    with blend.attach(tiny_pipeline.unet):
        blended = run(tiny_pipeline, edited, controller=blend)
    assert blended.shape == source.shape and torch.isfinite(blended).all()
    keep_all = Controller(edit=Edit(recorder.recording, alignment, local_blend=True, blend_threshold=1.0))
    with keep_all.attach(tiny_pipeline.unet):
        kept = run(tiny_pipeline, edited, controller=keep_all)  # mask empty: the source latent after every step
    assert torch.allclose(kept, source, atol=1e-6)


def test_align_prompts_swap_refine_and_refusal(tiny_pipeline):
    tok = tiny_pipeline.tokenizer
    swap = align_prompts(tok, "a red circle", "a red square")
    assert swap.kind == "swap" and swap.changed == [("circle", "square")] and swap.taken.all()
    assert swap.matrix[3, 3] == 1 and swap.matrix[:, 3].sum() == 1  # square's map is circle's
    refine = align_prompts(tok, "a circle", "a red circle")
    assert refine.kind == "refine" and refine.changed == [("", "red")]
    assert refine.taken[2] == 0 and refine.taken[3] == 1 and refine.matrix[2, 3] == 1  # circle <- circle
    assert refine.matrix[3, 4] == 1  # end token <- end token
    with pytest.raises(ValueError, match=r"cannot align.*\['blue'\] are missing"):
        align_prompts(tok, "a blue circle", "a red big circle")
    with pytest.raises(ValueError, match="out of order"):
        align_prompts(tok, "a red circle", "a circle and red")


def test_parse_weights_and_word_positions(tiny_pipeline):
    assert parse_weights(["red=2", "blue=-0.5"]) == {"red": 2.0, "blue": -0.5}
    for bad in ("red", "red=", "red=x", "red=inf", "red=nan", "=2"):
        with pytest.raises(ValueError, match="WORD=NUMBER"):
            parse_weights([bad])
    words = prompt_words(tiny_pipeline.tokenizer, "a red circle and a red square")
    assert word_positions(words, ["red"], "--reweight") == {"red": [2, 6]}
    with pytest.raises(ValueError, match=r"--excite: \['cat'\] not in the prompt"):
        word_positions(words, ["cat"], "--excite")


def test_gaussian_smooth_keeps_mass_and_size():
    maps = torch.zeros(1, 6, 6)
    maps[0, 3, 3] = 1.0
    smooth = gaussian_smooth(maps)
    assert smooth.shape == maps.shape and torch.isclose(smooth.sum(), torch.tensor(1.0))
    assert smooth[0, 3, 3] < 1 and smooth[0, 3, 4] > 0


def excite_for(pipe, prompt, *subjects, **kw):
    words = prompt_words(pipe.tokenizer, prompt)
    return Excite(positions(pipe, prompt, *subjects), text_end=words[-1].tokens[-1] + 1, **kw)


def test_excite_raises_the_weakest_subjects_maximum_attention(tiny_pipeline):
    prompt = "a red circle and a blue square"
    controller = Controller(excite=excite_for(tiny_pipeline, prompt, "circle", "square"))  # the paper's settings
    context = tiny_pipeline.encode_prompt([prompt] * 2)  # (2, T, D): two images, no guidance
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    tiny_pipeline.scheduler.set_timesteps(4)
    t = tiny_pipeline.scheduler.timesteps[0]
    with controller.attach(tiny_pipeline.unet):
        before = controller.subject_max_attention(tiny_pipeline, t, x, context).min(dim=1).values
        moved = controller.before_step(tiny_pipeline, t, x, context)
        after = controller.subject_max_attention(tiny_pipeline, t, moved, context).min(dim=1).values
    assert not torch.equal(moved, x)
    assert (after > before + 1e-4).all(), (before, after)
    (entry,) = controller.excite_log
    assert entry["step"] == 0 and entry["weakest_before"] == pytest.approx(before.tolist())


def test_excite_in_the_pipeline_keeps_the_store_clean(tiny_pipeline):
    prompt = "a red circle and a blue square"
    store = AttentionStore()
    controller = Controller(excite=excite_for(tiny_pipeline, prompt, "circle", "square"))
    with store.attach(tiny_pipeline.unet), controller.attach(tiny_pipeline.unet):
        controlled = run(tiny_pipeline, prompt, controller=controller, store=store, steps=5)
    assert [e["step"] for e in controller.excite_log] == [0, 1, 2]  # the first half of 5 steps, rounded
    assert sum(store.counts.values()) == 5 * len(store.layers)  # the gradient passes were not recorded
    assert all(s.shape[0] == 1 for s in store.sums.values())
    assert not torch.equal(controlled, run(tiny_pipeline, prompt, steps=5))
    sched = excite_for(tiny_pipeline, prompt, "circle").schedule(50)
    assert sched[0] == 25 and sched[1] == {0: 0.05, 10: 0.5, 20: 0.8}  # the paper's schedule at 50 steps
    assert sched[2][0] == pytest.approx(20.0) and sched[2][-1] == pytest.approx(20 * 0.5 ** 0.5)


def tiny_unet():
    torch.manual_seed(0)
    return UNet2DConditionModel(
        block_out_channels=(8, 16), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16, attention_head_dim=4, norm_num_groups=4)


def test_control_processors_on_a_diffusers_unet(tiny_pipeline):
    unet = tiny_unet()
    x = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(1))
    context = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(2))
    t = torch.tensor(500)

    def forward():
        with torch.no_grad():
            return unet(x, t, encoder_hidden_states=context).sample

    default = forward()
    results = {}
    for name, controller in {"off": Controller(), "one": Controller(Reweight({2: 1.0})),
                             "up": Controller(Reweight({2: 4.0})), "record": Controller(record=True)}.items():
        with controller.attach(unet):
            results[name] = forward()
        if name == "record":
            recording = controller.recording
    assert torch.allclose(results["off"], default, atol=1e-5)  # switched off: the default output
    assert torch.equal(results["one"], results["off"])
    assert not torch.allclose(results["up"], default, atol=1e-3)
    assert torch.equal(forward(), default)  # detached: the default processors again
    assert any(k[0].endswith("attn2") for k in recording.weights)

    identity = align_prompts(tiny_pipeline.tokenizer, "a red circle", "a red circle")
    identity.matrix, identity.taken = identity.matrix[:6, :6], identity.taken[:6]  # this context has 6 tokens
    replay = Controller(edit=Edit(recording, identity, cross_replace_steps=1.0, self_replace_steps=1.0))
    with replay.attach(unet):
        assert torch.equal(forward(), results["record"])

    store = AttentionStore()  # a store attached first keeps recording what the controller lets through
    with store.attach(unet), Controller(Reweight({2: 4.0})).attach(unet):
        assert torch.allclose(forward(), results["up"], atol=1e-6)
    assert store.layers and all(n.endswith("attn2") for n in store.layers)


def cli(tiny_pipeline_dir, out, *args):
    from unet.cli.generate import main
    return main([*args, "--model", str(tiny_pipeline_dir), "--out", str(out), "--steps", "3", "--quiet"])


def test_cli_writes_plain_and_controlled_side_by_side(tiny_pipeline_dir, tmp_path, capsys):
    import json

    from PIL import Image
    from safetensors.torch import load_file
    rc = cli(tiny_pipeline_dir, tmp_path, "a red circle left of a blue square", "--reweight", "red=2", "--excite",
             "--edit", "a red square left of a blue square", "--local-blend", "--num-images", "2")
    assert rc == 0, capsys.readouterr().err
    (folder,) = list(tmp_path.iterdir())
    meta = json.loads((folder / "meta.json").read_text())
    control = meta["control"]
    assert meta["prompt"] == "a red circle left of a blue square"  # the plain run is untouched
    assert control["prompt"] == "a red square left of a blue square" and control["reweight"] == {"red": 2.0}
    assert control["excite"] == ["square"] and control["excite_log"][0]["step"] == 0  # the object words
    assert control["local_blend"] and control["cross_replace_steps"] == 0.8
    assert control["timings"]["sampling_s"] > 0 and control["timings"]["record_source_s"] > 0
    assert control["images"] == ["controlled/image_0.png", "controlled/image_1.png"]
    assert all((folder / name).exists() for name in control["images"])
    assert load_file(str(folder / "controlled" / "maps.safetensors"))["2_square"].shape == (2, 16, 16)
    plain, controlled = Image.open(folder / "overlay.png"), Image.open(folder / "controlled" / "overlay.png")
    assert Image.open(folder / "compare.png").width > plain.width + controlled.width - 100  # side by side
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]
    assert str(folder / "compare.png") in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [
    (["a red circle", "--reweight", "blue=2"], "--reweight: ['blue'] not in the prompt"),
    (["a red circle", "--reweight", "red=nan"], "'red=nan': expected WORD=NUMBER with a finite number"),
    (["a red circle", "--reweight", "red=lots"], "expected WORD=NUMBER"),
    (["a red circle", "--excite", "cat"], "--excite: ['cat'] not in the prompt"),
    (["a red a", "--excite"], "has no object word"),
    (["a red circle", "--edit", "a big blue circle"], "cannot align the edit"),
    (["a red circle", "a blue square", "--edit", "a red square"], "--edit takes exactly one prompt"),
    (["a red circle", "--local-blend"], "--local-blend needs --edit"),
    (["a red circle", "--edit", "a red square", "--cross-replace-steps", "2"], "--cross-replace-steps must be"),
    (["a red circle", "--edit", "a red square", "--reweight", "circle=2"], "--reweight: ['circle'] not in"),
])
def test_cli_bad_control_input_exits_2_and_writes_nothing(tiny_pipeline_dir, tmp_path, capsys, args, message):
    out = tmp_path / "out"
    assert cli(tiny_pipeline_dir, out, *args) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and err.startswith("error:") and len(err.splitlines()) == 1, err
    assert not out.exists()


@pytest.mark.parametrize("control", ["excite", "reweight", "edit"])
def test_evaluate_control_reports_with_and_without(tiny_pipeline_dir, tmp_path, control, capsys):
    import json

    from unet.cli.evaluate import main as evaluate_main
    out = tmp_path / control
    rc = evaluate_main(["--control", control, "--quick", "--seeds", "1", "--steps", "2", "--model",
                        str(tiny_pipeline_dir), "--out", str(out), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert (out / "before_after.png").exists() and "| " in (out / "report.md").read_text()
    if control == "edit":
        assert report["swaps"] == 6
        # images: the swaps whose source (the plain prompt, same seed) showed both objects -- recounted here
        from unet.control import sample
        from unet.eval.control import swap_edits
        from unet.eval.detect import detect
        from unet.eval.prompts import check, eval_prompts
        from unet.pipeline import Settings, default_guidance, load_pipeline
        pipe = load_pipeline(tiny_pipeline_dir, show_progress=False)
        edits = swap_edits([p for p in eval_prompts() if p.task == "color_attr"][:3])  # the quick edit run's
        both = [all(m is not None for m in check(p, detect(sample(pipe, p.prompt, Settings(
            seed=n, steps=2, guidance=default_guidance(pipe)))[0]))[1]) for n, (p, *_) in enumerate(edits)]
        assert report["images"] == sum(both)
        assert set(report["seconds_per_image"]) == {"source", "replayed", "edited_alone"}
    else:
        assert sorted(report["tasks"]) == sorted(["single_object", "two_object", "colors", "position", "color_attr"])
        assert all(r["images"] == 2 for r in report["tasks"].values())  # 2 prompts x 1 seed per task
        for which in ("plain", "controlled"):  # GenEval's overall: the mean over tasks
            mean = sum(r[which] for r in report["tasks"].values()) / len(report["tasks"])
            assert report[f"overall_{which}"] == pytest.approx(mean)
        assert report["seconds_per_image_controlled"] > 0 and report["seconds_per_image_plain"] > 0
    assert "report:" in capsys.readouterr().out


def test_swap_edits_and_verdicts():
    from unet.eval.control import swap_edits, swap_succeeded
    from unet.eval.detect import Detection
    from unet.eval.prompts import EvalPrompt
    p = EvalPrompt("color_attr", "a red circle and a blue square", [("red", "circle"), ("blue", "square")])
    assert [e[3] for e in swap_edits([p])] == ["a red triangle and a blue square", "a red circle and a blue triangle"]

    def det(color, shape, x):
        return Detection(color, shape, (x, 10.0), (0, 0, 1, 1), None)
    source = [det("red", "circle", 5.0), det("blue", "square", 20.0)]
    assert swap_succeeded(source, 0, "triangle", [det("red", "triangle", 6.0), det("blue", "square", 21.0)], 3.0)["ok"]
    moved = swap_succeeded(source, 0, "triangle", [det("red", "triangle", 6.0), det("blue", "square", 25.0)], 3.0)
    assert moved == {"changed": True, "kept": False, "ok": False}
    unchanged = swap_succeeded(source, 0, "triangle", source, 3.0)
    assert unchanged == {"changed": False, "kept": True, "ok": False}
