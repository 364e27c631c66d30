"""Which fused SDPA kernel attention gets, and the padding that lets MLA have one.

TorchTitan's `ScaledDotProductAttentionWrapper` runs `F.scaled_dot_product_attention`
with the cuDNN, flash and math backends enabled, in that priority order. On CUDA, flash
needs q, k and v to share one head dim, and cuDNN refuses fp32 and deterministic mode,
so MLA (q/k head dim qk_nope + qk_rope, v head dim v_head_dim) would fall back to the
math kernel there, which holds the whole T x T score matrix. As other MLA
implementations do, `attend` zero-pads the narrower side to the common head dim, runs
SDPA and slices the output back: zero value channels only add zero output channels, and
zero q/k channels add nothing to q·k, so the result is the same. When q/k are padded the
softmax scale stays 1/sqrt(the real q/k head dim); when only v is padded, SDPA's default
(from q) already is that.

The padding is decided per call from the tensors' device (`q.device.type`, a constant
for torch.compile, so no graph break): CUDA pads, every other device does not. The CPU
path therefore runs exactly the call it always did (bitwise the same numbers); tests
force the CUDA-side choice with `pad=True`.

`attention_backends` says, before training, which kernel the wrapper will pick for each
attention kind of a model, asking PyTorch's own kernel checks with tiny tensors of the
real head dims (after padding) and dtype.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torchtitan.models.attention import ScaledDotProductAttentionWrapper


class AttentionShape(NamedTuple):
    """One attention kind of a model, in the numbers that decide its SDPA kernel."""

    kind: str  # "mha" (grouped-query included) or "mla"
    qk_head_dim: int
    v_head_dim: int
    n_heads: int
    n_kv_heads: int  # the K/V heads SDPA sees (MLA: n_heads, its keys are per head)


def pads_head_dims(device_type: str) -> bool:
    """Whether q/k and v of different head dims are zero-padded to one head dim before
    SDPA on this device type: on CUDA, where the flash kernel needs equal head dims; not
    elsewhere (the CPU path stays the unpadded call)."""
    return device_type == "cuda"


def sdpa_head_dims(qk_head_dim: int, v_head_dim: int, device_type: str,
                   pad: bool | None = None) -> tuple[int, int]:
    """(q/k head dim, v head dim) as SDPA sees them. `pad` None decides from the device
    type (`pads_head_dims`); True/False forces it (tests take the CUDA path on the CPU)."""
    if pad is None:
        pad = pads_head_dims(device_type)
    if not pad or qk_head_dim == v_head_dim:
        return qk_head_dim, v_head_dim
    d = max(qk_head_dim, v_head_dim)
    return d, d


def pad_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pad: bool | None = None):
    """q, k, v (bs, heads, seq, ·) zero-padded on the last dim as `sdpa_head_dims` says,
    and the softmax scale to pass to SDPA (None: SDPA's default from q is right)."""
    dqk, dv = q.shape[-1], v.shape[-1]
    pqk, pv = sdpa_head_dims(dqk, dv, q.device.type, pad)
    scale = None
    if pv > dv:
        v = F.pad(v, (0, pv - dv))
    if pqk > dqk:
        q, k = F.pad(q, (0, pqk - dqk)), F.pad(k, (0, pqk - dqk))
        scale = dqk ** -0.5
    return q, k, v, scale


def attend(sdpa: nn.Module, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
           pad: bool | None = None, **kwargs) -> torch.Tensor:
    """`sdpa(q, k, v, **kwargs)` (q, k, v: (bs, heads, seq, ·)) with the head dims padded
    as `pad_qkv` says and the output sliced back to v's head dim. Without padding this is
    exactly `sdpa(q, k, v, **kwargs)`."""
    dv = v.shape[-1]
    q, k, v, scale = pad_qkv(q, k, v, pad)
    if v.shape[-1] == dv and scale is None:
        return sdpa(q, k, v, **kwargs)
    if scale is not None and kwargs.get("scale") is None:
        kwargs["scale"] = scale
    return sdpa(q, k, v, **kwargs)[..., :dv]


# --- start-up report --------------------------------------------------------------------

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
