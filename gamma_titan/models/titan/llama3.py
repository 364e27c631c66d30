"""llama3: TorchTitan's Llama 3 (model, flavors, parallelize and pipelining functions,
state-dict adapter) with the paper's knobs from [gamma] (models/titan/knobs.py).

The gate lives in `GatedLlama3Attention`, the one piece written here: TorchTitan's
attention projects, rotates and attends as always (its own `apply_rotary_emb` and
`inner_attention`), and the gate scales each head's output before `wo`. Every other
attention, gated or not, answers the diagnostics' probe (`probe_qk`, `probe_gate`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchtitan.models.llama3 import get_train_spec as titan_spec
from torchtitan.models.llama3 import llama3_args
from torchtitan.models.llama3.infra.parallelize import parallelize_llama
from torchtitan.models.llama3.model.args import TransformerModelArgs
from torchtitan.models.llama3.model.model import Attention, FeedForward, Transformer, apply_rotary_emb
from torchtitan.models.llama3.model.state_dict_adapter import Llama3StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec

from gamma_titan.errors import ConfigError
from gamma_titan.models.common.flavors import Flavors
from gamma_titan.models.common.hf_layout import GAMMA_ARCHITECTURE, gamma_from_hf, gamma_to_hf
from gamma_titan.models.common.sdpa_kernels import AttentionShape
from gamma_titan.models.common.shapes import HeadShape

from .hf import GATE_HF, GATE_TITAN, inverse, package_reason, renamed
from .knobs import GateProjection, TitanArgs, TitanKnobs, parallelize_gate_projections


@dataclass
class Llama3Args(HeadShape, TitanArgs, TransformerModelArgs):
    def model_class(self) -> type[nn.Module]:
        return Llama3

    def supports_pipeline_parallel(self) -> bool:
        return True

    def attention_shapes(self) -> list[AttentionShape]:
        return [AttentionShape("mha", self.head_dim, self.head_dim, self.n_heads, self.kv_heads)]

    def ffn_hidden_dim(self) -> int:
        """The SwiGLU width TorchTitan's block builds from dim, multiple_of and ffn_dim_multiplier."""
        with torch.device("meta"):
            ffn = FeedForward(dim=self.dim, hidden_dim=4 * self.dim, multiple_of=self.multiple_of,
                              ffn_dim_multiplier=self.ffn_dim_multiplier)
        return ffn.w1.out_features

    def default_cosine_params(self) -> list[str]:
        return [f"layers.{layer}.{w}.weight" for layer in sorted({0, self.n_layers - 1})
                for w in ("attention.wo", "feed_forward.w1")]


class Llama3Attention(Attention):
    """TorchTitan's attention, unchanged, plus what the diagnostics' probe asks."""

    gate = "none"

    def probe_qk(self, x: torch.Tensor, freqs_cis: torch.Tensor, *args) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated queries and keys, (bs, seqlen, local heads, head_dim), as forward makes them."""
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        positions = args[1] if len(args) > 1 else None
        return apply_rotary_emb(q, k, freqs_cis=freqs_cis, positions=positions)


class GatedLlama3Attention(GateProjection, Llama3Attention):
    def __init__(self, args: Llama3Args):
        super().__init__(args)
        self.add_gate(args, self.head_dim)

    def forward(self, x, freqs_cis, attention_masks, positions=None):
        bs, seqlen, _ = x.shape
        q, k = self.probe_qk(x, freqs_cis, attention_masks, positions)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (bs, heads, seqlen, head_dim)
        if self.attn_type == "flex":
            out = self.inner_attention(q, k, v, block_mask=attention_masks, enable_gqa=self.enable_gqa)
        else:
            out = self.inner_attention(q, k, v, enable_gqa=self.enable_gqa)
        return self.wo(self.gated(out.transpose(1, 2), x).reshape(bs, seqlen, -1))


class Llama3(TitanKnobs, Transformer):
    def __init__(self, args: Llama3Args):
        super().__init__(args)
        self.apply_knobs(Llama3Attention, GatedLlama3Attention)

    def init_rope(self, device) -> None:
        with torch.device(device):
            self.freqs_cis = self._precompute_freqs_cis()


def parallelize(model: nn.Module, parallel_dims, job_config):
    """TorchTitan's parallelize_llama, the gate projections column-parallel first (local
    heads, as TorchTitan's plan leaves q, k, v local tensors)."""
    parallelize_gate_projections(model, parallel_dims, job_config, local_output=True)
    return parallelize_llama(model, parallel_dims, job_config)


class Llama3Adapter(Llama3StateDictAdapter):
    """Hugging Face form: ungated, TorchTitan's own mapping to `LlamaForCausalLM` (ε and the
    γ-init leave the architecture a Llama). Gated, the project's `GammaForCausalLM`
    (convert/hf_package), which has the gate: TorchTitan's names (ours are the same) under
    "model.", wq / wk permuted to its rotate-half RoPE as TorchTitan permutes them for
    Llama, and Llama 3.1's RoPE scaling in config.json."""

    HF_MODEL_TYPES = ()  # `convert from-hf` writes gamma_dense; training reads HF through TorchTitan

    def __init__(self, model_args: Llama3Args, hf_assets_path: str | None):
        super().__init__(model_args, hf_assets_path)
        self.package_reason = package_reason(model_args, None)  # every TorchTitan Llama is a transformers Llama
        self.gated = self.package_reason is not None
        if self.gated:
            self.from_hf_map[GATE_HF] = GATE_TITAN

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        hf = super().to_hf(state_dict)  # Llama names, q / k permuted
        return gamma_to_hf(renamed(hf, self.from_hf_map)) if self.gated else hf  # back to TorchTitan's names

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.gated:
            hf_state_dict = renamed(gamma_from_hf(hf_state_dict, "llama3"), inverse(self.from_hf_map))
        return super().from_hf(hf_state_dict)

    def hf_config(self) -> dict[str, Any]:
        a = self.model_args
        scaling = a.rope_scaling_args
        llama3_rope = {"factor": scaling.scaling_factor, "low_freq_factor": scaling.low_freq_factor,
                       "high_freq_factor": scaling.high_freq_factor,
                       "original_max_position_embeddings": scaling.original_max_position_embeddings}
        shape = {"vocab_size": a.vocab_size, "hidden_size": a.dim, "num_hidden_layers": a.n_layers,
                 "num_attention_heads": a.n_heads, "num_key_value_heads": a.kv_heads,
                 "intermediate_size": a.ffn_hidden_dim(), "rms_norm_eps": a.norm_eps,
                 "max_position_embeddings": a.max_seq_len, "rope_theta": a.rope_theta, "tie_word_embeddings": False}
        if self.gated:
            return {**GAMMA_ARCHITECTURE, **shape, "attention_gate": a.attention_gate,
                    "llama3_rope_scaling": llama3_rope}
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **shape, "head_dim": a.head_dim,
                "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                # transformers >= 5 reads rope_parameters; 4.x rope_scaling and rope_theta
                "rope_parameters": {"rope_type": "llama3", "rope_theta": a.rope_theta, **llama3_rope},
                "rope_scaling": {"rope_type": "llama3", **llama3_rope}}

    @classmethod
    def args_from_hf_config(cls, cfg: dict[str, Any]):
        raise ConfigError("config.json: gamma_titan_model = 'llama3': to start a llama3 run from a Hugging Face "
                          "folder, use TorchTitan's --checkpoint.initial_load_in_hf true "
                          "--checkpoint.initial_load_path HF_DIR")


def flavors() -> Flavors:
    """TorchTitan's llama3 flavors as Llama3Args (copies: the trainer mutates them)."""
    return Flavors({name: Llama3Args(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})
                    for name, args in llama3_args.items()})


def get_train_spec() -> TrainSpec:
    """TorchTitan's llama3 TrainSpec (its pipelining function, optimizers, loss, ...) with
    the knob-aware model, args, parallelize function and adapter."""
    return dataclasses.replace(
        titan_spec(), model_cls=Llama3, model_args=flavors(), parallelize_fn=parallelize,
        state_dict_adapter=Llama3Adapter)
