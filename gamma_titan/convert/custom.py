"""Gated gamma_dense <-> the self-contained `GammaForCausalLM` package (hf_package/).

No transformers class has the attention output gate, so the converted folder carries its
own modeling code (configuration_gamma.py, modeling_gamma.py, written by this project and
loaded with `trust_remote_code=True`). Its modules mirror ours, so tensor names map by
prefix alone: "model." + ours, except the output projection.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from gamma_titan.errors import ConfigError

MODEL_TYPE = "gamma_titan"
PACKAGE = Path(__file__).parent / "hf_package"
CODE_FILES = ("configuration_gamma.py", "modeling_gamma.py")


def represents(model_name: str, args) -> bool:
    return model_name == "gamma_dense"


def config(args, bos_id: int | None, eos_id: int | None, dtype: torch.dtype) -> dict[str, Any]:
    return {
        "architectures": ["GammaForCausalLM"],
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
    }


def to_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {(k if k == "output.weight" else f"model.{k}"): v for k, v in state.items()}


def from_hf(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        if name != "output.weight" and not name.startswith("model."):
            raise ConfigError(f"HF_DIR: tensor {name!r} has no counterpart in gamma_dense")
        out[name.removeprefix("model.")] = tensor
    return out


def args_from_config(cfg: dict[str, Any]):
    from gamma_titan.models.dense import dense_flavors

    args = dense_flavors["debug"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    args.dim, args.n_layers, args.n_heads = cfg["hidden_size"], cfg["num_hidden_layers"], heads
    args.n_kv_heads = None if kv == heads else kv
    args.ffn_hidden_dim, args.vocab_size = cfg["intermediate_size"], cfg["vocab_size"]
    args.rope_theta, args.max_seq_len = float(cfg["rope_theta"]), cfg["max_position_embeddings"]
    args.norm_eps, args.attention_gate = float(cfg["rms_norm_eps"]), cfg["attention_gate"]
    args.check()
    return args
