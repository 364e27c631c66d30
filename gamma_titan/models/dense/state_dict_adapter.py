"""gamma_dense <-> Hugging Face: transformers' `LlamaForCausalLM` without the attention
gate, the project's `GammaForCausalLM` with it (models/common/hf_layout.py).

Without the gate the model is Llama exactly: RMSNorm before attention and FFN, SwiGLU
(w2(silu(w1 x) * w3 x)), grouped-query attention without biases, rotary embeddings in the
"rotate half" layout that transformers uses (so, unlike TorchTitan's Llama 3, no
permutation of wq / wk), untied embeddings. Tensors are renamed and nothing else; ε and θ
go into config.json as they are. No transformers class has the gate, hence the package.
"""

from __future__ import annotations

import re
from typing import Any

from gamma_titan.errors import ConfigError
from gamma_titan.models.common.hf_layout import (
    GAMMA_MODEL_TYPE,
    HFStateDictAdapter,
    decoder_config,
    gamma_config,
    gamma_from_hf,
    gamma_to_hf,
    read_decoder_config,
    read_gamma_config,
    require,
)

from .args import dense_flavors

LLAMA_MODEL_TYPE = "llama"

# our name (after "layers.{i}.") -> Llama's (after "model.layers.{i}.")
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
_FROM_LAYER = {v: k for k, v in _LAYER_NAMES.items()}
_FROM_TOP = {v: k for k, v in _TOP_NAMES.items()}


class DenseStateDictAdapter(HFStateDictAdapter):
    """The layout follows `model_args.attention_gate`: "none" -> Llama, else GammaForCausalLM."""

    HF_MODEL_TYPES = (LLAMA_MODEL_TYPE, GAMMA_MODEL_TYPE)

    def __init__(self, model_args, hf_assets_path: str | None):
        super().__init__(model_args, hf_assets_path)
        self.llama = model_args.attention_gate == "none"

    # --- tensors --------------------------------------------------------------------------

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if not self.llama:
            return gamma_to_hf(state_dict)
        out = {}
        for name, tensor in state_dict.items():
            match = _LAYER.fullmatch(name)
            out[f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}" if match else _TOP_NAMES[name]] = tensor
        return out

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        if not self.llama:
            return gamma_from_hf(hf_state_dict, "gamma_dense")
        out = {}
        for name, tensor in hf_state_dict.items():
            match = _HF_LAYER.fullmatch(name)
            if match and match[2] in _FROM_LAYER:
                out[f"layers.{match[1]}.{_FROM_LAYER[match[2]]}"] = tensor
            elif name in _FROM_TOP:
                out[_FROM_TOP[name]] = tensor
            elif not name.endswith("rotary_emb.inv_freq"):  # a buffer some exporters save
                raise ConfigError(f"HF weights: tensor {name!r} has no counterpart in gamma_dense")
        if "output.weight" not in out and "tok_embeddings.weight" in out:  # a Llama with tied embeddings
            out["output.weight"] = out["tok_embeddings.weight"].clone()
        return out

    # --- config.json ----------------------------------------------------------------------

    def hf_config(self) -> dict[str, Any]:
        args = self.model_args
        if not self.llama:
            return gamma_config(args)
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": LLAMA_MODEL_TYPE,
            **decoder_config(args),
            "head_dim": args.head_dim,
            "hidden_act": "silu",
            # transformers >= 5 reads rope_parameters; 4.x reads rope_theta
            "rope_parameters": {"rope_type": "default", "rope_theta": args.rope_theta},
            "rope_theta": args.rope_theta,
            "attention_bias": False,
            "mlp_bias": False,
        }

    @classmethod
    def args_from_hf_config(cls, cfg: dict[str, Any]):
        args = dense_flavors["debug"]  # every field that matters is set below
        if cfg.get("model_type") == GAMMA_MODEL_TYPE:
            read_gamma_config(args, cfg)
        else:
            _check_llama(cfg)
            read_decoder_config(args, cfg)
            rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
            args.rope_theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
            args.attention_gate = "none"
        args.check()
        return args


def _check_llama(cfg: dict[str, Any]) -> None:
    """One-line error for what a Llama can do and gamma_dense cannot."""
    heads, width = require(cfg, "num_attention_heads"), require(cfg, "hidden_size")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    problems = {
        "rope scaling": rope.get("rope_type", rope.get("type", "default")) not in (None, "default"),
        "attention_bias": bool(cfg.get("attention_bias")),
        "mlp_bias": bool(cfg.get("mlp_bias")),
        "hidden_act": cfg.get("hidden_act", "silu") != "silu",
        "head_dim": cfg.get("head_dim", width // heads) != width // heads,
    }
    bad = [k for k, v in problems.items() if v]
    if bad:
        raise ConfigError(f"config.json: this Llama uses {', '.join(bad)}, which gamma_dense does not represent")
