"""deepseek_v3: TorchTitan's DeepSeek-V3 (model, flavors, parallelize and pipelining
functions, state-dict adapter) with the paper's knobs from [gamma] (models/titan/knobs.py).

What differs from llama3: the attention is multi-head latent attention (MLA: keys and
values from one compressed latent through kv_norm, queries direct or through q_norm, a
rotary slice shared by all heads), so a head's output is `v_head_dim` wide and the gate
has that many channels per head (elementwise); the final norm has no ε of its own
(PyTorch's machine epsilon), which `norm_eps` sets like every other; layers from
`n_dense_layers` on are TorchTitan's MoE, run on a CPU by models/titan/moe.py. TorchTitan's
optimizers for this family update the expert bias (auxiliary-loss-free balancing). In
Hugging Face form it is transformers' DeepseekV3 only where that class computes exactly
this model (`transformers_mismatch`), GammaForCausalLM otherwise.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchtitan.models.deepseek_v3 import deepseekv3_args
from torchtitan.models.deepseek_v3 import get_train_spec as titan_spec
from torchtitan.models.deepseek_v3.infra.parallelize import parallelize_deepseekv3
from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.model.model import (Attention, DeepSeekV3Model, apply_rotary_emb,
                                                       precompute_freqs_cis)
from torchtitan.models.deepseek_v3.model.state_dict_adapter import DeepSeekV3StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec

from gamma_titan.errors import ConfigError
from gamma_titan.models.common.flavors import Flavors
from gamma_titan.models.common.hf_layout import GAMMA_ARCHITECTURE, gamma_from_hf, gamma_to_hf
from gamma_titan.models.common.sdpa_kernels import AttentionShape

from .hf import gamma_moe_config, package_reason
from .knobs import GateProjection, TitanArgs, TitanKnobs, local, parallelize_gate_projections
from .moe import complete_router_gradients


@dataclass
class DeepSeekV3Args(TitanArgs, DeepSeekV3ModelArgs):
    # TorchTitan sets it in update_from_config only; a field, so that args built otherwise
    # (copies, inspect, converters) build the model too.
    moe_impl: str = "standard"

    def model_class(self) -> type[nn.Module]:
        return DeepSeekV3

    def supports_pipeline_parallel(self) -> bool:
        return True

    @property
    def head_dim(self) -> int:
        """A head's output width: what the gate scales (v_head_dim under MLA)."""
        return self.v_head_dim

    def attention_shapes(self) -> list[AttentionShape]:
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        return [AttentionShape("mla", qk, self.v_head_dim, self.n_heads, self.n_heads)]

    def expert_parallel_divisor(self) -> int:
        return self.moe_args.num_experts if self.n_layers > self.n_dense_layers else 1

    def float8_excluded_fqns(self) -> list[str]:
        return [*super().float8_excluded_fqns(), "moe.router.gate"]

    def default_cosine_params(self) -> list[str]:
        """The first and last layer's output projection and first FFN matrix (a MoE layer's
        shared experts; the routed ones are 3-D)."""
        def ffn(layer: int) -> str:
            if layer < self.n_dense_layers:
                return "feed_forward.w1"
            return "moe.shared_experts.w1" if self.moe_args.num_shared_experts else "attention.wkv_b"

        return [f"layers.{layer}.{w}.weight" for layer in sorted({0, self.n_layers - 1})
                for w in ("attention.wo", ffn(layer))]


class DeepSeekV3Attention(Attention):
    """TorchTitan's MLA, unchanged, plus what the diagnostics' probe asks."""

    gate = "none"

    @property
    def probe_scale(self) -> float:
        """The softmax scale forward uses: 1/√qk_head_dim, times YaRN's mscale² past the
        original context."""
        return self.softmax_scale

    def probe_qk(self, x: torch.Tensor, freqs_cis: torch.Tensor, *args) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys as forward makes them, (bs, seqlen, local heads, qk_head_dim):
        the rotary slice of each rotated, the key's shared by every head (under TP, this
        rank's heads: TorchTitan's plan keeps them DTensors)."""
        q, k, _ = self._qkv(x, freqs_cis, args[1] if len(args) > 1 else None)
        return local(q), local(k)

    def _qkv(self, x, freqs_cis, positions):
        bsz, seqlen, _ = x.shape
        q = self.wq(x) if self.q_lora_rank == 0 else self.wq_b(self.q_norm(self.wq_a(x)))
        q_nope, q_pe = q.view(bsz, seqlen, -1, self.qk_head_dim).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        q = torch.cat([q_nope, apply_rotary_emb(q_pe, freqs_cis, positions)], dim=-1)
        kv, k_pe = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = apply_rotary_emb(k_pe.unsqueeze(2), freqs_cis, positions)
        kv = self.wkv_b(self.kv_norm(kv)).view(bsz, seqlen, -1, self.qk_nope_head_dim + self.v_head_dim)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, -1, self.n_heads, -1)], dim=-1)
        return q, k, v


class GatedDeepSeekV3Attention(GateProjection, DeepSeekV3Attention):
    def __init__(self, args: DeepSeekV3Args):
        super().__init__(args)
        self.add_gate(args, self.v_head_dim)

    def forward(self, x, freqs_cis, attention_masks, positions=None):
        bsz, seqlen, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self._qkv(x, freqs_cis, positions))  # (bs, heads, seqlen, ·)
        if self.attn_type == "flex":
            out = self.inner_attention(q, k, v, block_mask=attention_masks, scale=self.softmax_scale)
        else:
            out = self.inner_attention(q, k, v, scale=self.softmax_scale)
        return self.wo(self.gated(out.transpose(1, 2), x).reshape(bsz, seqlen, -1))


class DeepSeekV3(TitanKnobs, DeepSeekV3Model):
    def __init__(self, args: DeepSeekV3Args):
        super().__init__(args)
        self.apply_knobs(DeepSeekV3Attention, GatedDeepSeekV3Attention)

    def init_rope(self, device) -> None:
        with torch.device(device):
            self.freqs_cis = precompute_freqs_cis(self.model_args)


def parallelize(model: nn.Module, parallel_dims, job_config):
    """TorchTitan's parallelize_deepseekv3, the gate projections column-parallel first (each
    rank's local heads, as TorchTitan's plan hands the attention output to `wo`; TorchTitan
    refuses float8 tensorwise TP for this model)."""
    parallelize_gate_projections(model, parallel_dims, job_config, local_output=True)
    model = parallelize_deepseekv3(model, parallel_dims, job_config)
    complete_router_gradients(model, parallel_dims)
    return model


#: transformers' DeepSeek MLA norms (q_a_layernorm, kv_a_layernorm) take no ε from config.json: always this
TRANSFORMERS_MLA_EPS = 1e-6


def transformers_mismatch(a: DeepSeekV3Args) -> str | None:
    """What transformers' DeepseekV3ForCausalLM would compute otherwise than this model
    (None: nothing). It routes by sigmoid (plus the expert bias, in groups scored by their
    two best experts, as TorchTitan's node-limited routing does), scales each expert's
    output, always has shared experts, and fixes its MLA norms' ε at 1e-6 while its other
    norms, the final one included, take rms_norm_eps."""
    moe = a.moe_args
    if moe.score_func != "sigmoid":
        return f"transformers' DeepseekV3 routes by sigmoid, this flavor by {moe.score_func}"
    if moe.score_before_experts:
        return "transformers' DeepseekV3 scales each expert's output by its score, this flavor the expert's input"
    if moe.gate_bias or moe.num_shared_experts < 1:
        return "transformers' DeepseekV3 has shared experts and a router without bias; this flavor differs"
    if a.every_norm_eps != TRANSFORMERS_MLA_EPS:
        final = a.every_norm_eps if a.every_norm_eps is not None else "the dtype's machine epsilon"
        return (f"transformers' DeepseekV3 fixes the MLA norms' ε at {TRANSFORMERS_MLA_EPS:g} and its final norm's "
                f"at rms_norm_eps; this model's are {a.norm_eps:g} and {final} (gamma.norm_eps = 1e-6 matches it)")
    return None


class DeepSeekV3Adapter(DeepSeekV3StateDictAdapter):
    """Hugging Face form: transformers' `DeepseekV3ForCausalLM` through TorchTitan's own
    mapping where it computes exactly this model (`transformers_mismatch`: a sigmoid-routed
    flavor with every ε at 1e-6, no gate); otherwise the project's `GammaForCausalLM`
    (convert/hf_package), which has the gate, softmax routing, scores before the experts and
    any ε: TorchTitan's names under "model.", DeepSeek's interleaved RoPE pairs and YaRN in
    config.json (TorchTitan's rotary layout is DeepSeek's, so no weight is permuted)."""

    HF_MODEL_TYPES = ()  # training reads HF through TorchTitan's initial_load_in_hf

    def __init__(self, model_args: DeepSeekV3Args, hf_assets_path: str | None):
        super().__init__(model_args, hf_assets_path)
        self.package_reason = package_reason(model_args, transformers_mismatch(model_args))

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.package_reason is not None:
            return gamma_to_hf(state_dict)
        hf = super().to_hf(state_dict)
        for layer in range(self.model_args.n_dense_layers, self.model_args.n_layers):
            # transformers' router always has the bias; a flavor without load balancing routes with zeros
            key = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
            if f"layers.{layer}.moe.router.gate.weight" in state_dict and key not in hf:
                hf[key] = torch.zeros(self.model_args.moe_args.num_experts)
        return hf

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.package_reason is not None:
            return gamma_from_hf(hf_state_dict, "deepseek_v3")
        state = super().from_hf(hf_state_dict)
        if self.model_args.moe_args.load_balance_coeff is None:  # no expert bias to load into
            state = {k: v for k, v in state.items() if not k.endswith(".moe.expert_bias")}
        return state

    def yarn(self) -> dict[str, Any] | None:
        """DeepSeek's YaRN as TorchTitan applies it: only when trained beyond original_seq_len."""
        a = self.model_args
        if a.max_seq_len <= a.original_seq_len:
            return None
        return {"factor": a.rope_factor, "original_max_position_embeddings": a.original_seq_len,
                "beta_fast": a.beta_fast, "beta_slow": a.beta_slow, "mscale": a.mscale}

    def hf_config(self) -> dict[str, Any]:
        a, moe = self.model_args, self.model_args.moe_args
        mla = {"q_lora_rank": a.q_lora_rank, "kv_lora_rank": a.kv_lora_rank, "qk_nope_head_dim": a.qk_nope_head_dim,
               "qk_rope_head_dim": a.qk_rope_head_dim, "v_head_dim": a.v_head_dim}
        shape = {"vocab_size": a.vocab_size, "hidden_size": a.dim, "num_hidden_layers": a.n_layers,
                 "num_attention_heads": a.n_heads, "num_key_value_heads": a.n_heads, "intermediate_size": a.inter_dim,
                 "rms_norm_eps": a.norm_eps, "max_position_embeddings": a.max_seq_len, "tie_word_embeddings": False}
        yarn = self.yarn()
        if self.package_reason is not None:
            return {**GAMMA_ARCHITECTURE, **shape, **mla, **gamma_moe_config(moe, a.moe_inter_dim, a.n_dense_layers),
                    "attention": "mla", "attention_gate": a.attention_gate, "rope_theta": a.rope_theta,
                    "rope_interleave": True, "yarn_rope_scaling": yarn,
                    "final_norm_eps": "dtype" if a.every_norm_eps is None else a.every_norm_eps}
        rope = {"rope_type": "default", "rope_theta": a.rope_theta}
        if yarn is not None:  # attention_factor 1: TorchTitan scales the softmax by mscale², not cos and sin
            rope = {**rope, "rope_type": "yarn", "factor": yarn["factor"], "beta_fast": yarn["beta_fast"],
                    "beta_slow": yarn["beta_slow"], "original_max_position_embeddings": a.original_seq_len,
                    "mscale": a.mscale, "mscale_all_dim": a.mscale, "attention_factor": 1.0}
            # DeepSeek's convention (which transformers checks the factor against): the extended context
            shape["max_position_embeddings"] = round(a.original_seq_len * a.rope_factor)
        return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **shape, **mla,
                "q_lora_rank": a.q_lora_rank or None, "moe_intermediate_size": a.moe_inter_dim,
                "n_routed_experts": moe.num_experts, "n_shared_experts": moe.num_shared_experts,
                "num_experts_per_tok": moe.top_k, "routed_scaling_factor": moe.route_scale,
                "norm_topk_prob": moe.route_norm, "n_group": moe.num_expert_groups or 1,
                "topk_group": moe.num_limited_groups or 1, "first_k_dense_replace": a.n_dense_layers,
                "hidden_act": "silu", "attention_bias": False, "rope_interleave": True, "rope_parameters": rope,
                "num_nextn_predict_layers": 0}

    @classmethod
    def args_from_hf_config(cls, cfg):
        raise ConfigError("config.json: gamma_titan_model = 'deepseek_v3': to start a deepseek_v3 run from a "
                          "Hugging Face folder, use TorchTitan's --checkpoint.initial_load_in_hf true "
                          "--checkpoint.initial_load_path HF_DIR")


def flavors() -> Flavors:
    """TorchTitan's deepseek_v3 flavors as DeepSeekV3Args."""
    return Flavors({name: DeepSeekV3Args(**{f.name: copy.deepcopy(getattr(args, f.name))
                                            for f in dataclasses.fields(args)})
                    for name, args in deepseekv3_args.items()})


def get_train_spec() -> TrainSpec:
    """TorchTitan's deepseek_v3 TrainSpec (its pipelining function, its optimizers with the
    expert-bias update, ...) with the knob-aware model, args, parallelize function and
    adapter."""
    return dataclasses.replace(
        titan_spec(), model_cls=DeepSeekV3, model_args=flavors(), parallelize_fn=parallelize,
        state_dict_adapter=DeepSeekV3Adapter)
