"""The paper's three knobs on TorchTitan's own models, in what every one of them shares.

A TorchTitan model family here is TorchTitan's model, flavors, parallelize and pipelining
functions and state-dict adapter, used by import, with three optional changes read from
`[gamma]` (each unset knob leaves TorchTitan's choice alone, so without the table the
model is TorchTitan's bit for bit):

  init_rate (+ init_rate_overrides, init_truncation)
        every weight W ~ N(0, d_in^(−2γ)) by gamma_titan/init.py's rule and its
        device-independent draw, after TorchTitan's own init (which still sets the norms
        to 1 and fills the buffers);
  norm_eps
        the ε of every RMSNorm of the model: the block norms, the final norm, qwen3's
        q/k norms, MLA's q/kv norms;
  attention_gate
        a `gate_proj` inside each block's attention, sigmoid(x W_g) per head (headwise)
        or per channel (elementwise) on the attention output before `wo`, x the block's
        normed input: the model's attention class is swapped for its gated subclass.

`TitanArgs` is the mixin each family's args add to TorchTitan's, so that the code outside
`models/` can ask them what it asks of our own families (GammaArgs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
from torchtitan.models.attention import FlexAttentionWrapper
from torchtitan.models.moe.moe import MoE
from torchtitan.models.utils import trunc_normal_

from gamma_titan.errors import ConfigError
from gamma_titan.init import GammaInit, gamma_init_, standard_fan_in
from gamma_titan.models.common.args import GammaArgs, apply_gamma, gamma_init_config
from gamma_titan.models.common.masks import trainer_masks

from .moe import make_cpu_capable, reset_load

#: TorchTitan's init std for the q/k/v projections (every family's), which a gate
#: projection, reading the same input, shares under TorchTitan's init.
QKV_INIT_STD = 0.02

#: [model_args] does not apply: TorchTitan's models take their shapes from their flavors.
NO_MODEL_ARGS = ()


def flavors_with(model_name: str, attn_types: tuple[str, ...]) -> str:
    """"<model>'s sdpa and flex flavors: a, b, ..." (TorchTitan's flavors, and ours)."""
    from torchtitan.protocols.train_spec import get_train_spec

    flavors = get_train_spec(model_name).model_args
    names = sorted(f for f, a in flavors.items() if getattr(a, "attn_type", "sdpa") in attn_types)
    return f"{model_name}'s {' and '.join(attn_types)} flavors: {', '.join(names)}"


def param_group(name: str) -> str:
    """The [gamma.init_rate_overrides] group of a weight, by its name in TorchTitan's
    layout (which all of TorchTitan's decoders share)."""
    if name.startswith("tok_embeddings."):
        return "embedding"
    if name.startswith("output."):
        return "output"
    if ".attention.gate_proj." in name:
        return "gate"
    if ".attention." in name:
        return "attention"
    if ".moe.router." in name:
        return "router"
    if ".feed_forward." in name or ".moe." in name:  # dense FFN, routed and shared experts
        return "ffn"
    raise KeyError(f"no γ group for parameter {name!r}")


def init_rule(name: str, shape: tuple[int, ...]) -> tuple[str, int | None]:
    """(γ group, fan-in) of a parameter of a TorchTitan model: the `InitRule` of
    gamma_titan/init.py. TorchTitan stores routed experts as (experts, out, in): w1, w3
    (E, hidden, dim), w2 (E, dim, hidden); each expert contracts its last dimension."""
    fan_in = shape[-1] if ".moe.experts." in name else standard_fan_in(shape)
    return ("norm" if fan_in is None else param_group(name)), fan_in


@dataclass
class TitanArgs(GammaArgs):
    """Mixed in before a TorchTitan args class: `class Args(TitanArgs, TransformerModelArgs)`.
    The fields hold the knobs, TorchTitan's choice where unset."""

    attention_gate: str = "none"
    init: GammaInit | None = None  # None: TorchTitan's init
    every_norm_eps: float | None = None  # gamma.norm_eps, for the norms the flavor's ε does not reach

    # TorchTitan's models read norm_eps for some norms and a constant for others (qwen3's
    # q/k norms, deepseek_v3's final norm): gamma.norm_eps sets both.
    EPS_FIELDS = ("norm_eps", "every_norm_eps")

    @classmethod
    def model_args_fields(cls) -> tuple[str, ...]:
        return NO_MODEL_ARGS

    def update_from_config(self, job_config, **kwargs) -> None:
        """TorchTitan's own update (after GammaArgs in the MRO), then the [gamma] knobs
        that are set."""
        super(GammaArgs, self).update_from_config(job_config, **kwargs)
        self.flavor_name, self.model_name = job_config.model.flavor, job_config.model.name  # for messages
        for f in job_config.model_args.__dataclass_fields__:
            if getattr(job_config.model_args, f) is not None:
                raise ConfigError(f"model_args.{f}: {job_config.model.name} takes its shapes from its flavors "
                                  "(model.flavor); [model_args] applies to gamma_dense and gamma_moe")
        apply_gamma(self, job_config)
        self.check()

    def gamma_init(self, job_config) -> GammaInit | None:
        """γ-init only where gamma.init_rate is set; None keeps TorchTitan's init."""
        gamma = job_config.gamma
        if gamma.init_rate is not None:
            return gamma_init_config(job_config, default_rate=float(gamma.init_rate))
        if any(getattr(gamma.init_rate_overrides, g) is not None for g in gamma.init_rate_overrides.__dataclass_fields__):
            raise ConfigError("gamma.init_rate_overrides: set gamma.init_rate too (without it, "
                              f"{job_config.model.name} keeps TorchTitan's init)")
        return None

    def check(self) -> None:
        if self.attention_kind() == "varlen":
            # TorchTitan's varlen attention is a compiled CUDA kernel; the init report walks
            # the model on the CPU (measured: inspect died in an AssertionError without masks).
            model = getattr(self, "model_name", None)
            raise ConfigError(f"model.flavor = {getattr(self, 'flavor_name', None)!r}: varlen attention runs only on "
                              "CUDA, and the init report runs the model on the CPU"
                              + (f"; {flavors_with(model, ('sdpa', 'flex'))}" if model else ""))

    def attention_kind(self) -> str:
        """TorchTitan's attention kind: "sdpa", "flex" or "varlen" (qwen3's args may lack it)."""
        return getattr(self, "attn_type", "sdpa")

    def check_training_device(self, cuda: bool) -> None:
        if self.attention_kind() == "flex" and not cuda:
            # torch's flex_attention refuses a CPU tensor that needs a gradient
            # (`_validate_device`, torch 2.13-2.15; tests/test_flex.py watches for the day it stops).
            raise ConfigError(f"model.flavor = {getattr(self, 'flavor_name', None)!r}: flex attention has no backward "
                              f"on a CPU (torch {torch.__version__}): train it on CUDA GPUs, or train an sdpa flavor "
                              "here (`gamma-titan inspect` runs it on a CPU)")

    def check_parallelism(self, layout) -> None:
        """TorchTitan's model runs every parallelism its own trainer allows."""

    def check_model(self, model_cls, layout) -> None:
        """TorchTitan's own parallelize functions plan its models (and our gate)."""

    def supports_context_parallel(self) -> bool:
        return True

    def takes_attention_masks(self) -> bool:
        return self.attention_kind() in ("flex", "varlen")

    def context_parallel_balancers(self) -> tuple[str | None, ...]:
        return ("headtail", "ptrr", None) if self.attention_kind() == "flex" else ("headtail", None)

    def expert_parallel_needs_cuda(self) -> bool:
        return True  # TorchTitan's ExpertParallel: no CPU path for its token permutation

    def model_width(self) -> int:
        """d, the residual stream's width (the axis of the recipes' tuned ladder)."""
        return int(self.dim)

    def float8_excluded_fqns(self) -> list[str]:
        """The output head and, for a headwise gate, its d -> n_heads projection (too
        narrow for float8's scaled matmuls)."""
        return ["output", *(["gate_proj"] if self.attention_gate == "headwise" else [])]

    def flops_per_token(self, seq_len: int) -> int:
        with torch.device("meta"):
            model = self.model_class()(self)
        return self.get_nparams_and_flops(model, seq_len)[1]

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        """TorchTitan's count (its formula counts the gate's weights with the others)."""
        return super(GammaArgs, self).get_nparams_and_flops(model, seq_len)

    def model_class(self) -> type[nn.Module]:
        raise NotImplementedError


# --------------------------------------------------------------------------- the model


class GateProjection:
    """Mixed in before a TorchTitan attention class (or its probe-aware subclass): the
    gate's projection `gate_proj`, d -> heads x (1 headwise | value_dim elementwise), drawn
    like the queries under TorchTitan's init (γ-init, when set, redraws it with the rest),
    the gate values for the diagnostics' probe, and `gated(out, x)`, the one step a gated
    forward adds before `wo`."""

    def add_gate(self, args, value_dim: int) -> None:
        self.gate = args.attention_gate
        self.gate_width = value_dim if self.gate == "elementwise" else 1
        self.gate_proj = nn.Linear(args.dim, args.n_heads * self.gate_width, bias=False)

    def init_weights(self, init_std: float) -> None:
        super().init_weights(init_std)
        trunc_normal_(self.gate_proj.weight, mean=0.0, std=QKV_INIT_STD)

    def probe_gate(self, x: torch.Tensor) -> torch.Tensor:
        return local(torch.sigmoid(self.gate_proj(x)))

    def gated(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """out (bs, seq, heads, value_dim) × sigmoid(x W_g) viewed as (bs, seq, heads, width)."""
        bs, seqlen = x.shape[:2]
        return out * torch.sigmoid(self.gate_proj(x)).view(bs, seqlen, -1, self.gate_width)


def parallelize_gate_projections(model: nn.Module, parallel_dims, job_config, *, local_output: bool) -> None:
    """With TP and a gate: each block's gate projection column-parallel, before the family's
    TorchTitan plan runs, like the queries it sits beside: its output this rank's heads, a
    local tensor or (`local_output` False) a DTensor sharded on the heads, in the float8
    style TorchTitan's plans pick for the queries (tensorwise float8: Float8ColwiseParallel)."""
    if not parallel_dims.tp_enabled or model.model_args.attention_gate == "none":
        return
    style = ColwiseParallel
    float8 = job_config.quantize.linear.float8
    if "float8" in job_config.model.converters and float8.recipe_name not in ("rowwise", "rowwise_with_gw_hp"):
        from torchao.float8.float8_tensor_parallel import Float8ColwiseParallel as style
    tp_mesh = parallel_dims.get_mesh("tp")
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, {"attention.gate_proj": style(use_local_output=local_output)})


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor a TP plan may leave a DTensor (the probe reads local heads)."""
    return t.to_local() if isinstance(t, DTensor) else t


def set_norm_eps(model: nn.Module, eps: float) -> None:
    """ε of every RMSNorm in the model (RMSNorm reads `eps` at each call)."""
    for module in model.modules():
        if isinstance(module, nn.RMSNorm):
            module.eps = eps


class FlexAttention(FlexAttentionWrapper):
    """TorchTitan's flex attention, its compiled kernel kept on a GPU under the readers'
    force_eager stance (models/common/masks.py `eager_reading`): eager flex attention holds
    every score, B·H·T² fp32 values (34 GB for 8B_flex's 4-sequence probe at 8192 tokens).
    On a CPU it runs eagerly there (no compilation for a probe of a few sequences); inside a
    compiled region, as TorchTitan's."""

    def forward(self, q, k, v, **kwargs):
        if q.is_cuda and not torch.compiler.is_compiling():
            with torch.compiler.set_stance("default"):
                return super().forward(q, k, v, **kwargs)
        return super().forward(q, k, v, **kwargs)


class TitanKnobs:
    """Mixed in before a TorchTitan model class. Applies the knobs the args hold: ε after
    construction, γ-init after TorchTitan's init (called by the trainer once the model is
    materialised and sharded). `ROPE` names the model's rotary buffer, which its blocks
    take after the hidden states."""

    ROPE = "freqs_cis"

    def forward(self, tokens, attention_masks=None, positions=None, *, head: bool = True):
        """TorchTitan's forward; with `head=False`, the final norm's output instead (the
        diagnostics' probe needs no vocabulary-sized logits)."""
        if head:
            return super().forward(tokens, attention_masks, positions)
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, getattr(self, self.ROPE), attention_masks, positions)
        return self.norm(h)

    def block_inputs(self, tokens: torch.Tensor, device, tokenizer=None) -> tuple:
        """A block's arguments after the hidden states, for a reader running the blocks one
        by one over `tokens` (inspect): the rotary table rebuilt on `device`, and the masks
        the trainer would build (None under SDPA; flex: block-causal at `tokenizer`'s EOS)."""
        self.init_rope(device)
        return (getattr(self, self.ROPE), trainer_masks(self, tokens.to(device), tokenizer))

    def init_rope(self, device) -> None:
        raise NotImplementedError

    def apply_knobs(self, attention: type[nn.Module], gated_attention: type[nn.Module]) -> None:
        """After TorchTitan's construction (on meta): each block's attention rebuilt as the
        probe-aware class, or the gated one; TorchTitan's MoE layers made to run on a CPU;
        ε on every RMSNorm."""
        args = self.model_args
        for block in self.layers.values():
            block.attention = (gated_attention if args.attention_gate != "none" else attention)(args)
            if args.attention_kind() == "flex":
                block.attention.inner_attention = FlexAttention()
            if getattr(block, "moe_enabled", False) and type(block.moe) is MoE:  # not DeepEP's (CUDA only)
                make_cpu_capable(block.moe, args.moe_args)
        if args.every_norm_eps is not None:
            set_norm_eps(self, args.every_norm_eps)

    init_rule = staticmethod(init_rule)

    def init_weights(self, buffer_device: torch.device | None = None) -> None:
        super().init_weights(buffer_device=buffer_device)
        reset_load(self, buffer_device or getattr(self, self.ROPE).device)
        if self.model_args.init is not None:
            gamma_init_(self, self.model_args.init, self.init_rule)
