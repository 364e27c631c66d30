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

Which kernel each attention kind gets is reported before training by sdpa_kernels.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


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
