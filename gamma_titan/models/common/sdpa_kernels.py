"""Which fused SDPA kernel each attention kind of a model gets, said before training (the
start-up summary and `inspect`): PyTorch's own kernel checks are asked with tiny tensors of
the real head dims (after sdpa.py's padding) and dtype, in the priority order TorchTitan's
`ScaledDotProductAttentionWrapper` sets."""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torchtitan.models.attention import ScaledDotProductAttentionWrapper

from .sdpa import pad_qkv, pads_head_dims, sdpa_head_dims


class AttentionShape(NamedTuple):
    """One attention kind of a model, in the numbers that decide its SDPA kernel."""

    kind: str  # "mha" (grouped-query included) or "mla"
    qk_head_dim: int
    v_head_dim: int
    n_heads: int
    n_kv_heads: int  # the K/V heads SDPA sees (MLA: n_heads, its keys are per head)


MATH = "math"
_CUDA_NAMES = {
    SDPBackend.CUDNN_ATTENTION: "cudnn",
    SDPBackend.FLASH_ATTENTION: "flash",
    SDPBackend.EFFICIENT_ATTENTION: "efficient",
    SDPBackend.MATH: MATH,
}
# F.scaled_dot_product_attention's fused kernel on the CPU:
# aten::_scaled_dot_product_flash_attention_for_cpu (equal q/k/v head dims only).
CPU_FLASH = "flash_cpu"


def _deterministic_enforced() -> bool:
    return (torch.are_deterministic_algorithms_enabled()
            and not torch.is_deterministic_algorithms_warn_only_enabled())


def sdpa_backend(q_head_dim: int, v_head_dim: int, n_heads: int, n_kv_heads: int,
                 dtype: torch.dtype, device: torch.device | str,
                 deterministic: bool | None = None, *, seq_len: int = 256) -> str:
    """The kernel TorchTitan's SDPA wrapper runs for causal attention of these shapes on
    `device`, after our padding: "cudnn", "flash", "efficient" or "math" on CUDA,
    "flash_cpu" or "math" elsewhere.

    `deterministic`: whether deterministic algorithms will be enforced
    (`torch.use_deterministic_algorithms(True)` without warn_only), where cuDNN refuses;
    None reads the current setting (PyTorch's cuDNN check also reads it in any case).
    The check builds tiny tensors (batch 1, `seq_len` positions) on `device`, laid out as
    the models lay out q, k, v, with requires_grad (some kernels refuse backward for
    some head dims)."""
    device = torch.device(device)
    if deterministic is None:
        deterministic = _deterministic_enforced()
    backends = ScaledDotProductAttentionWrapper().sdpa_backends  # the order it sets

    def proj(heads: int, d: int) -> torch.Tensor:  # (bs, seq, heads, d) -> (bs, heads, seq, d)
        return torch.zeros(1, seq_len, heads, d, dtype=dtype, device=device,
                           requires_grad=True).transpose(1, 2)

    gqa = n_kv_heads != n_heads
    with torch.enable_grad(), sdpa_kernel(backends, set_priority=True):
        q, k, v, scale = pad_qkv(proj(n_heads, q_head_dim), proj(n_kv_heads, q_head_dim),
                                 proj(n_kv_heads, v_head_dim), pad=pads_head_dims(device.type))
        if device.type != "cuda":
            choice = torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=scale, enable_gqa=gqa)
            return CPU_FLASH if choice == SDPBackend.FLASH_ATTENTION.value else MATH
        params = torch.backends.cuda.SDPAParams(q, k, v, None, 0.0, True, gqa)
        return cuda_backend(params, backends, deterministic)


def cuda_backend(params, backends: list[SDPBackend], deterministic: bool) -> str:
    """The first of `backends` (a priority order, enabled as `sdpa_kernel` enables them)
    that PyTorch's CUDA checks accept for `params` (a torch.backends.cuda.SDPAParams), as
    the SDPA dispatcher picks it; cuDNN is skipped when `deterministic`."""
    can_use = {
        SDPBackend.CUDNN_ATTENTION: lambda: (not deterministic
                                             and torch.backends.cuda.can_use_cudnn_attention(params)),
        SDPBackend.FLASH_ATTENTION: lambda: torch.backends.cuda.can_use_flash_attention(params),
        SDPBackend.EFFICIENT_ATTENTION: lambda: torch.backends.cuda.can_use_efficient_attention(params),
        SDPBackend.MATH: lambda: True,
    }
    for backend in backends:
        if backend in can_use and can_use[backend]():
            return _CUDA_NAMES[backend]
    return "none"  # no enabled kernel accepts these inputs: SDPA would raise


def attention_backends(model_args, dtype: torch.dtype, device: torch.device | str,
                       deterministic: bool | None = None, *, seq_len: int = 256) -> dict[str, str]:
    """Attention kind ("mha", "mla") -> the SDPA kernel it gets (see `sdpa_backend`), for
    model args with an `attention_shapes()` method."""
    return {s.kind: sdpa_backend(s.qk_head_dim, s.v_head_dim, s.n_heads, s.n_kv_heads, dtype, device,
                                 deterministic, seq_len=seq_len)
            for s in model_args.attention_shapes()}


def attention_backend_lines(model_args, dtype: torch.dtype, device: torch.device | str,
                            deterministic: bool | None = None, *, seq_len: int = 256) -> list[str]:
    """One line per attention kind: the kernel, the head dims SDPA sees, and a line
    starting with "WARNING" where it is the math kernel (full T x T scores in memory)."""
    device = torch.device(device)
    if model_args.takes_attention_masks():  # flex: TorchTitan's compiled kernel, not SDPA
        mask = getattr(model_args, "attn_mask_type", "causal").replace("_", "-")
        return [f"attention {s.kind}: flex attention, {mask} mask from each batch's EOS tokens (TorchTitan's "
                f"compiled kernel; head dims q/k {s.qk_head_dim}, v {s.v_head_dim}; "
                f"{str(dtype).removeprefix('torch.')} on {device.type})" for s in model_args.attention_shapes()]
    if deterministic is None:
        deterministic = _deterministic_enforced()
    backends = attention_backends(model_args, dtype, device, deterministic, seq_len=seq_len)
    lines = []
    for s in model_args.attention_shapes():
        backend = backends[s.kind]
        pqk, pv = sdpa_head_dims(s.qk_head_dim, s.v_head_dim, device.type)
        dims = f"head dims q/k {s.qk_head_dim}, v {s.v_head_dim}"
        if (pqk, pv) != (s.qk_head_dim, s.v_head_dim):
            dims += f" (zero-padded to {pqk})"
        line = (f"attention {s.kind}: SDPA kernel {backend} ({dims}; {str(dtype).removeprefix('torch.')} "
                f"on {device.type}{', deterministic' if deterministic else ''})")
        if backend in (MATH, "none"):
            line = (f"WARNING: {line}: no fused kernel takes these inputs, attention holds the "
                    "whole seq_len x seq_len score matrix")
        lines.append(line)
    return lines
