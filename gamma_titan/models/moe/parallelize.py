"""Tensor and expert parallelism, activation checkpointing, torch.compile and FSDP2 for
gamma_moe.

The order is TorchTitan's: TP → CP → EP → AC → compile (per block) → FSDP (or DDP, for
replicas without shards). Routed experts are
sharded by expert over the `ep` mesh (which TorchTitan's ParallelDims carves out of the
data-parallel ranks) with all-to-all token dispatch; everything else is FSDP-sharded as
in the dense model, the experts over the remaining `efsdp` ranks. TP covers the attention
(MHA or MLA, models/common/parallelize.attention_tp_plan), the shared experts and the
routed experts' hidden dimension; TP together with EP is refused by the pre-flight
checks for now. Both that refusal and the blocks' contract (MOE_BLOCK_CONTRACT) are
declared with `parallelize_moe` (MOE_CONTRACT): a family that reuses it is checked for
them before launch, with nothing to copy.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import parallelize_module
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.distributed import ParallelDims
from torchtitan.distributed.activation_checkpoint import apply_ac
from torchtitan.distributed.tensor_parallel import maybe_enable_async_tp
from torchtitan.models.deepseek_v3.infra.parallelize import _op_sac_save_list
from torchtitan.models.llama3.infra.parallelize import apply_ddp
from torchtitan.models.llama4.infra.parallelize import apply_compile, apply_fsdp, apply_moe_ep_tp
from torchtitan.tools.logging import logger

from gamma_titan.models.common.moe import TokenChoiceRouter
from gamma_titan.models.common.parallelize import (ParallelizeContract, apply_context_parallel, apply_tp,
                                                   declare_contract)

from .expert_parallel import ExpertParallel


#: What parallelize_moe, TorchTitan's EP/FSDP/compile helpers (llama4's infra) and its
#: load-balancing optimizer hook read of a block whose `moe_enabled` is true. Every block
#: has `moe_enabled`; these paths are under such a block.
MOE_BLOCK_CONTRACT = ("moe", "moe.experts", "moe.experts.num_experts", "moe.router", "moe.shared_experts",
                      "moe.score_before_experts", "moe.load_balance_coeff", "moe.tokens_per_expert",
                      "moe.expert_bias")


def check_moe_blocks(model: nn.Module) -> None:
    """Raise ConfigError, naming the block and the attribute, where a block breaks the
    contract parallelize_moe and TorchTitan's helpers read (MOE_BLOCK_CONTRACT): a family
    that reuses parallelize_moe with its own block finds out before launch, not in FSDP's
    wrapping or the optimizer's hook."""
    from gamma_titan.errors import ConfigError

    for index, block in model.layers.items():
        where = f"layers.{index} ({type(block).__name__})"
        if not hasattr(block, "moe_enabled"):
            raise ConfigError(f"block {where} has no moe_enabled: parallelize_moe reads it of every block "
                              "(models/moe/parallelize.py MOE_BLOCK_CONTRACT)")
        if not block.moe_enabled:
            continue
        for path in MOE_BLOCK_CONTRACT:
            node = block
            for part in path.split("."):
                if not hasattr(node, part):
                    raise ConfigError(f"block {where} has moe_enabled but no {path}: parallelize_moe, TorchTitan's "
                                      "expert-parallel and FSDP helpers and its load-balancing hook read it "
                                      "(models/moe/parallelize.py MOE_BLOCK_CONTRACT)")
                node = getattr(node, part)


def check_moe_layout(layout) -> str | None:
    """What parallelize_moe cannot apply: EP and TP together (it does not yet plan the
    routed experts' TP inside the EP groups)."""
    if layout.ep > 1 and layout.tp > 1:
        return (f"parallelism.expert_parallel_degree = {layout.ep} with tensor_parallel_degree = {layout.tp}: "
                "parallelize_moe does not combine expert and tensor parallelism yet")
    return None


MOE_CONTRACT = ParallelizeContract(layout_problem=check_moe_layout,
                                   check_model=lambda model, layout: check_moe_blocks(model))


@declare_contract(MOE_CONTRACT)
def parallelize_moe(model: nn.Module, parallel_dims: ParallelDims, job_config) -> nn.Module:
    if parallel_dims.tp_enabled:
        # Attention, norms, embedding, output and dense layers: the dense model's plan;
        # MoE layers: TorchTitan's (replicated router, column/row-parallel shared experts,
        # experts split along their hidden dimension).
        tp_mesh = parallel_dims.get_mesh("tp")
        apply_tp(model, tp_mesh, loss_parallel=not job_config.parallelism.disable_loss_parallel,
                 float8_tensorwise=False)
        apply_moe_ep_tp(model, tp_mesh=tp_mesh, ep_mesh=None, etp_mesh=None, ep_etp_mesh=None,
                        dual_pipe_v=False, use_deepep=False)
        maybe_enable_async_tp(job_config, tp_mesh)
    if parallel_dims.cp_enabled:
        apply_context_parallel(model, parallel_dims.get_mesh("cp"))
    if job_config.debug.moe_force_load_balance:  # benchmarking: every expert gets as many tokens
        for module in model.modules():
            if isinstance(module, TokenChoiceRouter):
                module.force_load_balance = True
        logger.info("debug.moe_force_load_balance: routing round-robin, every expert takes as many tokens")
    if parallel_dims.ep_enabled:
        ep_mesh = parallel_dims.get_mesh("ep")
        for block in model.layers.values():
            if block.moe_enabled:
                parallelize_module(block.moe.experts, ep_mesh, ExpertParallel())
        logger.info(f"Applied expert parallelism (degree {parallel_dims.ep}) to the routed experts")

    compile_model = job_config.compile.enable and "model" in job_config.compile.components
    if job_config.activation_checkpoint.mode != "none":
        apply_ac(model, job_config.activation_checkpoint, model_compile_enabled=compile_model,
                 op_sac_save_list=_op_sac_save_list, base_folder=job_config.job.dump_folder)
    if compile_model:
        apply_compile(model, job_config.compile, parallel_dims.ep_enabled)

    if parallel_dims.fsdp_enabled or parallel_dims.ep_enabled:
        replicate = ["dp_replicate"] if parallel_dims.dp_replicate_enabled else []
        apply_fsdp(
            model,
            parallel_dims.get_mesh(replicate + ["fsdp"]),
            param_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_param],
            reduce_dtype=TORCH_DTYPE_MAP[job_config.training.mixed_precision_reduce],
            pp_enabled=parallel_dims.pp_enabled,
            cpu_offload=job_config.training.enable_cpu_offload,
            reshard_after_forward_policy=job_config.parallelism.fsdp_reshard_after_forward,
            ep_degree=parallel_dims.ep,
            edp_mesh=parallel_dims.get_optional_mesh(replicate + ["efsdp"]),
            gradient_divide_factor=parallel_dims.fsdp_gradient_divide_factor,
        )
        logger.info("Applied FSDP to the model")
    elif parallel_dims.dp_replicate_enabled:  # replicas only: no other parallelism (training/layout.py)
        apply_ddp(model, parallel_dims.get_mesh("dp_replicate"), enable_compile=compile_model)
    return model
