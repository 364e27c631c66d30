"""The Hugging Face form every family shares: the adapter contract, the config.json keys of
the decoder skeleton, and the layout of the project's own `GammaForCausalLM` package.

A family's `state_dict_adapter.py` subclasses `HFStateDictAdapter`. TorchTitan's
CheckpointManager uses its `to_hf` / `from_hf` / `fqn_to_index_mapping` /
`get_hf_storage_reader` for `checkpoint.last_save_in_hf` and `checkpoint.initial_load_in_hf`;
`gamma-titan convert` uses the same methods, plus config.json both ways (`hf_config`,
`args_from_hf_config`), so a folder written by either path is the same.

`GammaForCausalLM` (gamma_titan/convert/hf_package/, loaded with `trust_remote_code=True`)
mirrors our modules, so its tensor names are ours under "model.", except the output head,
which stays "output.weight".
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, ClassVar

import torch
from torchtitan.protocols.state_dict_adapter import StateDictAdapter

from gamma_titan.errors import ConfigError
from gamma_titan.files import HF_INDEX_FILE

GAMMA_MODEL_TYPE = "gamma_titan"


def gamma_architecture(model_class: str = "GammaForCausalLM", module: str = "modeling_gamma") -> dict[str, Any]:
    """config.json's keys that make transformers load the modeling code the folder carries:
    `GammaForCausalLM`, or a family's subclass of it in a file of its own (`HF_CODE`)."""
    return {"architectures": [model_class], "model_type": GAMMA_MODEL_TYPE,
            "auto_map": {"AutoConfig": "configuration_gamma.GammaConfig",
                         "AutoModelForCausalLM": f"{module}.{model_class}"}}


GAMMA_ARCHITECTURE = gamma_architecture()
_OUTPUT = "output.weight"


class HFStateDictAdapter(StateDictAdapter):
    """TorchTitan's StateDictAdapter for one family, plus its config.json both ways.

    Subclasses set `HF_MODEL_TYPES` (the config.json `model_type`s the family reads) and
    implement `to_hf`, `from_hf`, `hf_config` and `args_from_hf_config`. `from_hf` raises a
    one-line ConfigError for a tensor name the family has no counterpart for.
    """

    HF_MODEL_TYPES: ClassVar[tuple[str, ...]] = ()
    #: Modeling files of the family's own (its block as a `GammaForCausalLM` subclass),
    #: shipped next to the shared package's (convert/hf_package/) when config.json's
    #: `auto_map` asks for the package.
    HF_CODE: ClassVar[tuple[Path, ...]] = ()
    #: why the model is written as GammaForCausalLM rather than a transformers class of its own
    #: (TorchTitan's families set it per model; ours have no other class)
    package_reason: str | None = None

    def __init__(self, model_args, hf_assets_path: str | None):
        # The base class reads the safetensors index under hf_assets_path (how to shard an HF
        # save). Ours is usually a tokenizer folder without one ("builtin" by default), where
        # the base would warn at every start: give it the path only when an index is there.
        has_index = bool(hf_assets_path) and os.path.isfile(os.path.join(hf_assets_path, HF_INDEX_FILE))
        super().__init__(model_args, hf_assets_path if has_index else None)
        self.hf_assets_path = hf_assets_path  # where initial_load_in_hf reads without initial_load_path
        self.model_args = model_args

    def hf_config(self) -> dict[str, Any]:
        """config.json for `self.model_args`: architecture, shape and knobs. The caller adds
        what is not the model's (token ids, dtype, the TrainSpec name)."""
        raise NotImplementedError

    @classmethod
    def args_from_hf_config(cls, cfg: dict[str, Any]):
        """The family's model args for a config.json this family reads (checked); a one-line
        ConfigError naming the key for a missing key or a model the family cannot represent."""
        raise NotImplementedError


# --- config.json ------------------------------------------------------------------------


def require(cfg: dict[str, Any], key: str) -> Any:
    """cfg[key], or a one-line ConfigError naming it."""
    if key not in cfg:
        raise ConfigError(f"config.json: {key!r} is missing")
    return cfg[key]


def decoder_config(args) -> dict[str, Any]:
    """The keys Llama's config.json and GammaForCausalLM's share: the decoder skeleton
    (embedding, attention heads, dense SwiGLU width, RMSNorm ε, untied output head)."""
    return {
        "vocab_size": args.vocab_size,
        "hidden_size": args.dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.kv_heads,
        "intermediate_size": args.ffn_hidden_dim,
        "rms_norm_eps": args.norm_eps,
        "max_position_embeddings": args.max_seq_len,
        "tie_word_embeddings": False,
    }


def read_decoder_config(args, cfg: dict[str, Any]) -> None:
    """Set the fields of `decoder_config` on `args` from `cfg` (the inverse)."""
    heads = require(cfg, "num_attention_heads")
    kv = cfg.get("num_key_value_heads") or heads
    args.dim, args.n_layers = require(cfg, "hidden_size"), require(cfg, "num_hidden_layers")
    args.n_heads, args.n_kv_heads = heads, None if kv == heads else kv
    args.ffn_hidden_dim, args.vocab_size = require(cfg, "intermediate_size"), require(cfg, "vocab_size")
    args.norm_eps = float(cfg.get("rms_norm_eps", 1e-6))  # transformers' default
    args.max_seq_len = cfg.get("max_position_embeddings", args.max_seq_len)


def gamma_config(args, architecture: dict[str, Any] = GAMMA_ARCHITECTURE) -> dict[str, Any]:
    """GammaForCausalLM's config.json for what every family holds; a family adds its own keys."""
    return {**architecture, **decoder_config(args), "rope_theta": args.rope_theta,
            "attention_gate": args.attention_gate}


def read_gamma_config(args, cfg: dict[str, Any]) -> None:
    """The inverse of `gamma_config` on `args`."""
    read_decoder_config(args, cfg)
    args.rope_theta = float(require(cfg, "rope_theta"))
    args.attention_gate = require(cfg, "attention_gate")


# --- GammaForCausalLM tensor names -----------------------------------------------------------


def gamma_to_hf(state: dict[str, Any]) -> dict[str, Any]:
    return {(k if k == _OUTPUT else f"model.{k}"): v for k, v in state.items()}


def gamma_from_hf(hf_state: dict[str, Any], family: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in hf_state.items():
        if name != _OUTPUT and not name.startswith("model."):
            raise ConfigError(f"HF weights: tensor {name!r} has no counterpart in {family}")
        out[name.removeprefix("model.")] = tensor
    return out


class GammaPackageAdapter(HFStateDictAdapter):
    """The whole adapter of a family of gated attention and SwiGLU blocks (AttentionFFNArgs)
    whose Hugging Face form is its own block in the package: a subclass names its args
    class (`ARGS`), its `GammaForCausalLM` subclass (`HF_CLASS`) and the file that holds it
    (`HF_CODE`, one file, named as transformers imports it). Tensor names are ours under
    "model.", as for every family written as the package."""

    HF_MODEL_TYPES = (GAMMA_MODEL_TYPE,)
    ARGS: ClassVar[type]
    HF_CLASS: ClassVar[str]
    package_reason = "no transformers class has this block"

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return gamma_to_hf(state_dict)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        return gamma_from_hf(hf_state_dict, self.HF_CLASS)

    def hf_config(self) -> dict[str, Any]:
        return gamma_config(self.model_args, gamma_architecture(self.HF_CLASS, self.HF_CODE[0].stem))

    @classmethod
    def args_from_hf_config(cls, cfg: dict[str, Any]):
        args = cls.ARGS()
        read_gamma_config(args, cfg)
        args.check()
        return args
