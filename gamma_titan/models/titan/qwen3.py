"""qwen3: TorchTitan's Qwen 3, dense and MoE (model, flavors, parallelize function,
state-dict adapter) with the paper's knobs from [gamma] (models/titan/knobs.py).

What differs from llama3: the heads have their own width (`head_dim`, so the attention
is n_heads·head_dim wide, not dim), queries and keys pass through RMSNorms of their own
(q_norm, k_norm: ε reaches them too), the debug flavors tie the output head to the
embedding (the tied weight follows the embedding's γ), and TorchTitan's tensor-parallel
plan keeps q, k, v and the attention output DTensors, so the gate's projection stays one
too. TorchTitan's qwen3 has no pipelining function. Its MoE layers run on a CPU too
(models/titan/moe.py), and TorchTitan's qwen3 spec keeps the expert bias fixed (its
optimizers do not update it), which is kept.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchtitan.models.qwen3 import get_train_spec as titan_spec
from torchtitan.models.qwen3 import qwen3_args
from torchtitan.models.qwen3.infra.parallelize import parallelize_qwen3
from torchtitan.models.qwen3.model.args import Qwen3ModelArgs
from torchtitan.models.qwen3.model.model import Attention, Qwen3Model, apply_rotary_emb
from torchtitan.models.qwen3.model.state_dict_adapter import Qwen3StateDictAdapter
from torchtitan.protocols.train_spec import TrainSpec

from gamma_titan.errors import ConfigError
from gamma_titan.models.common.flavors import Flavors
from gamma_titan.models.common.hf_layout import GAMMA_ARCHITECTURE, gamma_from_hf, gamma_to_hf
from gamma_titan.models.common.sdpa_kernels import AttentionShape

from .hf import gamma_moe_config, package_reason
from .knobs import GateProjection, TitanArgs, TitanKnobs, local, parallelize_gate_projections
from .moe import complete_router_gradients


#: torch 2.13's FSDP refuses a parameter held by two FSDP groups (pytorch/pytorch#179532).
FSDP_REFUSES_SHARED_PARAMETERS = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13)


@dataclass
class Qwen3Args(TitanArgs, Qwen3ModelArgs):
    def model_class(self) -> type[nn.Module]:
        return Qwen3

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    def attention_shapes(self) -> list[AttentionShape]:
        return [AttentionShape("mha", self.head_dim, self.head_dim, self.n_heads, self.kv_heads)]

    def tensor_parallel_shards_sdpa(self) -> bool:
        return True  # TorchTitan's plan keeps q, k, v DTensors into SDPA

    def expert_parallel_divisor(self) -> int:
        return self.moe_args.num_experts if self.moe_enabled else 1

    def check_parallelism(self, layout) -> None:
        """TorchTitan 0.2.2's FSDP shards the embedding and the output head in groups of their
        own; a flavor that ties them (debugmodel, 0.6B, 1.7B, 4B) then has one parameter in
        two groups, which torch 2.13's FSDP refuses at the first step (measured on CPU;
        TorchTitan groups them since pytorch/torchtitan#2522)."""
        if self.enable_weight_tying and layout.shard > 1 and FSDP_REFUSES_SHARED_PARAMETERS:
            raise ConfigError(
                f"parallelism.data_parallel_shard_degree = {layout.shard}: this qwen3 flavor ties the embedding "
                "and the output head, which TorchTitan 0.2.2's FSDP shards in two groups (torch "
                f"{torch.__version__.split('+')[0]} refuses that; the flavors of 8B and up and the MoE ones shard)")

    def unsupported_keys(self) -> dict[str, str]:
        return super().unsupported_keys() | {  # TorchTitan 0.2's parallelize_qwen3 passes use_deepep=False
            "parallelism.expert_parallel_comm_backend": "TorchTitan's qwen3 parallelism does not wire DeepEP"}

    def float8_excluded_fqns(self) -> list[str]:
        return [*super().float8_excluded_fqns(), *(["moe.router.gate"] if self.moe_enabled else [])]

    def default_cosine_params(self) -> list[str]:
        ffn = "moe.shared_experts.w1" if self.moe_enabled and self.moe_args.num_shared_experts else (
            "attention.wq" if self.moe_enabled else "feed_forward.w1")
        return [f"layers.{layer}.{w}.weight" for layer in sorted({0, self.n_layers - 1})
                for w in ("attention.wo", ffn)]


class Qwen3Attention(Attention):
    """TorchTitan's attention, unchanged, plus what the diagnostics' probe asks."""

    gate = "none"

    @property
    def probe_scale(self) -> float:
        return self.scaling  # the softmax scale forward uses

    def probe_qk(self, x: torch.Tensor, rope_cache: torch.Tensor, *args) -> tuple[torch.Tensor, torch.Tensor]:
        """Normed, rotated queries and keys, (bs, seqlen, local heads, head_dim), as forward
        makes them (under TP, this rank's heads: TorchTitan's plan keeps them DTensors)."""
        q, k = self._qk(x, rope_cache, args[1] if len(args) > 1 else None)
        return local(q), local(k)

    def _qk(self, x, rope_cache, positions):
        bs, seqlen, _ = x.shape
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        if self.q_norm is not None:
            q = self.q_norm(q)
        if self.k_norm is not None:
            k = self.k_norm(k)
        return apply_rotary_emb(q, k, rope_cache, positions)


class GatedQwen3Attention(GateProjection, Qwen3Attention):
    def __init__(self, args: Qwen3Args):
        super().__init__(args)
        self.add_gate(args, self.head_dim)

    def forward(self, x, rope_cache, attention_masks, positions=None):
        bs, seqlen, _ = x.shape
        q, k = self._qk(x, rope_cache, positions)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (bs, heads, seqlen, head_dim)
        if self.attn_type == "flex":
            out = self.inner_attention(q, k, v, block_mask=attention_masks, scale=self.scaling,
                                       enable_gqa=self.enable_gqa)
        else:
            out = self.inner_attention(q, k, v, scale=self.scaling, enable_gqa=self.enable_gqa)
        return self.wo(self.gated(out.transpose(1, 2), x).reshape(bs, seqlen, -1))


class Qwen3(TitanKnobs, Qwen3Model):
    ROPE = "rope_cache"

    def __init__(self, args: Qwen3Args):
        super().__init__(args)
        self.apply_knobs(Qwen3Attention, GatedQwen3Attention)

    def init_rope(self, device) -> None:
        with torch.device(device):
            self.rope_cache = self._precompute_rope_cache()


def parallelize(model: nn.Module, parallel_dims, job_config):
    """TorchTitan's parallelize_qwen3, the gate projections column-parallel first (their
    output a DTensor sharded on the heads, as TorchTitan's plan leaves the attention output)."""
    parallelize_gate_projections(model, parallel_dims, job_config, local_output=False)
    model = parallelize_qwen3(model, parallel_dims, job_config)
    complete_router_gradients(model, parallel_dims)
    return model


def transformers_mismatch(a: Qwen3Args) -> str | None:
    """What transformers' Qwen3ForCausalLM / Qwen3MoeForCausalLM would compute otherwise
    than this model (None: nothing): they always norm q and k, and Qwen3Moe routes by
    softmax to scaled expert outputs, without shared experts, router bias or groups."""
    if not a.qk_norm:
        return "transformers' Qwen3 norms each head's query and key; this flavor does not"
    moe = a.moe_args
    if a.moe_enabled and (moe.score_func, moe.num_shared_experts, moe.route_scale, moe.score_before_experts,
                          moe.gate_bias, moe.num_expert_groups) != ("softmax", 0, 1.0, False, False, None):
        return ("transformers' Qwen3Moe routes by softmax to scaled expert outputs, without shared experts, router "
                "bias or expert groups; this flavor's MoE differs")
    return None


class Qwen3Adapter(Qwen3StateDictAdapter):
    """Hugging Face form: transformers' `Qwen3ForCausalLM` / `Qwen3MoeForCausalLM` through
    TorchTitan's own mapping where they compute exactly this model (`transformers_mismatch`,
    no gate); otherwise the project's `GammaForCausalLM` (convert/hf_package), which has the
    gate, the q/k norms, the head width and TorchTitan's MoE variants: TorchTitan's names
    under "model." (Qwen 3 already rotates halves, as GammaForCausalLM does), a tied output
    head written out as its own tensor."""

    HF_MODEL_TYPES = ()  # training reads HF through TorchTitan's initial_load_in_hf

    def __init__(self, model_args: Qwen3Args, hf_assets_path: str | None):
        super().__init__(model_args, hf_assets_path)
        self.package_reason = package_reason(model_args, transformers_mismatch(model_args))

    def to_hf(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.package_reason is None:
            for key, bias in state_dict.items():  # TorchTitan's mapping drops it: it must not matter
                if key.endswith("moe.expert_bias") and bool(local(bias).any()):
                    raise ConfigError(f"{key}: not zero, and transformers' Qwen3Moe routes without an expert bias "
                                      "(TorchTitan's qwen3 optimizers never update it)")
            return super().to_hf(state_dict)
        state = dict(state_dict)
        if self.model_args.enable_weight_tying:
            state.setdefault("output.weight", state["tok_embeddings.weight"])
        return gamma_to_hf(state)

    def from_hf(self, hf_state_dict: dict[str, Any]) -> dict[str, Any]:
        if self.package_reason is None:
            return super().from_hf(hf_state_dict)
        state = gamma_from_hf(hf_state_dict, "qwen3")
        if self.model_args.enable_weight_tying:
            state.pop("output.weight", None)
        return state

    def hf_config(self) -> dict[str, Any]:
        a = self.model_args
        shape = {"vocab_size": a.vocab_size, "hidden_size": a.dim, "num_hidden_layers": a.n_layers,
                 "num_attention_heads": a.n_heads, "num_key_value_heads": a.kv_heads, "head_dim": a.head_dim,
                 "intermediate_size": a.hidden_dim, "rms_norm_eps": a.norm_eps,
                 "max_position_embeddings": a.max_seq_len, "rope_theta": a.rope_theta}
        moe = a.moe_args
        if self.package_reason is not None:
            experts = gamma_moe_config(moe, a.moe_inter_dim) if a.moe_enabled else {}
            return {**GAMMA_ARCHITECTURE, **shape, **experts, "qk_norm": a.qk_norm,
                    "attention_gate": a.attention_gate, "tie_word_embeddings": False}
        common = {**shape, "hidden_act": "silu", "attention_bias": False, "use_sliding_window": False,
                  "tie_word_embeddings": a.enable_weight_tying,
                  "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta}}
        if not a.moe_enabled:
            return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **common}
        return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **common,
                "num_experts": moe.num_experts, "num_experts_per_tok": moe.top_k,
                "moe_intermediate_size": a.moe_inter_dim, "norm_topk_prob": moe.route_norm,
                "decoder_sparse_step": 1, "mlp_only_layers": []}

    @classmethod
    def args_from_hf_config(cls, cfg: dict[str, Any]):
        raise ConfigError("config.json: gamma_titan_model = 'qwen3': to start a qwen3 run from a Hugging Face "
                          "folder, use TorchTitan's --checkpoint.initial_load_in_hf true "
                          "--checkpoint.initial_load_path HF_DIR")


def flavors() -> Flavors:
    """TorchTitan's qwen3 flavors (dense and MoE) as Qwen3Args."""
    return Flavors({name: Qwen3Args(**{f.name: copy.deepcopy(getattr(args, f.name)) for f in dataclasses.fields(args)})
                    for name, args in qwen3_args.items()})


def get_train_spec() -> TrainSpec:
    """TorchTitan's qwen3 TrainSpec (its optimizers, loss, ...; no pipelining function)
    with the knob-aware model, args, parallelize function and adapter."""
    return dataclasses.replace(
        titan_spec(), model_cls=Qwen3, model_args=flavors(), parallelize_fn=parallelize,
        state_dict_adapter=Qwen3Adapter)
