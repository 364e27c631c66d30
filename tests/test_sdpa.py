"""MLA's head-dim padding for a fused SDPA kernel (the CUDA path, forced on the CPU), and
the start-up report of which SDPA kernel each attention kind gets."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend
from torch.utils._python_dispatch import TorchDispatchMode
from torchtitan.models.attention import ScaledDotProductAttentionWrapper

import gamma_titan  # noqa: F401
from gamma_titan.models.common import GatedAttention, rope_cache
from gamma_titan.models.common import sdpa_kernels
from gamma_titan.models.common.mla import GatedMLA
from gamma_titan.models.common.sdpa import attend, pad_qkv, sdpa_head_dims
from gamma_titan.models.common.sdpa_kernels import (
    CPU_FLASH, attention_backend_lines, attention_backends, cuda_backend, sdpa_backend,
)
from gamma_titan.models.dense import dense_flavors
from gamma_titan.models.moe import moe_flavors

# Padded and unpadded paths run different kernels on the CPU (flash_cpu on the padded,
# equal head dims; math on the unpadded), so they agree to rounding: max |a - b| below
# this fraction of max |b| (fp32: a few ulp of fp32; bf16: about one ulp of bf16).
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
SEQ = 32


def assert_close_rel(a: torch.Tensor, b: torch.Tensor, dtype, what=""):
    err = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item()
    assert err <= REL_TOL[dtype] * scale, f"{what}: max diff {err:.3g} vs max {scale:.3g}"


def sdpa_run(q, k, v, grad_out, pad):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    out = attend(ScaledDotProductAttentionWrapper(), q, k, v, pad=pad)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("dqk, dv", [(24, 16), (16, 24)], ids=["v_narrower", "v_wider"])
def test_padded_sdpa_matches_unpadded(dtype, dqk, dv):
    """Output and q/k/v gradients of the padded path (CUDA's, forced) equal the unpadded
    call's; v wider than q/k pads q/k and keeps the scale 1/sqrt(real q/k dim)."""
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 4, SEQ, dqk, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(2, 4, SEQ, dv, generator=g).to(dtype)
    grad_out = torch.randn(2, 4, SEQ, dv, generator=g).to(dtype)
    plain = sdpa_run(q, k, v, grad_out, pad=False)
    padded = sdpa_run(q, k, v, grad_out, pad=True)
    assert padded[0].shape == plain[0].shape == (2, 4, SEQ, dv)
    for name, a, b in zip(("out", "dq", "dk", "dv"), padded, plain):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert_close_rel(a, b, dtype, name)
    # and both are attention: against a float64 reference
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert_close_rel(padded[0], ref, dtype, "out vs fp64")


def test_pad_qkv_shapes_and_scale():
    q, k, v = torch.ones(1, 2, 3, 24), torch.ones(1, 2, 3, 24), torch.ones(1, 2, 3, 16)
    pq, pk, pv, scale = pad_qkv(q, k, v, pad=True)
    assert pq is q and pk is k and pv.shape[-1] == 24 and scale is None  # SDPA's default is 1/sqrt(24)
    assert torch.equal(pv[..., 16:], torch.zeros(1, 2, 3, 8))
    pv2, pq2, pk2, scale2 = pad_qkv(v, v, q, pad=True)  # q/k narrower: they are padded
    assert pq2.shape[-1] == pk2.shape[-1] == 24 and scale2 == 16 ** -0.5
    # on the CPU nothing is padded unless forced
    assert pad_qkv(q, k, v)[2] is v and pad_qkv(q, k, v, pad=False)[2] is v


def make_mla(gate: str, q_lora_rank: int, dtype, pad):
    torch.manual_seed(0)
    mla = GatedMLA(64, 4, q_lora_rank, 32, 16, 8, 16, gate, 1e-6)  # q/k head dim 24, v 16
    for p in mla.parameters():
        if p.dim() > 1:
            torch.nn.init.normal_(p, std=0.2)
    mla = mla.to(dtype)
    mla.pad_head_dims = pad
    return mla


def mla_run(gate, q_lora_rank, dtype, pad):
    mla = make_mla(gate, q_lora_rank, dtype, pad)
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(1)).to(dtype).requires_grad_()
    out = mla(x, rope_cache(8, SEQ, 10000.0))
    out.float().pow(2).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in mla.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("gate", ["none", "headwise", "elementwise"])
@pytest.mark.parametrize("q_lora_rank", [0, 32], ids=["q_direct", "q_lora"])
def test_gated_mla_padded_matches_unpadded(dtype, gate, q_lora_rank):
    """GatedMLA with the padded path forced: the same output, input gradient and
    gradient of every parameter (gate included: it multiplies the sliced output)."""
    out, dx, grads = mla_run(gate, q_lora_rank, dtype, pad=None)  # CPU: unpadded
    out_p, dx_p, grads_p = mla_run(gate, q_lora_rank, dtype, pad=True)
    assert_close_rel(out_p, out, dtype, "out")
    assert_close_rel(dx_p, dx, dtype, "dx")
    assert grads.keys() == grads_p.keys()
    assert ("gate_proj.weight" in grads) == (gate != "none")
    for name in grads:
        assert_close_rel(grads_p[name], grads[name], dtype, name)


def test_mla_on_cpu_is_the_unpadded_call_bitwise():
    """The CPU path is exactly the call GatedMLA made before padding existed."""
    mla = make_mla("elementwise", 32, torch.float32, pad=None)
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(1))
    rope = rope_cache(8, SEQ, 10000.0)
    with torch.no_grad():
        q, k, v = mla.qkv(x, rope)
        o = mla.sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
        expected = mla.wo((o * mla.gate_values(x)).reshape(2, SEQ, -1))
        assert torch.equal(mla(x, rope), expected)


def test_mla_heads_sharded_like_tp():
    """Under TP each rank runs SDPA on its own heads (local tensors): padding is per
    head, so attending the two halves of the heads gives the halves of the result."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, SEQ, d, generator=g) for d in (24, 24, 16))
    sdpa = ScaledDotProductAttentionWrapper()
    whole = attend(sdpa, q, k, v, pad=True)
    halves = [attend(sdpa, q[:, h], k[:, h], v[:, h], pad=True) for h in (slice(0, 2), slice(2, 4))]
    torch.testing.assert_close(torch.cat(halves, dim=1), whole, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("pad", [None, True], ids=["decided_from_device", "forced"])
def test_mla_compiles_without_graph_break(pad):
    """The padding decision reads q.device.type, a constant to dynamo: one graph."""
    mla = make_mla("elementwise", 0, torch.float32, pad)
    x = torch.randn(2, SEQ, 64)
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(mla)(x, rope_cache(8, SEQ, 10000.0))
    finally:
        torch._dynamo.reset()
    assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
    targets = [str(n.target) for gm in explained.graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert any("pad" in t for t in targets) == (pad is True)


def test_mha_untouched():
    """Equal head dims: attend() is the plain wrapper call, padding forced or not, and
    GatedAttention does not go through it at all."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, SEQ, 16, generator=g)
    k, v = torch.randn(2, 2, SEQ, 16, generator=g), torch.randn(2, 2, SEQ, 16, generator=g)
    sdpa = ScaledDotProductAttentionWrapper()
    plain = sdpa(q, k, v, enable_gqa=True)
    assert torch.equal(attend(sdpa, q, k, v, pad=True, enable_gqa=True), plain)
    assert torch.equal(attend(sdpa, q, k, v, enable_gqa=True), plain)
    assert not hasattr(GatedAttention(64, 4, 2, 16, "elementwise"), "pad_head_dims")


# --- the decision on a CUDA device, as far as it goes without one ---------------------

def test_padding_decision_per_device_type():
    assert sdpa_head_dims(192, 128, "cuda") == (192, 192)
    assert sdpa_head_dims(64, 96, "cuda") == (96, 96)
    assert sdpa_head_dims(128, 128, "cuda") == (128, 128)
    assert sdpa_head_dims(192, 128, "cpu") == (192, 128)
    assert sdpa_head_dims(192, 128, "meta") == (192, 128)
    assert sdpa_head_dims(192, 128, "cpu", pad=True) == (192, 192)
    assert sdpa_head_dims(192, 128, "cuda", pad=False) == (192, 128)


class FakeCudaChecks:
    """torch.backends.cuda.can_use_* stand-ins that record the SDPAParams they see."""

    def __init__(self, monkeypatch, accept=()):
        self.accept, self.seen = set(accept), []
        for name in ("cudnn", "flash", "efficient"):
            monkeypatch.setattr(torch.backends.cuda, f"can_use_{name}_attention", self.check(name))

    def check(self, name):
        def can_use(params, debug=False):
            self.seen.append((name, params))
            return name in self.accept
        return can_use


def test_cuda_backend_priority_order(monkeypatch):
    """The wrapper's order (cuDNN, flash, math); cuDNN skipped when deterministic; math
    the fallback; 'none' when no enabled backend takes the inputs."""
    backends = ScaledDotProductAttentionWrapper().sdpa_backends
    assert backends == [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]
    q = torch.zeros(1, 2, 8, 16)
    params = torch.backends.cuda.SDPAParams(q, q, q, None, 0.0, True, False)  # the real constructor
    if torch.version.cuda is None:  # real checks, CPU build: no fused kernel (a CUDA build asks the driver)
        assert cuda_backend(params, backends, False) == "math"
    FakeCudaChecks(monkeypatch, accept={"cudnn", "flash"})
    assert cuda_backend(params, backends, False) == "cudnn"
    assert cuda_backend(params, backends, True) == "flash"
    FakeCudaChecks(monkeypatch, accept={"cudnn"})
    assert cuda_backend(params, backends, True) == "math"
    assert cuda_backend(params, [SDPBackend.FLASH_ATTENTION], False) == "none"
    FakeCudaChecks(monkeypatch, accept={"efficient"})
    assert cuda_backend(params, [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], False) == "efficient"


def test_sdpa_backend_cuda_branch_sees_padded_tensors(monkeypatch):
    """sdpa_backend on a CUDA device (tensors made on the CPU instead): PyTorch's checks
    get the padded MLA shapes, grad-requiring tensors, the GQA flag, in priority order."""
    real_zeros, devices = torch.zeros, []

    def zeros_on_cpu(*shape, device=None, **kw):
        devices.append(torch.device(device).type if device is not None else None)
        return real_zeros(*shape, **kw)

    monkeypatch.setattr(sdpa_kernels.torch, "zeros", zeros_on_cpu)
    checks = FakeCudaChecks(monkeypatch, accept={"flash"})
    assert sdpa_backend(192, 128, 16, 16, torch.bfloat16, "cuda", deterministic=False) == "flash"
    assert [name for name, _ in checks.seen] == ["cudnn", "flash"]
    params = checks.seen[-1][1]
    assert params.query.shape == params.key.shape == params.value.shape == (1, 16, 256, 192)
    assert params.value.dtype == torch.bfloat16 and params.query.requires_grad and params.is_causal
    assert not params.enable_gqa and params.attn_mask is None and params.dropout == 0.0

    checks = FakeCudaChecks(monkeypatch, accept={"cudnn", "flash"})
    assert sdpa_backend(64, 64, 8, 2, torch.bfloat16, "cuda", deterministic=True) == "flash"
    assert [name for name, _ in checks.seen] == ["flash"]  # cuDNN never asked in deterministic mode
    params = checks.seen[-1][1]
    assert params.enable_gqa and params.key.shape == (1, 2, 256, 64)
    assert sdpa_backend(64, 64, 8, 2, torch.bfloat16, "cuda", deterministic=False) == "cudnn"
    assert devices and set(devices) == {"cuda"}


# --- the report on the CPU ------------------------------------------------------------

def kernel_that_runs(qk, v, heads, kv_heads, dtype) -> str:
    """Run TorchTitan's wrapper on the CPU and see whether the fused CPU kernel ran."""
    class Ops(TorchDispatchMode):
        seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func))
            return func(*args, **(kwargs or {}))

    q = torch.randn(1, heads, 16, qk, dtype=dtype)
    k, val = torch.randn(1, kv_heads, 16, qk, dtype=dtype), torch.randn(1, kv_heads, 16, v, dtype=dtype)
    with Ops() as ops:
        ScaledDotProductAttentionWrapper()(q, k, val, enable_gqa=kv_heads != heads)
    return CPU_FLASH if any("_scaled_dot_product_flash_attention_for_cpu" in s for s in ops.seen) else "math"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family, flavor, expected", [
    ("dense", "debug", {"mha": CPU_FLASH}),
    ("dense", "7B", {"mha": CPU_FLASH}),
    ("moe", "debug", {"mha": CPU_FLASH}),
    ("moe", "debug_mla", {"mla": "math"}),  # q/k 64, v 32: not padded on the CPU
    ("moe", "16B-A2.4B", {"mla": "math"}),  # q/k 192, v 128
    ("moe", "3B-A0.5B-mla", {"mla": CPU_FLASH}),  # q/k 96 = v 96
])
def test_attention_backends_on_cpu(family, flavor, expected, dtype):
    args = (dense_flavors if family == "dense" else moe_flavors)[flavor]
    assert attention_backends(args, dtype, "cpu") == expected
    for s in args.attention_shapes():  # the report names the kernel that really runs
        assert kernel_that_runs(s.qk_head_dim, s.v_head_dim, s.n_heads, s.n_kv_heads, dtype) == expected[s.kind]


def test_attention_shapes():
    assert dense_flavors["7B"].attention_shapes() == [("mha", 128, 128, 32, 8)]
    assert moe_flavors["debug"].attention_shapes() == [("mha", 64, 64, 4, 4)]
    assert moe_flavors["16B-A2.4B"].attention_shapes() == [("mla", 192, 128, 16, 16)]


def test_padded_mla_gets_the_fused_cpu_kernel():
    """What the padding buys, seen on the CPU's kernel choice: equal head dims are fused."""
    assert sdpa_backend(192, 128, 16, 16, torch.bfloat16, "cpu") == "math"
    assert sdpa_backend(192, 192, 16, 16, torch.bfloat16, "cpu") == CPU_FLASH


def test_report_lines_warn_on_math():
    lines = attention_backend_lines(moe_flavors["debug_mla"], torch.float32, "cpu", deterministic=False)
    assert len(lines) == 1 and lines[0].startswith("WARNING: attention mla: SDPA kernel math")
    assert "q/k 64, v 32" in lines[0] and "padded" not in lines[0]
    (line,) = attention_backend_lines(dense_flavors["debug"], torch.bfloat16, "cpu", deterministic=True)
    assert line == "attention mha: SDPA kernel flash_cpu (head dims q/k 64, v 64; bfloat16 on cpu, deterministic)"



def test_report_line_names_the_padding_on_cuda(monkeypatch):
    monkeypatch.setattr(sdpa_kernels, "attention_backends", lambda *a, **k: {"mla": "flash"})
    (line,) = attention_backend_lines(moe_flavors["16B-A2.4B"], torch.bfloat16, "cuda", deterministic=True)
    assert line == ("attention mla: SDPA kernel flash (head dims q/k 192, v 128 (zero-padded to 192); "
                    "bfloat16 on cuda, deterministic)")
