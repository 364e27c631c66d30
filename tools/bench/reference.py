"""TorchTitan's own models at exactly the shape of a gamma_titan model: the yardsticks of
the performance targets.

  gamma_dense (gate "none")          -> TorchTitan llama3  (same width, depth, heads, KV
                                        heads, SwiGLU width, vocabulary, RoPE θ)
  gamma_moe (MHA, gate "none",       -> TorchTitan qwen3 with MoE in every layer, QK-norm
  n_dense_layers = 0)                   off, head_dim = dim / n_heads, the same routed and
                                        shared experts, top-k, score function and balancing
  gamma_moe (MLA, gate "none")       -> TorchTitan deepseek_v3: the same dense and MoE
                                        layers, low-rank projections, experts and routing

Parameter counts are checked to be equal, so a speed or memory ratio compares the same
arithmetic done by two implementations.
"""

from __future__ import annotations

import contextlib

import torch

import gamma_titan  # noqa: F401  (CPU shims before TorchTitan)


def llama3_args(dense):
    """TorchTitan's TransformerModelArgs for a gamma_dense shape. llama3 derives its SwiGLU
    width from dim: multiple_of · ceil(int(8·dim/3) / multiple_of); pick the multiple_of
    that gives ours."""
    from torchtitan.models.llama3 import TransformerModelArgs

    base = int(2 * 4 * dense.dim / 3)
    multiple = next((m for m in range(dense.ffn_hidden_dim, 0, -1)
                     if dense.ffn_hidden_dim % m == 0 and m * -(-base // m) == dense.ffn_hidden_dim), None)
    if multiple is None:
        raise ValueError(f"llama3 cannot express SwiGLU width {dense.ffn_hidden_dim} at dim {dense.dim}")
    return TransformerModelArgs(
        dim=dense.dim, n_layers=dense.n_layers, n_heads=dense.n_heads, n_kv_heads=dense.n_kv_heads,
        vocab_size=dense.vocab_size, multiple_of=multiple, norm_eps=dense.norm_eps,
        rope_theta=dense.rope_theta, max_seq_len=dense.max_seq_len,
    )


def qwen3_moe_args(moe, device: torch.device):
    """TorchTitan's Qwen3ModelArgs (MoE in every layer) for a gamma_moe MHA shape, to run on
    `device`: TorchTitan's own experts take their kernel from a flag fixed here (ours
    decide per call), grouped GEMMs only for CUDA."""
    import dataclasses

    from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

    if moe.attention != "mha" or moe.n_dense_layers != 0:
        raise ValueError("qwen3 has MHA attention and MoE in every layer: use attention = 'mha', "
                         "n_dense_layers = 0")
    return Qwen3ModelArgs(
        dim=moe.dim, n_layers=moe.n_layers, n_heads=moe.n_heads, n_kv_heads=moe.kv_heads,
        vocab_size=moe.vocab_size, head_dim=moe.head_dim, norm_eps=moe.norm_eps,
        rope_theta=moe.rope_theta, qk_norm=False, max_seq_len=moe.max_seq_len,
        moe_enabled=True, moe_inter_dim=moe.moe_hidden_dim,
        moe_args=dataclasses.replace(moe.moe_args(), use_grouped_mm=device.type == "cuda"),
    )


def deepseek_v3_args(moe, device: torch.device):
    """TorchTitan's DeepSeekV3ModelArgs for a gamma_moe MLA shape (its first
    `n_dense_layers` dense, the rest MoE; the same low-rank projections, routed and shared
    experts, top-k, score function and balancing), with RoPE unscaled (YaRN only past
    `original_seq_len`, set to the sequence length), to run on `device` (grouped GEMMs only
    for CUDA, as for qwen3)."""
    import dataclasses

    from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs

    if moe.attention != "mla":
        raise ValueError("deepseek_v3 has MLA attention: use attention = 'mla'")
    args = DeepSeekV3ModelArgs(
        dim=moe.dim, n_layers=moe.n_layers, n_dense_layers=moe.n_dense_layers, n_heads=moe.n_heads,
        vocab_size=moe.vocab_size, inter_dim=moe.ffn_hidden_dim, moe_inter_dim=moe.moe_hidden_dim,
        norm_eps=moe.norm_eps, q_lora_rank=moe.q_lora_rank, kv_lora_rank=moe.kv_lora_rank,
        qk_nope_head_dim=moe.qk_nope_head_dim, qk_rope_head_dim=moe.qk_rope_head_dim, v_head_dim=moe.v_head_dim,
        max_seq_len=moe.max_seq_len, original_seq_len=moe.max_seq_len, rope_theta=moe.rope_theta,
        attn_type="sdpa", attn_mask_type="causal",
        moe_args=dataclasses.replace(moe.moe_args(), use_grouped_mm=device.type == "cuda"),
    )
    args.moe_impl = "standard"  # what update_from_config sets from [parallelism]'s default
    return args


def build(model_cls, args, device: torch.device) -> torch.nn.Module:
    with torch.device("meta"):
        model = model_cls(args)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=device)
    return model


def llama3_model(dense, device):
    from torchtitan.models.llama3 import Transformer

    return build(Transformer, llama3_args(dense), device)


def qwen3_moe_model(moe, device):
    from torchtitan.models.qwen3.model.model import Qwen3Model

    return build(Qwen3Model, qwen3_moe_args(moe, device), device)


def deepseek_v3_model(moe, device):
    from torchtitan.models.deepseek_v3.model.model import DeepSeekV3Model

    return build(DeepSeekV3Model, deepseek_v3_args(moe, device), device)


@contextlib.contextmanager
def cpu_histc():
    """TorchTitan's MoE counts tokens per expert with torch.histc on int64, which the CPU
    does not implement; on the CPU, count in float for the reference model (exact for
    these counts). No-op on CUDA."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.histc

    def histc(x, *args, **kwargs):
        if x.is_floating_point():
            return original(x, *args, **kwargs)
        return original(x.float(), *args, **kwargs).to(x.dtype)  # as CUDA: counts in the input dtype

    torch.histc = histc
    try:
        yield
    finally:
        torch.histc = original


def parallelize_one_process(model: torch.nn.Module, spec_name: str, job_config) -> torch.nn.Module:
    """A TrainSpec's own `parallelize_fn` on a world of one: what its trainer applies
    (activation checkpointing, torch.compile) when there is nothing to shard."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.train_spec import get_train_spec

    import gamma_titan.training.train_spec  # noqa: F401  (registers the families)

    one = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    return get_train_spec(spec_name).parallelize_fn(model, one, job_config)


def same_parameter_count(a: torch.nn.Module, b: torch.nn.Module) -> None:
    na, nb = (sum(p.numel() for p in m.parameters()) for m in (a, b))
    if na != nb:
        raise AssertionError(f"shapes differ: {na:,} vs {nb:,} parameters")


