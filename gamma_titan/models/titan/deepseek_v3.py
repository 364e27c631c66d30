"""deepseek_v3: TorchTitan's DeepSeek-V3 (model, flavors, parallelize and pipelining
functions, state-dict adapter) with the paper's knobs from [gamma] (models/titan/knobs.py).

What differs from llama3: the attention is multi-head latent attention (MLA: keys and
values from one compressed latent through kv_norm, queries direct or through q_norm, a
rotary slice shared by all heads), so a head's output is `v_head_dim` wide and the gate
has that many channels per head (elementwise); the final norm has no ε of its own
(PyTorch's machine epsilon), which `norm_eps` sets like every other; layers from
`n_dense_layers` on are TorchTitan's MoE, run on a CPU by models/titan/moe.py. TorchTitan's
optimizers for this family update the expert bias (auxiliary-loss-free balancing).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torchtitan.models.deepseek_v3 import deepseekv3_args
from torchtitan.models.deepseek_v3 import get_train_spec as titan_spec
from torchtitan.models.deepseek_v3.infra.parallelize import parallelize_deepseekv3
from torchtitan.models.deepseek_v3.model.args import DeepSeekV3ModelArgs
from torchtitan.models.deepseek_v3.model.model import (Attention, DeepSeekV3Model, apply_rotary_emb,
                                                       precompute_freqs_cis)
from torchtitan.models.deepseek_v3.model.state_dict_adapter import DeepSeekV3StateDictAdapter

from gamma_titan.errors import ConfigError
from gamma_titan.models.common.flavors import Flavors
from gamma_titan.models.common.sdpa import AttentionShape
from gamma_titan.training.train_spec import with_our_components

from .hf import GATE_HF, GATE_TITAN
from .knobs import GateProjection, TitanArgs, TitanKnobs, local


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
    """TorchTitan's parallelize_deepseekv3; with TP, each gate projection is column-parallel
    first, its output each rank's local heads, as TorchTitan's plan hands the attention
    output to `wo`. (TorchTitan's plan refuses float8 tensorwise TP for this model.)"""
    if parallel_dims.tp_enabled and model.model_args.attention_gate != "none":
        tp_mesh = parallel_dims.get_mesh("tp")
        for block in model.layers.values():
            parallelize_module(block, tp_mesh, {"attention.gate_proj": ColwiseParallel()})
    return parallelize_deepseekv3(model, parallel_dims, job_config)


class DeepSeekV3Adapter(DeepSeekV3StateDictAdapter):
    """TorchTitan's mapping to transformers' DeepSeek-V3 names, with the gate projection
    under the same name as in every other family."""

    HF_MODEL_TYPES = ()

    def __init__(self, model_args: DeepSeekV3Args, hf_assets_path: str | None):
        super().__init__(model_args, hf_assets_path)
        if model_args.attention_gate != "none":
            self.from_hf_map[GATE_HF] = GATE_TITAN

    def hf_config(self):
        raise ConfigError("deepseek_v3 has no Hugging Face form here yet (convert to-hf, "
                          "checkpoint.last_save_in_hf); save DCP checkpoints (checkpoint.last_save_in_hf = false)")

    @classmethod
    def args_from_hf_config(cls, cfg):
        raise ConfigError("config.json: gamma_titan_model = 'deepseek_v3': to start a deepseek_v3 run from a "
                          "Hugging Face folder, use TorchTitan's --checkpoint.initial_load_in_hf true")


def flavors() -> Flavors:
    """TorchTitan's deepseek_v3 flavors as DeepSeekV3Args."""
    return Flavors({name: DeepSeekV3Args(**{f.name: copy.deepcopy(getattr(args, f.name))
                                            for f in dataclasses.fields(args)})
                    for name, args in deepseekv3_args.items()})


def train_spec():
    """TorchTitan's deepseek_v3 TrainSpec (its pipelining function, its optimizers with the
    expert-bias update, ...) with the knob-aware model, args, parallelize function and
    adapter, and our data, tokenizer and metrics."""
    return with_our_components(dataclasses.replace(
        titan_spec(), model_cls=DeepSeekV3, model_args=flavors(), parallelize_fn=parallelize,
        state_dict_adapter=DeepSeekV3Adapter))
