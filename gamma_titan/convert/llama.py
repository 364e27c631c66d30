"""gamma_dense without the attention gate <-> Hugging Face `LlamaForCausalLM`, exactly.

The dense model was written to be Llama: RMSNorm before attention and FFN, SwiGLU
(w2(silu(w1 x) * w3 x)), grouped-query attention without biases, rotary embeddings in the
"rotate half" layout with the default inverse frequencies, untied embeddings. So the
conversion renames tensors and nothing else; ε and θ go into config.json as they are.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from gamma_titan.errors import ConfigError

# our name (with {i} for the layer) -> transformers name
_LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
}
_TOP_NAMES = {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def represents(model_name: str, args) -> bool:
    return model_name == "gamma_dense" and args.attention_gate == "none"


def config(args, bos_id: int | None, eos_id: int | None, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_hidden_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": args.max_seq_len,
        "rms_norm_eps": args.norm_eps,
        # transformers >= 5 reads rope_parameters; 4.x reads rope_theta
        "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
        "rope_theta": args.rope_theta,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "dtype": str(dtype).removeprefix("torch."),
    }


def to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        match = _LAYER.fullmatch(name)
        if match:
            out[f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}"] = tensor
        else:
            out[_TOP_NAMES[name]] = tensor
    return out


def from_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    layer_names = {v: k for k, v in _LAYER_NAMES.items()}
    top_names = {v: k for k, v in _TOP_NAMES.items()}
    out = {}
    for name, tensor in state.items():
        match = _HF_LAYER.fullmatch(name)
        if match and match[2] in layer_names:
            out[f"layers.{match[1]}.{layer_names[match[2]]}"] = tensor
        elif name in top_names:
            out[top_names[name]] = tensor
        elif not name.endswith("rotary_emb.inv_freq"):  # a buffer some exporters save
            raise ConfigError(f"HF_DIR: tensor {name!r} has no counterpart in gamma_dense")
    if "output.weight" not in out and "tok_embeddings.weight" in out:  # tied embeddings
        out["output.weight"] = out["tok_embeddings.weight"].clone()
    return out


def set_decoder_shape(args, cfg: dict[str, Any]) -> None:
    """Width, depth, heads, (dense) FFN width and vocabulary from HF config keys, which our
    package's config.json shares with Llama's."""
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    args.dim, args.n_layers, args.n_heads = cfg["hidden_size"], cfg["num_hidden_layers"], heads
    args.n_kv_heads = None if kv == heads else kv
    args.ffn_hidden_dim, args.vocab_size = cfg["intermediate_size"], cfg["vocab_size"]


def args_from_config(cfg: dict[str, Any]):
    """DenseModelArgs for a Llama config.json; one-line error for what Llama can do and we cannot."""
    from gamma_titan.models.dense import dense_flavors

    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    problems = {
        "rope scaling": rope_type not in (None, "default"),
        "attention_bias": bool(cfg.get("attention_bias")),
        "mlp_bias": bool(cfg.get("mlp_bias")),
        "hidden_act": cfg.get("hidden_act", "silu") != "silu",
        "head_dim": cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        != cfg["hidden_size"] // cfg["num_attention_heads"],
    }
    bad = [k for k, v in problems.items() if v]
    if bad:
        raise ConfigError(f"HF_DIR: this Llama uses {', '.join(bad)}, which gamma_dense does not represent")
    args = dense_flavors["debug"]
    set_decoder_shape(args, cfg)
    args.rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    args.max_seq_len = cfg.get("max_position_embeddings", args.max_seq_len)
    args.norm_eps = float(cfg.get("rms_norm_eps", 1e-6))
    args.attention_gate = "none"
    args.check()
    return args
