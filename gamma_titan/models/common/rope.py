"""Rotary position embedding, in the "rotate half" layout that Hugging Face Llama uses,
so that dense checkpoints convert to `transformers` without permuting q/k weights."""

import torch


def rope_cache(head_dim: int, max_seq_len: int, theta: float, device=None) -> torch.Tensor:
    """(max_seq_len, 2, head_dim) fp32: cos and sin for every position."""
    if head_dim % 2:
        raise ValueError(f"rotary embedding needs an even head_dim, got {head_dim}")
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(max_seq_len, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)  # (seq, head_dim)
    return torch.stack([angles.cos(), angles.sin()], dim=1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
    """x: (batch, seq, heads, head_dim); rope: the cache sliced to (seq, 2, head_dim)."""
    cos = rope[:, 0].unsqueeze(1)  # (seq, 1, head_dim), broadcast over heads
    sin = rope[:, 1].unsqueeze(1)
    xf = x.float()
    return (xf * cos + _rotate_half(xf) * sin).type_as(x)
