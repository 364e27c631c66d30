"""Rotary position embedding, in the "rotate half" layout that Hugging Face Llama uses,
so that dense checkpoints convert to `transformers` without permuting q/k weights.

    rope(x) = x·cos + rotate_half(x)·sin,   rotate_half([x1, x2]) = [−x2, x1]

With the sign folded into the cache (sin_signed = [−sin, sin] over the two halves), each
half is one fused multiply-add onto x·cos:

    out[:h] = x[:h]·cos[:h] + x[h:]·sin_signed[:h],   out[h:] = x[h:]·cos[h:] + x[:h]·sin_signed[h:]

The rotation is orthogonal, so the backward pass is the same with the halves of
sin_signed swapped. `_Rotate` does each direction in one allocation and three kernels, and
saves nothing but the cache. Autograd through the plain formula made four temporaries
per call: on the CPU, forward and backward took 2.5x TorchTitan's complex-number rotation
(which needs the interleaved layout), and now take about 1.7x.

The cache is stored as complex64, cos + i·sin_signed. Each block receives it as an
argument, and FSDP2's mixed-precision policy casts every floating-point argument of a
wrapped module to the parameter dtype: in bf16, cos and sin of large positions would
lose all but 8 bits. A complex tensor is not floating point, so it reaches the rotation
in fp32 (TorchTitan passes its freqs_cis to blocks as complex for the same reason).
"""

import torch


def rope_cache(head_dim: int, max_seq_len: int, theta: float, device=None) -> torch.Tensor:
    """(max_seq_len, head_dim) complex64: cos + i·sin_signed for every position."""
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    cos, sin = angles.cos(), angles.sin()
    return torch.complex(torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1))


def _rotate(x: torch.Tensor, cos: torch.Tensor, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """x·cos, plus x[h:]·first onto the first half and x[:h]·second onto the second."""
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], first)
    out[..., half:].addcmul_(x[..., :half], second)
    return out


class _Rotate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin_signed)
        half = x.shape[-1] // 2
        xf = x.to(torch.promote_types(x.dtype, torch.float32))  # bf16 rotates in fp32
        return _rotate(xf, cos, sin_signed[..., :half], sin_signed[..., half:]).type_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        cos, sin_signed = ctx.saved_tensors
        half = grad.shape[-1] // 2
        gf = grad.to(torch.promote_types(grad.dtype, torch.float32))
        return _rotate(gf, cos, sin_signed[..., half:], sin_signed[..., :half]).type_as(grad), None, None


def rope_at(rope: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The cache rows of each token's position: (batch, seq, head_dim). Under context
    parallelism a rank holds chunks of each sequence (TorchTitan's load-balanced shards) and
    `positions` says where in the sequence each of its tokens is."""
    return rope[positions]


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim); rope: the cache, (≥ seq, head_dim), whose positions
    0..seq-1 are taken here, where the whole sequence is (a block's input may be one TP
    rank's sequence shard, gathered before attention); or each token's own rows, (batch,
    seq, head_dim) (`rope_at`)."""
    if rope.dim() == 3:
        parts = torch.view_as_real(rope).unsqueeze(2)  # (batch, seq, 1, head_dim, 2)
    else:
        parts = torch.view_as_real(rope[: x.shape[1]]).unsqueeze(1)  # (seq, 1, head_dim, 2): broadcast over heads
    return _Rotate.apply(x, parts[..., 0], parts[..., 1])
