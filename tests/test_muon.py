"""Muon on the hidden weight matrices, AdamW on the rest (unet/muon.py), in one optimizer."""

import pytest
import torch

from unet.muon import MuonAdamW, is_muon_matrix, orthogonalise
from unet.train import TrainConfig, build_components, build_optimizer


@pytest.mark.parametrize("shape", [(16, 64), (64, 16)])
def test_orthogonalise_sets_every_singular_value_near_one(shape):
    g = torch.Generator().manual_seed(0)
    # a badly conditioned gradient: one direction far above the others
    spike = torch.outer(torch.randn(shape[0], generator=g), torch.randn(shape[1], generator=g))
    m = torch.randn(shape, generator=g) + 30 * spike / shape[0] ** 0.5
    before, after = torch.linalg.svdvals(m), torch.linalg.svdvals(orthogonalise(m))
    assert before.max() / before.min() > 20
    assert after.min() > 0.5 and after.max() < 1.5, after  # Newton-Schulz's quintic lands in about [0.5, 1.5]


def test_its_adamw_groups_step_exactly_as_torch_adamw():
    torch.manual_seed(0)
    a = torch.nn.Linear(8, 4)
    b = torch.nn.Linear(8, 4)
    b.load_state_dict(a.state_dict())
    ours = MuonAdamW([{"params": list(a.parameters()), "weight_decay": 0.01}], lr=1e-2)
    theirs = torch.optim.AdamW([{"params": list(b.parameters()), "weight_decay": 0.01}], lr=1e-2)
    x = torch.randn(16, 8)
    for _ in range(5):
        for model, opt in ((a, ours), (b, theirs)):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-7)


def test_muon_fits_a_convolution():
    """A 3x3 convolution (a 4-D weight, which torch.optim.Muon refuses) learns a target convolution."""
    torch.manual_seed(0)
    target, model = torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.Conv2d(4, 8, 3, padding=1, bias=False)
    opt = MuonAdamW([{"params": [model.weight], "weight_decay": 0.0, "muon": True}], lr=2e-2)
    x = torch.randn(32, 4, 8, 8)
    with torch.no_grad():
        y = target(x) - target.bias[:, None, None]
    losses = []
    for _ in range(100):
        opt.zero_grad()
        loss = (model(x) - y).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.05 * losses[0], (losses[0], losses[-1])
    assert opt.state[model.weight]["momentum_buffer"].shape == (8, 4 * 3 * 3)


def test_the_unet_and_text_matrices_go_to_muon_and_the_pixel_layers_embeddings_and_norms_to_adamw(tmp_path):
    cfg = TrainConfig.from_flat(out=str(tmp_path), size=16, channels=(8, 16, 16), text_width=16, text_layers=1, heads=2,
                      max_length=16, position_embedding=True, pooled_text=True, optimizer="muon")
    _, text_encoder, unet = build_components(cfg, tmp_path)
    params, optimizer, names = build_optimizer(unet, text_encoder, cfg)
    by_id = dict(zip(map(id, params), names))
    muon = {by_id[id(p)] for g in optimizer.param_groups if g["muon"] for p in g["params"]}
    adam = {by_id[id(p)] for g in optimizer.param_groups if not g["muon"] for p in g["params"]}
    assert "unet.mid_res1.conv1.weight" in muon and "text.encoder.layers.0.mlp.fc1.weight" in muon
    assert "unet.mid_attn.blocks.0.attn2.to_k.weight" in muon
    assert {"unet.conv_in.weight", "unet.conv_out.weight", "text.embeddings.token_embedding.weight"} <= adam
    assert all(not n.endswith(".bias") for n in muon) and all(is_muon_matrix(n, torch.zeros(2, 2)) for n in muon)
    assert len(params) == len(names) == len(set(names))


def test_a_bad_optimizer_names_what_is_accepted(tmp_path):
    with pytest.raises(ValueError, match="optimizer must be one of 'adamw', 'muon', got 'sgd'"):
        TrainConfig.from_flat(out=str(tmp_path), optimizer="sgd").validate()
    with pytest.raises(ValueError, match=r"muon_momentum must be in \[0, 1\)"):
        TrainConfig.from_flat(out=str(tmp_path), optimizer="muon", muon_momentum=1.0).validate()


def test_update_rms_sets_the_muon_step_length_and_an_older_checkpoints_groups_step_with_0_2():
    """A Muon step moves a matrix by lr * update_rms * sqrt(max(out, in)) times its orthogonalised update, so twice
    update_rms is twice the step; an optimizer state saved before the setting existed loads as 0.2."""
    steps = {}
    for rms in (0.2, 0.4):
        torch.manual_seed(0)
        w = torch.nn.Parameter(torch.randn(16, 32))
        opt = MuonAdamW([{"params": [w], "weight_decay": 0.0, "muon": True}], lr=1e-2, update_rms=rms)
        before = w.detach().clone()
        w.grad = torch.randn(16, 32)
        opt.step()
        steps[rms] = (w.detach() - before).norm()
    torch.testing.assert_close(steps[0.4], 2 * steps[0.2])
    state = opt.state_dict()
    for group in state["param_groups"]:
        del group["update_rms"]
    fresh = MuonAdamW([{"params": [w], "weight_decay": 0.0, "muon": True}], lr=1e-2, update_rms=0.4)
    fresh.load_state_dict(state)
    assert fresh.param_groups[0]["update_rms"] == 0.2


def test_a_muon_update_rms_of_zero_names_what_is_accepted(tmp_path):
    with pytest.raises(ValueError, match=r"muon_update_rms must be > 0 \(0.2 matches AdamW's update\), got 0.0"):
        TrainConfig.from_flat(out=str(tmp_path), optimizer="muon", muon_update_rms=0.0).validate()
