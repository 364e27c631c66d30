"""What every family's args offer the code outside `models/`.

A family's args dataclass (`models/<family>/args.py`) inherits `GammaArgs` and holds its
fields, flavors and checks. Code outside `models/` never reads a family-specific field:
it asks these methods, which a family overrides where it differs.
"""

from __future__ import annotations

from dataclasses import fields
from typing import ClassVar

from torch import nn
from torchtitan.protocols.model import BaseModelArgs

from gamma_titan.init import GROUPS, GammaInit

#: The fields [gamma] sets (the paper's three knobs); [model_args] sets the others.
KNOBS = ("norm_eps", "attention_gate", "init")

#: TorchTitan's keys that only a pipelining function, context parallelism or experts read
#: (config/key_support.py: a family without them refuses them, `unsupported_keys`).
PIPELINE_KEYS = ("parallelism.module_fqns_per_model_part", "parallelism.pipeline_parallel_first_stage_less_layers",
                 "parallelism.pipeline_parallel_last_stage_less_layers",
                 "parallelism.pipeline_parallel_layers_per_stage", "parallelism.pipeline_parallel_schedule",
                 "parallelism.pipeline_parallel_schedule_csv", "parallelism.pipeline_parallel_microbatch_size",
                 "parallelism.pipeline_parallel_expert_parallel_overlap")
CONTEXT_KEYS = ("parallelism.context_parallel_load_balancer",)
EXPERT_KEYS = ("parallelism.expert_parallel_comm_backend", "debug.moe_force_load_balance")


def gamma_init_config(job_config, default_rate: float) -> GammaInit:
    """[gamma]'s init settings (γ, its per-group overrides, truncation) and the run's seed."""
    gamma = job_config.gamma
    overrides = {g: float(v) for g in GROUPS if (v := getattr(gamma.init_rate_overrides, g)) is not None}
    rate = default_rate if gamma.init_rate is None else float(gamma.init_rate)
    return GammaInit(rate=rate, rate_overrides=overrides, truncation=float(gamma.init_truncation),
                     seed=job_config.debug.seed)


def apply_gamma(args, job_config) -> None:
    """Write [gamma]'s three knobs into a model's args: the one place they are applied, for
    our families and TorchTitan's alike. A knob left unset keeps the args' own choice (the
    flavor's); the args say which fields hold ε (`EPS_FIELDS`) and what init an unset
    γ means (`gamma_init`). The values were checked when the config was parsed."""
    gamma = job_config.gamma
    if gamma.norm_eps is not None:
        for name in args.EPS_FIELDS:
            setattr(args, name, float(gamma.norm_eps))
    if gamma.attention_gate is not None:
        args.attention_gate = gamma.attention_gate
    args.init = args.gamma_init(job_config)


class GammaArgs(BaseModelArgs):
    #: The fields gamma.norm_eps sets: every ε of the model.
    EPS_FIELDS: ClassVar[tuple[str, ...]] = ("norm_eps",)

    # --- the job config --------------------------------------------------------------

    def update_from_config(self, job_config, **kwargs) -> None:
        """Write [model_args] and [gamma] into this flavor, then check the shape. Called by
        TorchTitan's Trainer, and by the pre-flight checks, so both see the same model."""
        from gamma_titan.errors import ConfigError

        allowed = {f.name for f in fields(self)} - set(KNOBS)
        for f in fields(job_config.model_args):  # the families' fields (model_args_fields)
            value = getattr(job_config.model_args, f.name)
            if value is None:
                continue
            if f.name not in allowed:
                raise ConfigError(f"model_args.{f.name} does not apply to model {job_config.model.name}")
            setattr(self, f.name, value)
        apply_gamma(self, job_config)
        self.check()  # before max_seq_len is raised to the data's: a bad value is refused, not replaced
        seq_lens = [job_config.training.seq_len]
        if job_config.validation.enable:
            seq_lens.append(job_config.validation.seq_len)
        self.max_seq_len = max(self.max_seq_len, *seq_lens)

    def gamma_init(self, job_config) -> GammaInit | None:
        """The init [gamma] asks for: γ-init at gamma.init_rate, else at the flavor's γ."""
        return gamma_init_config(job_config, default_rate=self.init.rate)

    @classmethod
    def model_args_fields(cls) -> tuple[str, ...]:
        """The fields [model_args] may set (the knobs come from [gamma])."""
        return tuple(f.name for f in fields(cls) if f.name not in KNOBS and not f.name.startswith("_"))

    def check(self) -> None:
        """Raise ConfigError (naming the [model_args] or [gamma] key) for a shape that cannot work."""
        raise NotImplementedError

    def check_parallelism(self, layout) -> None:
        """Raise ConfigError for degrees of a layout (training/layout.py's Layout: tp, ep,
        ...) this model's shapes cannot be split by (called before any process group
        starts; the layout rules all models share are layout.py's)."""
        raise NotImplementedError

    def check_model(self, model_cls, layout) -> None:
        """Before any process group starts, on the model built on the meta device: what the
        family's parallelize reads of it (`check_built_model`). Built only where there is
        something to check."""
        if not self.needs_model_check(layout):
            return
        import torch

        with torch.device("meta"):
            model = model_cls(self)
        self.check_built_model(model, layout)

    def check_training_device(self, cuda: bool) -> None:
        """Raise ConfigError where this model cannot take a training step on the ranks'
        device (`cuda`: whether they have GPUs); ours train on both."""

    def needs_model_check(self, layout) -> bool:
        return layout.tp > 1

    def check_built_model(self, model, layout) -> None:
        """Under TP, the plan `apply_tp` applies (models/common/parallelize.py, from the
        modules' own plans) places every parameter of the model."""
        from .parallelize import check_tensor_parallel_plan

        if layout.tp > 1:
            check_tensor_parallel_plan(model)

    # --- what the rest of the package asks ---------------------------------------------

    def model_width(self) -> int:
        """d, the residual stream's width (the axis of the recipes' tuned ladder)."""
        return int(self.dim)

    def supports_pipeline_parallel(self) -> bool:
        """Whether the family's TrainSpec has a pipelining function."""
        return False

    def pipeline_blocks(self) -> int:
        """The blocks a pipeline splits into stages (TorchTitan's pipeline_llm reads n_layers)."""
        return int(self.n_layers)

    def takes_attention_masks(self) -> bool:
        """Whether the model's forward takes attention masks built from the batch
        (`get_attention_masks`: flex and varlen attention); SDPA's causal mask is its own."""
        return False

    def supports_context_parallel(self) -> bool:
        """Whether the family's forward takes TorchTitan's context-parallel `positions` and
        its attention runs SDPA in a module TorchTitan's CP plan can hook."""
        return False

    def context_parallel_balancers(self) -> tuple[str | None, ...]:
        """The `context_parallel_load_balancer` values the attention can take: SDPA's causal
        mask takes head-tail chunks (or none); "ptrr" reorders flex attention's block mask."""
        return ("headtail", None)

    def unsupported_keys(self) -> dict[str, str]:
        """TorchTitan keys this family's code never reads, and why: pre-flight refuses a value
        other than TorchTitan's default (config/key_support.py)."""
        out = {}
        if not self.supports_pipeline_parallel():
            out |= dict.fromkeys(PIPELINE_KEYS, "it applies to pipeline parallelism, which this model does not have")
        if not self.supports_context_parallel():
            out |= dict.fromkeys(CONTEXT_KEYS, "it applies to context parallelism, which this model does not have")
        if self.expert_parallel_divisor() == 1:
            out |= dict.fromkeys(EXPERT_KEYS, "it applies to routed experts, which this model does not have")
        return out

    def tensor_parallel_shards_sdpa(self) -> bool:
        """Whether the TP plan hands SDPA DTensors sharded on the heads (rather than each
        rank's local heads): PyTorch has sharding rules for the CUDA SDPA kernels only."""
        return False

    def expert_parallel_needs_cuda(self) -> bool:
        """Whether the family's expert parallelism orders the dispatched tokens with a Triton
        kernel (TorchTitan's), which needs a CUDA device."""
        return False

    def expert_parallel_divisor(self) -> int:
        """What an expert-parallel degree must divide (the routed experts); 1: the model
        has no experts, so expert parallelism does not apply."""
        return 1

    def active_params(self) -> int | None:
        """Parameters one token passes through, where that differs from all (MoE)."""
        return None

    def float8_excluded_fqns(self) -> list[str]:
        """Linear layers that stay in high precision under float8 training."""
        return []

    def default_cosine_params(self) -> list[str]:
        """The weights the live diagnostics draw row-cosine maps of by default."""
        return []

    def flops_per_token(self, seq_len: int) -> int:
        raise NotImplementedError

    def get_nparams_and_flops(self, model: nn.Module, seq_len: int) -> tuple[int, int]:
        return sum(p.numel() for p in model.parameters()), self.flops_per_token(seq_len)
