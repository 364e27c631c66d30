"""Gated gamma_dense and every gamma_moe <-> the self-contained `GammaForCausalLM`
package (hf_package/).

No transformers class has the attention output gate. None feeds a routed expert its
token already scaled by the router score, as TorchTitan's MoE does (score_before_experts):
DeepSeek-V3, GLM-4-MoE and Qwen-MoE scale the expert's output, which is a different
function for a SwiGLU expert. So these models get a folder that carries its own modeling
code (configuration_gamma.py, modeling_gamma.py, written by this project and loaded with
`trust_remote_code=True`). Its modules mirror ours, so tensor names map by prefix alone:
"model." + ours, except the output projection.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gamma_titan.convert.llama import set_decoder_shape
from gamma_titan.errors import ConfigError

MODEL_TYPE = "gamma_titan"
PACKAGE = Path(__file__).parent / "hf_package"
CODE_FILES = ("configuration_gamma.py", "modeling_gamma.py")


MODELS = ("gamma_dense", "gamma_moe")


def represents(model_name: str, args) -> bool:
    return model_name in MODELS


def config(args, bos_id: int | None, eos_id: int | None, dtype: torch.dtype) -> dict[str, Any]:
    moe = hasattr(args, "n_routed_experts")
    extra = {}
    if moe:
        extra = {
            "attention": args.attention, "q_lora_rank": args.q_lora_rank, "kv_lora_rank": args.kv_lora_rank,
            "qk_nope_head_dim": args.qk_nope_head_dim, "qk_rope_head_dim": args.qk_rope_head_dim,
            "v_head_dim": args.v_head_dim, "n_routed_experts": args.n_routed_experts,
            "n_shared_experts": args.n_shared_experts, "num_experts_per_tok": args.top_k,
            "moe_intermediate_size": args.moe_hidden_dim, "n_dense_layers": args.n_dense_layers,
            "score_func": args.score_func, "route_norm": args.route_norm, "route_scale": args.route_scale,
            "expert_bias": args.load_balance_coeff is not None,
        }
    return {
        "architectures": ["GammaForCausalLM"],
        "gamma_titan_model": "gamma_moe" if moe else "gamma_dense",
        "model_type": MODEL_TYPE,
        "auto_map": {"AutoConfig": "configuration_gamma.GammaConfig",
                     "AutoModelForCausalLM": "modeling_gamma.GammaForCausalLM"},
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "intermediate_size": args.ffn_hidden_dim,
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "max_position_embeddings": args.max_seq_len,
        "attention_gate": args.attention_gate,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "dtype": str(dtype).removeprefix("torch."),
        **extra,
    }


def to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {(k if k == "output.weight" else f"model.{k}"): v for k, v in state.items()}


def from_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        if name != "output.weight" and not name.startswith("model."):
            raise ConfigError(f"HF_DIR: tensor {name!r} has no counterpart in gamma-titan's models")
        out[name.removeprefix("model.")] = tensor
    return out


def args_from_config(cfg: dict[str, Any]):
    from gamma_titan.models.dense import dense_flavors
    from gamma_titan.models.moe import moe_flavors

    moe = cfg.get("gamma_titan_model") == "gamma_moe"
    args = moe_flavors["debug"] if moe else dense_flavors["debug"]
    if moe:
        args.attention, args.q_lora_rank, args.kv_lora_rank = cfg["attention"], cfg["q_lora_rank"], cfg["kv_lora_rank"]
        args.qk_nope_head_dim, args.qk_rope_head_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        args.v_head_dim, args.n_routed_experts = cfg["v_head_dim"], cfg["n_routed_experts"]
        args.n_shared_experts, args.top_k = cfg["n_shared_experts"], cfg["num_experts_per_tok"]
        args.moe_hidden_dim, args.n_dense_layers = cfg["moe_intermediate_size"], cfg["n_dense_layers"]
        args.score_func, args.route_norm, args.route_scale = cfg["score_func"], cfg["route_norm"], cfg["route_scale"]
        # the bias step size is a training setting; what matters here is whether the bias exists
        args.load_balance_coeff = (args.load_balance_coeff or 1e-3) if cfg["expert_bias"] else None
    set_decoder_shape(args, cfg)
    args.rope_theta, args.max_seq_len = float(cfg["rope_theta"]), cfg["max_position_embeddings"]
    args.norm_eps, args.attention_gate = float(cfg["rms_norm_eps"]), cfg["attention_gate"]
    args.check()
    return args
