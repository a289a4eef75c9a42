import pytest
import torch
from diffusers.models.attention_processor import Attention
from hypothesis import given, settings
from hypothesis import strategies as st

from crossattn import CrossAttention, SpatialTransformer, TransformerBlock, attention


def test_explicit_and_fused_paths_agree():
    block = CrossAttention(32, 16, heads=4, head_dim=8)
    x, ctx = torch.randn(2, 32, 5, 7), torch.randn(2, 6, 16)
    fused = block(x, ctx)
    explicit, weights = block(x, ctx, need_weights=True)
    assert torch.allclose(fused, explicit, atol=1e-5)
    assert weights.shape == (2, 4, 35, 6)  # (B, heads, HW, T) for a non-square 5x7 map
    assert torch.allclose(weights.sum(-1), torch.ones(2, 4, 35), atol=1e-5)


def test_four_steps_by_hand():
    block = CrossAttention(8, 6, heads=1, head_dim=4)
    x, ctx = torch.randn(1, 3, 8), torch.randn(1, 5, 6)
    out, w = attention(x, ctx, block.to_q, block.to_k, block.to_v, heads=1, return_weights=True)
    q, k, v = block.to_q(x), block.to_k(ctx), block.to_v(ctx)
    expected_w = torch.softmax(q @ k.transpose(1, 2) / 2.0, dim=-1)  # sqrt(head_dim=4) = 2
    assert torch.allclose(w[:, 0], expected_w, atol=1e-6)
    assert torch.allclose(out, expected_w @ v, atol=1e-6)


def test_padding_gets_zero_weight_and_does_not_change_output():
    block = CrossAttention(16, 8, heads=2, head_dim=8)
    x, ctx = torch.randn(2, 10, 16), torch.randn(2, 6, 8)
    mask = torch.tensor([[True] * 4 + [False] * 2, [True] * 6])
    out, w = block(x, ctx, mask=mask, need_weights=True)
    assert torch.all(w[0, :, :, 4:] == 0)
    assert torch.allclose(block(x, ctx, mask=mask), out, atol=1e-5)
    # dropping the padded keys altogether gives the same answer for the first sample
    assert torch.allclose(out[0], block(x[:1], ctx[:1, :4])[0], atol=1e-5)


def test_self_attention_when_no_context():
    block = CrossAttention(12, heads=3, head_dim=4)
    x = torch.randn(2, 9, 12)
    out, w = block(x, need_weights=True)
    assert w.shape == (2, 3, 9, 9) and out.shape == x.shape


@pytest.mark.parametrize("hw", [(4, 4), (3, 8)])
def test_matches_diffusers_attention_with_same_weights(hw):
    ours = CrossAttention(32, 24, heads=4, head_dim=8)
    theirs = Attention(query_dim=32, cross_attention_dim=24, heads=4, dim_head=8)
    theirs.load_state_dict(ours.state_dict())  # parameter names are the same
    ours.load_state_dict(theirs.state_dict())
    x, ctx = torch.randn(2, hw[0] * hw[1], 32), torch.randn(2, 7, 24)
    expected = theirs(x, encoder_hidden_states=ctx)
    assert torch.allclose(ours(x, ctx), expected, atol=1e-5)
    assert torch.allclose(ours(x, ctx, need_weights=True)[0], expected, atol=1e-5)
    image = x.transpose(1, 2).reshape(2, 32, *hw)
    assert torch.allclose(ours(image, ctx).flatten(2).transpose(1, 2), expected, atol=1e-5)


@pytest.mark.parametrize("bad, match", [
    (lambda b: b(torch.randn(2, 8)), r"\(B, C, H, W\) or \(B, N, C\)"),
    (lambda b: b(torch.randn(2, 5, 7), torch.randn(2, 3, 8)), "query_dim=16"),
    (lambda b: b(torch.randn(2, 5, 16), torch.randn(2, 3, 9)), r"\(2, T, 8\)"),
    (lambda b: b(torch.randn(2, 5, 16)), r"\(B, T, 8\)"),
    (lambda b: b(torch.randn(2, 5, 16), torch.randn(2, 3, 8), mask=torch.ones(2, 4, dtype=torch.bool)), r"\(2, 3\)"),
])
def test_bad_input_names_expected_shape(bad, match):
    with pytest.raises(ValueError, match=match):
        bad(CrossAttention(16, 8, heads=2, head_dim=4))


@settings(max_examples=25, deadline=None)
@given(B=st.integers(1, 3), N=st.integers(1, 12), T=st.integers(1, 9), heads=st.integers(1, 4),
       head_dim=st.integers(1, 8), data=st.data())
def test_random_shapes_and_masks(B, N, T, heads, head_dim, data):
    block = CrossAttention(8, 5, heads=heads, head_dim=head_dim)
    lengths = data.draw(st.lists(st.integers(1, T), min_size=B, max_size=B))
    mask = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T)
    x, ctx = torch.randn(B, N, 8), torch.randn(B, T, 5)
    out, w = block(x, ctx, mask=mask, need_weights=True)
    assert w.shape == (B, heads, N, T)
    assert torch.allclose(w.sum(-1), torch.ones(B, heads, N), atol=1e-5)
    assert torch.all(w.masked_select(~mask[:, None, None, :].expand_as(w)) == 0)
    assert torch.allclose(block(x, ctx, mask=mask), out, atol=1e-5)


def test_transformer_blocks_shapes_and_zero_init():
    st_block = SpatialTransformer(16, 8, heads=2, head_dim=8)
    x, ctx = torch.randn(2, 16, 3, 5), torch.randn(2, 4, 8)
    assert torch.equal(st_block(x, ctx), x)  # zero-initialised output projection: identity at start
    block = TransformerBlock(16, 8, heads=2, head_dim=8)
    h = torch.randn(2, 15, 16)
    assert block(h, ctx).shape == h.shape
    no_self = TransformerBlock(16, 8, heads=2, head_dim=8, self_attention=False)
    assert no_self.attn1 is None and no_self(h, ctx).shape == h.shape
