"""gamma_moe <-> Hugging Face: the project's `GammaForCausalLM` (models/common/hf_layout.py),
with or without the gate, MHA or MLA.

No transformers class feeds a routed expert its token already scaled by the router score,
as TorchTitan's MoE does (score_before_experts): DeepSeek-V3, GLM-4-MoE and Qwen-MoE scale
the expert's output, a different function for a SwiGLU expert. So every gamma_moe goes to
the package, whose config.json carries the MoE and MLA keys below.
"""

from __future__ import annotations

from typing import Any

from gamma_titan.models.common.hf_layout import (
    GAMMA_MODEL_TYPE,
    HFStateDictAdapter,
    gamma_config,
    gamma_from_hf,
    gamma_to_hf,
    read_gamma_config,
    require,
)

from .args import moe_flavors

# our args field -> its GammaConfig key; the values are the same both ways
_MOE_KEYS = {
    "attention": "attention", "q_lora_rank": "q_lora_rank", "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim", "qk_rope_head_dim": "qk_rope_head_dim", "v_head_dim": "v_head_dim",
    "n_routed_experts": "n_routed_experts", "n_shared_experts": "n_shared_experts",
    "top_k": "num_experts_per_tok", "moe_hidden_dim": "moe_intermediate_size", "n_dense_layers": "n_dense_layers",
    "score_func": "score_func", "route_norm": "route_norm", "route_scale": "route_scale",
}
# the bias step size is a training setting; config.json says only whether the bias exists
_DEFAULT_BIAS_STEP = 1e-3


class MoEStateDictAdapter(HFStateDictAdapter):
    HF_MODEL_TYPES = (GAMMA_MODEL_TYPE,)

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return gamma_to_hf(state_dict)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return gamma_from_hf(hf_state_dict, "gamma_moe")

    def hf_config(self) -> dict[str, Any]:
        args = self.model_args
        return {**gamma_config(args), **{key: getattr(args, field) for field, key in _MOE_KEYS.items()},
                "expert_bias": args.load_balance_coeff is not None}

    @classmethod
    def args_from_hf_config(cls, cfg: dict[str, Any]):
        args = moe_flavors["debug"]  # every field that matters is set below
        read_gamma_config(args, cfg)
        for field, key in _MOE_KEYS.items():
            setattr(args, field, require(cfg, key))
        has_bias = require(cfg, "expert_bias")
        args.load_balance_coeff = (args.load_balance_coeff or _DEFAULT_BIAS_STEP) if has_bias else None
        args.check()
        return args
