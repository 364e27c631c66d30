"""The Hugging Face form every TorchTitan family here shares.

A checkpoint goes to the model's usual transformers class (LlamaForCausalLM,
Qwen3ForCausalLM, DeepseekV3ForCausalLM, ...) through TorchTitan's own adapter when that class computes exactly
this model; otherwise to the project's `GammaForCausalLM` (convert/hf_package), which
holds the gate and every variant TorchTitan trains. `package_reason` says which and why,
so that `convert to-hf` can tell the user. Also here: the gate projection's key, renaming
by an adapter's table (`from_hf_map`, layer numbers abstracted as "{}"), and the MoE keys
of GammaForCausalLM's config.json for TorchTitan's `MoEArgs`.
"""

from __future__ import annotations

import re
from typing import Any

#: The gate projection under HF names (as GammaForCausalLM and the families' maps spell it).
GATE_HF = "model.layers.{}.self_attn.gate_proj.weight"
GATE_TITAN = "layers.{}.attention.gate_proj.weight"
_LAYER = re.compile(r"(\d+)")


def package_reason(args, transformers_mismatch: str | None) -> str | None:
    """Why the model goes to GammaForCausalLM instead of its usual transformers class: the
    gate, or `transformers_mismatch` (what that class computes otherwise); None: it does not."""
    if args.attention_gate != "none":
        return "the attention gate (no transformers class has it)"
    return transformers_mismatch


def gamma_moe_config(moe_args, moe_inter_dim: int, n_dense_layers: int = 0) -> dict[str, Any]:
    """GammaForCausalLM's config.json keys for TorchTitan's MoE layers (`MoEArgs`)."""
    return {"n_routed_experts": moe_args.num_experts, "n_shared_experts": moe_args.num_shared_experts,
            "num_experts_per_tok": moe_args.top_k, "moe_intermediate_size": moe_inter_dim,
            "n_dense_layers": n_dense_layers, "score_func": moe_args.score_func, "route_norm": moe_args.route_norm,
            "route_scale": moe_args.route_scale, "expert_bias": moe_args.load_balance_coeff is not None,
            "score_before_experts": moe_args.score_before_experts,
            "num_expert_groups": moe_args.num_expert_groups, "num_limited_groups": moe_args.num_limited_groups,
            "router_bias": moe_args.gate_bias}


def rename(key: str, table: dict[str, str]) -> str:
    """`key` through `table`, whose keys have the layer number as "{}"."""
    layer = _LAYER.search(key)
    return table[_LAYER.sub("{}", key, count=1)].format(layer.group(0)) if layer else table[key]


def renamed(state: dict[str, Any], table: dict[str, str]) -> dict[str, Any]:
    return {rename(k, table): v for k, v in state.items()}


def inverse(table: dict[str, str | None]) -> dict[str, str]:
    return {v: k for k, v in table.items() if v is not None}
