"""Gated attention against a naive softmax implementation written out here."""

import math

import pytest
import torch
import torch.nn.functional as F

import gamma_titan  # noqa: F401
from gamma_titan.models.common import GatedAttention, apply_rope, rope_cache

DIM, HEADS, KV_HEADS, HEAD_DIM, SEQ, THETA = 64, 4, 2, 16, 12, 10000.0


def make(gate: str, seed: int = 0) -> GatedAttention:
    torch.manual_seed(seed)
    attn = GatedAttention(DIM, HEADS, KV_HEADS, HEAD_DIM, gate)
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return attn


def naive_rope(x: torch.Tensor) -> torch.Tensor:
    """Rotate the pair (x_i, x_{i + hd/2}) by position · θ^(−2i/hd), one element at a time."""
    out = x.clone()
    half = HEAD_DIM // 2
    for pos in range(x.shape[1]):
        for i in range(half):
            angle = pos * THETA ** (-2 * i / HEAD_DIM)
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[:, pos, :, i], x[:, pos, :, i + half]
            out[:, pos, :, i] = a * c - b * s
            out[:, pos, :, i + half] = a * s + b * c
    return out


def naive_attention(attn: GatedAttention, x: torch.Tensor) -> torch.Tensor:
    bs, seq, _ = x.shape
    q = naive_rope((x @ attn.wq.weight.T).view(bs, seq, HEADS, HEAD_DIM))
    k = naive_rope((x @ attn.wk.weight.T).view(bs, seq, KV_HEADS, HEAD_DIM))
    v = (x @ attn.wv.weight.T).view(bs, seq, KV_HEADS, HEAD_DIM)
    group = HEADS // KV_HEADS
    out = torch.zeros(bs, seq, HEADS, HEAD_DIM)
    for h in range(HEADS):
        kv = h // group  # query head h reads KV head h // group
        scores = q[:, :, h] @ k[:, :, kv].transpose(1, 2) / math.sqrt(HEAD_DIM)
        mask = torch.ones(seq, seq).tril().bool()
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[:, :, h] = probs @ v[:, :, kv]
    if attn.gate != "none":
        g = torch.sigmoid(x @ attn.gate_proj.weight.T)
        out = out * (g.view(bs, seq, HEADS, -1))  # (…, 1) headwise, (…, HEAD_DIM) elementwise
    return out.reshape(bs, seq, -1) @ attn.wo.weight.T


@pytest.fixture
def x():
    return torch.randn(2, SEQ, DIM, generator=torch.Generator().manual_seed(1))


@pytest.fixture
def rope():
    return rope_cache(HEAD_DIM, SEQ, THETA)


@pytest.mark.parametrize("gate", ["none", "headwise", "elementwise"])
def test_matches_naive_softmax_attention(gate, x, rope):
    attn = make(gate)
    torch.testing.assert_close(attn(x, rope), naive_attention(attn, x), atol=1e-5, rtol=1e-5)


def test_none_is_bitwise_plain_attention(x, rope):
    """gate = "none" adds no op at all: bitwise equal to ungated attention built from the
    same primitives, and the gated module's weights minus W_g are the same parameters."""
    attn = make("none")
    bs, seq, _ = x.shape
    q = apply_rope(F.linear(x, attn.wq.weight).view(bs, seq, -1, HEAD_DIM), rope)
    k = apply_rope(F.linear(x, attn.wk.weight).view(bs, seq, -1, HEAD_DIM), rope)
    v = F.linear(x, attn.wv.weight).view(bs, seq, -1, HEAD_DIM)
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       is_causal=True, enable_gqa=True).transpose(1, 2)
    reference = F.linear(o.reshape(bs, seq, -1), attn.wo.weight)
    assert torch.equal(attn(x, rope), reference)
    gated = make("elementwise")
    assert [n for n, _ in attn.named_parameters()] == [
        n for n, _ in gated.named_parameters() if not n.startswith("gate_proj")
    ]


@pytest.mark.parametrize("gate, width", [("headwise", 1), ("elementwise", HEAD_DIM)])
def test_gate_shape_and_gradient(gate, width, x, rope):
    attn = make(gate)
    assert attn.gate_proj.weight.shape == (HEADS * width, DIM)
    attn(x, rope).pow(2).sum().backward()
    grad = attn.gate_proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0 and torch.isfinite(grad).all()


def test_gate_at_zero_logits_halves_the_output(x, rope):
    """W_g = 0 gives sigmoid(0) = 1/2 on every head; wo is linear, so the output is half
    the ungated attention's with the same q, k, v, o weights."""
    attn = make("headwise")
    with torch.no_grad():
        attn.gate_proj.weight.zero_()
    ungated = make("none")
    ungated.load_state_dict({k: v for k, v in attn.state_dict().items() if "gate_proj" not in k})
    torch.testing.assert_close(attn(x, rope), 0.5 * ungated(x, rope), atol=1e-6, rtol=1e-5)


def test_rope_backward_is_the_naive_formulas_gradient():
    """apply_rope has a hand-written backward (the transposed rotation): it must equal
    autograd through the naive formula, in float64 and for a bf16 input."""
    x = torch.randn(2, SEQ, HEADS, HEAD_DIM, dtype=torch.float64, requires_grad=True)
    cache = rope_cache(HEAD_DIM, SEQ, THETA).to(torch.complex128)
    grad = torch.randn_like(x)
    ours, = torch.autograd.grad(apply_rope(x, cache), x, grad)
    naive, = torch.autograd.grad(naive_rope(x), x, grad)
    torch.testing.assert_close(ours, naive, atol=1e-6, rtol=1e-6)  # cache built in fp32
    assert torch.autograd.gradcheck(lambda t: apply_rope(t, cache[:6]), (x[:1, :6].detach().requires_grad_(),))

    xb = x.detach().bfloat16().requires_grad_()
    out = apply_rope(xb, rope_cache(HEAD_DIM, SEQ, THETA))
    assert out.dtype == torch.bfloat16
    gb, = torch.autograd.grad(out, xb, grad.bfloat16())
    torch.testing.assert_close(gb.double(), naive, atol=0.05, rtol=0.02)
